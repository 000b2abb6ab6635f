"""Confidence-based stopping and adaptive allocation of a fixed sample budget."""

from __future__ import annotations

import math

import pytest

import inference_optimizations as io


def test_answer_agreement():
    assert io.answer_agreement(["3", "3", "4", None]) == ("3", 0.5)
    assert io.answer_agreement([None, None]) == (None, 0.0)


def test_stopping_by_agreement_and_margin():
    stop = io.ConfidenceBasedStopping(agreement=0.7, min_samples=3)
    assert not stop.should_stop(["5", "5"])  # too few samples yet
    assert stop.should_stop(["5", "5", "5"])
    assert not stop.should_stop(["5", "5", "4"])  # 2/3 < 0.7
    by_margin = io.ConfidenceBasedStopping(agreement=1.0, min_samples=2, margin=1.0)
    assert by_margin.should_stop(["1", "2"], scores=[3.0, 1.5])
    assert not by_margin.should_stop(["1", "2"], scores=[3.0, 2.5])
    with pytest.raises(ValueError):
        io.ConfidenceBasedStopping(agreement=0.0)


def _beta_tail_by_integration(a: int, b: int, steps: int = 200_000) -> float:
    """P(p > 1/2) for p ~ Beta(a, b), by the midpoint rule on the density (independent of the binomial identity)."""
    width = 0.5 / steps
    xs = [0.5 + (i + 0.5) * width for i in range(steps)]
    norm = math.gamma(a + b) / (math.gamma(a) * math.gamma(b))
    return norm * width * sum(x ** (a - 1) * (1 - x) ** (b - 1) for x in xs)


@pytest.mark.parametrize("leading,runner_up", [(3, 0), (4, 0), (5, 1), (6, 1), (2, 2), (7, 3), (1, 0)])
def test_beta_majority_confidence_matches_the_beta_posterior(leading, runner_up):
    got = io.beta_majority_confidence(leading, runner_up)
    assert got == pytest.approx(_beta_tail_by_integration(leading + 1, runner_up + 1), abs=1e-9)


def test_beta_majority_confidence_hand_values():
    assert io.beta_majority_confidence(3, 0) == 15 / 16  # Beta(4, 1): 1 - 0.5^4
    assert io.beta_majority_confidence(2, 2) == 0.5  # a tie is a coin flip
    assert io.beta_majority_confidence(5, 1) == 120 / 128  # P(Bin(7, 1/2) < 6) = 1 - (7 + 1) / 128


def test_stopping_by_the_beta_rule():
    stop = io.ConfidenceBasedStopping(min_samples=1, beta_threshold=0.95)
    assert not stop.should_stop(["5", "5", "5"])  # 0.9375
    assert stop.should_stop(["5", "5", "5", "5"])  # 31/32
    assert not stop.should_stop(["5", "5", "5", "5", "5", "4"])  # 5 against 1: 0.9375
    assert stop.should_stop(["5", "5", "5", "5", "5", "5", "4"])  # 6 against 1: 247/256
    assert stop.should_stop(["5", None, "5", "5", "5"])  # samples without an answer do not count
    assert not stop.should_stop([None] * 8)
    assert not io.ConfidenceBasedStopping(min_samples=5, beta_threshold=0.95).should_stop(["5"] * 4)
    with pytest.raises(ValueError):
        io.ConfidenceBasedStopping(beta_threshold=0.5)


@pytest.mark.parametrize("difficulty,budget,expected", [
    ([1, 1, 1, 1], 8, [2, 2, 2, 2]),
    ([0, 0, 3, 1], 10, [1, 1, 6, 2]),   # 6 left over split 3:1 -> 4.5, 1.5 -> largest remainders
    ([0, 0, 0], 7, [3, 2, 2]),          # no signal: spread evenly
])
def test_allocation_sums_to_the_budget(difficulty, budget, expected):
    shares = io.AdaptiveComputeAllocator(budget, min_per_prompt=1).allocate(difficulty)
    assert sum(shares) == budget and all(s >= 1 for s in shares)
    assert shares == expected


def test_allocation_respects_the_cap_and_rejects_impossible_budgets():
    shares = io.AdaptiveComputeAllocator(12, min_per_prompt=1, max_per_prompt=4).allocate([10, 0, 0, 0])
    assert shares[0] == 4 and sum(shares) == 12 and max(shares) <= 4
    with pytest.raises(ValueError):
        io.AdaptiveComputeAllocator(3, min_per_prompt=1).allocate([1, 1, 1, 1])
