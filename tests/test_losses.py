"""Section 5 (losses): the pure preference losses, checked numerically.

For ``dpo_loss`` (every ``loss_type``), ``simpo_loss``, ``orpo_loss``, ``kto_loss`` and
``reward_model_loss`` this file checks:

1. per-example losses against an independent re-statement of the paper's formula written here in
   plain Python ``math`` (float64, random inputs);
2. a value worked out by hand for one simple input (the arithmetic is in the comment);
3. finite losses and finite gradients for extreme log-ratios (+-1e4 in every combination; for ORPO
   length-averaged log-probs of 0, -1e-9 and -1e4), in float32 and float64;
4. the gradient sign: raising the chosen log-prob lowers the loss and raising the rejected one raises
   it, wherever the paper's loss has that property, and the documented exceptions where it does not
   (target-based losses such as IPO / SPPO / EXO / NCA, cDPO with label smoothing, APO-down);
5. the error for an unknown ``loss_type`` (it names every valid one) and for IPO without lengths;
6. DPO's limits (label_smoothing=0 is plain -logsigmoid; a large beta drives the loss to 0 when the
   policy already prefers the chosen answer);
7. the returned rewards equal beta * (policy - reference) and carry no gradient.

Notation in comments: c = policy_chosen - reference_chosen, r = policy_rejected - reference_rejected,
h = c - r (the DPO "logits"), sigma = the logistic function.
"""

from __future__ import annotations

import math

import pytest
import torch

import rlhf

F64 = torch.float64
LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "kto_pair", "bco_pair", "exo_pair", "nca_pair", "sppo_hard",
              "apo_zero", "apo_down")
# (loss_type, label_smoothing): label smoothing changes sigmoid (cDPO), robust (rDPO) and exo_pair.
LOSS_CASES = [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.0), ("robust", 0.1), ("hinge", 0.0), ("ipo", 0.0),
              ("kto_pair", 0.0), ("bco_pair", 0.0), ("exo_pair", 0.0), ("exo_pair", 0.1), ("nca_pair", 0.0),
              ("sppo_hard", 0.0), ("apo_zero", 0.0), ("apo_down", 0.0)]
CASE_IDS = [f"{name}-eps{eps}" for name, eps in LOSS_CASES]
EXTREMES = (-1e4, 0.0, 1e4)


# ---- independent reference formulas (plain Python floats) ----


def _logsigmoid(x: float) -> float:
    """log(sigma(x)) without overflow: -log(1 + e^-x) for x >= 0, x - log(1 + e^x) otherwise."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _ref_dpo(loss_type: str, c: list[float], r: list[float], beta: float, eps: float) -> list[float]:
    """Per-example losses from the (for ipo: length-normalised) log-ratios c and r."""
    n = len(c)
    if loss_type == "kto_pair":  # KTO with the KL point estimated from the other half of the batch
        kl_c, kl_r = max(sum(c) / n, 0.0), max(sum(r) / n, 0.0)
        return [0.5 * ((1 - _sigmoid(beta * (ci - kl_r))) + (1 - _sigmoid(beta * (kl_c - ri)))) for ci, ri in zip(c, r)]
    if loss_type == "bco_pair":  # reward shift delta = mean implicit reward over both halves
        delta = sum(beta * x for x in c + r) / (2 * n)
        return [-_logsigmoid(beta * ci - delta) - _logsigmoid(-(beta * ri - delta)) for ci, ri in zip(c, r)]
    out = []
    for ci, ri in zip(c, r):
        z = beta * (ci - ri)
        if loss_type == "sigmoid":  # DPO eq. 7; cDPO mixes in the flipped label with weight eps
            out.append(-(1 - eps) * _logsigmoid(z) - eps * _logsigmoid(-z))
        elif loss_type == "robust":  # rDPO: unbiased under label-flip rate eps
            out.append(((1 - eps) * -_logsigmoid(z) - eps * -_logsigmoid(-z)) / (1 - 2 * eps))
        elif loss_type == "hinge":  # SLiC
            out.append(max(0.0, 1 - z))
        elif loss_type == "ipo":  # IPO eq. 17, regression of h onto 1 / (2 beta)
            out.append((ci - ri - 1 / (2 * beta)) ** 2)
        elif loss_type == "exo_pair":  # KL(Bernoulli(sigma(z)) || Bernoulli(1 - eps'))
            e = eps if eps > 0 else 1e-3
            p = _sigmoid(z)
            out.append(p * (_logsigmoid(z) - math.log(1 - e)) + (1 - p) * (_logsigmoid(-z) - math.log(e)))
        elif loss_type == "nca_pair":
            cr, rr = beta * ci, beta * ri
            out.append(-_logsigmoid(cr) - 0.5 * _logsigmoid(-cr) - 0.5 * _logsigmoid(-rr))
        elif loss_type == "sppo_hard":
            out.append((ci - 0.5 / beta) ** 2 + (ri + 0.5 / beta) ** 2)
        elif loss_type == "apo_zero":
            out.append((1 - _sigmoid(beta * ci)) + _sigmoid(beta * ri))
        elif loss_type == "apo_down":
            out.append(_sigmoid(beta * ci) + (1 - _sigmoid(beta * (ci - ri))))
        else:
            raise AssertionError(loss_type)
    return out


def _dsigmoid(x: float) -> float:
    return _sigmoid(x) * (1 - _sigmoid(x))


def _ref_orpo_log_odds(c: float, r: float) -> float:
    """log[odds(chosen) / odds(rejected)] with odds(p) = p / (1 - p) and p = e^logp."""
    return (c - r) - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r)))


# ---- helpers ----


def _rand(seed: int, n: int, lo: float, hi: float) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (lo + (hi - lo) * torch.rand(n, generator=g, dtype=F64)).tolist()


def _t(values, dtype=F64, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def _dpo(pc, pr, rc, rr, loss_type, *, beta=0.1, eps=0.0, lengths=None, **kwargs):
    """rlhf.dpo_loss, passing token counts (all 1 unless given) only when the loss type needs them."""
    if loss_type == "ipo":
        if lengths is None:
            lengths = (torch.ones(pc.shape, dtype=torch.long), torch.ones(pc.shape, dtype=torch.long))
        kwargs.update(chosen_lengths=lengths[0], rejected_lengths=lengths[1])
    return rlhf.dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps, **kwargs)


def _dpo_grads(loss_type, c, r, *, beta=0.1, eps=0.0, lengths=None):
    """(d sum(losses) / d policy_chosen, d sum(losses) / d policy_rejected) at log-ratios c, r.

    Each loss only depends on its own row (batch statistics are detached), so these are per-example."""
    rc, rr = _t([-50.0] * len(c)), _t([-60.0] * len(r))
    pc, pr = (rc + _t(c)).requires_grad_(), (rr + _t(r)).requires_grad_()
    losses, _, _ = _dpo(pc, pr, rc, rr, loss_type, beta=beta, eps=eps, lengths=lengths)
    losses.sum().backward()
    return pc.grad, pr.grad


def _assert_finite(*tensors):
    for t in tensors:
        assert t is not None
        assert torch.isfinite(t).all(), t


# ---- dpo_loss: registry and errors ----


def test_registry_holds_exactly_the_eleven_losses():
    assert set(rlhf.PREFERENCE_LOSSES) == set(LOSS_TYPES)
    assert all(callable(fn) for fn in rlhf.PREFERENCE_LOSSES.values())


def test_unknown_loss_type_names_every_valid_one():
    x = _t([-1.0, -2.0])
    with pytest.raises((ValueError, rlhf.RLHFInputError)) as info:
        rlhf.dpo_loss(x, x, x, x, loss_type="dpo_typo")
    message = str(info.value)
    assert "dpo_typo" in message
    missing = [name for name in LOSS_TYPES if name not in message]
    assert not missing, f"error message does not name {missing}: {message}"


@pytest.mark.parametrize("which", ["both", "chosen", "rejected"])
def test_ipo_without_lengths_raises(which):
    x = _t([-1.0, -2.0])
    n = torch.tensor([3, 4])
    lengths = {"both": {}, "chosen": {"rejected_lengths": n}, "rejected": {"chosen_lengths": n}}[which]
    with pytest.raises((ValueError, rlhf.RLHFInputError)):
        rlhf.dpo_loss(x, x, x, x, loss_type="ipo", **lengths)


# ---- dpo_loss: formula, hand values, limits ----


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("loss_type,eps", LOSS_CASES, ids=CASE_IDS)
def test_dpo_matches_reference_formula(loss_type, eps, beta, seed):
    n = 8
    pc, pr, rc, rr = (_rand(seed * 10 + k, n, -80.0, -5.0) for k in range(4))
    lc = [int(x) for x in _rand(seed * 10 + 4, n, 1, 40)]
    lr = [int(x) for x in _rand(seed * 10 + 5, n, 1, 40)]
    c = [a - b for a, b in zip(pc, rc)]
    r = [a - b for a, b in zip(pr, rr)]
    if loss_type == "ipo":  # IPO uses length-normalised log-ratios
        c = [x / k for x, k in zip(c, lc)]
        r = [x / k for x, k in zip(r, lr)]
    lengths = (torch.tensor(lc), torch.tensor(lr))
    losses, chosen_rewards, rejected_rewards = _dpo(_t(pc), _t(pr), _t(rc), _t(rr), loss_type, beta=beta, eps=eps,
                                                    lengths=lengths)
    assert losses.shape == (n,) and losses.dtype == F64
    torch.testing.assert_close(losses, _t(_ref_dpo(loss_type, c, r, beta, eps)), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(chosen_rewards, _t([beta * x for x in c]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rejected_rewards, _t([beta * x for x in r]), rtol=1e-12, atol=1e-12)


# One pair with c = 1, r = -1 (h = 2), beta = 0.1 unless noted; s(x) = sigma(x).
HAND_VALUES = [
    # -log s(0.2) = log(1 + e^-0.2) = 0.5981388693815918
    ("sigmoid", 0.0, 0.5981388693815918),
    # 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9 * 0.59813887 + 0.1 * 0.79813887 = 0.6181388693815918
    ("sigmoid", 0.1, 0.6181388693815918),
    # (0.9 * 0.59813887 - 0.1 * 0.79813887) / (1 - 0.2) = 0.45851111 / 0.8 = 0.5731388693815918
    ("robust", 0.1, 0.5731388693815918),
    # relu(1 - 0.1 * 2) = 0.8
    ("hinge", 0.0, 0.8),
    # token counts 1: (2 - 1 / 0.2)^2 = (2 - 5)^2 = 9
    ("ipo", 0.0, 9.0),
    # B = 1: KL_c = max(1, 0) = 1, KL_r = max(-1, 0) = 0;
    # 0.5 * ((1 - s(0.1 * (1 - 0))) + (1 - s(0.1 * (1 + 1)))) = 0.5 * (0.47502081 + 0.45016600) = 0.462593407604291
    ("kto_pair", 0.0, 0.462593407604291),
    # delta = mean(0.1, -0.1) = 0: -log s(0.1) - log s(0.1) = 2 * 0.64439666 = 1.2887933201471418
    ("bco_pair", 0.0, 1.2887933201471418),
    # eps' = 1e-3, p = s(0.2) = 0.54983400: p * (log p - log 0.999) + (1 - p) * (log(1 - p) - log 0.001)
    #   = 0.549834 * (-0.59813887 + 0.00100050) + 0.450166 * (-0.79813887 + 6.90775528) = 2.4220146206616477
    ("exo_pair", 0.0, 2.4220146206616477),
    # -log s(0.1) - 0.5 log s(-0.1) - 0.5 log s(0.1) = 1.5 * 0.64439666 + 0.5 * 0.74439666 = 1.3387933201471418
    ("nca_pair", 0.0, 1.3387933201471418),
    # (1 - 0.5 / 0.1)^2 + (-1 + 0.5 / 0.1)^2 = 16 + 16 = 32
    ("sppo_hard", 0.0, 32.0),
    # (1 - s(0.1)) + s(-0.1) = 2 * 0.47502081 = 0.95004162504212
    ("apo_zero", 0.0, 0.95004162504212),
    # s(0.1) + (1 - s(0.2)) = 0.52497919 + 0.45016600 = 0.9751451901664621
    ("apo_down", 0.0, 0.9751451901664621),
]


@pytest.mark.parametrize("loss_type,eps,expected", HAND_VALUES, ids=[f"{n}-eps{e}" for n, e, _ in HAND_VALUES])
def test_dpo_hand_computed_value(loss_type, eps, expected):
    # policy chosen -1 vs reference -2 (c = 1); policy rejected -3 vs reference -2 (r = -1)
    losses, _, _ = _dpo(_t([-1.0]), _t([-3.0]), _t([-2.0]), _t([-2.0]), loss_type, beta=0.1, eps=eps)
    assert losses.item() == pytest.approx(expected, rel=1e-12)


def test_ipo_hand_value_uses_length_normalised_log_ratios():
    # c = 4 / 2 tokens = 2, r = -4 / 4 tokens = -1, h = 3: (3 - 1 / (2 * 0.1))^2 = (3 - 5)^2 = 4;
    # rewards from the normalised ratios: 0.1 * 2 = 0.2 and 0.1 * -1 = -0.1
    losses, chosen_rewards, rejected_rewards = _dpo(_t([-6.0]), _t([-14.0]), _t([-10.0]), _t([-10.0]), "ipo",
                                                    beta=0.1, lengths=(torch.tensor([2]), torch.tensor([4])))
    assert losses.item() == pytest.approx(4.0, rel=1e-12)
    assert chosen_rewards.item() == pytest.approx(0.2, rel=1e-12)
    assert rejected_rewards.item() == pytest.approx(-0.1, rel=1e-12)


def test_bco_delta_overrides_the_batch_mean():
    # delta = 0.3 given: -log s(0.1 - 0.3) - log s(-(-0.1 - 0.3)) = log(1 + e^0.2) + log(1 + e^-0.4)
    #   = 0.79813887 + 0.51301525 = 1.3111541...
    losses, _, _ = _dpo(_t([-1.0]), _t([-3.0]), _t([-2.0]), _t([-2.0]), "bco_pair", beta=0.1, bco_delta=0.3)
    assert losses.item() == pytest.approx(-_logsigmoid(-0.2) - _logsigmoid(0.4), rel=1e-12)
    assert losses.item() == pytest.approx(1.3111541, abs=1e-6)


def test_kto_pair_mean_equals_trl_mean_over_2b_terms():
    """TRL returns 2B terms (B chosen, then B rejected); our B per-example halves-sums have the same mean."""
    n, beta = 6, 0.2
    c, r = _rand(3, n, -5, 8), _rand(4, n, -9, 4)
    kl_c, kl_r = max(sum(c) / n, 0.0), max(sum(r) / n, 0.0)
    trl_terms = [1 - _sigmoid(beta * (x - kl_r)) for x in c] + [1 - _sigmoid(beta * (kl_c - x)) for x in r]
    rc, rr = _t([-20.0] * n), _t([-30.0] * n)
    losses, _, _ = _dpo(rc + _t(c), rr + _t(r), rc, rr, "kto_pair", beta=beta)
    assert losses.mean().item() == pytest.approx(sum(trl_terms) / (2 * n), rel=1e-12)


def test_dpo_defaults_are_sigmoid_beta_0_1_and_equal_minus_logsigmoid():
    pc, pr, rc, rr = (_rand(20 + k, 5, -40, -1) for k in range(4))
    losses, _, _ = rlhf.dpo_loss(_t(pc), _t(pr), _t(rc), _t(rr))
    expected = [-_logsigmoid(0.1 * ((a - b) - (d - e))) for a, d, b, e in zip(pc, pr, rc, rr)]
    torch.testing.assert_close(losses, _t(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", [50.0, 1e3])
def test_dpo_sigmoid_large_beta_limits(beta):
    # h > 0: -log s(beta h) = log(1 + e^-(beta h)) -> 0; h < 0: -> beta |h| (linear, never inf)
    h = [0.5, 1.0, 10.0]
    zero = _t([0.0] * 3)
    pos, _, _ = _dpo(_t(h), zero, zero, zero, "sigmoid", beta=beta)
    assert (pos >= 0).all() and (pos < 1e-9).all()
    neg, _, _ = _dpo(_t([-x for x in h]), zero, zero, zero, "sigmoid", beta=beta)
    torch.testing.assert_close(neg, _t([beta * x for x in h]), rtol=1e-9, atol=1e-9)


# ---- dpo_loss: extremes ----


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("loss_type,eps", LOSS_CASES, ids=CASE_IDS)
def test_dpo_finite_at_extreme_log_ratios(loss_type, eps, dtype):
    combos = [(c, r) for c in EXTREMES for r in EXTREMES]
    # every combination alone (batch statistics see only it) and all nine in one batch
    for batch in [[combo] for combo in combos] + [combos]:
        c, r = [x for x, _ in batch], [y for _, y in batch]
        rc, rr = _t([-2e4] * len(batch), dtype), _t([-2e4] * len(batch), dtype)  # policy log-probs stay <= 0
        pc = (rc + _t(c, dtype)).requires_grad_()
        pr = (rr + _t(r, dtype)).requires_grad_()
        losses, chosen_rewards, rejected_rewards = _dpo(pc, pr, rc, rr, loss_type, eps=eps)
        losses.mean().backward()
        _assert_finite(losses, chosen_rewards, rejected_rewards, pc.grad, pr.grad)


# ---- dpo_loss: gradient signs ----

# Raising the chosen log-prob never raises the loss and raising the rejected one never lowers it,
# whatever the log-ratios: these losses are monotone in h (sigmoid with eps = 0, robust, hinge) or in
# c and r separately (kto_pair, bco_pair, apo_zero; their batch statistics are detached).
MONOTONE_EVERYWHERE = [("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.1), ("robust", 0.3), ("hinge", 0.0),
                       ("kto_pair", 0.0), ("bco_pair", 0.0), ("apo_zero", 0.0)]
# Target-based losses have a finite optimum, so the sign only holds on the near side of it, which
# includes the initialisation c = r = 0 (policy = reference): ipo pulls h to 1/(2 beta), sppo_hard
# pulls c to 1/(2 beta) and r to -1/(2 beta), exo_pair pulls sigma(beta h) to 1 - eps', nca_pair's
# chosen term is minimal at beta c = log 2, cDPO's at sigma(beta h) = 1 - eps.
MONOTONE_NEAR_INIT = [("ipo", 0.0), ("sppo_hard", 0.0), ("exo_pair", 0.0), ("exo_pair", 0.1), ("nca_pair", 0.0),
                      ("sigmoid", 0.1)]


def _check_signs(grad_c, grad_r):
    assert (grad_c <= 0).all(), grad_c
    assert (grad_r >= 0).all(), grad_r
    assert (grad_c < 0).any() and (grad_r > 0).any(), "gradients vanish everywhere"


@pytest.mark.parametrize("loss_type,eps", MONOTONE_EVERYWHERE, ids=[f"{n}-eps{e}" for n, e in MONOTONE_EVERYWHERE])
def test_dpo_gradient_sign_everywhere(loss_type, eps):
    c, r = _rand(30, 16, -50, 50), _rand(31, 16, -50, 50)  # beta * log-ratios in [-5, 5]
    _check_signs(*_dpo_grads(loss_type, c, r, beta=0.1, eps=eps))


@pytest.mark.parametrize("loss_type,eps", MONOTONE_NEAR_INIT, ids=[f"{n}-eps{e}" for n, e in MONOTONE_NEAR_INIT])
def test_dpo_gradient_sign_near_initialisation(loss_type, eps):
    c, r = _rand(32, 16, -1, 1), _rand(33, 16, -1, 1)
    lengths = (torch.tensor([int(x) for x in _rand(34, 16, 1, 20)]),
               torch.tensor([int(x) for x in _rand(35, 16, 1, 20)]))
    _check_signs(*_dpo_grads(loss_type, c, r, beta=0.1, eps=eps, lengths=lengths))
    # exactly at the initialisation, too
    _check_signs(*_dpo_grads(loss_type, [0.0], [0.0], beta=0.1, eps=eps))


def test_apo_down_rejected_sign_everywhere():
    # d/dr [s(beta c) + 1 - s(beta (c - r))] = beta s'(beta (c - r)) > 0 for every c, r
    _, grad_r = _dpo_grads("apo_down", _rand(36, 16, -50, 50), _rand(37, 16, -50, 50))
    assert (grad_r > 0).all(), grad_r


# Where the chosen/rejected sign is (by design) reversed; beta = 0.1, token counts 1.
# (loss_type, eps, c, r, sign of dL/d policy_chosen, sign of dL/d policy_rejected)
PAST_THE_OPTIMUM = [
    # ipo: dL/dh = 2 (h - 5) > 0 once h = 10 overshoots 1/(2 beta) = 5, so both signs flip
    ("ipo", 0.0, 10.0, 0.0, 1, -1),
    # sppo_hard: dL/dc = 2 (c - 5) > 0 at c = 10; dL/dr = 2 (r + 5) < 0 at r = -10
    ("sppo_hard", 0.0, 10.0, -10.0, 1, -1),
    # exo_pair: dL/dz = s(z) (1 - s(z)) (z - log(0.999 / 0.001)) > 0 at z = beta h = 10 > 6.9068
    ("exo_pair", 0.0, 100.0, 0.0, 1, -1),
    # cDPO eps = 0.1: dL/dz = -(0.9 - s(z)) > 0 once s(z) > 0.9, e.g. z = 4 (s = 0.982)
    ("sigmoid", 0.1, 40.0, 0.0, 1, -1),
    # nca_pair: dL/d(beta c) = -s(-1) + 0.5 s(1) = -0.2689 + 0.3655 > 0 at beta c = 1 > log 2;
    # its rejected term 0.5 softplus(beta r) keeps dL/dr > 0
    ("nca_pair", 0.0, 10.0, 0.0, 1, 1),
    # apo_down is built to push the chosen answer down as well ("both worse than the model"):
    # dL/dc = beta (s'(beta c) - s'(beta (c - r))) = 0.1 (0.25 - s'(10)) > 0 at c = 0, r = -100 ...
    ("apo_down", 0.0, 0.0, -100.0, 1, 1),
    # ... but < 0 once the margin term dominates: 0.1 (s'(10) - s'(0)) at c = r = 100
    ("apo_down", 0.0, 100.0, 100.0, -1, 1),
]


@pytest.mark.parametrize("loss_type,eps,c,r,sign_c,sign_r", PAST_THE_OPTIMUM,
                         ids=[f"{row[0]}-c{row[2]}-r{row[3]}" for row in PAST_THE_OPTIMUM])
def test_dpo_gradient_sign_reverses_past_the_optimum(loss_type, eps, c, r, sign_c, sign_r):
    grad_c, grad_r = _dpo_grads(loss_type, [c], [r], beta=0.1, eps=eps)
    assert torch.sign(grad_c).item() == sign_c, grad_c
    assert torch.sign(grad_r).item() == sign_r, grad_r


def test_kto_pair_and_bco_pair_batch_statistics_are_detached():
    """Gradients equal the analytic per-row derivative with KL / delta held constant.

    (TRL's kto_pair does not detach its KL estimate; the forward values are the same either way.)"""
    n, beta = 5, 0.1
    c, r = _rand(40, n, -20, 30), _rand(41, n, -30, 20)
    kl_c, kl_r = max(sum(c) / n, 0.0), max(sum(r) / n, 0.0)
    grad_c, grad_r = _dpo_grads("kto_pair", c, r, beta=beta)
    torch.testing.assert_close(grad_c, _t([-0.5 * beta * _dsigmoid(beta * (x - kl_r)) for x in c]),
                               rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_r, _t([0.5 * beta * _dsigmoid(beta * (kl_c - x)) for x in r]),
                               rtol=1e-9, atol=1e-12)

    delta = sum(beta * x for x in c + r) / (2 * n)
    grad_c, grad_r = _dpo_grads("bco_pair", c, r, beta=beta)
    torch.testing.assert_close(grad_c, _t([-beta * _sigmoid(-(beta * x - delta)) for x in c]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_r, _t([beta * _sigmoid(beta * x - delta) for x in r]), rtol=1e-9, atol=1e-12)


# ---- dpo_loss: rewards ----


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_rewards_are_detached_beta_log_ratios(loss_type):
    beta = 0.3
    pc, pr = _t(_rand(50, 4, -30, -1), grad=True), _t(_rand(51, 4, -30, -1), grad=True)
    rc, rr = _t(_rand(52, 4, -30, -1)), _t(_rand(53, 4, -30, -1))
    lc, lr = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 1, 2, 7])
    _, chosen_rewards, rejected_rewards = _dpo(pc, pr, rc, rr, loss_type, beta=beta, lengths=(lc, lr))
    norm_c, norm_r = (lc, lr) if loss_type == "ipo" else (1, 1)
    torch.testing.assert_close(chosen_rewards, beta * (pc - rc).detach() / norm_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rejected_rewards, beta * (pr - rr).detach() / norm_r, rtol=1e-12, atol=1e-12)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


# ---- simpo_loss ----


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (2.0, 0.5, 0.1)])
def test_simpo_matches_reference_formula(beta, gamma, eps, seed):
    c, r = _rand(60 + seed, 8, -4, -0.1), _rand(70 + seed, 8, -4, -0.1)  # length-averaged log-probs
    losses, chosen_rewards, rejected_rewards = rlhf.simpo_loss(_t(c), _t(r), beta=beta, gamma=gamma,
                                                               label_smoothing=eps)
    z = [beta * (x - y) - gamma for x, y in zip(c, r)]  # SimPO eq. 6: beta/|y| log pi(y) margin minus gamma
    expected = [-(1 - eps) * _logsigmoid(v) - eps * _logsigmoid(-v) for v in z]
    assert losses.shape == (8,)
    torch.testing.assert_close(losses, _t(expected), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(chosen_rewards, _t([beta * x for x in c]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rejected_rewards, _t([beta * x for x in r]), rtol=1e-12, atol=1e-12)


def test_simpo_hand_value_and_defaults():
    # defaults beta = 2, gamma = 0.5; c = -1, r = -2: z = 2 * (-1 + 2) - 0.5 = 1.5;
    # -log s(1.5) = log(1 + e^-1.5) = 0.2014132779827524
    losses, _, _ = rlhf.simpo_loss(_t([-1.0]), _t([-2.0]))
    assert losses.item() == pytest.approx(0.2014132779827524, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_simpo_finite_at_extremes(dtype):
    values = (-1e4, -1e-9, 0.0)
    c = _t([x for x in values for _ in values], dtype, grad=True)
    r = _t([y for _ in values for y in values], dtype, grad=True)
    losses, chosen_rewards, rejected_rewards = rlhf.simpo_loss(c, r)
    losses.sum().backward()
    _assert_finite(losses, chosen_rewards, rejected_rewards, c.grad, r.grad)


def test_simpo_gradient_sign_and_detached_rewards():
    c, r = _t(_rand(80, 16, -6, -0.01), grad=True), _t(_rand(81, 16, -6, -0.01), grad=True)
    losses, chosen_rewards, rejected_rewards = rlhf.simpo_loss(c, r)
    losses.sum().backward()
    _check_signs(c.grad, r.grad)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


# ---- orpo_loss ----


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_orpo_matches_reference_formula(beta, seed):
    c, r = _rand(90 + seed, 8, -3, -0.01), _rand(100 + seed, 8, -3, -0.01)  # length-averaged, < 0
    losses, chosen_rewards, rejected_rewards, log_odds = rlhf.orpo_loss(_t(c), _t(r), beta=beta)
    expected_log_odds = [_ref_orpo_log_odds(x, y) for x, y in zip(c, r)]
    assert losses.shape == (8,)
    torch.testing.assert_close(log_odds, _t(expected_log_odds), rtol=1e-9, atol=1e-10)
    # ORPO eq. 7: L_OR = -log s(log odds ratio), weighted by beta (lambda in the paper)
    torch.testing.assert_close(losses, _t([-beta * _logsigmoid(v) for v in expected_log_odds]), rtol=1e-9,
                               atol=1e-10)
    torch.testing.assert_close(chosen_rewards, _t([beta * x for x in c]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rejected_rewards, _t([beta * x for x in r]), rtol=1e-12, atol=1e-12)
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


def test_orpo_hand_value():
    # p_chosen = 0.5 (odds 1), p_rejected = 0.25 (odds 1/3): log odds ratio = log 3 = 1.0986123;
    # -0.1 * log s(log 3) = -0.1 * log(3 / 4) = 0.02876820724517809
    losses, _, _, log_odds = rlhf.orpo_loss(_t([math.log(0.5)]), _t([math.log(0.25)]), beta=0.1)
    assert log_odds.item() == pytest.approx(math.log(3.0), rel=1e-12)
    assert losses.item() == pytest.approx(0.02876820724517809, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_orpo_finite_at_extremes(dtype):
    values = (0.0, -1e-9, -1e4)
    c = _t([x for x in values for _ in values], dtype, grad=True)
    r = _t([y for _ in values for y in values], dtype, grad=True)
    losses, chosen_rewards, rejected_rewards, log_odds = rlhf.orpo_loss(c, r)
    losses.sum().backward()
    _assert_finite(losses, chosen_rewards, rejected_rewards, log_odds, c.grad, r.grad)
    # a certain chosen answer against a near-impossible rejected one is (almost) no loss
    certain = losses[torch.tensor([x == 0.0 and y == -1e4 for x, y in zip(c.tolist(), r.tolist())])]
    assert certain.numel() == 1
    assert (certain < 0.1 * math.log(2)).all()


def test_orpo_fp32_log_odds_accurate_near_probability_one():
    # A confident model has averaged log-probs like -1e-5, where 1 - e^c cancels catastrophically in
    # fp32 (the naive log1p(-exp(c)) is off by ~1e-3 here); log(-expm1(c)) keeps full precision.
    c, r = _t([-1e-5, -1e-3, -0.1], torch.float32), _t([-2.0, -1e-4, -1e-5], torch.float32)
    _, _, _, log_odds = rlhf.orpo_loss(c, r)
    expected = [_ref_orpo_log_odds(x, y) for x, y in zip(c.tolist(), r.tolist())]  # the fp32 inputs, in fp64
    torch.testing.assert_close(log_odds, _t(expected, torch.float32), rtol=1e-6, atol=1e-5)


def test_orpo_gradient_sign():
    # d log_odds / dc = 1 / (1 - e^c) > 0 and d log_odds / dr = -1 / (1 - e^r) < 0; -log s is decreasing
    c, r = _t(_rand(110, 16, -5, -0.01), grad=True), _t(_rand(111, 16, -5, -0.01), grad=True)
    losses, _, _, _ = rlhf.orpo_loss(c, r)
    losses.sum().backward()
    _check_signs(c.grad, r.grad)


# ---- kto_loss ----


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("beta,kl,w_d,w_u", [(0.1, 0.0, 1.0, 1.0), (0.1, 0.7, 1.0, 1.0), (0.5, 2.5, 1.33, 0.7)])
def test_kto_matches_reference_formula(beta, kl, w_d, w_u, seed):
    n = 10
    policy, reference = _rand(120 + seed, n, -60, -5), _rand(130 + seed, n, -60, -5)
    desirable = [x > 0.5 for x in _rand(140 + seed, n, 0, 1)]
    desirable[0], desirable[1] = True, False  # both kinds present
    losses, rewards = rlhf.kto_loss(_t(policy), _t(reference), torch.tensor(desirable), _t(kl), beta=beta,
                                    desirable_weight=w_d, undesirable_weight=w_u)
    logratio = [p - q for p, q in zip(policy, reference)]
    # KTO eq. 8: lambda_y - v(x, y) with v = lambda_D s(beta (r - z0)) or lambda_U s(beta (z0 - r))
    expected = [w_d * (1 - _sigmoid(beta * (x - kl))) if d else w_u * (1 - _sigmoid(beta * (kl - x)))
                for x, d in zip(logratio, desirable)]
    assert losses.shape == (n,)
    torch.testing.assert_close(losses, _t(expected), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(rewards, _t([beta * x for x in logratio]), rtol=1e-12, atol=1e-12)


def test_kto_hand_values():
    # beta = 0.1, KL = 0.5; desirable log-ratio 1.5: 2 * (1 - s(0.1 * (1.5 - 0.5))) = 2 * 0.47502081 = 0.95004163;
    # undesirable log-ratio -0.5: 3 * (1 - s(0.1 * (0.5 + 0.5))) = 3 * 0.47502081 = 1.42506244
    losses, rewards = rlhf.kto_loss(_t([-1.0, -3.0]), _t([-2.5, -2.5]), torch.tensor([True, False]), _t(0.5),
                                    beta=0.1, desirable_weight=2.0, undesirable_weight=3.0)
    assert losses.tolist() == pytest.approx([0.95004162504212, 1.42506243756318], rel=1e-12)
    assert rewards.tolist() == pytest.approx([0.15, -0.05], rel=1e-12)


def test_kto_clamps_and_detaches_kl():
    policy, reference = _t([-1.0, -3.0]), _t([-2.5, -2.5])
    desirable = torch.tensor([True, False])
    at_zero, _ = rlhf.kto_loss(policy, reference, desirable, _t(0.0))
    negative, _ = rlhf.kto_loss(policy, reference, desirable, _t(-2.0))  # a negative estimate counts as 0
    torch.testing.assert_close(negative, at_zero, rtol=0, atol=0)
    source = _t(0.8, grad=True)
    losses, rewards = rlhf.kto_loss(policy, reference, desirable, source * 1.0)
    assert not losses.requires_grad, "no gradient may flow into the KL estimate"
    assert not rewards.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_kto_finite_at_extremes(dtype):
    for kl in (0.0, 5.0, 1e4):
        for desirable in (True, False):
            reference = _t([-2e4] * 3, dtype)
            policy = (reference + _t(list(EXTREMES), dtype)).requires_grad_()
            losses, rewards = rlhf.kto_loss(policy, reference, torch.tensor([desirable] * 3), _t(kl, dtype))
            losses.sum().backward()
            _assert_finite(losses, rewards, policy.grad)


def test_kto_gradient_sign():
    # desirable rows: raising log pi lowers the loss; undesirable rows: raising it raises the loss
    n = 16
    reference = _t(_rand(150, n, -40, -5))
    policy = (reference + _t(_rand(151, n, -30, 30))).requires_grad_()
    desirable = torch.tensor([i % 2 == 0 for i in range(n)])
    losses, _ = rlhf.kto_loss(policy, reference, desirable, _t(0.4))
    losses.sum().backward()
    assert (policy.grad[desirable] < 0).all() and (policy.grad[~desirable] > 0).all(), policy.grad


# ---- reward_model_loss ----


@pytest.mark.parametrize("with_margin", [False, True], ids=["no-margin", "margin"])
def test_reward_model_matches_reference_formula(with_margin):
    chosen, rejected = _rand(160, 8, -5, 5), _rand(161, 8, -5, 5)
    margin = _rand(162, 8, 0, 3) if with_margin else [0.0] * 8
    losses = rlhf.reward_model_loss(_t(chosen), _t(rejected), _t(margin) if with_margin else None)
    expected = [-_logsigmoid(a - b - m) for a, b, m in zip(chosen, rejected, margin)]
    assert losses.shape == (8,)
    torch.testing.assert_close(losses, _t(expected), rtol=1e-9, atol=1e-10)


def test_reward_model_hand_values():
    # -log s(2 - 1) = log(1 + e^-1) = 0.31326168751822286; with margin 1: -log s(0) = log 2
    assert rlhf.reward_model_loss(_t([2.0]), _t([1.0])).item() == pytest.approx(0.31326168751822286, rel=1e-12)
    assert rlhf.reward_model_loss(_t([2.0]), _t([1.0]), _t([1.0])).item() == pytest.approx(math.log(2), rel=1e-12)


def test_reward_boosting_weights_are_the_pairwise_loss_gradient():
    """sigmoid(-(c - r - m)): hand values, the independent formula 1 - exp(-loss) (loss = -log sigmoid(h),
    so exp(-loss) = sigmoid(h)), and exactly minus the gradient of the summed loss in the score difference."""
    # h = 0 -> 1/2; h = ln 3 -> 1/(1 + 3) = 1/4; h = -ln 3 -> 3/4; margin 1 on h = 1 -> 1/2
    weights = rlhf.reward_boosting_weights(_t([0.0, math.log(3), 0.0, 1.0]), _t([0.0, 0.0, math.log(3), 0.0]),
                                           _t([0.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(weights, _t([0.5, 0.25, 0.75, 0.5]), rtol=1e-12, atol=1e-12)
    chosen, rejected, margin = _rand(170, 8, -5, 5), _rand(171, 8, -5, 5), _rand(172, 8, 0, 3)
    expected = [1 - math.exp(_logsigmoid(a - b - m)) for a, b, m in zip(chosen, rejected, margin)]
    torch.testing.assert_close(rlhf.reward_boosting_weights(_t(chosen), _t(rejected), _t(margin)), _t(expected),
                               rtol=1e-9, atol=1e-12)
    difference = _t([a - b for a, b in zip(chosen, rejected)], grad=True)
    rlhf.reward_model_loss(difference, torch.zeros_like(difference), _t(margin)).sum().backward()
    torch.testing.assert_close(-difference.grad, rlhf.reward_boosting_weights(_t(chosen), _t(rejected), _t(margin)))
    extremes = rlhf.reward_boosting_weights(_t([1e4, -1e4], torch.float32), _t([-1e4, 1e4], torch.float32))
    assert torch.isfinite(extremes).all() and extremes.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_reward_model_finite_at_extremes_and_gradient_sign(dtype):
    chosen = _t([x for x in EXTREMES for _ in EXTREMES], dtype, grad=True)
    rejected = _t([y for _ in EXTREMES for y in EXTREMES], dtype, grad=True)
    losses = rlhf.reward_model_loss(chosen, rejected)
    losses.sum().backward()
    _assert_finite(losses, chosen.grad, rejected.grad)
    _check_signs(chosen.grad, rejected.grad)
