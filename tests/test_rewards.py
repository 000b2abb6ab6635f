"""Section 6 rule-based rewards (groundwork for GRPO/PPO): the verifiable exact-answer checker, the
format check, the length penalty, weighted composites and the running normaliser, on hand values."""

from __future__ import annotations

import statistics

import pytest
import torch

import rlhf

COMPLETIONS = ["37 + 8 = 45\nAnswer: 45", "37 + 8 = 46\nAnswer: 46", "37 + 8 = 45", "Answer: 4\nAnswer: 45"]
ANSWERS = ["45", "45", "45", "45"]


def test_exact_answer_and_format():
    prompts = ["What is 37 + 8?"] * 4
    assert rlhf.exact_answer_reward(prompts, COMPLETIONS, ANSWERS).tolist() == [1.0, 0.0, 0.0, 1.0]  # last wins
    assert rlhf.format_reward(prompts, COMPLETIONS, ANSWERS).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert rlhf.exact_answer_reward(["p"], ["Answer: 3"], [None]).tolist() == [0.0]
    with pytest.raises(ValueError):
        rlhf.exact_answer_reward(["p"], ["a", "b"], ["1"])  # lengths must agree


def test_length_penalty_and_composite():
    penalty = rlhf.length_penalty(10, scale=0.5)
    assert penalty([""] * 3, ["x" * 10, "x" * 20, "x" * 5], [None] * 3).tolist() == [0.0, -0.5, -0.25]
    with pytest.raises(rlhf.RLHFInputError):
        rlhf.length_penalty(0)
    composite = rlhf.CompositeReward([("correct", rlhf.exact_answer_reward, 1.0), ("format", rlhf.format_reward, 0.2)])
    total = composite([""] * 4, COMPLETIONS, ANSWERS)
    torch.testing.assert_close(total, torch.tensor([1.2, 0.2, 0.0, 1.2]))
    assert composite.last_components["format"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_running_normalizer_matches_statistics_and_resumes():
    batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0]), torch.tensor([-4.0, 0.5])]
    normalizer = rlhf.RunningRewardNormalizer(clip=2.0)
    for batch in batches:
        normalizer.update(batch)
    seen = [x for b in batches for x in b.tolist()]
    assert normalizer.mean == pytest.approx(statistics.mean(seen))
    assert normalizer.std == pytest.approx(statistics.stdev(seen))
    out = normalizer.normalize(torch.tensor([statistics.mean(seen), 100.0]))
    assert out.tolist() == pytest.approx([0.0, 2.0])  # centred, and clipped
    again = rlhf.RunningRewardNormalizer()
    again.load_state_dict(normalizer.state_dict())
    assert again.mean == normalizer.mean and again.std == normalizer.std
