"""Throughput and model FLOP utilisation in every run's log (issue 56, part 2): the FLOPs a step does (PaLM's count,
as torchtitan and prime-rl log MFU), the peak they are measured against (a known GPU's, a CPU's measured rate, or
mfu_peak_flops), and an online step split into waiting for its rollout (sampling, scoring) and training."""

from __future__ import annotations

import json

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(tie: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tie", [False, True])
def test_training_flops_are_six_per_matmul_parameter_and_token_plus_attention(tie):
    """Per layer: q, k, v, o 4 x 8 x 8 = 256, gate, up, down 3 x 8 x 16 = 384, two norms 16; two layers 1312, the
    final norm 8 and the output layer 32 x 8 = 256 (tied or not, it is a matmul; the input embedding is a lookup):
    1576. Sequences of 3 and 5 tokens: 3 (6 x 1576 + 12 x 2 x 8 x 3) + 5 (6 x 1576 + 12 x 2 x 8 x 5) = 82176."""
    shape = rlhf.ModelShape.of(_llama(tie))
    assert (shape.matmul_params, shape.layers, shape.width) == (1576, 2, 8)
    assert shape.training_flops([3, 5]) == 82176


def test_the_peak_is_a_known_gpus_or_this_cpus_measured_rate(tmp_path, monkeypatch):
    assert rlhf.gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert rlhf.gpu_peak_flops("NVIDIA H100 PCIe", torch.float16) == 756e12
    assert rlhf.gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12  # TF32: half
    assert rlhf.gpu_peak_flops("Some New Accelerator", torch.bfloat16) is None
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    measured = rlhf.measured_cpu_peak_flops(tmp_path, threads=1, size=128)
    assert torch.equal(torch.rand(3), expected)  # measuring leaves the run's random numbers where they were
    assert 1e6 < measured < 1e13 and len(json.loads((tmp_path / rlhf.CPU_PEAK_FILE).read_text())) == 1

    def no_matmul(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(torch, "mm", no_matmul)
    assert rlhf.measured_cpu_peak_flops(tmp_path, threads=1, size=128) == measured  # once per machine
    with pytest.raises(rlhf.RLHFInputError, match="'mfu_peak_flops' must be the device's peak FLOP/s"):
        rlhf.SFTConfig(mfu_peak_flops=0)
    progress = rlhf.PlainProgress("sft", 10, 0, 60.0)
    progress.update(loss="0.5", speed="812 tok/s, MFU 3.1%")
    assert progress.line(progress.began + 1).endswith("loss 0.5 (812 tok/s, MFU 3.1%)")


def test_every_logged_step_carries_throughput_and_mfu(tmp_path, tiny_model_dir, demo_dir):
    peak = 1e9  # mfu_peak_flops: the figure MFU is measured against
    result = rlhf.train_sft(rlhf.SFTConfig(
        model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "sft"), dataset="demo_sft",
        dataset_dir=str(demo_dir), max_samples=16, cutoff_len=64, per_device_train_batch_size=4, max_steps=3,
        logging_steps=1, save_steps=0, report_to="none", disable_progress_bar=True, finetuning_type="full",
        mfu_peak_flops=peak))
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    assert len(rows) == 3
    shape = rlhf.ModelShape.of(rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).model)
    for row in rows:
        assert 0 < row["perf/trained_tokens_per_s"] < row["perf/tokens_per_s"]  # the prompts have no labels
        assert row["perf/training_s"] > 0 and row["perf/batch_s"] >= 0
        # FLOPs per processed token: at least the 6 per parameter, at most that plus attention at the longest row
        per_token = row["perf/mfu"] * peak / row["perf/tokens_per_s"]
        low = 6 * shape.matmul_params
        assert low < per_token <= low + 12 * shape.layers * shape.width * 64 + 1e-6 * low, (per_token, low)
    assert result.global_step == 3
    config = rlhf.GRPOConfig(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "grpo"),
                             dataset="demo_rl", dataset_dir=str(demo_dir), max_samples=4, num_generations=2,
                             per_device_train_batch_size=4, max_completion_length=8, max_steps=2, beta=0.0,
                             reward_funcs=["length"], logging_steps=1, save_steps=0, report_to="none",
                             disable_progress_bar=True, finetuning_type="full")
    rlhf.train_grpo(config)
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    for row in [row for row in rows if "loss" in row]:
        assert row["perf/generation_s"] > 0 and row["perf/scoring_s"] > 0 and row["perf/training_s"] > 0
        assert row["perf/batch_s"] >= row["perf/generation_s"]  # the rollout is what the step waited for
        assert 0 < row["perf/mfu"] < 1  # on this CPU's measured peak
