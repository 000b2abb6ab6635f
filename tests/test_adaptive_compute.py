"""Confidence-based stopping and adaptive allocation of a fixed sample budget."""

from __future__ import annotations

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
