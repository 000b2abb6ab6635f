"""bench/gpu_grpo.py, the GPU script of issue 45 part 6, at tiny settings on the CPU: it builds its model, trains SFT
and GRPO, and reports tokens/s and MFU, so the device time it is prepared for is not spent finding a typo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def test_the_gpu_script_runs_end_to_end_at_tiny_settings_on_the_cpu(tmp_path, capsys):
    import real_models

    real_models.sources_or_skip()
    import gpu_grpo

    out = tmp_path / "figures.json"
    code = gpu_grpo.main(["--device", "cpu", "--shape", "tiny", "--grpo-steps", "3", "--sft-steps", "3",
                          "--warmup", "1", "--prompts-per-step", "2", "--num-generations", "2",
                          "--completion-len", "8", "--sft-batch", "2", "--seq-len", "128",
                          "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    for stage in ("sft", "grpo"):
        assert figures[stage]["seconds"] > 0 and figures[stage]["tokens"] > 0 and 0 < figures[stage]["mfu"] < 1
    # random weights never stop early: every completion is the full budget
    assert figures["grpo"]["sampled"] == pytest.approx(2 * 2 * 8)
    assert "prime-rl" in capsys.readouterr().out
