"""Elastic weight consolidation: the penalty by hand, the Fisher against per-example gradients taken
independently, the trainer wiring (logged penalty, resume keeps the anchor) and, end to end, EWC keeping
the SFT loss lower than the same DPO run without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the penalty ----------------------------------------------------------------------------------------------

def test_penalty_by_hand():
    theta = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    anchor = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    fisher = {"a": torch.tensor([0.5, 2.0]), "b": torch.tensor([[0.25]])}
    # lambda/2 * (0.5*1 + 2*4 + 0.25*4) = 1.5 * 9.5
    assert float(rlhf.ewc_penalty(theta, anchor, fisher, 3.0)) == pytest.approx(14.25)
    assert float(rlhf.ewc_penalty(anchor, anchor, fisher, 3.0)) == 0.0


def test_penalty_gradient_is_lambda_fisher_displacement():
    theta = {"w": torch.tensor([1.0, -2.0, 0.5], requires_grad=True)}
    anchor, fisher = {"w": torch.tensor([0.5, 0.0, 0.5])}, {"w": torch.tensor([4.0, 1.0, 9.0])}
    rlhf.ewc_penalty(theta, anchor, fisher, 2.0).backward()
    expected = 2.0 * fisher["w"] * (theta["w"].detach() - anchor["w"])  # d/dtheta lambda/2 F (theta - a)^2
    torch.testing.assert_close(theta["w"].grad, expected)
    assert theta["w"].grad[0] > 0 and theta["w"].grad[1] < 0  # it pulls back towards the anchor


# -- the Fisher -----------------------------------------------------------------------------------------------

def _examples(model_dir: Path, demo_dir: Path, count: int) -> tuple[rlhf.PolicyModel, list[dict]]:
    policy = rlhf.PolicyModel.from_pretrained(str(model_dir))
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    records = rlhf.load_records("demo_sft", demo_dir, "sft", max_samples=count)
    dataset = rlhf.SFTDataset(records, policy.tokenizer, formatter, cutoff_len=96)
    collate = rlhf.SFTCollator(policy.tokenizer.pad_token_id)
    return policy, [collate([dataset[i]]) for i in range(len(dataset))]


def test_fisher_is_mean_squared_per_example_log_likelihood_gradient(llama_dir, demo_dir):
    policy, batches = _examples(llama_dir, demo_dir, 3)
    model = policy.model
    ewc = rlhf.ElasticWeightConsolidation.from_data(model, batches, 1.0)
    params = dict(model.named_parameters())
    assert set(ewc.fisher) == set(params)
    # independently: log p(response | prompt) summed by hand from log_softmax, one autograd.grad per example
    squares = {name: torch.zeros_like(p) for name, p in params.items()}
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[0, :-1]
        targets = batch["labels"][0, 1:]
        keep = targets != rlhf.IGNORE_INDEX
        log_likelihood = torch.log_softmax(logits[keep], -1).gather(-1, targets[keep, None]).sum()
        grads = torch.autograd.grad(log_likelihood, list(params.values()), allow_unused=True)
        for (name, _), grad in zip(params.items(), grads):
            if grad is not None:
                squares[name] += grad ** 2
    for name in params:
        torch.testing.assert_close(ewc.fisher[name], squares[name] / len(batches), rtol=1e-4, atol=1e-10)
        torch.testing.assert_close(ewc.anchors[name], params[name].detach())
    assert sum(float(f.sum()) for f in ewc.fisher.values()) > 0
    assert all(p.grad is None for p in model.parameters())  # leaves no gradients behind


def test_fisher_covers_only_trainable_parameters_and_round_trips(llama_dir, demo_dir, tmp_path):
    policy, batches = _examples(llama_dir, demo_dir, 2)
    for name, p in policy.model.named_parameters():
        p.requires_grad_("layers.1." in name)
    ewc = rlhf.ElasticWeightConsolidation.from_data(policy.model, batches, 5.0, source={"model": "m"})
    assert ewc.fisher and all("layers.1." in name for name in ewc.fisher)
    path = tmp_path / rlhf.ElasticWeightConsolidation.FILE
    ewc.save(path)
    loaded = rlhf.ElasticWeightConsolidation.load(path, 5.0)
    assert loaded.source == {"model": "m"} and set(loaded.fisher) == set(ewc.fisher)
    assert float(loaded.penalty(policy.model).detach()) == 0.0  # at the anchor
    with torch.no_grad():
        next(p for n, p in policy.model.named_parameters() if n in ewc.fisher).add_(1.0)
    assert float(loaded.penalty(policy.model)) > 0.0


# -- config -------------------------------------------------------------------------------------------------

def test_ewc_config_errors_name_the_field():
    with pytest.raises(rlhf.RLHFInputError, match="'ewc_lambda' only applies to policy-optimisation stages"):
        rlhf.SFTConfig(ewc_lambda=10.0, ewc_dataset="demo_sft")
    with pytest.raises(rlhf.RLHFInputError, match="'ewc_dataset' must name the SFT dataset"):
        rlhf.DPOConfig(ewc_lambda=10.0)
    with pytest.raises(rlhf.RLHFInputError, match="ewc_lambda/ewc_samples"):
        rlhf.GRPOConfig(ewc_lambda=-1.0)


def test_pipeline_protects_its_sft_dataset_by_default():
    pipeline = rlhf.PipelineConfig.from_dict({"stages": ["sft", "dpo"], "sft": {"dataset": "demo_sft"},
                                              "dpo": {"dataset": "demo_preference", "ewc_lambda": 100.0}})
    assert pipeline.stage_config("dpo").ewc_dataset == "demo_sft"


# -- in the trainers ----------------------------------------------------------------------------------------

def _dpo(model: Path | str, demo_dir: Path, out: Path, **overrides) -> rlhf.DPOConfig:
    settings = dict(model_name_or_path=str(model), dataset="demo_preference", dataset_dir=str(demo_dir), max_samples=32,
                    cutoff_len=96, finetuning_type="full", per_device_train_batch_size=8, max_steps=20,
                    learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=0,
                    disable_progress_bar=True, output_dir=str(out), seed=0, resume_from_checkpoint="none",
                    ewc_dataset="demo_sft", ewc_samples=32)
    settings.update(overrides)
    return rlhf.DPOConfig(**settings)


def _sft_loss(model_dir: Path, demo_dir: Path) -> float:
    policy, batches = _examples(model_dir, demo_dir, 64)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            loss_sum, units = rlhf.causal_lm_loss_sum(
                policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                batch["labels"])
            total, count = total + float(loss_sum), count + units
    return total / count


def test_ewc_keeps_sft_loss_lower_than_plain_dpo(sft_model, demo_dir, tmp_path):
    start = _sft_loss(sft_model, demo_dir)
    rlhf.train_dpo(_dpo(sft_model, demo_dir, tmp_path / "plain"))
    guarded = rlhf.train_dpo(_dpo(sft_model, demo_dir, tmp_path / "ewc", ewc_lambda=1000.0))
    plain_loss, guarded_loss = _sft_loss(tmp_path / "plain", demo_dir), _sft_loss(tmp_path / "ewc", demo_dir)
    rows = [row for row in guarded.history if "loss" in row]
    print(f"SFT loss: start {start:.3f}, after DPO {plain_loss:.3f}, after DPO + EWC(1e3) {guarded_loss:.3f}; "
          f"DPO loss with EWC {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
    # measured: start 2.33, plain 3.21, EWC 2.89; the DPO loss still falls 0.693 -> 0.63
    assert plain_loss > start + 0.3
    assert guarded_loss < plain_loss - 0.15
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.02  # EWC protects SFT without stopping DPO from learning
    assert rows[0]["ewc/penalty"] == pytest.approx(0.0, abs=1e-6) and rows[5]["ewc/penalty"] > 0
    assert (tmp_path / "ewc" / rlhf.ElasticWeightConsolidation.FILE).is_file()
    assert not (tmp_path / "plain" / rlhf.ElasticWeightConsolidation.FILE).exists()


def test_resumed_run_keeps_the_original_anchor(sft_model, demo_dir, tmp_path):
    config = _dpo(sft_model, demo_dir, tmp_path, ewc_lambda=1000.0, max_steps=6, save_steps=3,
                  resume_from_checkpoint="auto")
    with rlhf.logging_restored():  # _start_stage sets up the stage's logging, as a stage runner's body would
        rlhf.releases_output_dir(_resume_keeps_anchor)(config, tmp_path, sft_model)  # as a stage runner lets go


def _resume_keeps_anchor(config: rlhf.DPOConfig, tmp_path: Path, sft_model: Path) -> None:
    from conftest import killed_after_checkpoint

    records, devices = rlhf._start_stage(config, None)

    def trainer() -> rlhf.DPOTrainer:
        policy = rlhf._load_policy(config, devices.device)
        formatter = rlhf.ChatFormatter(policy.tokenizer, config.template)
        train, validation, _ = rlhf._preference_datasets(config, records, policy.tokenizer, formatter, devices)
        return rlhf.DPOTrainer(config, policy, train, eval_dataset=validation,
                               reference=rlhf.create_reference_model(config, policy), formatter=formatter,
                               devices=devices)

    killed_after_checkpoint(trainer(), 3)
    anchor = rlhf.ElasticWeightConsolidation.load(tmp_path / rlhf.ElasticWeightConsolidation.FILE, 1.0).anchors
    resumed = trainer()
    result = resumed.train()
    assert result.global_step == 6
    for name, value in anchor.items():  # anchored to the stage's starting weights, not the step-3 checkpoint's
        torch.testing.assert_close(resumed.ewc.anchors[name], value)
    start = dict(rlhf.PolicyModel.from_pretrained(str(sft_model)).model.named_parameters())
    torch.testing.assert_close(anchor["model.embed_tokens.weight"], start["model.embed_tokens.weight"].detach())
