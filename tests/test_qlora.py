"""QLoRA: ``quantization_bit: 4 | 8`` loads the base through bitsandbytes (its CPU backend here) and trains LoRA
adapters over it in every stage; the reference of a QLoRA run is the quantised base with the adapter off, so the
first DPO loss is ln 2 exactly; without bitsandbytes, or with full fine-tuning, it is a one-line error, never an
unquantised load."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import rlhf

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama 128 wide: bitsandbytes' CPU kernels quantise in blocks of 64 inputs, and repack 4-bit weights
    for inference only when a layer has at least one block (every real model does; conftest's 32-wide one not)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id))
    path = tmp_path_factory.mktemp("llama-128")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _quantization(bits: int):
    return rlhf.quantization_config(rlhf.SFTConfig(output_dir="unused", quantization_bit=bits))


@pytest.mark.parametrize("bits,layer", [(4, "Linear4bit"), (8, "Linear8bitLt")])
def test_the_base_loads_quantised(bits, layer, llama_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(llama_dir), quantization=_quantization(bits))
    assert type(policy.model.model.layers[0].self_attn.q_proj).__name__ == layer
    assert rlhf.is_quantized(policy.model)
    full = rlhf.PolicyModel.from_pretrained(str(llama_dir))
    ids = torch.randint(5, 100, (2, 10))
    quantised, exact = policy(ids).logits, full(ids).logits
    assert not torch.equal(quantised, exact)
    assert float((quantised - exact).abs().max()) < 0.25 * float(exact.abs().max())  # the same model, rounded


def test_without_bitsandbytes_it_is_an_error_not_an_unquantised_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(rlhf.RLHFInputError, match="'quantization_bit' needs bitsandbytes: pip install bitsandbytes"):
        _quantization(4)


@pytest.mark.parametrize("settings,message", [
    ({"quantization_bit": 4, "finetuning_type": "full"}, "trains adapters only; set finetuning_type: lora"),
    ({"quantization_bit": 3}, "'quantization_bit' must be 4 or 8, got 3"),
    ({"quantization_bit": 4, "quantization_method": "gptq"}, "'quantization_method' is 'gptq'"),
])
def test_bad_quantisation_settings_are_one_line_errors(settings, message):
    with pytest.raises(rlhf.RLHFInputError, match=message):
        rlhf.SFTConfig(output_dir="unused", **settings)


def _common(model, demo_dir, out, **overrides):
    settings = dict(model_name_or_path=str(model), dataset_dir=str(demo_dir), max_samples=16, cutoff_len=64,
                    finetuning_type="lora", lora_rank=4, quantization_bit=4, per_device_train_batch_size=4,
                    max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=0, disable_progress_bar=True,
                    output_dir=str(out), resume_from_checkpoint="none", seed=0)
    settings.update(overrides)
    return settings


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_qlora_dpo_starts_at_ln2_against_the_quantised_base(llama_dir, demo_dir, tmp_path):
    rlhf.train_dpo(rlhf.DPOConfig(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_preference", max_steps=1)))
    # bitsandbytes' CPU backend repacks 4-bit weights for no-grad forwards with bf16 block scales, so policy and
    # reference agree to 1e-5; an unquantised reference would sit ~1e-2 away (the 4-bit rounding of every layer)
    assert _rows(tmp_path)[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert (tmp_path / "adapter_model.safetensors").is_file() and not (tmp_path / "model.safetensors").exists()


def test_qlora_sft_learns_and_its_adapter_reloads_over_the_quantised_base(llama_dir, demo_dir, tmp_path):
    rlhf.train_sft(rlhf.SFTConfig(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_sft", max_steps=12,
                                            learning_rate=5e-3, quantization_bit=8)))
    losses = [row["loss"] for row in _rows(tmp_path) if "loss" in row]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    reloaded = rlhf.PolicyModel.from_pretrained(str(tmp_path), quantization=_quantization(8))
    assert reloaded.is_peft and rlhf.is_quantized(reloaded.model)


@pytest.mark.parametrize("stage", ["rm", "kto", "grpo", "ppo"])
def test_qlora_runs_every_other_stage(stage, llama_dir, demo_dir, tmp_path):
    if stage == "rm":
        rlhf.train_rm(rlhf.RewardModelConfig(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_preference")))
    elif stage == "kto":
        rlhf.train_kto(rlhf.KTOConfig(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_kto")))
    else:
        config = rlhf.GRPOConfig if stage == "grpo" else rlhf.PPOConfig
        extra = {"num_generations": 2} if stage == "grpo" else {"ppo_epochs": 1}
        rlhf.train_grpo(config(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_rl", reward_funcs=["length"],
                                         max_completion_length=8, **extra))) if stage == "grpo" else \
            rlhf.train_ppo(config(**_common(llama_dir, demo_dir, tmp_path, dataset="demo_rl", reward_funcs=["length"],
                                            max_completion_length=8, **extra)))
    losses = [row["loss"] for row in _rows(tmp_path) if "loss" in row]
    assert losses and all(math.isfinite(loss) for loss in losses)
