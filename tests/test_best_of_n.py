"""Best-of-N and the standalone reward-model scorer in inference_optimizations (no rlhf import there):
scores match rlhf's own reward model exactly, the sampler keeps the argmax, and the CLI runs; its user
mistakes are one ``error:`` line with exit status 2, found before a model loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_scorer_of_an_ensemble_is_the_members_mean(tmp_path, tiny_model_dir, reward_dir):
    """An rm stage's ensemble directory (ensemble.json + member directories) scores like rlhf's RewardEnsemble."""
    shutil.copytree(reward_dir, tmp_path / "member-0")
    rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=5).save_pretrained(tmp_path / "member-1")
    rlhf.RewardEnsemble.write_manifest(tmp_path, ["member-0", "member-1"])
    prompts, responses = PROMPTS * 2, RESPONSES + ["14 + 7 = 20\nAnswer: 20", "no answer"]
    ours = io.RewardModelScorer(tmp_path, batch_size=3)(prompts, responses)
    members = [io.RewardModelScorer(tmp_path / f"member-{k}")(prompts, responses) for k in range(2)]
    assert float((members[0] - members[1]).abs().min()) > 1e-4  # two different heads
    torch.testing.assert_close(ours, (members[0] + members[1]) / 2, atol=1e-6, rtol=0)
    theirs = rlhf.LearnedReward.from_pretrained(str(tmp_path))(prompts, responses, [None] * 4)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


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
    out = tmp_path / "new" / "best.jsonl"  # its directory is created
    code = io.main(["best-of-n", "--policy", str(tiny_model_dir), "--reward", str(reward_dir), "--prompts",
                    str(prompts), "-n", "3", "--max-new-tokens", "6", "--output", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert all(len(r["candidates"]) == len(r["scores"]) == 3 and r["best"] == r["candidates"][r["best_index"]]
               for r in rows)
    err = capsys.readouterr().err
    assert "accuracy of the best" in err and "samples per prompt" in err


# -- user mistakes: one line, status 2, no traceback, before any model loads -------------------------------------

@pytest.fixture()
def cli(tmp_path, tiny_model_dir, reward_dir, capsys, monkeypatch):
    """Run best-of-n with working defaults and one change; returns (status, stderr). Loading a model would
    fail the test: every mistake here must be caught before that."""
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was reported")

    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", no_loading)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 1 + 1?\n")

    def run(*changes: str) -> tuple[int, str]:
        given = dict(zip(changes[::2], changes[1::2]))
        options = {"--policy": str(tiny_model_dir), "--reward": str(reward_dir), "--prompts": str(prompts),
                   "--device": "cpu", **given}
        code = io.main(["best-of-n", *[item for pair in options.items() for item in pair]])
        return code, capsys.readouterr().err
    return run


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err


def test_cli_reward_that_is_a_causal_lm(cli, tiny_model_dir):
    assert_one_line_error(*cli("--reward", str(tiny_model_dir)),
                          rf"^error: --reward {re.escape(str(tiny_model_dir))} is a causal LM, not a reward model "
                          r"\(no reward_config\.json / reward_head\.safetensors\); pass the rm stage's output")


def test_cli_reward_layout_problems(cli, tmp_path, reward_dir):
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                        "id2label": {"0": "A", "1": "B"}}))
    assert_one_line_error(*cli("--reward", str(classifier)),
                          r"is a sequence classifier with 2 labels; a reward model has one")
    headless = tmp_path / "headless"
    headless.mkdir()
    for name in ("config.json", "reward_config.json", "tokenizer.json"):
        (headless / name).write_text((reward_dir / name).read_text())
    assert_one_line_error(*cli("--reward", str(headless)),
                          r"--reward .*headless has reward_config\.json but no reward_head\.safetensors; save it again")
    assert_one_line_error(*cli("--reward", str(tmp_path / "nope")), r"^error: --reward \S+nope does not exist$")
    ensemble = tmp_path / "ensemble"
    ensemble.mkdir()
    (ensemble / "ensemble.json").write_text(json.dumps({"members": []}))
    assert_one_line_error(*cli("--reward", str(ensemble)), r"ensemble\.json lists no member directories; save the "
                                                            r"ensemble again with rlhf's rm stage")
    (ensemble / "ensemble.json").write_text(json.dumps({"members": ["member-0", "member-1"]}))
    shutil.copytree(reward_dir, ensemble / "member-0")
    assert_one_line_error(*cli("--reward", str(ensemble)), r"^error: --reward \S+ensemble/member-1 does not exist$")
    assert_one_line_error(*cli("--reward", str(tmp_path)),
                          r"is not a model directory \(no config\.json, no reward_config")


def test_cli_lora_policy_whose_base_is_gone(cli, tmp_path):
    pytest.importorskip("peft")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    gone = tmp_path / "base-was-here"
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                             "base_model_name_or_path": str(gone)}))
    assert_one_line_error(*cli("--policy", str(adapter)),
                          rf"^error: --policy {re.escape(str(adapter))} is a LoRA adapter whose base "
                          rf"{re.escape(str(gone))} \(from adapter_config\.json\) does not exist$")


def test_cli_policy_problems(cli, tmp_path):
    assert_one_line_error(*cli("--policy", str(tmp_path / "nope")), r"^error: --policy \S+nope does not exist$")
    assert_one_line_error(*cli("--policy", str(tmp_path)), r"is not a Hugging Face model directory \(no config\.json")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(*cli("--policy", str(tmp_path / "file")), r"is a file; pass a model directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cli_cuda_without_a_gpu(cli):
    assert_one_line_error(*cli("--device", "cuda"), r"^error: --device cuda: no CUDA GPU here; use --device cpu$")


def test_cli_not_a_device(cli):
    assert_one_line_error(*cli("--device", "gpu"), r"^error: --device gpu is not a device; use cpu or cuda")


def test_cli_output_checked_before_sampling(cli, tmp_path):
    assert_one_line_error(*cli("--output", str(tmp_path)),
                          rf"^error: --output {re.escape(str(tmp_path))} is a directory; give a file path$")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(*cli("--output", str(tmp_path / "file" / "sub" / "best.jsonl")),
                          r"cannot create the directory \S+sub \(\S+file is a file\)")
    assert_one_line_error(*cli("--output", " "), r"^error: --output is empty; give a file path")


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--temperature", "-1", r"--temperature must be >= 0, got -1$"),
    ("--temperature", "nan", r"--temperature must be a finite number >= 0, got nan$"),
    ("--temperature", "inf", r"--temperature must be a finite number >= 0, got inf$"),
    ("--top-p", "0", r"--top-p must be in \(0, 1\] \(1: off\), got 0$"),
    ("--top-p", "1.5", r"--top-p must be in \(0, 1\] \(1: off\), got 1.5$"),
    ("--top-k", "-1", r"--top-k must be >= 0 \(0: off\), got -1$"),
    ("--max-new-tokens", "0", r"--max-new-tokens must be >= 1, got 0$"),
    ("--batch-size", "0", r"--batch-size must be >= 1, got 0$"),
    ("-n", "0", r"-n must be >= 1, got 0$"),
    ("--seed", str(2 ** 64), r"--seed must be a 64-bit integer"),
])
def test_cli_numeric_options(cli, option, value, message):
    assert_one_line_error(*cli(option, value), r"^error: " + message)


def test_cli_bad_prompts_file(cli, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert_one_line_error(*cli("--prompts", str(bad)), r"bad\.jsonl:2: each record needs a 'prompt' string$")
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert_one_line_error(*cli("--prompts", str(bad)),
                          r"bad\.jsonl:2: invalid JSON \(.*\); each line must be one object$")
    bad.write_bytes(b"ok\n\xff\xfe\n")
    assert_one_line_error(*cli("--prompts", str(bad)), r"bad\.jsonl:2: not UTF-8 text; save the prompts file as UTF-8$")
    assert_one_line_error(*cli("--prompts", str(tmp_path)),
                          rf"^error: --prompts {re.escape(str(tmp_path))} is a directory; give a prompts file")
    assert_one_line_error(*cli("--prompts", str(tmp_path / "nope.txt")),
                          r"^error: --prompts \S+nope\.txt does not exist$")
    (tmp_path / "empty.txt").write_text("\n\n")
    assert_one_line_error(*cli("--prompts", str(tmp_path / "empty.txt")), r"empty\.txt holds no prompts$")


def test_script_entry_point_exits_2(tmp_path):
    repo = Path(io.__file__).resolve().parent
    proc = subprocess.run([sys.executable, str(repo / "inference_optimizations.py"), "best-of-n", "--policy", "p",
                           "--reward", "r", "--prompts", "x", "--temperature", "-1"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "error: --temperature must be >= 0, got -1\n"
