"""bench/rm_probe.py's flaw split: each held-out pair lands in the row of the digit its rejected answer gets
wrong, checked against the demo generator's own record of the flaw it made."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import load_script

pytestmark = pytest.mark.usefixtures("keeps_torch_threads")  # main() sets the thread count

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    return load_script("bench/rm_probe.py")


@pytest.mark.parametrize(
    ("chosen", "rejected", "kind", "digit"),
    [
        ("66 + 3 = 69\nAnswer: 69", "66 + 3 = 59\nAnswer: 59", "arithmetic", "tens"),
        ("66 + 3 = 69\nAnswer: 69", "66 + 3 = 70\nAnswer: 70", "arithmetic", "units"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48\nAnswer: 58", "format", "tens"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48\nAnswer: 46", "format", "units"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48", "format", None),
        # the careless teacher's forgotten borrow, carried into the next step
        ("Step 1: 52 - 7 = 45\nStep 2: 45 + 3 = 48\nAnswer: 48",
         "Step 1: 52 - 7 = 55\nStep 2: 55 + 3 = 58\nAnswer: 58", "arithmetic", "tens"),
        ("Step 1: 95 + 5 = 100\nStep 2: 100 - 1 = 99\nAnswer: 99",
         "Step 1: 95 + 5 = 90\nStep 2: 90 - 1 = 89\nAnswer: 89", "arithmetic", "tens"),
    ],
)
def test_flaw_kind_and_wrong_digit(probe, chosen, rejected, kind, digit):
    assert probe.flaw_kind(rejected) == kind
    assert probe.wrong_digit(chosen, rejected) == digit


def test_flaw_rows_partition_the_demo_pairs(probe):
    """Each kind's rows split it without overlap, and the digit rows agree with the slip the generator made
    (its FLAW_DELTAS: 1 or 2 is the units digit, 10 the tens)."""
    pairs = [json.loads(line) for line in (REPO / "data/demo/preference.jsonl").read_text().splitlines()]
    rows = dict(probe.flaw_rows(pairs))
    assert sorted(rows["all"]) == list(range(len(pairs)))
    assert sorted(rows["format"] + rows["arithmetic"]) == rows["all"]
    assert sorted(rows["  no Answer line"] + rows["  Answer disagrees in the units digit"]
                  + rows["  Answer disagrees in the tens digit"]) == rows["format"]
    assert sorted(rows["  wrong units digit"] + rows["  wrong tens digit"]) == rows["arithmetic"]
    assert all(len(indices) > 20 for indices in rows.values())
    for i in rows["  wrong tens digit"] + rows["  Answer disagrees in the tens digit"]:
        assert "Answer:" in pairs[i]["rejected"]
        last_right = int(pairs[i]["chosen"].rsplit(" ", 1)[1])
        assert abs(int(pairs[i]["rejected"].rsplit(" ", 1)[1]) - last_right) == 10


def test_main_prints_a_training_pair_column_per_reward_model(probe, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """End to end on the tiny model: two reward models and --train-pairs give two training-pair columns;
    --policy-pairs a row for a make_onpolicy_pairs directory, counting its pairs."""
    import rlhf

    for seed in (1, 2):
        rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=seed).save_pretrained(tmp_path / f"rm-{seed}")
    models = f"{tmp_path / 'rm-1'},{tmp_path / 'rm-2'}"
    pairs_dir = tmp_path / "pairs"
    pairs_dir.mkdir()
    pair = {"prompt": "What is 52 - 7?", "chosen": "52 - 7 = 45\nAnswer: 45", "rejected": "52 - 7 = 55\nAnswer: 55"}
    (pairs_dir / "pairs.jsonl").write_text((json.dumps(pair) + "\n") * 3)
    (pairs_dir / "dataset_info.json").write_text(json.dumps({"onpolicy_pairs": {
        "file_name": "pairs.jsonl", "ranking": True,
        "columns": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}}}))
    monkeypatch.setenv("COLUMNS", "1000")  # wide enough that no header is cut
    monkeypatch.setattr(sys, "argv", ["rm_probe.py", "--policy", str(tiny_model_dir), "--reward-models", models,
                                      "--train-pairs", "6", "--val-size", "20", "--threads", "1",
                                      "--policy-pairs", str(pairs_dir)])
    assert probe.main() == 0
    out = capsys.readouterr().out
    assert out.count("on 6 training pairs") == 2, out
    row = next(line for line in out.splitlines() if f"policy samples, {pairs_dir}" in line)
    assert " 3 " in row


def test_policy_pairs_without_a_pairs_directory_is_one_line(probe, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rm_probe.py", "--policy", str(tiny_model_dir), "--reward-models",
                                      str(tiny_model_dir), "--policy-pairs", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--policy-pairs .*no dataset_info.json there"):
        probe.main()


def test_tens_digit_pairs_are_the_habit_and_an_invented_borrow(probe):
    """Every eval single-step subtraction lands in exactly one probe: a borrow problem against the habit
    (10 too high), a problem without one against a borrow taken anyway (10 too low); the chosen answer is
    the eval file's own."""
    eval_path = REPO / "data/demo/eval.jsonl"
    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"] for line in eval_path.read_text().splitlines()}
    pairs = probe.tens_digit_pairs(eval_path)
    habit, invented = pairs["borrow, vs the habit (+10)"], pairs["no borrow, vs a borrow (-10)"]
    assert len(habit) > 30 and len(invented) > 30
    assert not {p["messages"][0]["content"] for p in habit} & {p["messages"][0]["content"] for p in invented}
    for pair, delta in [(p, 10) for p in habit] + [(p, -10) for p in invented]:
        prompt = pair["messages"][0]["content"]
        right = int(pair["chosen"].rsplit(" ", 1)[1])
        assert str(right) == answers[prompt] and " - " in prompt
        assert int(pair["rejected"].rsplit(" ", 1)[1]) == right + delta
    def needs_borrow(pair: dict) -> bool:  # "What is 52 - 7?": 2 units cannot give 7
        words = pair["messages"][0]["content"].split()
        return int(words[2]) % 10 < int(words[4].rstrip("?"))

    assert all(needs_borrow(p) for p in habit) and not any(needs_borrow(p) for p in invented)
