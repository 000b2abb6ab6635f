"""bench/careless_breakdown.py's pooled row (--pool): seeds of one recipe averaged per prompt and tested against
the first policy, checked by hand and against exact enumeration of the sign flips; and the row end to end."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from conftest import load_script

pytestmark = pytest.mark.usefixtures("keeps_torch_threads")  # main() sets the thread count

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def breakdown():
    return load_script("bench/careless_breakdown.py")


def test_pooled_row_by_hand(breakdown):
    classes = ["1-step", "1-step", "1-step borrow", "multi", "multi borrow", "1-step borrow"]
    baseline = [True, True, False, True, False, False]
    run_a = [True, False, True, True, False, True]   # +2 prompts, -1
    run_b = [True, True, True, True, True, False]    # +2 prompts
    row = breakdown.pooled_row([baseline, run_a, run_b], classes, [9, 3, 2], columns=7, resamples=20000, seed=0)
    assert row[:7] == ["mean of 2 runs", "75.0%", "75.0%", "75.0%", "100.0%", "50.0%", "2.5"]
    # per prompt: 0, -0.5, +1, 0, +0.5, +0.5 -> +1.5 over 6 prompts = +25 points
    assert row[7].startswith("+25.0 pts, sign-flip p=")
    differences = [0.5, 1.0, 0.5, 0.5]  # the non-zero ones, up to sign
    observed = abs(-0.5 + 1.0 + 0.5 + 0.5)
    exact = sum(abs(sum(s * d for s, d in zip(signs, differences))) >= observed - 1e-12
                for signs in itertools.product((1, -1), repeat=4)) / 16
    assert float(row[7].split("p=")[1]) == pytest.approx(exact, abs=0.02)


def test_pooled_row_pads_the_sampled_columns(breakdown):
    row = breakdown.pooled_row([[True, False], [True, False]], ["1-step", "multi"], [0, 0], columns=9, resamples=100,
                               seed=0)
    assert len(row) == 10 and row[7:9] == ["", ""] and row[3] == "-"  # no borrow problems here
    assert row[9] == "+0.0 pts, sign-flip p=1"


def test_pool_end_to_end_and_its_errors(breakdown, sft_model, monkeypatch, capsys):
    policy = str(sft_model)
    monkeypatch.setattr(sys, "argv", ["careless_breakdown.py", "--pool", "--threads", "1",
                                      "--policies", ",".join([policy] * 3)])
    assert breakdown.main() == 0
    out = capsys.readouterr().out
    assert "mean of 2 runs" in out and "+0.0 pts, sign-flip p=1" in out  # the same policy thrice: nothing ahead
    monkeypatch.setattr(sys, "argv", ["careless_breakdown.py", "--pool", "--policies", policy])
    with pytest.raises(SystemExit) as error:
        breakdown.main()
    assert error.value.code == 2
    assert "--pool needs the baseline policy and at least one run" in capsys.readouterr().err
