"""bench/bench_real_learning.py end to end on the embedded tiny model (its ChatML template stands in for a real
model's): the SFT checkpoint it trains for DPO and GRPO, one training subprocess per stage and implementation (ours
and TRL's), the plain-transformers evaluator, the table, the verdicts and the JSON. Tiny settings: 2 steps of each
stage (1 timed), a few records, 8 held-out prompts, 1 thread."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script

import rlhf

STAGES = ("sft", "dpo", "grpo")
IMPLS = ("ours", "trl")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_real_learning.py")


def test_the_evaluator_takes_the_number_after_the_last_answer_line(bench):
    assert bench.last_answer("Step 1: 12 + 3 = 15\nAnswer: 15") == "15"
    assert bench.last_answer("Answer: 3\nno, wait\nAnswer: -4") == "-4"
    assert bench.last_answer("15 - 9 = 6") is None
    assert bench.last_answer("Answer: about twelve") is None


def test_the_driver_reads_our_dpo_default_without_importing_rlhf(bench):
    default = rlhf.DPOConfig.__dataclass_fields__["precompute_ref_log_probs"].default
    assert bench.our_default("DPOConfig", "precompute_ref_log_probs") == default == "auto"


def test_every_stage_and_implementation_has_finite_times_memory_and_an_accuracy(bench, tmp_path, tiny_model_dir,
                                                                                capsys):
    pytest.importorskip("trl")  # a bench-only dependency (bench/requirements-bench.txt)
    report, workdir = tmp_path / "report.json", tmp_path / "work"
    code = bench.main(["--model", str(tiny_model_dir), "--workdir", str(workdir), "--threads", "1",
                       "--sft-steps", "2", "--dpo-steps", "2", "--grpo-steps", "2", "--warmup", "1",
                       "--sft-records", "16", "--dpo-records", "16", "--grpo-records", "8", "--eval-prompts", "8",
                       "--sft-batch", "4", "--dpo-batch", "4", "--grpo-batch", "8", "--completion-len", "16",
                       "--eval-max-new-tokens", "16", "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(report.read_text())

    # DPO and GRPO started from one SFT checkpoint that the bench trained into --workdir
    start = data["starts"]["dpo"]
    assert start == data["starts"]["grpo"] != data["starts"]["sft"] and start.startswith(str(workdir))
    assert f"DPO and GRPO start from the SFT checkpoint {start}" in out
    for before in ("base model", "SFT checkpoint"):
        assert 0.0 <= data["evals"][before]["accuracy"] <= 1.0
    for stage in STAGES:
        for impl in IMPLS:
            row = data["summary"][f"{stage}/{impl}"]
            assert "error" not in row, row
            assert row["timed"] == 1
            for key in ("step", "min", "cycle", "peak", "base"):
                assert math.isfinite(row[key]) and row[key] > 0, (stage, impl, key, row[key])
            evaluated = data["evals"][f"{stage}/{impl}"]
            assert 0.0 <= evaluated["accuracy"] <= 1.0 and evaluated["prompts"] == 8
        assert sum(line.startswith(("PASS", "FAIL")) and f" {stage}: time " in line for line in out.splitlines()) == 1
    for impl in IMPLS:  # GRPO's completion tokens per step, counted for both (sampling differs)
        assert 0 < data["summary"][f"grpo/{impl}"]["tokens"] <= 8 * 16
    for stage in ("sft", "dpo"):  # the same batches and the same loss: the settings match
        ours, theirs = (data["runs"][f"{stage}/{impl}"][0]["losses"] for impl in IMPLS)
        assert len(ours) == len(theirs) == 2 and max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    dpo = [data["runs"][f"dpo/{impl}"][0]["precompute_ref_log_probs"] for impl in IMPLS]
    assert dpo[0] == dpo[1]  # TRL gets our default
    assert not (workdir / "bench-runs").exists()  # the trained models are deleted once evaluated
    for impl in IMPLS:  # the driver is pytest here, so a run's ru_maxrss may start from its peak; VmHWM does not
        assert all(run["peak_hwm"] > 0 for run in data["runs"][f"sft/{impl}"])
