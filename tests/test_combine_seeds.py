"""bench/combine_seeds.py: several inference_demo runs pooled per prompt, and the sign-flip test they use."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import combine_seeds  # noqa: E402


def test_sign_flip_p_matches_the_exact_value():
    # five prompts all +1: of the 2^5 sign patterns only all-plus and all-minus are as extreme -> 2/32
    assert combine_seeds.sign_flip_p([1.0] * 5, 20000, 0) == pytest.approx(2 / 32, abs=0.006)
    # differences of 0 carry no information. +0.5, -0.5 and +1 (observed |sum| 1), over the 8 sign patterns:
    # the two halves cancel in 4 patterns (sum +-1, both as extreme), add to +-1 in the other 4 (sum 2 or 0,
    # -2 or 0: 2 of them as extreme) -> 6/8
    assert combine_seeds.sign_flip_p([0.0, 0.5, -0.5, 1.0], 20000, 0) == pytest.approx(0.75, abs=0.02)
    assert combine_seeds.sign_flip_p([0.0, 0.0], 100, 0) == 1.0


def test_per_prompt_mean_averages_each_prompt_over_the_runs():
    assert combine_seeds.per_prompt_mean([[True, False, True], [True, True, False]]) == [1.0, 0.5, 0.5]


def run(seed: int, greedy: list[bool], method: list[bool], n: int = 8) -> dict:
    settings = {"seed": seed, "output": f"s{seed}.json", "n": n, "policy": "p"}
    rows = [{"method": "Greedy", "prompts": "eval (4)", "accuracy": 100 * sum(greedy) / 4, "correct": greedy},
            {"method": "MCTS + PRM value", "prompts": "eval (4)", "accuracy": 100 * sum(method) / 4,
             "correct": method, "claim": 2, "versus": 0}]
    return {"settings": settings, "rows": rows}


def test_combine_reports_the_mean_over_runs_against_the_claims_baseline():
    greedy = [True, False, False, False]
    runs = [run(0, greedy, [True, True, False, False]), run(1, greedy, [True, True, True, False])]
    (row,) = combine_seeds.combine(runs, 2000, 0)
    assert row[:6] == ["2", "MCTS + PRM value", "eval (4)", "Greedy", "25.0%", "62.5%"]
    assert row[6] == "50.0 / 75.0"
    assert row[7].startswith("+37.5 pts")  # per prompt: 0, +1, +0.5, 0


def test_runs_that_differ_in_more_than_the_seed_are_refused(tmp_path):
    greedy = [True, False, False, False]
    a, b = run(0, greedy, greedy), run(1, greedy, greedy)
    b["settings"]["policy"] = "other"
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    with pytest.raises(SystemExit, match=r"b.json: settings differ from .*a.json in policy"):
        combine_seeds.load_runs(paths)
    del b["rows"][0]["correct"]
    b["settings"]["policy"] = "p"
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="no per-prompt flags"):
        combine_seeds.load_runs(paths)


def test_stopping_at_equal_accuracy_holds_with_three_runs():
    """Claim 4 compares counts: with 3 runs per-prompt means like 1/3 are inexact floats, and equal accuracy must
    still read as 'no lower'."""
    base = [True, False, True, False, True]
    runs = []
    for seed, flags in enumerate([[False, True, True, False, True], [True, False, True, False, True],
                                  [True, False, False, True, True]]):
        data = run(seed, base, flags)
        data["rows"][1].update(claim=4, method="Confidence stopping + majority", mean_samples=3.0)
        runs.append(data)
    (row,) = combine_seeds.combine(runs, 200, 0)
    assert row[7].startswith("+0.0 pts") and row[7].endswith("62% fewer samples") and row[8] == "holds"


def test_a_seed_twice_or_another_row_layout_is_refused(tmp_path):
    greedy = [True, False, False, False]
    a, b = run(0, greedy, greedy), run(0, greedy, greedy)
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    with pytest.raises(SystemExit, match="a seed given twice"):
        combine_seeds.load_runs(paths)
    b = run(1, greedy, greedy)
    b["rows"][1]["method"] = "Something else"
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="its rows are not those of"):
        combine_seeds.load_runs(paths)
    (tmp_path / "b.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not an inference_demo --output file"):
        combine_seeds.load_runs(paths)
