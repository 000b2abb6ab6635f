"""Online DPO (Guo et al. 2024): two fresh samples per prompt, ranked by the reward functions, trained with the
DPO-family loss against the reference; ties stay out of the loss; the metric moves the right way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=32)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _trainer(tmp_path: Path, model_dir: Path, dataset, reward_fn, **overrides) -> rlhf.OnlineDPOTrainer:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    per_device_train_batch_size=8, max_completion_length=8, cutoff_len=64, max_steps=2,
                    learning_rate=1e-3, lr_scheduler_type="constant", save_steps=0, logging_steps=1,
                    disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                    resume_from_checkpoint="none")
    settings.update(overrides)
    config = rlhf.OnlineDPOConfig(**settings)
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    reference = rlhf.create_reference_model(config, policy) if config.uses_reference else None
    return rlhf.OnlineDPOTrainer(config, policy, dataset, reward_fn=reward_fn, reference=reference,
                                 formatter=rlhf.ChatFormatter(policy.tokenizer))


def digit_share(prompts, completions, answers):
    return torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])


def constant(prompts, completions, answers):
    return torch.ones(len(completions))


def _sequence_logps(model, batch):
    """Summed log-probs of the completion tokens by a plain log_softmax."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    mask = batch["labels"][:, 1:] != rlhf.IGNORE_INDEX
    per_token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (per_token * mask).sum(-1)


def test_the_loss_is_dpo_on_each_ranked_pair(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, digit_share)
    rollout = trainer.make_rollout([prompts[i] for i in range(8)])
    [batch] = trainer.rollout_schedule(rollout)
    loss, metrics = trainer.compute_loss(batch)
    with torch.no_grad():
        policy = _sequence_logps(trainer.policy.model, batch)
        reference = _sequence_logps(rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).model, batch)
    chosen, rejected = (policy - reference).chunk(2)
    weights = batch["pair_weights"].chunk(2)[0]
    want = (-F.logsigmoid(0.1 * (chosen - rejected)) * weights).sum()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-4)
    # the chosen row of every ranked pair scored higher than its rejected one
    texts = [trainer.policy.decode(row[batch["labels"][i] != rlhf.IGNORE_INDEX].tolist())
             for i, row in enumerate(batch["input_ids"])]
    scores = digit_share(None, texts, None).chunk(2)
    assert (all(c > r for c, r, w in zip(*scores, weights) if w)
            and all(c == r for c, r, w in zip(*scores, weights) if not w))
    assert 0 <= rollout.metrics["online_dpo/ties_frac"] <= 1


def test_ties_stay_out_of_the_loss(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, constant, max_steps=1)
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    result = trainer.train()
    assert result.history[0]["online_dpo/ties_frac"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.model.state_dict().items())


@pytest.mark.parametrize("pref_loss", ["sigmoid", "ipo", "simpo"])
def test_online_dpo_learns_a_simple_reward(tmp_path, tiny_model_dir, prompts, pref_loss):
    beta = {"sigmoid": 0.5, "ipo": 0.5, "simpo": 2.0}[pref_loss]
    result = _trainer(tmp_path, tiny_model_dir, prompts, digit_share, max_steps=40, learning_rate=3e-3,
                      pref_loss=pref_loss, pref_beta=beta, temperature=1.0).train()
    rewards = [row["reward"] for row in result.history if "reward" in row]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, rewards


def test_online_dpo_runs_from_the_command_line(tmp_path, tiny_model_dir, demo_dir, capsys):
    config = tmp_path / "online_dpo.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: demo_rl\ndataset_dir: {demo_dir}\n"
                      "reward_funcs: [exact_answer, format]\nper_device_train_batch_size: 4\nmax_completion_length: 8\n"
                      "max_steps: 2\nmax_samples: 8\nreport_to: none\ndisable_progress_bar: true\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    assert rlhf.main(["online_dpo", "--config", str(config)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["stages"][-1]["stage"] == "online_dpo"
    with pytest.raises(rlhf.RLHFInputError, match="orpo is not offered online"):
        rlhf.OnlineDPOConfig(reward_funcs=["format"], pref_loss="orpo")
