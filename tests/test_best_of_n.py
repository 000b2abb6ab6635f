"""Best-of-N and the standalone reward-model scorer in inference_optimizations (no rlhf import there):
scores match rlhf's own reward model exactly, the sampler keeps the argmax, and the CLI runs."""

from __future__ import annotations

import json

import pytest
import torch

import inference_optimizations as io
import rlhf


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, tiny_model_dir):
    directory = tmp_path_factory.mktemp("rm")
    rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=3).save_pretrained(directory)
    return directory


PROMPTS = ["What is 14 + 7?", "Compute 22 + 7 - 8."]
RESPONSES = ["14 + 7 = 21\nAnswer: 21", "Step 1: 22 + 7 = 29\nStep 2: 29 - 8 = 21\nAnswer: 21"]


def test_completion_ids_match_rlhf_formatter(tiny_tokenizer):
    formatter = rlhf.ChatFormatter(tiny_tokenizer, "auto")
    for prompt, response in zip(PROMPTS, RESPONSES):
        record = {"system": "", "messages": [{"role": "user", "content": prompt}]}
        assert io.chat_prompt_ids(tiny_tokenizer, prompt) == formatter.prompt_ids(record)
        assert io.chat_completion_ids(tiny_tokenizer, prompt, response) == formatter.completion_ids(record, response)
    assert set(io.stop_token_ids(tiny_tokenizer)) == set(formatter.stop_token_ids)


def test_scorer_equals_rlhf_reward_model(reward_dir):
    prompts, responses = PROMPTS * 2, RESPONSES + ["14 + 7 = 20\nAnswer: 20", "no answer"]
    ours = io.RewardModelScorer(reward_dir, batch_size=3)(prompts, responses)
    theirs = rlhf.LearnedReward.from_pretrained(reward_dir)(prompts, responses, [None] * 4)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert ours.shape == (4,)


def test_scorer_rejects_multi_label_classifier(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=2)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="one output label"):
        io.RewardModelScorer(tmp_path)


class Shortest:
    def __call__(self, prompts, responses):
        self.seen = list(zip(prompts, responses))
        return torch.tensor([-float(len(r)) for r in responses])


def test_best_of_n_keeps_the_highest_score(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    reward = Shortest()
    sampler = io.BestOfNSampler(model, tiny_tokenizer, reward, n=4,
                                params=io.SamplingParams(max_new_tokens=8, seed=1), prompts_per_batch=1)
    result = sampler(PROMPTS)
    assert result.scores.shape == (2, 4) and len(result.candidates) == 2 and all(len(c) == 4 for c in result.candidates)
    for row, (best, index) in enumerate(zip(result.best, result.best_index)):
        assert result.candidates[row][index] == best
        assert result.scores[row, index] == result.scores[row].max() == -len(best)
    assert [p for p, _ in reward.seen] == [p for p in PROMPTS for _ in range(4)]  # prompt-major, n per prompt
    assert not model.training


def test_cli_best_of_n(tmp_path, tiny_model_dir, reward_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": "21"}) + "\n" for p in PROMPTS))
    out = tmp_path / "best.jsonl"
    code = io.main(["best-of-n", "--policy", str(tiny_model_dir), "--reward", str(reward_dir), "--prompts", str(prompts),
                    "-n", "3", "--max-new-tokens", "6", "--output", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert all(len(r["candidates"]) == len(r["scores"]) == 3 and r["best"] == r["candidates"][r["best_index"]]
               for r in rows)
    err = capsys.readouterr().err
    assert "accuracy of the best" in err and "samples per prompt" in err


def test_cli_bad_prompts_file(tmp_path, tiny_model_dir, reward_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:2: each record needs a 'prompt' string"):
        io.main(["best-of-n", "--policy", str(tiny_model_dir), "--reward", str(reward_dir), "--prompts", str(bad)])
    good = tmp_path / "good.txt"
    good.write_text("What is 1 + 1?\n")
    with pytest.raises(SystemExit, match="is not a Hugging Face model directory"):
        io.main(["best-of-n", "--policy", str(tmp_path), "--reward", str(reward_dir), "--prompts", str(good)])
