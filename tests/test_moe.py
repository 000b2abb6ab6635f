"""Mixture-of-experts models: LoRA reaches the fused expert weights (transformers 5 stores them as 3-D parameters,
not linear layers), and the router's load-balancing loss is part of every trainer's loss, logged as moe/aux_loss."""

from __future__ import annotations

import json

import pytest
import torch

import rlhf


def _moe_config(kind: str, tokenizer):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              router_aux_loss_coef=0.001)
    return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config(request.param, tiny_tokenizer))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


# -- the load-balancing loss ---------------------------------------------------------------------------------------


def test_load_balancing_loss_is_top_k_for_a_uniform_router():
    """Uniform router: every expert has probability 1/E, and each of the k slots puts all its tokens somewhere, so
    E * sum_e f_e P_e = E * (k * 1) * (1/E) = k."""
    logits = [torch.zeros(6, 4), torch.zeros(6, 4)]
    assert float(rlhf.router_load_balancing_loss(logits, top_k=2)) == pytest.approx(2.0)


def test_load_balancing_loss_by_hand_and_when_tokens_crowd():
    # 2 tokens, 2 experts, top-1; both prefer expert 0 with probability p = sigmoid(2)
    logits = [torch.tensor([[2.0, 0.0], [2.0, 0.0]])]
    p = torch.sigmoid(torch.tensor(2.0))
    # f = (1, 0), P = (p, 1 - p): E * (1 * p + 0) = 2p
    assert float(rlhf.router_load_balancing_loss(logits, top_k=1)) == pytest.approx(float(2 * p), rel=1e-6)
    assert float(rlhf.router_load_balancing_loss(logits, top_k=1)) > 1.0  # crowded: above the uniform value


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers_own(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    batch, length, experts = 3, 5, 6
    logits = tuple(torch.randn(batch * length, experts) for _ in range(2))
    mask = torch.ones(batch, length, dtype=torch.long)
    if masked:
        mask[0, 3:] = 0
        mask[2, 1:] = 0
    ours = rlhf.router_load_balancing_loss(logits, top_k=2, attention_mask=mask if masked else None)
    theirs = load_balancing_loss_func(logits, experts, 2, mask if masked else None)
    torch.testing.assert_close(ours, theirs)


# -- LoRA on the experts -------------------------------------------------------------------------------------------


def test_lora_all_reaches_the_fused_experts(moe_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(moe_dir))
    experts = rlhf.find_expert_parameter_names(policy.model)
    assert experts == ["experts.down_proj", "experts.gate_up_proj"]
    attention_only = rlhf.PolicyModel.from_pretrained(str(moe_dir))
    config = rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4)
    policy.prepare_for_training(config)
    attention_only.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4,
                                                       lora_target="q_proj,k_proj,v_proj,o_proj"))
    assert _wrapped_expert_weights(policy.model) == {"gate_up_proj", "down_proj"}
    assert policy.num_parameters(trainable_only=True) > 2 * attention_only.num_parameters(trainable_only=True)
    ids = torch.randint(5, 100, (2, 12))
    out = policy(ids, torch.ones_like(ids)).logits
    out.float().pow(2).mean().backward()
    grads = [p.grad for n, p in policy.model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads)  # 2 layers x 2 weights


def _wrapped_expert_weights(model) -> set[str]:
    return {m.parameter_name for m in model.modules() if type(m).__name__ == "ParamWrapper"}


def test_lora_target_names_an_expert_weight_by_its_short_name(moe_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(moe_dir))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4,
                                               lora_target="q_proj,down_proj"))
    assert _wrapped_expert_weights(policy.model) == {"down_proj"}
    with pytest.raises(rlhf.RLHFInputError, match="expert weights: experts.down_proj, experts.gate_up_proj"):
        rlhf.PolicyModel.from_pretrained(str(moe_dir)).prepare_for_training(
            rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_target="w9"))


def test_expert_adapter_saves_and_reloads_to_the_same_function(moe_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(moe_dir))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4))
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # a trained-looking adapter, not the zero init
    policy.model.eval()
    policy.save_pretrained(tmp_path / "adapter")
    reloaded = rlhf.PolicyModel.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.randint(5, 100, (2, 10))
    torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits)


# -- the router loss in training ---------------------------------------------------------------------------------


def _sft(moe_dir, demo_dir, out, **overrides):
    settings = dict(model_name_or_path=str(moe_dir), dataset="demo_sft", dataset_dir=str(demo_dir), max_samples=16,
                    cutoff_len=64, finetuning_type="full", per_device_train_batch_size=4, max_steps=2,
                    learning_rate=1e-2, logging_steps=1, save_steps=0, disable_progress_bar=True, output_dir=str(out),
                    resume_from_checkpoint="none", seed=0)
    settings.update(overrides)
    return rlhf.SFTConfig(**settings)


def test_router_loss_is_logged_and_trains_the_router(moe_dir, demo_dir, tmp_path):
    rlhf.train_sft(_sft(moe_dir, demo_dir, tmp_path / "on"))
    rlhf.train_sft(_sft(moe_dir, demo_dir, tmp_path / "off", router_aux_loss_coef=0.0))
    rows = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    aux = [row["moe/aux_loss"] for row in rows if "moe/aux_loss" in row]
    assert len(aux) == 2 and all(2.0 - 0.1 <= value <= 4.0 for value in aux)  # top-2 of 4: 2 if balanced, 4 at worst
    assert not any("moe/aux_loss" in line for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines())
    on = rlhf.PolicyModel.from_pretrained(str(tmp_path / "on")).model
    off = rlhf.PolicyModel.from_pretrained(str(tmp_path / "off")).model
    router = next(n for n, _ in on.named_parameters() if n.endswith("mlp.gate.weight"))
    assert not torch.equal(on.get_parameter(router), off.get_parameter(router))  # the balancing term moved it


def test_router_loss_reaches_a_reward_model_backbone(moe_dir, demo_dir, tmp_path):
    config = rlhf.RewardModelConfig(model_name_or_path=str(moe_dir),
                                    dataset="demo_preference", dataset_dir=str(demo_dir),
                                    max_samples=8, cutoff_len=64, finetuning_type="full", per_device_train_batch_size=4,
                                    max_steps=1, logging_steps=1, save_steps=0, disable_progress_bar=True,
                                    output_dir=str(tmp_path), resume_from_checkpoint="none", router_aux_loss_coef=0.1)
    rlhf.train_rm(config)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["moe/aux_loss"] >= 1.0


def test_router_loss_with_packed_preference_pairs_and_gradient_checkpointing(moe_dir, demo_dir, tmp_path):
    """DPO runs chosen and rejected through shared-prefix rows with their own attention masks; checkpointing
    re-runs each layer's routers in backward. Neither may change what the router loss sees."""
    common = dict(model_name_or_path=str(moe_dir), dataset="demo_preference", dataset_dir=str(demo_dir), max_samples=8,
                  cutoff_len=64, finetuning_type="lora", lora_rank=4, per_device_train_batch_size=4, max_steps=1,
                  logging_steps=1, save_steps=0, disable_progress_bar=True, resume_from_checkpoint="none", seed=0)
    values = []
    for checkpointing in (False, True):
        out = tmp_path / f"ckpt-{checkpointing}"
        rlhf.train_dpo(rlhf.DPOConfig(**common, output_dir=str(out), gradient_checkpointing=checkpointing))
        values.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["moe/aux_loss"])
    assert values[0] == pytest.approx(values[1], rel=1e-5) and values[0] >= 1.9


def test_router_loss_follows_the_policy_when_a_separate_critic_is_another_model(moe_dir, llama_dir):
    """PPO with value_model: the critic is a second Hugging Face model; the policy's routers still count."""
    policy = rlhf.PolicyModel.from_pretrained(str(moe_dir))
    critic, _ = rlhf.ValueModel.from_pretrained(str(llama_dir))
    actor_critic = rlhf.ActorCritic(policy.model, critic)
    router = rlhf.RouterAuxLoss.attach(actor_critic, rlhf.PPOConfig(output_dir="unused", router_aux_loss_coef=0.1,
                                                                          reward_funcs=["length"]))
    ids = torch.randint(5, 100, (2, 8))
    actor_critic(ids, torch.ones_like(ids))
    assert len(router.losses) == 1 and float(router.losses[0]) >= 1.9
