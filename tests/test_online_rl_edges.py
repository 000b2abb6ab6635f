"""Edge cases found in review of the online-RL code: a short last prompt batch of an epoch, fp16 loss-scaler
bookkeeping when a step is skipped, re-running PPO with a separate critic, a LoRA critic's trainable
parameters, the reward API named twice, dropout during rollouts, and the chat template a reward model
was trained with reaching the standalone scorer."""

from __future__ import annotations

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def five_prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=5)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _grpo(tmp_path, model_dir, dataset, **overrides) -> rlhf.GRPOTrainer:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    max_completion_length=6, cutoff_len=64, num_train_epochs=2, beta=0.0, learning_rate=1e-4,
                    save_steps=0, logging_steps=1, disable_progress_bar=True, report_to="none",
                    reward_funcs=["format"], seed=0, resume_from_checkpoint="none")
    settings.update(overrides)
    config = rlhf.GRPOConfig(**settings)
    policy = rlhf.PolicyModel.from_pretrained(str(model_dir))
    return rlhf.GRPOTrainer(config, policy, dataset, reward_fn=lambda p, c, a: torch.tensor([len(x) % 3 for x in c],
                                                                                          dtype=torch.float32))


def test_short_last_batch_of_an_epoch_keeps_steps_whole(tmp_path, tiny_model_dir, five_prompts):
    """5 prompts, 2 per rollout: the epoch's third rollout has 1 prompt; it is filled up so that every
    optimizer step trains on exactly one rollout and total_steps rollouts are made."""
    trainer = _grpo(tmp_path, tiny_model_dir, five_prompts)
    sizes, original = [], trainer.make_rollout

    def recording(items):
        sizes.append(len(items))
        return original(items)

    trainer.make_rollout = recording
    result = trainer.train()
    assert result.global_step == trainer.total_steps == 6  # 3 rollouts per epoch x 2 epochs
    assert sizes == [2] * 6


def test_skipped_fp16_step_closes_the_loss_scaler():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    for skip in (True, False):
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.unscale_(optimizer)  # clipping unscales
        if skip:
            optimizer.zero_grad(set_to_none=True)
            rlhf.close_loss_scaler_step(scaler)
        else:
            scaler.step(optimizer)  # would raise "unscale_() has already been called" without the close
            scaler.update()
    rlhf.close_loss_scaler_step(torch.amp.GradScaler("cpu"))  # nothing unscaled: a no-op, no error


def _ppo_config(tmp_path, model_dir, **overrides) -> rlhf.PPOConfig:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "ppo"), finetuning_type="full",
                    per_device_train_batch_size=4, max_completion_length=6, cutoff_len=64, max_steps=2, ppo_epochs=1,
                    save_steps=0, logging_steps=1, disable_progress_bar=True, report_to="none",
                    reward_funcs=["format"], seed=0)
    settings.update(overrides)
    return rlhf.PPOConfig(**settings)


def _ppo(config, dataset, critic) -> rlhf.PPOTrainer:
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    return rlhf.PPOTrainer(config, policy, dataset, reward_fn=rlhf.format_reward,
                           reference=rlhf.create_reference_model(config, policy), critic=critic)


def test_ppo_with_a_separate_critic_runs_again_in_the_same_directory(tmp_path, tiny_model_dir, five_prompts):
    config = _ppo_config(tmp_path, tiny_model_dir)
    for _ in range(2):  # the second run finds the finished checkpoint, evaluates and publishes the model again
        critic, _ = rlhf.ValueModel.from_pretrained(str(tiny_model_dir))
        assert _ppo(config, five_prompts, critic).train().global_step == 2
    assert (tmp_path / "ppo" / "critic" / "value_head.safetensors").is_file()


def test_lora_critic_trains_only_its_adapter_and_head(tmp_path, tiny_model_dir, five_prompts):
    adapter_dir = tmp_path / "critic-lora"
    model = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    model.prepare_for_training(rlhf.SFTConfig(finetuning_type="lora", lora_rank=2))
    model.save_pretrained(adapter_dir)
    critic, _ = rlhf.ValueModel.from_pretrained(str(adapter_dir))
    trainer = _ppo(_ppo_config(tmp_path, tiny_model_dir, finetuning_type="lora", lora_rank=2), five_prompts, critic)
    trainable = [n for n, p in trainer.critic.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable), trainable
    assert any(n.startswith("head.") for n in trainable)


def test_api_reward_is_not_counted_twice():
    config = rlhf.GRPOConfig(reward_funcs=["api"], reward_model_type="api", reward_api_url="http://localhost:1")
    assert config.reward_names() == ["api"]
    assert rlhf.GRPOConfig(reward_funcs=[], reward_model_type="api",
                           reward_api_url="http://x").reward_names() == ["reward_model"]


def test_online_rl_turns_dropout_off(tmp_path, tiny_arch_dir, tiny_tokenizer, demo_dir):
    gpt2 = tiny_arch_dir("gpt2")  # GPT-2 ships dropout 0.1 in attention, residual and embeddings
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=4)
    policy = rlhf.PolicyModel.from_pretrained(str(gpt2))
    dataset = rlhf.GRPODataset(records, policy.tokenizer, rlhf.ChatFormatter(policy.tokenizer), cutoff_len=64)
    assert any(m.p > 0 for m in policy.model.modules() if isinstance(m, torch.nn.Dropout))
    config = rlhf.GRPOConfig(model_name_or_path=str(gpt2), output_dir=str(tmp_path / "g"), finetuning_type="full",
                             num_generations=2, per_device_train_batch_size=4, max_steps=1, beta=0.0,
                             reward_funcs=["format"], disable_progress_bar=True)
    trainer = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=rlhf.format_reward)
    assert all(m.p == 0 for m in trainer.policy.model.modules() if isinstance(m, torch.nn.Dropout))


def test_scorer_uses_the_template_the_reward_model_was_trained_with(tmp_path, tiny_model_dir):
    directory = tmp_path / "rm"
    reward = rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=1)
    reward.save_pretrained(directory, chat_template=rlhf.CHAT_TEMPLATES["default"])  # not the tokenizer's ChatML
    prompts, responses = ["What is 2 + 3?"], ["2 + 3 = 5\nAnswer: 5"]
    expected = rlhf.LearnedReward(reward, template="default")(prompts, responses, [None])
    torch.testing.assert_close(io.RewardModelScorer(directory)(prompts, responses), expected, atol=1e-5, rtol=0)


def test_value_model_from_an_ensemble_is_a_clear_error(tmp_path):
    rlhf.RewardEnsemble.write_manifest(tmp_path, ["member-0", "member-1"])
    with pytest.raises(rlhf.RLHFInputError, match="ensemble.*member-0"):
        rlhf.ValueModel.from_pretrained(str(tmp_path))
