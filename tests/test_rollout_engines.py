"""The rollout-engine protocol (inference_optimizations.RolloutEngine): the online trainers sample, sync and close
through it alone, so a new engine is one class and a registry row."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path

import pytest
import torch

import inference_optimizations as io
import rlhf

MEMBERS = ("sample", "sync_weights", "sleep", "close", "holds_weights", "shared", "takes_images")


def test_the_protocol_names_what_the_trainer_calls():
    declared = set(typing.get_type_hints(io.RolloutEngine)) | {
        name for name in vars(io.RolloutEngine) if not name.startswith("_")}
    assert declared == set(MEMBERS)


@pytest.mark.parametrize("engine", [io.LocalEngine, io.QuantizedEngine, io.VLLMEngine, io.VLLMClient])
def test_every_engine_implements_the_protocol(engine):
    assert all(hasattr(engine, name) for name in MEMBERS)


def test_the_registry_holds_an_engine_for_every_setting():
    assert set(rlhf.ROLLOUT_ENGINES) == {"ours", "ours_fp16", "ours_int8", "vllm_colocate", "vllm_server",
                                         "measured"}
    assert rlhf.rollout_engine_name(rlhf.GRPOConfig(reward_funcs=["format"])) == "ours"
    assert rlhf.rollout_engine_name(rlhf.GRPOConfig(reward_funcs=["format"], use_vllm="auto")) == "measured"
    assert rlhf.rollout_engine_name(rlhf.GRPOConfig(reward_funcs=["format"], rollout_dtype="int8")) == "ours_int8"
    assert all(f"vllm_{mode}" in rlhf.ROLLOUT_ENGINES for mode in io.VLLM_MODES)


class CopyEngine:
    """An engine holding its own copy of the policy, refreshed by each sync from the PolicyWeights alone (what
    vLLM does), sampling with this project's generate: one class, registered below."""

    holds_weights, shared, takes_images = True, False, False

    def __init__(self, context: rlhf.EngineContext) -> None:
        self.model = copy.deepcopy(context.devices.unwrap(context.policy.model)).eval()
        self.tokenizer, self.engine = context.policy.tokenizer, context.config.generation_engine
        self.versions: list[int] = []
        self.closed = False

    def sample(self, prompts, params, images=None):
        return io.generate(self.model, prompts, params, pad_token_id=self.tokenizer.pad_token_id,
                           tokenizer=self.tokenizer, engine=self.engine)

    def sync_weights(self, weights: io.PolicyWeights) -> None:
        missing, unexpected = self.model.load_state_dict(dict(weights.named()), strict=False)
        assert not unexpected and all(name.endswith("lm_head.weight") for name in missing)  # tied: sent once
        self.versions.append(weights.version)

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir):
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=16)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _run(tmp_path: Path, model_dir: Path, dataset, **overrides) -> rlhf.GRPOTrainer:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=4, per_device_train_batch_size=8, max_completion_length=12, cutoff_len=64,
                    max_steps=3, beta=0.0, learning_rate=1e-3, save_steps=0, logging_steps=1,
                    disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                    resume_from_checkpoint="none", generation_engine="static")
    config = rlhf.GRPOConfig(**{**settings, **overrides})
    rlhf.set_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    trainer = rlhf.GRPOTrainer(config, policy, dataset, formatter=rlhf.ChatFormatter(policy.tokenizer),
                               reward_fn=lambda p, c, a: torch.tensor([sum(ch.isdigit() for ch in t) / 8.0
                                                                       for t in c]))
    trainer.result = trainer.train()
    return trainer


@pytest.mark.parametrize("environment", [None, "test_tools:scripted"])
def test_a_new_engine_is_one_class(tmp_path, tiny_model_dir, prompts, monkeypatch, environment):
    """A registered engine that holds a copy of the policy, synced after every step, trains as our engine sampling
    from the policy itself: the same samples, no gap for the importance correction to find, the same weights;
    single-turn rollouts and multi-turn episodes alike."""
    tools = dict(environment=environment, max_turns=3, max_turn_tokens=4) if environment else {}
    ours = _run(tmp_path / "ours", tiny_model_dir, prompts, **tools)
    engines: list[CopyEngine] = []
    monkeypatch.setitem(rlhf.ROLLOUT_ENGINES, "copy", lambda context: engines.append(CopyEngine(context))
                        or engines[-1])
    monkeypatch.setattr(rlhf, "rollout_engine_name", lambda config: "copy")
    theirs = _run(tmp_path / "copy", tiny_model_dir, prompts, **tools)
    assert len(engines) == 1 and engines[0].versions == [0, 1, 2] and engines[0].closed
    assert theirs.engine.engine is None  # closed and dropped at the end of the run
    rows = [row for row in theirs.result.history if "loss" in row]
    assert len(rows) == 3 and all("perf/weight_sync_s" in row for row in rows)
    assert all(row["rollout/logprob_abs_diff_max"] < 1e-5 for row in rows)  # an exact copy: no gap to correct
    trained = theirs.policy.model.state_dict()  # equal up to the rounding of the correction's own old-log-prob pass
    for name, value in ours.policy.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5)


# -- use_vllm: auto (MeasuredEngineChoice): a copy engine stands in for vLLM, which the main install lacks -------------


@pytest.fixture
def copy_as_vllm(monkeypatch):
    """vLLM's place taken by CopyEngine (an exact copy, synced like vLLM): the choice's logic runs on real engines."""
    started: list[CopyEngine] = []
    monkeypatch.setattr(rlhf, "vllm_missing", lambda: "")
    monkeypatch.setattr(rlhf, "_vllm_colocate_engine", lambda trainer: started.append(CopyEngine(trainer))
                        or started[-1])
    return started


def test_auto_tries_vllm_on_the_second_rollout_and_keeps_the_faster(tmp_path, tiny_model_dir, prompts, copy_as_vllm,
                                                                    monkeypatch, caplog):
    """With a start said to be free, the second rollout is a timed trial: the engine kept is the one whose rollout
    (with a weight sync) was faster by the figures it logged; the trial's rollout is corrected as a copy's, and the
    run trains as our engine alone would (the copy is exact)."""
    monkeypatch.setattr(rlhf, "VLLM_START_SECONDS", 0.0)
    with caplog.at_level("INFO", logger="rlhf"):
        run = _run(tmp_path / "auto", tiny_model_dir, prompts, use_vllm="auto", max_steps=4)
    assert len(copy_as_vllm) == 1  # one trial start
    trial = copy_as_vllm[0]
    rows = [row for row in run.result.history if "loss" in row]
    assert len(rows) == 4 and "rollout/logprob_abs_diff_max" not in rows[0]  # ours: nothing to correct
    assert rows[1]["rollout/logprob_abs_diff_max"] < 1e-5  # the trial: the copy sampled it
    message = next(r.getMessage() for r in caplog.records if "use_vllm=auto: a rollout of" in r.getMessage())
    ours_s, theirs_s = (float(x) for x in re.findall(r"takes ([0-9.]+) s with our engine, ([0-9.]+) s", message)[0])
    kept = message.endswith("vLLM samples from now on")
    assert kept == (theirs_s < ours_s) or theirs_s == ours_s  # the log rounds to 10 ms: a tie may go either way
    assert all(("rollout/logprob_abs_diff_max" in row) == kept for row in rows[2:])
    assert trial.versions[0] == 1 and trial.versions[1:] == ([2, 3] if kept else [])  # started after step 1
    assert trial.closed
    alone = _run(tmp_path / "ours", tiny_model_dir, prompts, use_vllm="auto", max_steps=4)  # the trial never pays
    for name, value in alone.policy.model.state_dict().items():
        torch.testing.assert_close(run.policy.model.state_dict()[name], value, rtol=0, atol=2e-5)


def test_auto_skips_the_trial_when_the_run_is_too_short_to_earn_the_start(tmp_path, tiny_model_dir, prompts,
                                                                          copy_as_vllm, caplog):
    with caplog.at_level("INFO", logger="rlhf"):
        _run(tmp_path, tiny_model_dir, prompts, use_vllm="auto", max_steps=2)
    assert copy_as_vllm == []
    assert any("use_vllm=auto: our engine samples every rollout" in r.getMessage() for r in caplog.records)


def test_auto_without_vllm_samples_with_ours_and_says_why(tmp_path, tiny_model_dir, prompts, monkeypatch, caplog):
    monkeypatch.setattr(rlhf, "vllm_missing", lambda: "vLLM is not installed")
    with caplog.at_level("INFO", logger="rlhf"):
        run = _run(tmp_path, tiny_model_dir, prompts, use_vllm="auto", max_steps=1)
    assert any("use_vllm=auto: our engine samples (vLLM is not installed)" in r.getMessage() for r in caplog.records)
    assert len([row for row in run.result.history if "loss" in row]) == 1


@pytest.mark.parametrize(("given", "read"), [("auto", "auto"), ("true", True), ("off", False), (True, True)])
def test_use_vllm_reads_true_false_or_auto(given, read, monkeypatch):
    monkeypatch.setattr(rlhf, "vllm_missing", lambda: "")
    config = rlhf.load_config(rlhf.GRPOConfig, None, [f"use_vllm={given}", "reward_funcs=format"])
    assert config.use_vllm == read


def test_use_vllm_auto_refuses_what_it_cannot_measure():
    with pytest.raises(rlhf.RLHFInputError, match="use_vllm.*true, false or auto"):
        rlhf.GRPOConfig(reward_funcs=["format"], use_vllm="maybe")
    with pytest.raises(rlhf.RLHFInputError, match="auto measures a colocated vLLM"):
        rlhf.GRPOConfig(reward_funcs=["format"], use_vllm="auto", vllm_mode="server")
    with pytest.raises(rlhf.RLHFInputError, match="rollout_dtype"):
        rlhf.GRPOConfig(reward_funcs=["format"], use_vllm="auto", rollout_dtype="int8")


# -- low-precision rollouts (rollout_dtype: fp16, int8) ----------------------------------------------------------------


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.std())


@pytest.mark.parametrize("dtype, bound", [("fp16", 1e-3), ("int8", 0.05)])
def test_the_quantized_engine_follows_every_sync(tiny_model_dir, tiny_tokenizer, dtype, bound):
    """The copy's logits stay within its format's rounding of the policy's (relative RMS, as the q8_0 export
    check), and after a sync they follow the changed policy, tied output layer included."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).model.eval()
    engine = io.QuantizedEngine(policy, dtype=dtype, pad_token_id=tiny_tokenizer.pad_token_id,
                                tokenizer=tiny_tokenizer)
    ids = torch.tensor([io.chat_prompt_ids(tiny_tokenizer, "What is 12 + 7?")])
    with torch.no_grad():
        before = policy(ids).logits
        assert _relative_rms(engine.model(ids).logits, before) < bound
        torch.manual_seed(0)  # the update's draw, whatever ran before
        for parameter in policy.parameters():  # a large update, every tensor (the tied embedding too)
            parameter.add_(torch.randn_like(parameter) * parameter.std().clamp_min(1e-3))
        after = policy(ids).logits
        stale = _relative_rms(engine.model(ids).logits, after)
        state = dict(policy.state_dict())
        named = lambda: ((n, t) for n, t in state.items() if n != "lm_head.weight")  # noqa: E731 (tied: sent once)
        engine.sync_weights(io.PolicyWeights(1, named))
        assert _relative_rms(engine.model(ids).logits, after) < bound < stale
    engine.close()


@pytest.fixture(scope="module", params=["fp16", "int8"])
def quantized_run(request, tmp_path_factory, tiny_model_dir, prompts):
    return _run(tmp_path_factory.mktemp(request.param), tiny_model_dir, prompts, rollout_dtype=request.param,
                max_steps=2, generation_engine="auto")


def test_low_precision_rollouts_report_and_correct_the_gap(quantized_run):
    """The behaviour log-probs come from the copy; the trainer's fp32 ones differ by the format's rounding, which the
    importance weights correct (logged under rollout/, as vLLM's under vllm/)."""
    rows = [row for row in quantized_run.result.history if "loss" in row]
    bound = 1e-3 if quantized_run.config.rollout_dtype == "fp16" else 0.1
    assert len(rows) == 2
    for row in rows:
        assert 0 < row["rollout/logprob_abs_diff_mean"] < bound and row["rollout/kl"] < 0.01
        assert abs(row["rollout/is_weight_mean"] - 1) < 0.05 and "perf/weight_sync_s" in row


def test_held_out_answers_are_the_policys_own_with_low_precision_rollouts(quantized_run, demo_dir):
    """The copy approximates the policy: the online evaluation answers with the policy itself."""
    quantized_run.eval_records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=8)
    try:
        metrics = quantized_run.evaluate()
        assert isinstance(quantized_run.engine.engine, io.QuantizedEngine)
        assert quantized_run.policy.rollout_engine is None
    finally:
        quantized_run.close_rollouts()
    assert metrics == rlhf._generation_eval(quantized_run)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_low_precision_rollouts_of_a_lora_policy_follow_its_adapter(tmp_path, tiny_model_dir, prompts, dtype):
    """A LoRA policy's base layers are converted and its adapters synced in fp32 (PEFT reads their dtype)."""
    trainer = _run(tmp_path, tiny_model_dir, prompts, rollout_dtype=dtype, max_steps=2, finetuning_type="lora",
                   lora_rank=8)
    rows = [row for row in trainer.result.history if "loss" in row]
    assert len(rows) == 2 and all(0 < row["rollout/logprob_abs_diff_mean"] < 0.1 for row in rows)


def test_an_unknown_rollout_dtype_is_one_line():
    with pytest.raises(rlhf.RLHFInputError, match="rollout_dtype"):
        rlhf.GRPOConfig(reward_funcs=["format"], rollout_dtype="int4")


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_grpo_with_low_precision_rollouts_learns_like_fp32(tmp_path, tiny_model_dir, demo_dir, tiny_tokenizer, dtype):
    """test_grpo.py's test_grpo_learns_a_simple_reward (the same run and threshold), sampled from the copy."""
    from test_grpo import DigitShare, _config, _trainer

    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=32)
    dataset = rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)
    config = _config(tmp_path, tiny_model_dir, max_steps=30, learning_rate=3e-3, rollout_dtype=dtype)
    result = _trainer(config, dataset, DigitShare()).train()
    rewards = [row["reward"] for row in result.history if "loss" in row]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25 and last > first + 0.3, rewards


def test_a_sync_converts_only_the_tensors_that_changed(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """The copy remembers each tensor's storage and in-place version: a sync of unchanged weights (a LoRA policy's
    frozen base, or step 0) converts nothing, and after an in-place update only that tensor is converted again,
    with the copy following it."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).model.eval()
    engine = io.QuantizedEngine(policy, dtype="fp16", pad_token_id=tiny_tokenizer.pad_token_id,
                                tokenizer=tiny_tokenizer)
    converted = []
    inner = torch.ao.nn.quantized.dynamic.Linear.set_weight_bias
    monkeypatch.setattr(torch.ao.nn.quantized.dynamic.Linear, "set_weight_bias",
                        lambda self, w, b: converted.append(self) or inner(self, w, b))

    def named():
        return ((n, t.detach()) for n, t in policy.state_dict().items() if n != "lm_head.weight")

    engine.sync_weights(io.PolicyWeights(0, named))
    assert converted == []  # the weights the copy was made from
    target = policy.model.layers[0].mlp.down_proj
    with torch.no_grad():
        target.weight.add_(torch.randn_like(target.weight))
    engine.sync_weights(io.PolicyWeights(1, named))
    assert converted == [engine.modules["model.layers.0.mlp.down_proj"]]
    ids = torch.tensor([io.chat_prompt_ids(tiny_tokenizer, "What is 12 + 7?")])
    with torch.no_grad():
        assert _relative_rms(engine.model(ids).logits, policy(ids).logits) < 1e-3
    engine.close()
