"""bench/tables.py: the table every benchmark prints, with rich and, where rich is missing, as aligned plain text;
bench/limits.py: the machine's limits and the FLOP and byte counts behind every bench's limit columns."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from limits import (  # noqa: E402
    Limits,
    describe_limits,
    folder_params,
    forward_flops,
    fraction,
    giga,
    measure_limits,
    measure_limits_in_subprocess,
    model_params,
    model_weight_bytes,
    rl_step_flops,
    training_flops,
)
from tables import print_table  # noqa: E402

HEADERS = ["method", "tokens/s", "vs HF"]
ROWS = [["HF generate", "438", "1.00x"], ["ours, compiled", "1008", "2.30x"]]


def test_rich_table_has_the_title_headers_and_every_cell(capsys):
    print_table(HEADERS, ROWS, "Generation speed")
    out = capsys.readouterr().out
    assert "Generation speed" in out
    assert all(cell in out for cell in HEADERS + [c for row in ROWS for c in row])


def test_without_rich_the_columns_are_right_aligned_plain_text(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `from rich.console import Console` raises ImportError
    print_table(HEADERS, ROWS, "Generation speed")
    assert capsys.readouterr().out.splitlines() == [
        "Generation speed",
        "        method  tokens/s  vs HF",
        "   HF generate       438  1.00x",
        "ours, compiled      1008  2.30x",
    ]


# -- bench/limits.py: the machine's limits and the FLOP / byte counts every bench's limit columns use -----------------


def test_flop_counts_are_2_per_parameter_and_token_forward_and_6_with_the_backward():
    assert training_flops(1e6, 100) == 6e8
    assert forward_flops(1e6, 100) == 2e8
    # 10 sampled tokens (2e7) + 100 trained (6e8) + 50 forwarded without backward (1e8)
    assert rl_step_flops(1e6, 10, 100, 50) == 7.2e8
    assert rl_step_flops(1e6, 10, 100) == 6.2e8


def test_fraction_is_a_percentage_with_one_decimal_or_a_dash():
    assert fraction(12.3, 100) == "12.3%"
    assert fraction(1, 3) == "33.3%"
    assert fraction(2.5e9, 1e9) == "250.0%"  # speculative decoding's equivalent bandwidth can pass 100%
    assert fraction(0, 5) == "0.0%"
    for achieved, peak in [(None, 1.0), (1.0, None), (1.0, 0.0), (1.0, -2.0), (math.nan, 1.0), (1.0, math.inf)]:
        assert fraction(achieved, peak) == "-"
    assert giga(1.234e9) == "1.23" and giga(4.56e10, 1) == "45.6" and giga(None) == "-" and giga(math.nan) == "-"


def test_the_limits_line_names_the_best_of_every_measurement():
    line = describe_limits([1.0e11, 1.2e11], [3.0e10, 4.05e10], "float32", 1024,
                           "measured before and after each batch size")
    assert line == ("peak float32 matmul: 120.0 GFLOP/s (1024^2 torch.matmul, best of 100.0, 120.0 measured before "
                    "and after each batch size); memory bandwidth: 40.5 GB/s (best read of a 256 MiB tensor, 30.0, "
                    "40.5)")
    assert describe_limits([], [], "float32", 1024) == "peak matmul and memory bandwidth: not measured"
    limits = Limits("float32")
    assert math.isnan(limits.peak) and math.isnan(limits.bandwidth) and limits.matmul_size == 1024
    limits.add(1.0e9, 2.0e9)
    limits.add(3.0e9, 1.0e9)
    assert (limits.peak, limits.bandwidth) == (3.0e9, 2.0e9)
    assert limits.describe().startswith("peak float32 matmul: 3.0 GFLOP/s (1024^2 torch.matmul, best of 1.0, 3.0 "
                                        "measured before and after the timed runs); memory bandwidth: 2.0 GB/s")


def test_measured_limits_are_finite_and_positive():
    peak, bandwidth = measure_limits("cpu", "float32", 128)
    assert math.isfinite(peak) and peak > 0
    assert math.isfinite(bandwidth) and bandwidth > 0


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [True, False])
def test_model_params_count_each_matmul_weight_once_and_no_untied_input_table(tied):
    # embedding / head 10x4 = 40, attention 4 x (4x4) = 64, MLP 3 x (8x4) = 96, norms 3 x 4 = 12: 212 either way (tied:
    # the embedding is the head; untied: the head counts, the input table, a lookup, does not)
    model = _tiny_llama(tied)
    assert sum(p.numel() for p in model.parameters()) == (212 if tied else 252)
    assert model_params(model) == 212
    assert model_weight_bytes(model) == 212 * 4  # fp32


def test_folder_params_and_the_limits_subprocess(tmp_path):
    _tiny_llama(True).config.save_pretrained(tmp_path)
    assert folder_params(tmp_path) == 212
    result = measure_limits_in_subprocess(1, "float32", 128, model=tmp_path)
    assert result["params"] == 212 and result["threads"] == 1
    assert all(math.isfinite(result[key]) and result[key] > 0 for key in ("peak", "bandwidth"))


def test_step_token_counts_split_by_optimizer_step():
    import torch
    from bench_dpo import batch_tokens
    from bench_grpo import tokens_by_step

    assert batch_tokens({"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}) == 3
    assert batch_tokens({"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == 10  # no mask: every position
    events = [(0.5, "trained", 3), (1.5, "trained", 4), (1.7, "extra", 2), (2.0, "trained", 5), (2.5, "trained", 1),
              (9.0, "trained", 100)]  # after the last step's end: no step's
    assert tokens_by_step(events, [1.0, 2.0, 3.0], "trained") == [3, 9, 1]
    assert tokens_by_step(events, [1.0, 2.0, 3.0], "extra") == [0, 2, 0]
