"""Online-RL math of section 5 (groundwork for the GRPO/PPO trainers): GRPO advantages and loss
aggregations, GAE, whitening, PPO policy/value losses and the KL controllers, each against an
independent plain-Python formula or a hand-computed value."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import rlhf


def test_grpo_advantages_group_batch_none():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # two groups of 3
    group_std = statistics.stdev([1.0, 0.0, 1.0])  # 0.57735, unbiased as torch.std
    want_group = [(1 - 2 / 3) / (group_std + 1e-4), (0 - 2 / 3) / (group_std + 1e-4), (1 - 2 / 3) / (group_std + 1e-4),
                  (1 - 1 / 3) / (group_std + 1e-4), (0 - 1 / 3) / (group_std + 1e-4), (0 - 1 / 3) / (group_std + 1e-4)]
    torch.testing.assert_close(rlhf.grpo_advantages(rewards, 3), torch.tensor(want_group))
    batch_std = statistics.stdev(rewards.tolist())
    centred = [1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3, -1 / 3]
    torch.testing.assert_close(rlhf.grpo_advantages(rewards, 3, scale="batch"),
                               torch.tensor([c / (batch_std + 1e-4) for c in centred]))
    torch.testing.assert_close(rlhf.grpo_advantages(rewards, 3, scale="none"), torch.tensor(centred))
    # a group whose rewards are all equal carries no signal
    assert rlhf.grpo_advantages(torch.tensor([0.5, 0.5]), 2).abs().max() == 0
    with pytest.raises(rlhf.RLHFInputError, match="groups of 4"):
        rlhf.grpo_advantages(rewards, 4)
    with pytest.raises(rlhf.RLHFInputError, match="valid: group, batch, none"):
        rlhf.grpo_advantages(rewards, 3, scale="sequence")


def _grpo_reference(logp, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, max_len):
    rows = []
    for b in range(len(logp)):
        row = []
        for t in range(len(logp[b])):
            ratio = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = -clipped * adv[b] * logp[b][t] if loss_type == "cispo" else -min(ratio * adv[b], clipped * adv[b])
            kl = math.exp(ref[b][t] - logp[b][t]) - (ref[b][t] - logp[b][t]) - 1
            row.append(loss + beta * kl)
        rows.append(row)
    masked = [[rows[b][t] for t in range(len(rows[b])) if mask[b][t]] for b in range(len(rows))]
    if loss_type == "grpo":
        return sum(sum(r) / max(len(r), 1) for r in masked) / len(masked)
    if loss_type in ("bnpo", "dapo", "cispo"):
        return sum(sum(r) for r in masked) / sum(len(r) for r in masked)
    return sum(sum(r) for r in masked) / (len(masked) * max_len)


@pytest.mark.parametrize("loss_type", rlhf.GRPO_LOSS_TYPES)
def test_grpo_loss_matches_plain_formula(loss_type):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3  # ratios clip on both sides
    ref = logp + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.tensor([1.5, -0.7, 0.2], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    loss, metrics = rlhf.grpo_loss(logp, old, ref, adv, mask, epsilon_low=0.2, epsilon_high=0.28, beta=0.04,
                                   loss_type=loss_type, max_completion_length=8)
    want = _grpo_reference(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 0.04,
                           loss_type, 8)
    assert float(loss) == pytest.approx(want, rel=1e-10)
    assert 0 < metrics["clip_ratio/region_mean"] < 1 and metrics["kl"] > 0


def test_grpo_loss_on_policy_hand_value_and_gradient():
    # on-policy (ratio 1), beta 0: loss = -mean(A) per token; d loss / d logp = -A / tokens
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = rlhf.grpo_loss(logp, None, None, adv, torch.ones(2, 2), beta=0.0)
    assert float(loss.detach()) == pytest.approx(-(2.0 - 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))
    with pytest.raises(rlhf.RLHFInputError, match="dr_grpo"):
        rlhf.grpo_loss(logp, None, None, adv, torch.ones(2, 2), loss_type="ppo")


def test_compute_gae_matches_recursion_and_hand_value():
    # one sequence, gamma 1, lam 1: advantages are reward-to-go minus value
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    adv, ret = rlhf.compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75, 0.25]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    gen = torch.Generator().manual_seed(1)
    rewards, values = (torch.randn(2, 6, generator=gen, dtype=torch.float64),
                       torch.randn(2, 6, generator=gen, dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    adv, ret = rlhf.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(2):
        n = int(mask[b].sum())
        r, v = rewards[b, :n].tolist(), values[b, :n].tolist() + [0.0]
        for t in range(n):
            want = sum((0.9 * 0.8) ** k * (r[t + k] + 0.9 * v[t + k + 1] - v[t + k]) for k in range(n - t))
            assert float(adv[b, t]) == pytest.approx(want, rel=1e-9)
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].abs().sum() == 0
    torch.testing.assert_close(ret, (adv + values) * mask)


def test_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    out = rlhf.whiten(x, mask)
    torch.testing.assert_close(out[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)  # mean 2, unbiased var 1
    kept = rlhf.whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(kept[:3], torch.tensor([1.0, 2.0, 3.0]), atol=1e-6, rtol=0)


def test_whiten_across_processes_equals_whitening_the_whole_batch():
    """Two 'processes' each hold half the rows; with the sums exchanged, each half is whitened with the whole
    batch's mean and unbiased variance, so the halves put together equal whitening everything at once."""
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    halves = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    calls = []

    def whiten_as_process(rank: int, shift_mean: bool) -> torch.Tensor:
        own_x, own_mask = halves[rank]
        other_x, other_mask = halves[1 - rank]
        answers = iter([
            [float((other_x * other_mask).sum()), float(other_mask.sum())],  # the other process's sum and count
        ])

        def collective(values):  # the collective: this process's list plus the other's, element-wise
            calls.append(len(values))
            if len(values) == 2:
                theirs = next(answers)
                return [values[0] + theirs[0], values[1] + theirs[1]]
            # squares around the global mean, which the other process computes from the same sums
            mean = float((x * mask).sum() / mask.sum())
            return [values[0] + float((((other_x - mean) ** 2) * other_mask).sum())]

        return rlhf.whiten(own_x, own_mask, shift_mean, sum_across_processes=collective)

    for shift_mean in (True, False):
        together = torch.cat([whiten_as_process(0, shift_mean), whiten_as_process(1, shift_mean)]) * mask
        whole = rlhf.whiten(x, mask, shift_mean) * mask
        torch.testing.assert_close(together, whole, atol=1e-6, rtol=0)
        alone = rlhf.whiten(x[:3], mask[:3], shift_mean) * mask[:3]  # what each process did before: its own moments
        assert not torch.allclose(alone, whole[:3], atol=1e-3)
    assert calls == [2, 1] * 4  # two collectives per call: (sum, count), then the squares
    # one process: the identity collective changes nothing
    torch.testing.assert_close(rlhf.whiten(x, mask, sum_across_processes=lambda v: [float(a) for a in v]),
                               rlhf.whiten(x, mask))


def test_ppo_policy_loss_clips_and_hand_value():
    old = torch.zeros(1, 3)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics = rlhf.ppo_policy_loss(logps, old, adv, torch.ones(1, 3), clip_range=0.2)
    # per token max(-A r, -A clip(r)): max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(1.1, 1.1) = 1.1
    assert float(loss) == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert metrics["policy/clipfrac"] == pytest.approx(1 / 3)


def test_ppo_value_loss_hand_value():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 1.0]])
    # token 1: V 1.0 vs clipped 0.7 -> max(1.0, 0.49) = 1.0; token 2: max(1, 1) = 1; 0.5 * mean = 0.5
    assert float(rlhf.ppo_value_loss(values, old, returns, torch.ones(1, 2),
                                     clip_range_value=0.2)) == pytest.approx(0.5)


def test_kl_controllers():
    controller = rlhf.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 12 is twice the target: error clipped to +0.2; 256 steps: 0.1 * (1 + 0.2 * 256 / 10000)
    assert controller.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    before = controller.value
    assert controller.update(3.0, 256) == pytest.approx(before * (1 - 0.2 * 256 / 10000))  # -0.5 clipped to -0.2
    assert rlhf.FixedKLController(0.05).update(100.0, 256) == 0.05


# -- rollout-engine importance sampling (use_vllm) -------------------------------------------------------------------


def test_rollout_importance_weights_by_hand():
    """rho_t = exp(trainer - engine) per token; C = 2. Row 0: rho = e^0.1, e^1.0, e^-1.0; row 1: e^0.5, then
    padding (mask 0)."""
    trainer = torch.tensor([[-1.0, -1.0, -3.0], [-0.5, -9.0, -9.0]])
    engine = torch.tensor([[-1.1, -2.0, -2.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    e = math.e
    weights, metrics = rlhf.rollout_importance_weights(trainer, engine, mask, cap=2.0, mode="token_truncate")
    torch.testing.assert_close(weights, torch.tensor([[e ** 0.1, 2.0, e ** -1.0], [e ** 0.5, 0.0, 0.0]]))
    assert metrics["is_changed_frac"] == pytest.approx(1 / 4)  # only e^1.0 > 2 was cut
    assert metrics["logprob_abs_diff_mean"] == pytest.approx((0.1 + 1.0 + 1.0 + 0.5) / 4)
    assert metrics["logprob_abs_diff_max"] == pytest.approx(1.0)
    k3 = [math.exp(r) - 1 - r for r in (0.1, 1.0, -1.0, 0.5)]
    assert metrics["kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    weights, _ = rlhf.rollout_importance_weights(trainer, engine, mask, cap=2.0, mode="token_mask")
    # 1/2 <= rho <= 2 keeps e^0.1 and e^0.5; e^1.0 (2.72) and e^-1.0 (0.37) are dropped
    torch.testing.assert_close(weights, torch.tensor([[e ** 0.1, 0.0, 0.0], [e ** 0.5, 0.0, 0.0]]))
    weights, _ = rlhf.rollout_importance_weights(trainer, engine, mask, cap=2.0, mode="sequence_truncate")
    # row 0: prod rho = e^(0.1 + 1 - 1) = e^0.1; row 1: e^0.5 (padding counts as rho = 1)
    torch.testing.assert_close(weights, torch.tensor([[e ** 0.1] * 3, [e ** 0.5, 0.0, 0.0]]))
    weights, _ = rlhf.rollout_importance_weights(trainer * 2, engine, mask, cap=2.0, mode="sequence_mask")
    # row 0: log prod = (-2 + 1.1) + (-2 + 2) + (-6 + 2) = -4.9 -> dropped; row 1: -1 + 1 = 0 -> rho 1, kept
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    with pytest.raises(rlhf.RLHFInputError, match="unknown importance sampling mode"):
        rlhf.rollout_importance_weights(trainer, engine, mask, mode="token")


def test_a_token_outside_the_trainers_support_gets_zero_weight():
    trainer = torch.tensor([[-float("inf"), -0.5]])
    weights, metrics = rlhf.rollout_importance_weights(trainer, torch.tensor([[-3.0, -0.5]]), torch.ones(1, 2))
    assert weights[0, 0] < 1e-6 and weights[0, 1] == 1.0 and math.isfinite(metrics["kl"])


def test_importance_weights_scale_each_tokens_policy_term():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    advantages, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 2)
    weights = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
    loss, _ = rlhf.grpo_loss(logps, None, None, advantages, mask, beta=0.0, loss_type="dapo",
                             importance_weights=weights)
    # on-policy: rho = 1, per token -A * w; the token mean over 4 tokens
    assert float(loss.detach()) == pytest.approx((-1 * 0.5 - 1 * 2.0 + 2 * 1.0 + 2 * 0.0) / 4)
    loss.backward()  # d/dlogp of -A w rho = -A w at rho = 1
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -2.0], [2.0, 0.0]]) / 4)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    plain, _ = rlhf.ppo_policy_loss(old.clone(), old, torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), mask)
    weighted, _ = rlhf.ppo_policy_loss(old.clone(), old, torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), mask,
                                       importance_weights=weights)
    assert float(plain) == pytest.approx((-1 - 1 + 2 + 2) / 4)
    assert float(weighted) == pytest.approx((-0.5 - 2.0 + 2.0 + 0.0) / 4)


@pytest.mark.parametrize("truncation", [{"top_k": 2}, {"top_p": 0.7}, {"min_p": 0.3}])
def test_sampled_log_probs_renormalise_over_the_kept_tokens(truncation):
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_k 2 and top_p 0.7 keep the first two (0.5 + 0.3 >= 0.7), min_p 0.3
    keeps p >= 0.15 (0.3 * 0.5), the first three; each kept token's log-prob is log(p / kept mass)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1, 4, 4).clone()
    targets = torch.tensor([[0, 1, 2, 3]])
    got = rlhf.OutputHead().sampled_log_probs(logits, targets, 1.0, **truncation)[0]
    kept = 3 if "min_p" in truncation else 2
    mass = float(probs[:kept].sum())
    want = [math.log(p / mass) if i < kept else -math.inf for i, p in enumerate(probs.tolist())]
    assert got.tolist() == pytest.approx(want, rel=1e-5)


# -- RLOO and REINFORCE++ advantages -----------------------------------------------------------------------------------


def test_rloo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0])  # two groups of 3
    # 1 - (0 + 0) / 2 = 1; 0 - (1 + 0) / 2 = -0.5 twice; the second group is all equal: 0
    torch.testing.assert_close(rlhf.rloo_advantages(rewards, 3), torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    # the independent form: G / (G - 1) (r - mean)
    rewards = torch.randn(24)
    grouped = rewards.view(-1, 4)
    want = (4 / 3 * (grouped - grouped.mean(-1, keepdim=True))).reshape(-1)
    torch.testing.assert_close(rlhf.rloo_advantages(rewards, 4), want)
    with pytest.raises(rlhf.RLHFInputError, match="groups of 4"):
        rlhf.rloo_advantages(torch.ones(6), 4)


def _reinforce_pp_by_hand(scores, mask, kl, kl_coef, group):
    """Token by token: rewards, returns-to-go, whitening with the unbiased variance, as loops."""
    scores = [float(s) for s in scores]
    if group:
        for start in range(0, len(scores), group):
            mean = sum(scores[start:start + group]) / group
            scores[start:start + group] = [s - mean for s in scores[start:start + group]]
    returns = []
    for row, score in enumerate(scores):
        valid = [t for t in range(mask.shape[1]) if mask[row, t]]
        rewards = {t: -kl_coef * float(kl[row, t]) for t in valid}
        if valid:
            rewards[valid[-1]] += score
        returns.append({t: sum(r for s, r in rewards.items() if s >= t) for t in valid})
    flat = [v for row in returns for v in row.values()]
    mean = sum(flat) / len(flat)
    std = (sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)) ** 0.5
    out = torch.zeros(mask.shape)
    for row, values in enumerate(returns):
        for t, v in values.items():
            out[row, t] = (v - mean) / std
    return out


@pytest.mark.parametrize("group", [None, 2])
def test_reinforce_pp_advantages_against_loops(group):
    torch.manual_seed(0)
    scores, kl = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.rand(4, 5) * 0.2
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got = rlhf.reinforce_pp_advantages(scores, mask, kl=kl, kl_coef=0.1, group_size=group)
    torch.testing.assert_close(got, _reinforce_pp_by_hand(scores, mask, kl, 0.1, group), atol=1e-4, rtol=1e-4)
    # without KL every token of a row has the row's score as its return: a row's advantage is constant
    plain = rlhf.reinforce_pp_advantages(scores, mask)
    assert torch.allclose(plain[0, :3], plain[0, 0].expand(3))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_all_equal_rewards_give_zero_advantage_for_every_estimator(estimator):
    rewards, mask = torch.full((8,), 0.3), torch.ones(8, 6, dtype=torch.bool)
    mask[3, 4:] = False
    advantages = {"grpo": lambda: rlhf.grpo_advantages(rewards, 4),
                  "rloo": lambda: rlhf.rloo_advantages(rewards, 4),
                  "reinforce_pp": lambda: rlhf.reinforce_pp_advantages(rewards, mask),
                  "reinforce_pp_baseline": lambda: rlhf.reinforce_pp_advantages(rewards, mask, group_size=4),
                  }[estimator]()
    assert torch.equal(advantages, torch.zeros_like(advantages))


# -- GSPO and CISPO ----------------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_equals_the_sequence_level_objective():
    """GSPO-token's per-token form, averaged per sequence, has the value and gradient of the sequence-level
    objective: -min(s A, clip(s) A) with s = exp(mean_t(logp - old)), averaged over sequences."""
    torch.manual_seed(0)
    logps = (torch.randn(3, 5) * 0.3 - 1).requires_grad_()
    old = logps.detach() + torch.tensor([[0.0002], [0.001], [0.0]]) + torch.randn(3, 5) * 1e-4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    loss, _ = rlhf.grpo_loss(logps, old, None, advantages, mask, epsilon_low=3e-4, epsilon_high=4e-4, beta=0.0,
                             importance_sampling_level="sequence")
    loss.backward()
    got = logps.grad.clone()
    logps.grad = None
    m = mask.float()
    s = torch.exp(((logps - old) * m).sum(-1) / m.sum(-1))
    want = (-torch.min(s * advantages, s.clamp(1 - 3e-4, 1 + 4e-4) * advantages)).mean()
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    torch.testing.assert_close(got, logps.grad)
    assert got[1].abs().sum() == 0  # row 1: s = e^-0.001 < 1 - 3e-4 with A < 0: clipped, no gradient


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])  # ratio e^0.5 = 1.65 on the first token, 1 on the second
    loss, metrics = rlhf.grpo_loss(logps, old, None, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool),
                                   epsilon_low=0.2, epsilon_high=0.28, beta=0.0, loss_type="cispo")
    # -sg(clip(rho)) A logp, token mean: (-(1.28 * 2 * -1) - (1 * 2 * -2)) / 2
    assert float(loss.detach()) == pytest.approx((1.28 * 2 * 1 + 1 * 2 * 2) / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.28 * 2 / 2, -2 / 2]]))  # the clipped token still learns
    assert metrics["clip_ratio/high_mean"] == 0.5


def test_grpo_loss_takes_per_token_advantages():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 0.5]])
    loss, _ = rlhf.grpo_loss(logps, None, None, advantages, torch.ones(1, 3, dtype=torch.bool), beta=0.0,
                             loss_type="dapo")
    loss.backward()
    torch.testing.assert_close(logps.grad, -advantages / 3)


def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then -0.25 per token down to -1 at 10, -1 beyond; factor 0.5
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    torch.testing.assert_close(rlhf.overlong_penalty(lengths, 10, 4, 0.5),
                               torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    assert torch.equal(rlhf.overlong_penalty(lengths, 10, 0), torch.zeros(6))  # buffer 0: off


# -- the policy-loss registry --------------------------------------------------------------------------------------


def test_the_policy_loss_registry_is_in_step_with_the_config_choices():
    assert tuple(rlhf.POLICY_LOSSES)[:len(rlhf.GRPO_LOSS_TYPES)] == rlhf.GRPO_LOSS_TYPES
    assert tuple(rlhf.LOSS_AGGREGATIONS) == rlhf.POLICY_LOSS_AGGREGATIONS
    assert tuple(rlhf.IMPORTANCE_LOG_RATIOS) == rlhf.IMPORTANCE_SAMPLING_LEVELS
    assert {name: loss.aggregation for name, loss in rlhf.POLICY_LOSSES.items() if name in rlhf.GRPO_LOSS_TYPES} == {
        "grpo": "sequence_mean", "bnpo": "micro_batch_token_mean", "dapo": "step_token_mean",
        "dr_grpo": "fixed_length_sum", "cispo": "step_token_mean"}
    assert [n for n, loss in rlhf.POLICY_LOSSES.items() if loss.token_level_only] == ["cispo"]


USER_LOSSES = '''
import rlhf


@rlhf.register_policy_loss("vanilla_pg", aggregation="step_token_mean")
def vanilla_policy_gradient(inputs):
    """REINFORCE without a ratio or clip: -A * logp per token."""
    return -inputs.advantages * inputs.logps


def not_registered(inputs):
    return inputs.logps
'''


def test_a_users_policy_loss_is_named_by_module_and_function(tmp_path, monkeypatch):
    (tmp_path / "my_policy_losses.py").write_text(USER_LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rlhf, "POLICY_LOSSES", dict(rlhf.POLICY_LOSSES))  # the registration stays in this test
    config = rlhf.GRPOConfig(model_name_or_path="tiny", reward_funcs=["format"],
                             loss_type="my_policy_losses:vanilla_policy_gradient")
    loss = rlhf.policy_loss(config.loss_type)
    assert loss.name == "vanilla_pg" and loss.aggregation == "step_token_mean"
    assert rlhf.policy_loss("my_policy_losses:vanilla_pg") is loss  # by its registered name too
    # hand value: tokens (-1, -2 | -0.5) with advantages (2 | -1): -(2*-1 + 2*-2 + -1*-0.5) / 3 tokens
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    value, _ = rlhf.grpo_loss(logps, None, None, torch.tensor([2.0, -1.0]), mask, beta=0.0,
                              loss_type=config.loss_type)
    assert float(value) == pytest.approx(-(2 * -1.0 + 2 * -2.0 + -1 * -0.5) / 3)
    value.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    with pytest.raises(rlhf.RLHFInputError, match="registered no policy loss named 'not_registered'"):
        rlhf.GRPOConfig(model_name_or_path="tiny", reward_funcs=["format"], loss_type="my_policy_losses:not_registered")
    with pytest.raises(rlhf.RLHFInputError, match="cannot import 'no_such_module_here'"):
        rlhf.GRPOConfig(model_name_or_path="tiny", reward_funcs=["format"], loss_type="no_such_module_here:loss")
    with pytest.raises(rlhf.RLHFInputError, match="did you mean 'dapo'"):
        rlhf.GRPOConfig(model_name_or_path="tiny", reward_funcs=["format"], loss_type="dapoo")
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        rlhf.register_policy_loss("bad", aggregation="mean")
