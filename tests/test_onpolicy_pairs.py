"""scripts/make_onpolicy_pairs.py's prompt loading: answers computed for demo prompts that carry none
(sft.jsonl), duplicates across files used once, and the skipped validation prompts kept out everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/make_onpolicy_pairs.py")


@pytest.mark.parametrize(("prompt", "answer"), [("What is 52 - 7?", "45"), ("What is 95 + 5?", "100"),
                                                ("Compute 12 + 7 - 5.", "14"), ("Compute 90 - 7 + 4 - 30.", "57"),
                                                ("Say hello.", None)])
def test_demo_answer(script, prompt, answer):
    assert script.demo_answer(prompt) == answer


def test_demo_answer_agrees_with_every_demo_file_that_has_answers(script):
    for name in ("eval.jsonl", "rl_prompts.jsonl", "multistep.jsonl"):
        for line in (REPO / "data/demo" / name).read_text().splitlines():
            record = json.loads(line)
            assert script.demo_answer(record["prompt"]) == str(record["answer"]), (name, record)


def test_load_prompts_skips_dedupes_and_fills_answers(script, tmp_path):
    first = tmp_path / "rl.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is 52 - 7?", "answer": "45"}, {"prompt": "What is 10 + 3?", "answer": "13"}]))
    second = tmp_path / "sft.jsonl"
    second.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is 61 - 2?", "response": "61 - 2 = 59"}, {"prompt": "What is 52 - 7?", "response": "x"},
        {"prompt": "What is 10 + 3?", "response": "y"}, {"prompt": "Compute 1 + 2 + 3.", "response": "z"}]))
    records = script.load_prompts([str(first), str(second)], skip=1)
    # 52 - 7 is skipped in the first file and so kept out of the second; 61 - 2 is the second file's skipped line
    assert records == [{"prompt": "What is 10 + 3?", "answer": "13"}, {"prompt": "Compute 1 + 2 + 3.", "answer": "6"}]


def test_load_prompts_names_the_line_without_an_answer(script, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: no 'answer'"):
        script.load_prompts([str(path)], skip=0)


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "What is 1 + 2?"}\nnot json\n', r"bad.jsonl:2: not JSON"),
    ('{"prompt": "What is 1 + 2?"}\n\n{"question": "What is 1 + 2?"}\n', r"bad.jsonl:3: no 'prompt' string"),
    ('["What is 1 + 2?"]\n', r"bad.jsonl:1: no 'prompt' string"),
])
def test_load_prompts_names_the_bad_line(script, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        script.load_prompts([str(path)], skip=0)


def test_a_missing_prompt_file_is_one_line_from_the_command(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nowhere.jsonl"
    (tmp_path / "config.json").write_text("{}")  # the prompts are read before the policy loads
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "make_onpolicy_pairs.py"), "--policy",
                           str(tmp_path), "--prompts", str(missing)], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"{missing}: cannot read it (No such file or directory); give JSONL files with a " \
                                  "'prompt' per line"


def test_a_directory_without_a_model_is_a_usage_error(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "make_onpolicy_pairs.py"), "--policy", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"--policy {tmp_path}: no model there (no config.json); "
                                                         "give a directory saved by rlhf.py")


def test_mix_writes_the_given_pairs_and_the_new_ones_shuffled(script, tiny_model_dir, tmp_path):
    """End to end on the tiny model: mixed.jsonl holds every line of the --mix files and every new pair, in
    an order fixed by --seed, and dataset_info.json registers both files."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(20, 24)))
    extra = tmp_path / "extra.jsonl"
    given = [{"prompt": f"What is {a} - 7?", "chosen": f"{a} - 7 = {a - 7}\nAnswer: {a - 7}",
              "rejected": f"{a} - 7 = {a + 3}\nAnswer: {a + 3}"} for a in range(50, 62)]
    extra.write_text("".join(json.dumps(p) + "\n" for p in given))
    outs = []
    for name in ("a", "b"):
        args = ["--policy", str(tiny_model_dir), "--prompts", str(prompts), "--samples", "4", "--temperature", "1.0",
                "--mix", str(extra), "--out", str(tmp_path / name)]
        assert script.main(args) == 0
        outs.append(tmp_path / name)
    new = (outs[0] / "pairs.jsonl").read_text().splitlines()
    mixed = (outs[0] / "mixed.jsonl").read_text().splitlines()
    assert sorted(mixed) == sorted([json.dumps(p) for p in given] + new)
    assert mixed != [json.dumps(p) for p in given] + new  # shuffled
    assert (outs[1] / "mixed.jsonl").read_text() == (outs[0] / "mixed.jsonl").read_text()
    info = json.loads((outs[0] / "dataset_info.json").read_text())
    assert info["onpolicy_mixed"]["file_name"] == "mixed.jsonl" and info["onpolicy_pairs"]["file_name"] == "pairs.jsonl"


def test_a_mix_record_that_is_not_a_pair_names_its_line(script, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?", "chosen": "Answer: 2", "rejected": "Answer: 3"}) + "\n"
                    + json.dumps({"prompt": "What is 1 + 2?", "response": "Answer: 3"}) + "\n")
    with pytest.raises(SystemExit, match=r"sft.jsonl:2: no 'chosen' string"):
        script.read_pair_lines(str(path))
