"""PPO end to end on the embedded tiny model: a rollout's per-token rewards (score on the last completion token,
-kl_coef * (logp - ref_logp) everywhere), GAE and whitening against independent formulas written here, the seeded
ppo_epochs mini-batch schedule, the value head on the policy's backbone or a separate critic (values, save/load),
the adaptive KL controller (one update per rollout), a learnable reward that is learned, exact resume at and
inside a rollout boundary (the checkpoint keeps the rollout) and the CLI.

Runs are a handful of steps of 4-8 completions of at most 8-10 tokens (about 0.1-0.2 s a step on one thread).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import killed_after_checkpoint, rlhf_log

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# -- helpers ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=32)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer, "auto"), cutoff_len=64)


def _config(tmp_path: Path, model_dir: Path, **overrides) -> rlhf.PPOConfig:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    per_device_train_batch_size=4, max_completion_length=10, cutoff_len=64, max_steps=2, ppo_epochs=2,
                    learning_rate=1e-3, lr_scheduler_type="constant", save_steps=0, logging_steps=1,
                    disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                    resume_from_checkpoint="none")
    settings.update(overrides)
    return rlhf.PPOConfig(**settings)


def _trainer(config: rlhf.PPOConfig, dataset, reward_fn, critic: rlhf.ValueModel | None = None) -> rlhf.PPOTrainer:
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    reference = rlhf.create_reference_model(config, policy)  # a frozen copy of the start
    return rlhf.PPOTrainer(config, policy, dataset, reward_fn=reward_fn, reference=reference, critic=critic,
                           formatter=rlhf.ChatFormatter(policy.tokenizer, "auto"))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


class DigitShare:
    """Share of digit characters in the completion: about 0.05 for the untrained tiny model, learnable.
    ``scores`` keeps every call's result so a test can place them itself."""

    __name__ = "digit_share"

    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(self, prompts, completions, answers):
        scores = torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])
        scores = scores + torch.tensor([0.1 * (i % 3) for i in range(len(completions))])  # rows differ for sure
        self.scores.append(scores.clone())
        return scores


def _hand_logps(model: torch.nn.Module, input_ids, attention_mask, temperature: float) -> torch.Tensor:
    """Per-token log-probs (N, T-1) by a plain log_softmax over the whole padded rollout."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _hand_rewards(scores, old, ref, mask, kl_coef: float) -> torch.Tensor:
    """Per-token rewards written out: -kl_coef * (old - ref) on completion tokens, + score on each row's last one."""
    rewards = torch.zeros_like(old)
    for i in range(old.shape[0]):
        positions = [t for t in range(old.shape[1]) if mask[i, t]]
        for t in positions:
            rewards[i, t] = -kl_coef * (old[i, t] - ref[i, t])
        rewards[i, positions[-1]] += scores[i]
    return rewards


def _hand_gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as a plain loop per row: the completion is one episode, the step after its last token is terminal."""
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t]]
        running = 0.0
        for k in reversed(range(len(positions))):
            t = positions[k]
            next_value = float(values[i, positions[k + 1]]) if k + 1 < len(positions) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i, t] = running
            returns[i, t] = running + float(values[i, t])
    return advantages, returns


# -- 1. the rollout --------------------------------------------------------------------------------------------------


def test_rollout_rewards_and_gae_match_independent_formulas(tmp_path, tiny_model_dir, prompts):
    reward = DigitShare()
    config = _config(tmp_path, tiny_model_dir, whiten_advantages=False, gamma=0.9, lam=0.8, init_kl_coef=0.3,
                     adap_kl_ctrl=False, temperature=0.7)
    trainer = _trainer(config, prompts, reward)
    items = [prompts[i] for i in range(4)]

    # first rollout: the policy is the reference, so the KL term is exactly 0
    first = trainer.make_rollout(items)
    mask = first.completion_mask
    assert torch.equal(first.old_logps * mask, first.ref_logps * mask)
    assert first.metrics["objective/kl"] == 0.0
    assert first.metrics["objective/scores"] == pytest.approx(float(reward.scores[-1].mean()))

    # move the policy away from the reference: the KL term is now non-zero on every token
    with torch.no_grad():
        for p in trainer.policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    rollout = trainer.make_rollout(items)
    scores, mask = reward.scores[-1], rollout.completion_mask
    ids, attention = rollout.input_ids, rollout.attention_mask
    with torch.no_grad():
        old = _hand_logps(trainer.policy.model, ids, attention, 0.7)
        ref = _hand_logps(trainer.reference.model.model, ids, attention, 0.7)
    torch.testing.assert_close(rollout.old_logps * mask, old * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollout.ref_logps * mask, ref * mask, atol=1e-5, rtol=1e-5)
    assert float(((old - ref).abs() * mask).max()) > 1e-3

    rewards = _hand_rewards(scores, rollout.old_logps, rollout.ref_logps, mask, 0.3)
    advantages, returns = _hand_gae(rewards, rollout.old_values, mask, 0.9, 0.8)
    torch.testing.assert_close(rollout.advantages, advantages, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollout.returns, returns, atol=1e-5, rtol=1e-5)

    sequence_kl = [float(((rollout.old_logps - rollout.ref_logps) * mask)[i].sum()) for i in range(4)]
    metrics = rollout.metrics
    assert metrics["objective/kl"] == pytest.approx(sum(sequence_kl) / 4, abs=1e-5)
    assert metrics["objective/kl_coef"] == 0.3
    assert metrics["objective/rlhf_reward"] == pytest.approx(
        sum(float(s) - 0.3 * k for s, k in zip(scores, sequence_kl)) / 4, abs=1e-5)


def test_whitened_advantages_have_mean_zero_and_unit_std(tmp_path, tiny_model_dir, prompts):
    """Same samples (same RNG state) with and without whitening: the whitened advantages are the raw ones
    standardised over the completion tokens; returns do not change."""
    trainer = _trainer(_config(tmp_path, tiny_model_dir, adap_kl_ctrl=False, whiten_advantages=False,
                               per_device_train_batch_size=8), prompts, DigitShare())
    items = [prompts[i] for i in range(8)]
    rng = torch.get_rng_state()
    raw = trainer.make_rollout(items)
    torch.set_rng_state(rng)
    trainer.config.whiten_advantages = True
    white = trainer.make_rollout(items)
    assert torch.equal(raw.input_ids, white.input_ids)
    torch.testing.assert_close(white.returns, raw.returns)
    mask = white.completion_mask
    values = white.advantages[mask]
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(values.std()) == pytest.approx(1.0, abs=1e-4)
    assert float(white.advantages[~mask].abs().max()) == 0.0  # zero outside the completions
    plain = raw.advantages[mask]
    torch.testing.assert_close(values, (plain - plain.mean()) / plain.std(), atol=1e-4, rtol=1e-4)


def test_rollout_whitens_with_every_process_moments(tmp_path, tiny_model_dir, prompts, monkeypatch):
    """The rollout whitens rewards and advantages through the devices' cross-process sum, so with several
    processes each one uses the whole batch's mean and variance (whiten's own test checks the arithmetic).
    Here a collective that doubles every sum stands for a second process holding the same rows: the mean
    is unchanged and the unbiased variance over 2n tokens is 2(n - 1) / (2n - 1) times the one over n."""
    trainer = _trainer(_config(tmp_path, tiny_model_dir, adap_kl_ctrl=False, per_device_train_batch_size=4),
                       prompts, DigitShare())
    sent = []

    def doubled(values):
        sent.append(len(values))
        return [2 * float(v) for v in values]

    items = [prompts[i] for i in range(4)]
    rng = torch.get_rng_state()
    alone = trainer.make_rollout(items)
    monkeypatch.setattr(trainer.devices, "sum_list_across_processes", doubled)
    for whiten_rewards in (False, True):
        sent.clear()
        torch.set_rng_state(rng)
        trainer.config.ppo_whiten_rewards = whiten_rewards
        twice = trainer.make_rollout(items)
        assert torch.equal(twice.input_ids, alone.input_ids)
        assert sent.count(1) == 1 + whiten_rewards  # one squares collective per whitening
    torch.set_rng_state(rng)
    trainer.config.ppo_whiten_rewards = False
    twice = trainer.make_rollout(items)
    mask = twice.completion_mask
    n = int(mask.sum())
    torch.testing.assert_close(twice.advantages[mask], alone.advantages[mask] * ((2 * n - 1) / (2 * (n - 1))) ** 0.5)


# -- 2. the mini-batch schedule ---------------------------------------------------------------------------------------


def _fake_rollout(rows: int) -> rlhf.Rollout:
    ids = torch.arange(rows)[:, None].repeat(1, 3) + 10  # row i holds i + 10: where each row went is visible
    labels = ids.clone()
    labels[:, 0] = rlhf.IGNORE_INDEX
    return rlhf.Rollout(ids, torch.ones_like(ids), labels, advantages=ids[:, 1:].float() * 2,
                        old_logps=ids[:, 1:].float(), ref_logps=ids[:, 1:].float(), old_values=ids[:, 1:].float(),
                        returns=ids[:, 1:].float())


def test_rollout_schedule_is_ppo_epochs_seeded_permutations(tmp_path, tiny_model_dir, prompts):
    config = _config(tmp_path, tiny_model_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     ppo_buffer_size=2, ppo_epochs=3)
    trainer = _trainer(config, prompts, DigitShare())
    assert trainer.prompts_per_rollout == 8 and trainer.steps_per_rollout == 6
    # max_steps counts optimizer steps: 2 steps of a 6-step rollout are one rollout of 8 completions
    assert trainer.rollout_plan() == ("ppo: 2 optimizer steps = 1 rollout of 8 completions (8 sampled), "
                                      "each trained on 3 times")
    trainer.total_steps = 300
    assert trainer.rollout_plan().startswith("ppo: 300 optimizer steps = 50 rollouts of 8 completions (400 sampled)")
    rollout = _fake_rollout(8)
    trainer.rollout_index = 5
    schedule = trainer.rollout_schedule(rollout)
    assert len(schedule) == 3 * 8 // 2  # = steps_per_rollout * gradient_accumulation_steps
    order = []
    for batch in schedule:
        assert batch["input_ids"].shape == (2, 3)
        rows = (batch["input_ids"][:, 0] - 10).tolist()
        for key in ("advantages", "old_logps", "old_values", "returns", "labels"):  # every field moves with its row
            assert torch.equal(batch[key], getattr(rollout, key)[rows])
        order += rows
    epochs = [order[i:i + 8] for i in range(0, 24, 8)]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # each epoch sees every row once
    assert len({tuple(e) for e in epochs}) > 1  # and in a fresh order
    again = [b["input_ids"] for b in trainer.rollout_schedule(rollout)]
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(again, schedule))  # deterministic
    trainer.rollout_index = 6
    other = torch.cat([b["input_ids"][:, 0] for b in trainer.rollout_schedule(rollout)])
    assert not torch.equal(other, torch.cat([b["input_ids"][:, 0] for b in schedule]))  # the next rollout differs


# -- 3. the critic -----------------------------------------------------------------------------------------------------


def test_shared_value_head_reads_the_policy_final_hidden_states(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir), prompts, DigitShare())
    critic = trainer.critic
    assert critic.shares_policy_backbone and critic.backbone is None
    rollout = trainer.make_rollout([prompts[i] for i in range(4)])
    with torch.no_grad():
        out = trainer.policy.model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                                   output_hidden_states=True)
        values = critic.head(out.hidden_states[-1]).squeeze(-1)[:, :-1]
        logits, ac_values = trainer.actor_critic(rollout.input_ids, rollout.attention_mask)
    torch.testing.assert_close(rollout.old_values, values)
    torch.testing.assert_close(ac_values[:, :-1], values)
    torch.testing.assert_close(logits, out.logits)
    # the head is a trained parameter of the one optimizer
    head_params = {id(p) for p in critic.head.parameters()}
    assert head_params <= {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}


def test_separate_critic_values_and_save_load(tmp_path, tiny_model_dir, prompts):
    critic, tokenizer = rlhf.ValueModel.from_pretrained(str(tiny_model_dir), seed=3)
    assert not critic.shares_policy_backbone and len(tokenizer) > 0
    trainer = _trainer(_config(tmp_path, tiny_model_dir), prompts, DigitShare(), critic=critic)
    rollout = trainer.make_rollout([prompts[i] for i in range(4)])
    with torch.no_grad():
        hidden = critic.backbone(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                                 output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(rollout.old_values, critic.head(hidden).squeeze(-1)[:, :-1])
        for p in critic.parameters():  # so that a reload from the start would be visible
            p.add_(0.01)
    saved = tmp_path / "saved"
    trainer._save_model(saved)
    assert (saved / "model.safetensors").is_file()
    assert ((saved / "critic" / "model.safetensors").is_file()
            and (saved / "critic" / rlhf.ValueModel.HEAD_FILE).is_file())
    assert not (saved / rlhf.ValueModel.HEAD_FILE).exists()

    reloaded, _ = rlhf.ValueModel.from_pretrained(str(saved / "critic"), seed=7)
    assert _changed(_state(critic), _state(reloaded)) == []
    other, _ = rlhf.ValueModel.from_pretrained(str(tiny_model_dir), seed=7)
    second = _trainer(_config(tmp_path / "b", tiny_model_dir), prompts, DigitShare(), critic=other)
    second._load_model(saved)
    assert _changed(_state(critic), _state(other)) == []
    assert _changed(_state(trainer.policy.model), _state(second.policy.model)) == []


def test_shared_value_head_save_load_round_trip(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, seed=1), prompts, DigitShare())
    with torch.no_grad():
        trainer.critic.head.bias.fill_(0.5)
    saved = tmp_path / "saved"
    trainer._save_model(saved)
    assert (saved / rlhf.ValueModel.HEAD_FILE).is_file() and (saved / "model.safetensors").is_file()
    assert not (saved / "critic").exists()
    second = _trainer(_config(tmp_path / "b", tiny_model_dir, seed=2), prompts, DigitShare())
    assert _changed(_state(trainer.critic), _state(second.critic))  # different seeds, different heads
    second._load_model(saved)
    assert _changed(_state(trainer.critic), _state(second.critic)) == []
    # a saved value head is picked up by ValueModel.from_pretrained as well
    critic, _ = rlhf.ValueModel.from_pretrained(str(saved), seed=9)
    assert _changed(_state(trainer.critic.head), _state(critic.head)) == []


# -- 4. the KL controller ----------------------------------------------------------------------------------------------


def test_adaptive_kl_coefficient_updates_once_per_rollout(tmp_path, tiny_model_dir, prompts):
    config = _config(tmp_path, tiny_model_dir, init_kl_coef=0.2, ppo_target=1.0, kl_horizon=100, max_steps=4,
                     ppo_epochs=2, learning_rate=1e-2)
    trainer = _trainer(config, prompts, DigitShare())
    seen = []
    original = trainer.make_rollout

    def make_rollout(items):
        before = trainer.kl_controller.value
        rollout = original(items)
        seen.append((before, rollout.metrics["objective/kl"], trainer.kl_controller.value, len(items)))
        return rollout

    trainer.make_rollout = make_rollout
    trainer.train()
    assert len(seen) == 2  # 4 steps, 2 per rollout
    assert seen[0][0] == 0.2 and seen[0][1] == 0.0
    for before, kl, after, n in seen:
        error = min(max(kl / 1.0 - 1, -0.2), 0.2)
        assert after == pytest.approx(before * (1 + error * n / 100), rel=1e-12)
    assert seen[1][0] == seen[0][2]  # the second rollout uses the coefficient the first one left
    assert seen[0][2] == pytest.approx(0.2 * (1 - 0.2 * 4 / 100))  # KL 0 < target: the coefficient shrinks
    assert trainer.kl_controller.value == seen[1][2]


def test_fixed_kl_coefficient_stays(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, adap_kl_ctrl=False, init_kl_coef=0.05, max_steps=4,
                               learning_rate=1e-2), prompts, DigitShare())
    assert isinstance(trainer.kl_controller, rlhf.FixedKLController)
    result = trainer.train()
    coefs = [row["objective/kl_coef"] for row in result.history if "objective/kl_coef" in row]
    assert coefs == [0.05, 0.05] and trainer.kl_controller.value == 0.05
    kls = [row["objective/kl"] for row in result.history if "objective/kl" in row]
    assert kls[0] == 0.0 and kls[1] != 0.0  # the second rollout comes from a trained policy


# -- 5. learning -------------------------------------------------------------------------------------------------------


def test_ppo_learns_a_simple_reward(tmp_path, tiny_model_dir, prompts):
    def digit_share(prompts, completions, answers):
        return torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])

    config = _config(tmp_path, tiny_model_dir, per_device_train_batch_size=8, max_completion_length=8, max_steps=30,
                     learning_rate=3e-3, init_kl_coef=0.01)
    result = _trainer(config, prompts, digit_share).train()
    scores = [row["objective/scores"] for row in result.history if "objective/scores" in row]
    assert len(scores) == 15  # one rollout per ppo_epochs=2 steps, logged once
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    print(f"ppo: objective/scores {first:.3f} -> {last:.3f}")
    assert first < 0.15, scores  # the untrained model writes few digits
    assert last > first + 0.2, scores  # measured 0.03 -> 0.5
    assert (Path(result.output_dir) / rlhf.ValueModel.HEAD_FILE).is_file()


# -- 6. resume ---------------------------------------------------------------------------------------------------------


def _resume_pair(tmp_path, model_dir, dataset, kill_at: int, **settings):
    """(straight trainer, resumed trainer, files of the checkpoint resumed from) for the same config: straight runs
    to the end; the other is killed after the checkpoint of ``kill_at`` and resumed from it."""
    settings = dict(max_steps=4, save_steps=kill_at, resume_from_checkpoint="auto", learning_rate=1e-2, **settings)
    straight = _trainer(_config(tmp_path / "straight", model_dir, **settings), dataset, DigitShare())
    straight.train()
    files = killed_after_checkpoint(_trainer(_config(tmp_path / "resumed", model_dir, **settings), dataset,
                                              DigitShare()), kill_at)
    resumed = _trainer(_config(tmp_path / "resumed", model_dir, **settings), dataset, DigitShare())
    assert resumed.train().global_step == 4
    return straight, resumed, files


def _streaming(tokenizer, demo_dir) -> rlhf.StreamingGRPODataset:
    return rlhf.StreamingGRPODataset(rlhf.resolve_dataset("demo_rl", demo_dir), tokenizer,
                                     rlhf.ChatFormatter(tokenizer, "auto"), cutoff_len=64, max_samples=32)


def test_resume_at_a_rollout_boundary_is_exact_when_streaming(tmp_path, tiny_model_dir, tiny_tokenizer, demo_dir):
    """ppo_epochs=2 and a checkpoint at step 2: the resumed run starts a fresh rollout, as the straight one did."""
    straight, resumed, files = _resume_pair(tmp_path, tiny_model_dir, _streaming(tiny_tokenizer, demo_dir), 2,
                                     streaming=True, ppo_score_norm=True)
    assert _changed(_state(straight.policy.model), _state(resumed.policy.model)) == []
    assert _changed(_state(straight.critic), _state(resumed.critic)) == []
    assert resumed.kl_controller.value == straight.kl_controller.value
    assert resumed.normalizer.state_dict() == straight.normalizer.state_dict()
    assert "rollout.safetensors" not in files  # nothing of a finished rollout is needed


def test_resume_at_a_rollout_boundary_is_exact(tmp_path, tiny_model_dir, prompts):
    straight, resumed, files = _resume_pair(tmp_path, tiny_model_dir, prompts, 2)
    assert _changed(_state(straight.policy.model), _state(resumed.policy.model)) == []
    assert _changed(_state(straight.critic), _state(resumed.critic)) == []
    assert resumed.kl_controller.value == straight.kl_controller.value


def test_resume_in_the_middle_of_a_rollout_is_exact(tmp_path, tiny_model_dir, prompts):
    """Killed after step 1 of a 2-step rollout: the checkpoint keeps the rollout, and the resumed run trains on it
    without sampling it again, so the KL coefficient and the score normaliser move once per rollout as well."""
    straight, resumed, files = _resume_pair(tmp_path, tiny_model_dir, prompts, 1, ppo_score_norm=True, kl_horizon=100)
    assert "rollout.safetensors" in files
    assert _changed(_state(straight.policy.model), _state(resumed.policy.model)) == []
    assert _changed(_state(straight.critic), _state(resumed.critic)) == []
    assert resumed.kl_controller.value == straight.kl_controller.value != 0.2
    assert resumed.normalizer.state_dict() == straight.normalizer.state_dict()
    assert straight.normalizer.count == 8  # two rollouts of 4 scores, each seen once


# -- 7. CLI ------------------------------------------------------------------------------------------------------------


def _cli_args(tmp_path: Path, model: Path, demo_dir: Path, *extra: str) -> list[str]:
    return ["ppo", f"model_name_or_path={model}", "dataset=demo_rl", f"dataset_dir={demo_dir}", "max_samples=8",
            "per_device_train_batch_size=4", "max_completion_length=8", "cutoff_len=64", "max_steps=2", "ppo_epochs=1",
            f"output_dir={tmp_path / 'cli'}", "save_steps=0", "logging_steps=1", "disable_progress_bar=true",
            "report_to=none", "reward_funcs=exact_answer", "finetuning_type=full", *extra]


def test_cli_ppo_run_writes_the_value_head_and_report(tmp_path, tiny_model_dir, demo_dir, capsys, caplog):
    with rlhf_log(caplog):
        status = rlhf.main(_cli_args(tmp_path, tiny_model_dir, demo_dir))
    assert status == 0, capsys.readouterr().err
    # a value head on a fully fine-tuned shared backbone is warned about (it cost the demo 19 points)
    assert sum("value head shares the policy's fully fine-tuned backbone" in m for m in caplog.messages) == 1
    out = tmp_path / "cli"
    assert (out / rlhf.ValueModel.HEAD_FILE).is_file() and (out / "model.safetensors").is_file()
    entry = json.loads((out / "report.json").read_text())["stages"][-1]
    assert entry["stage"] == "ppo" and entry["global_step"] == 2
    # a separate critic from a model directory is saved under critic/
    caplog.clear()
    with rlhf_log(caplog):
        status = rlhf.main(_cli_args(tmp_path, tiny_model_dir, demo_dir, f"value_model={tiny_model_dir}",
                                     "overwrite_output_dir=true", "max_steps=1"))
    assert status == 0, capsys.readouterr().err
    assert not any("value head shares" in m for m in caplog.messages)
    assert (out / "critic" / rlhf.ValueModel.HEAD_FILE).is_file() and (out / "critic" / "model.safetensors").is_file()
    assert len(json.loads((out / "report.json").read_text())["stages"]) == 2


def test_rollout_buffer_replays_every_row_once_per_epoch():
    rows = 10
    rollout = rlhf.Rollout(input_ids=torch.arange(rows)[:, None].repeat(1, 3),
                           attention_mask=torch.ones(rows, 3, dtype=torch.long),
                           labels=torch.arange(rows)[:, None].repeat(1, 3),
                           advantages=torch.arange(rows, dtype=torch.float32))
    buffer = rlhf.RolloutBuffer(rollout, micro_batch_size=4, epochs=3, seed=7)
    batches = buffer.micro_batches()
    assert len(buffer) == len(batches) == 9  # 3 epochs x ceil(10 / 4)
    for epoch in range(3):
        seen = torch.cat([b["input_ids"][:, 0] for b in batches[epoch * 3:(epoch + 1) * 3]])
        assert sorted(seen.tolist()) == list(range(rows))
        assert all(torch.equal(b["advantages"], b["input_ids"][:, 0].float())
                   for b in batches[epoch * 3:(epoch + 1) * 3])
    again = rlhf.RolloutBuffer(rollout, micro_batch_size=4, epochs=3, seed=7).micro_batches()
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))
    orders = [torch.cat([b["input_ids"][:, 0] for b in batches[e * 3:(e + 1) * 3]]).tolist() for e in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # each pass draws a new order
