"""7B/70B presets and the memory plan: parameter counts against real Hugging Face models and PEFT,
the plan against hand arithmetic for one preset, the presets' stage configs, the accelerate files and
the ``plan`` command."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rlhf

GIB = 1024 ** 3
SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_parameter_counts_match_a_real_model_and_peft():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    assert rlhf.count_parameters(SMALL) == model.num_parameters()
    tied = {**SMALL, "tie_word_embeddings": True}
    assert rlhf.count_parameters(tied) == LlamaForCausalLM(LlamaConfig(**tied)).num_parameters()
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert rlhf.count_lora_parameters(SMALL, 4) == trainable
    assert rlhf.count_parameters(rlhf.PRESET_ARCHITECTURES["7b"]) == pytest.approx(7.62e9, rel=0.01)  # Qwen2.5-7B
    assert rlhf.count_parameters(rlhf.PRESET_ARCHITECTURES["70b"]) == pytest.approx(70.6e9, rel=0.01)  # Llama-3.1-70B


def test_memory_plan_by_hand_for_the_7b_full_preset():
    arch = rlhf.PRESET_ARCHITECTURES["7b"]
    # 2 x 152064 x 3584 + 28 x (2 x 3584^2 + 2 x 3584 x 512 + 3 x 3584 x 18944 + 2 x 3584) + 3584
    params = 7_615_487_488
    assert rlhf.count_parameters(arch) == params
    plan = rlhf.estimate_memory(arch, gpus=8, finetuning_type="full", batch=4, seq_len=2048, stage="dpo")
    assert plan["weights"] == pytest.approx(2 * params / 8 / GIB)
    assert plan["gradients"] == pytest.approx(2 * params / 8 / GIB)
    assert plan["optimizer"] == pytest.approx(12 * params / 8 / GIB)  # fp32 master + two moments
    assert plan["reference model"] == pytest.approx(2 * params / 8 / GIB) and plan["reward model"] == 0
    # checkpointed: 28 layer inputs of 2 x b x s x h bytes + one full layer s b h (34 + 5 a s / h), pairs doubled,
    # plus fp32 logits of both sequences
    full_layer = 2048 * 4 * 3584 * (34 + 5 * 28 * 2048 / 3584)
    activations = 2 * (28 * 2 * 4 * 2048 * 3584 + full_layer) + 2 * 4 * 4 * 2048 * 152064
    assert plan["activations"] == pytest.approx(activations / GIB)
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"))
    lora = rlhf.estimate_memory(arch, gpus=1, finetuning_type="lora", lora_rank=16, stage="dpo", sharded=False)
    assert lora["reference model"] == 0  # the adapter is switched off instead of copying the model
    assert lora["optimizer"] == pytest.approx(12 * rlhf.count_lora_parameters(arch, 16) / GIB)


def test_presets_are_complete_pipelines():
    for factory, size in ((rlhf.get_7b_model_config, "7b"), (rlhf.get_70b_model_config, "70b")):
        for finetuning in ("lora", "full"):
            preset = factory(finetuning)
            assert preset.stages == ["sft", "rm", "dpo", "grpo"]
            sft, grpo = preset.stage_config("sft"), preset.stage_config("grpo")
            assert sft.bf16 and sft.gradient_checkpointing and sft.finetuning_type == finetuning
            assert sft.model_name_or_path == rlhf.PRESET_ARCHITECTURES[size]["model"]
            assert grpo.reward_model == f"outputs/{size}/rm"  # the pipeline's own reward model
    assert rlhf.get_7b_model_config(model_name_or_path="my/model").stage_config("dpo").model_name_or_path == "my/model"
    with pytest.raises(rlhf.RLHFInputError, match="finetuning_type"):
        rlhf.get_7b_model_config("freeze")


def test_accelerate_files_load(repo):
    from accelerate.commands.config.config_args import load_config_from_file

    zero3 = load_config_from_file(str(repo / "configs/accelerate/deepspeed_zero3.yaml"))
    fsdp = load_config_from_file(str(repo / "configs/accelerate/fsdp.yaml"))
    assert zero3.deepspeed_config["zero_stage"] == 3 and zero3.mixed_precision == "bf16"
    assert fsdp.fsdp_config["fsdp_version"] == 2 and fsdp.fsdp_config["fsdp_reshard_after_forward"] is True
    assert fsdp.mixed_precision == "bf16"


def test_plan_command_prints_the_table(capsys):
    assert rlhf.main(["plan", "--preset", "70b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "gradients", "optimizer", "activations", "reference model", "reward model", "total",
                 "sft", "grpo", "ppo", "fits 80 GiB?"):
        assert word in out
    assert rlhf.main(["plan", "--preset", "7b", "--gpus", "1", "--finetuning-type", "full", "--stage", "sft"]) == 0
    assert "NO" in capsys.readouterr().out  # 7B full fine-tuning on one GPU needs ~120 GiB
