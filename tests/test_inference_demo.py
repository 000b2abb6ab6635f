"""bench/inference_demo.py's allocation under reward-model reranking, on a case worked out by hand."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    return load_script("bench/inference_demo.py")


def test_adaptive_reranked_spends_the_budget_where_the_pilot_scores_low(demo):
    """4 prompts, 2 samples each (8 in all), a 1-sample pilot. The best pilot scores are 5, 4, 1, 2; their
    median (the upper middle, 4) leaves shortfalls 0, 0, 3, 2, so the 4 further samples go to the last two
    prompts 3:2: 2.4 and 1.6 give 2 and 1, and the one left over is shared again 3:2 and goes to the larger
    remainder (AdaptiveComputeAllocator). Each prompt answers with its highest-scored sample."""
    scores = [[5, 0, 0, 0], [4, 0, 0, 0], [1, 2, 3, 0], [2, 1, 0, 3]]
    ok = [[True, False, False, False], [True, False, False, False], [False, False, True, False],
          [False, False, False, True]]
    args = argparse.Namespace(budget_per_prompt=2, pilot=1, max_per_prompt=4)
    result = demo.adaptive_vs_uniform_reranked(scores, ok, args)
    assert result["shares"] == [1, 1, 4, 2] and result["total"] == 8 and result["hard"] == 2
    assert result["adaptive"] == [True, True, True, False]  # prompt 3's right sample is its 4th, not reached
    assert result["uniform"] == [True, True, False, False]  # the best of the first 2 samples


def test_lowest_share_gives_the_extra_samples_evenly_to_the_lowest_scored_prompts(demo):
    """The same 4 prompts with the lowest-scored half flagged: best pilot scores 5, 4, 1, 2 flag prompts 2
    and 3, which share the 4 further samples evenly (2 each, 3 samples apiece); with a cap of 2 per prompt
    the flagged are full after 1 each and the 2 left over go evenly to the others."""
    scores = [[5, 0, 0, 0], [4, 0, 0, 0], [1, 2, 3, 0], [2, 1, 0, 3]]
    ok = [[True, False, False, False], [True, False, False, False], [False, False, True, False],
          [False, False, False, True]]
    assert demo.lowest_share_difficulty(scores, 0.5, pilot=1) == [0.0, 0.0, 1.0, 1.0]
    assert demo.lowest_share_difficulty(scores, 0.25, pilot=1) == [0.0, 0.0, 1.0, 0.0]
    # with a 2-sample pilot the best pilot scores are 5, 4, 2, 2: a tie is broken by prompt order
    assert demo.lowest_share_difficulty(scores, 0.25, pilot=2) == [0.0, 0.0, 1.0, 0.0]
    args = argparse.Namespace(budget_per_prompt=2, pilot=1, max_per_prompt=4)
    flags, shares = demo.reranked_allocation(scores, ok, [0.0, 0.0, 1.0, 1.0], args, max_per_prompt=4)
    assert shares == [1, 1, 3, 3] and flags == [True, True, True, False]
    flags, shares = demo.reranked_allocation(scores, ok, [0.0, 0.0, 1.0, 1.0], args, max_per_prompt=2)
    assert shares == [2, 2, 2, 2] and flags == [True, True, False, False]
