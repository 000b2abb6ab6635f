"""RLHFOrchestrator: capability gates with a forced regression that triggers rollback, rollback on a crash,
stage skipping for the same config and data, resume after a kill, the eval / best_of_n / merge stages with
report.md and the PNG summary, and save_models / load_models. Every model is a real tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def writes_answer_line(response: str, record: dict) -> bool:
    """Capability verifier for the tests: the response keeps the demo's output format."""
    return "Answer:" in response


def _pipeline(tmp_path: Path, model: Path | str, demo_dir: Path, stages: list[str], **sections) -> rlhf.PipelineConfig:
    raw = {"stages": stages, "output_dir": str(tmp_path / "run"), "model_name_or_path": str(model),
           "dataset_dir": str(demo_dir), "cutoff_len": 96, "seed": 0, "finetuning_type": "full", "max_samples": 32,
           "per_device_train_batch_size": 8, "save_steps": 0, "disable_progress_bar": True, "logging_steps": 1,
           "eval_max_new_tokens": 32, "per_device_eval_batch_size": 32, **sections}
    return rlhf.PipelineConfig.from_dict(raw, source="test.yaml")


FORMAT_GATE = {"capability_tests": {"format": {"dataset": "demo_multistep", "max_samples": 16,
                                               "verifier": "test_orchestrator:writes_answer_line"}},
               "capability_threshold": 0.1}


# -- gates and rollback ----------------------------------------------------------------------------------------

def test_forced_regression_rolls_back_and_the_next_stage_starts_from_the_previous_model(sft_model, demo_dir, tmp_path):
    config = _pipeline(tmp_path, sft_model, demo_dir, ["dpo", "kto"], **FORMAT_GATE, dataset="demo_preference",
                       # wrecks the format
                       dpo={"learning_rate": 1e-2, "lr_scheduler_type": "constant", "max_steps": 5},
                       kto={"dataset": "demo_kto", "learning_rate": 1e-7, "max_steps": 2})
    orchestrator = rlhf.RLHFOrchestrator(config)
    history = orchestrator.run_full_pipeline()
    dpo, kto = history
    assert dpo["status"] == "rolled_back" and "capability regression: format -100.0%" in dpo["reason"]
    assert dpo["capabilities"]["before"] == {"format": 1.0} and dpo["capabilities"]["after"] == {"format": 0.0}
    assert kto["input_model"] == str(sft_model)  # rolled back: kto trains from the SFT model, not the broken DPO one
    assert kto["status"] == "completed" and kto["capabilities"]["deltas"] == {"format": 0.0}
    assert orchestrator.current_model == kto["output_dir"] and "dpo" not in orchestrator.models
    stored = rlhf.read_report(config.output_dir)["stages"]
    assert [(e["stage"], e["status"]) for e in stored] == [("dpo", "rolled_back"), ("kto", "completed")]
    markdown = (Path(config.output_dir) / "report.md").read_text()
    assert "## Rollbacks (1)" in markdown and "- dpo: capability regression: format -100.0%" in markdown


def failing_reward(prompts, completions, answers):
    raise RuntimeError("reward server unreachable")


@pytest.mark.parametrize("rollback", [True, False])
def test_a_crashing_stage_rolls_back_or_stops(rollback, sft_model, demo_dir, tmp_path):
    config = _pipeline(tmp_path, sft_model, demo_dir, ["grpo"], dataset="demo_rl", rollback_on_error=rollback,
                       grpo={"reward_funcs": ["test_orchestrator:failing_reward"], "num_generations": 2,
                             "max_completion_length": 8, "max_steps": 1, "beta": 0.0})
    orchestrator = rlhf.RLHFOrchestrator(config)
    if not rollback:
        with pytest.raises(RuntimeError, match="reward server unreachable"):
            orchestrator.run_full_pipeline()
        return
    [entry] = orchestrator.run_full_pipeline()
    assert entry["status"] == "rolled_back" and entry["error"]
    assert entry["reason"] == "RuntimeError: reward server unreachable"
    assert orchestrator.current_model is None  # nothing adopted: a next stage starts from the configured model
    assert "1 rollback(s)" in str(rlhf.pipeline_table(orchestrator.history, "t").caption)


def test_user_mistakes_still_stop_the_pipeline(sft_model, demo_dir, tmp_path):
    config = _pipeline(tmp_path, sft_model, demo_dir, ["dpo"], dataset="no_such_dataset")
    with pytest.raises(rlhf.RLHFInputError, match="no_such_dataset"):
        rlhf.RLHFOrchestrator(config).run_full_pipeline()


# -- skipping and resuming -------------------------------------------------------------------------------------

def _sft_pipeline(tmp_path, model, demo_dir, **overrides):
    settings = {"dataset": "demo_sft", "max_steps": 6, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
                **overrides}
    return _pipeline(tmp_path, model, demo_dir, ["sft"], **settings)


def test_a_complete_stage_is_skipped_and_a_changed_one_reruns(tiny_model_dir, demo_dir, tmp_path, caplog):
    from conftest import rlhf_log

    first = rlhf.RLHFOrchestrator(_sft_pipeline(tmp_path, tiny_model_dir, demo_dir)).run_full_pipeline()
    assert first[0]["status"] == "completed" and not first[0].get("skipped")
    again = rlhf.RLHFOrchestrator(_sft_pipeline(tmp_path, tiny_model_dir, demo_dir))
    [entry] = again.run_full_pipeline()
    assert entry["skipped"] and entry["fingerprint"] == first[0]["fingerprint"]
    assert again.current_model == first[0]["output_dir"]
    assert len(rlhf.read_report(tmp_path / "run")["stages"]) == 1  # a skipped stage adds no entry
    with rlhf_log(caplog):
        [changed] = rlhf.RLHFOrchestrator(_sft_pipeline(tmp_path, tiny_model_dir, demo_dir, learning_rate=5e-4)
                                          ).run_full_pipeline()
    assert not changed.get("skipped") and changed["fingerprint"] != first[0]["fingerprint"]
    assert "starting it afresh" in caplog.text
    assert len(rlhf.read_report(tmp_path / "run")["stages"]) == 2


def test_data_change_is_noticed(tiny_model_dir, demo_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = (demo_dir / "sft.jsonl").read_text().splitlines()[:40]
    (data / "sft.jsonl").write_text("\n".join(lines) + "\n")
    config = rlhf.SFTConfig(dataset=str(data / "sft.jsonl"), dataset_dir=str(data))
    before = rlhf.data_fingerprint(config)
    (data / "sft.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert rlhf.data_fingerprint(config) != before


def test_a_killed_stage_resumes_to_the_same_weights(tiny_model_dir, demo_dir, tmp_path, monkeypatch, caplog):
    from conftest import rlhf_log

    config = _sft_pipeline(tmp_path, tiny_model_dir, demo_dir, save_steps=2)
    original = rlhf.BaseTrainer._save_checkpoint

    def killed_after_step_4(self):
        original(self)
        if self.global_step == 4:
            raise KeyboardInterrupt  # what a kill right after the step-4 checkpoint leaves behind

    monkeypatch.setattr(rlhf.BaseTrainer, "_save_checkpoint", killed_after_step_4)
    with pytest.raises(KeyboardInterrupt):
        rlhf.RLHFOrchestrator(config).run_full_pipeline()
    monkeypatch.setattr(rlhf.BaseTrainer, "_save_checkpoint", original)
    assert not (Path(config.output_dir) / "report.json").exists()  # an interrupted stage reports nothing
    # a setting a resume goes through (how often it logs) keeps the interrupted stage's checkpoints (review M4)
    rerun = _sft_pipeline(tmp_path, tiny_model_dir, demo_dir, save_steps=2, logging_steps=3)
    with rlhf_log(caplog):
        [entry] = rlhf.RLHFOrchestrator(rerun).run_full_pipeline()
    assert "resumed from" in caplog.text and "checkpoint-4" in caplog.text and "afresh" not in caplog.text
    assert entry["global_step"] == 6 and entry["status"] == "completed"
    straight = _sft_pipeline(tmp_path / "straight", tiny_model_dir, demo_dir, save_steps=2)
    rlhf.RLHFOrchestrator(straight).run_full_pipeline()
    resumed = rlhf.PolicyModel.from_pretrained(entry["output_dir"]).model.state_dict()
    uninterrupted = rlhf.PolicyModel.from_pretrained(str(Path(straight.output_dir) / "sft")).model.state_dict()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


def test_a_preempted_pipeline_resumes_at_the_interrupted_stage(tiny_model_dir, demo_dir, tmp_path, monkeypatch,
                                                                 caplog):
    """SIGTERM during the second stage (dpo, after its step 2): the step finishes, a checkpoint is written and the
    pipeline stops with TrainingPreempted; run again, it skips the finished sft stage, resumes dpo from that
    checkpoint and ends with the weights of an uninterrupted pipeline."""
    import os
    import signal

    from conftest import rlhf_log

    def pipeline(root):
        return _pipeline(root, tiny_model_dir, demo_dir, ["sft", "dpo"],
                         sft={"dataset": "demo_sft", "max_steps": 3, "learning_rate": 1e-3},
                         dpo={"dataset": "demo_preference", "max_steps": 5, "learning_rate": 1e-4})

    config = pipeline(tmp_path)
    original = rlhf.BaseTrainer._optimizer_step

    def signalled_during_dpo_step_3(self, group, window):
        if self.stage == "dpo" and self.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the step runs; the step still finishes
        return original(self, group, window)

    monkeypatch.setattr(rlhf.BaseTrainer, "_optimizer_step", signalled_during_dpo_step_3)
    with pytest.raises(rlhf.TrainingPreempted, match="stopped by SIGTERM after step 3 of 5") as stop:
        rlhf.RLHFOrchestrator(config).run_full_pipeline()
    assert stop.value.exit_code == 128 + signal.SIGTERM
    monkeypatch.setattr(rlhf.BaseTrainer, "_optimizer_step", original)
    with rlhf_log(caplog):
        entries = rlhf.RLHFOrchestrator(config).run_full_pipeline()
    assert [e["stage"] for e in entries] == ["sft", "dpo"] and entries[0].get("skipped")
    assert "resumed from" in caplog.text and "checkpoint-3" in caplog.text
    straight = pipeline(tmp_path / "straight")
    rlhf.RLHFOrchestrator(straight).run_full_pipeline()
    resumed = rlhf.PolicyModel.from_pretrained(entries[1]["output_dir"]).model.state_dict()
    uninterrupted = rlhf.PolicyModel.from_pretrained(str(Path(straight.output_dir) / "dpo")).model.state_dict()
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


# -- eval, best_of_n, merge, reports and saved models ----------------------------------------------------------

def test_final_stages_report_and_saved_models(sft_model, demo_dir, tmp_path):
    config = _pipeline(tmp_path, sft_model, demo_dir, ["rm", "dpo", "eval", "best_of_n", "merge"],
                       dataset="demo_preference", eval_dataset="demo_eval", max_steps=3, learning_rate=1e-5,
                       plot_loss=True, eval={"max_prompts": 8, "reference": str(sft_model), "pairs": "demo_preference",
                                             "max_pairs": 16},
                       best_of_n={"n": 3, "max_prompts": 8},
                       merge={"method": "task_arithmetic", "base_model": str(sft_model),
                              "models": [{"model": "dpo", "weight": 0.5}]})
    orchestrator = rlhf.RLHFOrchestrator(config)
    history = orchestrator.run_full_pipeline()
    by_stage = {entry["stage"]: entry for entry in history}
    assert all(entry["status"] == "completed" for entry in history)
    evaluation = by_stage["eval"]["metrics"]
    assert set(evaluation["per_stage"]) == {"dpo"} and evaluation["reference"] == str(sft_model)
    dpo = evaluation["per_stage"]["dpo"]
    assert {"reward/mean", "kl/k1", "kl/k3"} <= set(dpo) and dpo["kl/k3"] >= 0
    final = evaluation["final"]
    assert {"diversity/distinct_1", "diversity/self_similarity", "win/win_rate", "reward/accuracy"} <= set(final)
    bon = by_stage["best_of_n"]["metrics"]
    assert bon["n"] == 3 and bon["prompts"] == 8
    for scorer in ("rm", "vote"):
        assert 0 <= bon[f"accuracy/{scorer}"] <= bon["accuracy/oracle"]  # a pick can only be right if some sample is
    merged = by_stage["merge"]
    assert merged["metrics"]["method"] == "task_arithmetic" and "eval/accuracy" in merged["eval"]
    assert (Path(merged["output_dir"]) / "config.json").is_file()
    weights = {name: rlhf.PolicyModel.from_pretrained(path).model.state_dict()["model.norm.weight"]
               for name, path in (("sft", str(sft_model)), ("dpo", by_stage["dpo"]["output_dir"]),
                                  ("merged", merged["output_dir"]))}
    torch.testing.assert_close(weights["merged"], weights["sft"] + 0.5 * (weights["dpo"] - weights["sft"]))
    root = Path(config.output_dir)
    for stage in ("rm", "dpo", "eval", "best_of_n", "merge"):
        assert (root / "logs" / f"{stage}.log").is_file(), stage
    assert (root / "pipeline_summary.png").stat().st_size > 0 and list(root.glob("dpo/plot_*.png"))
    markdown = (root / "report.md").read_text()
    assert "| dpo | completed |" in markdown and "## Final policy evaluation" in markdown

    saved = orchestrator.save_models(tmp_path / "final")
    manifest = json.loads((saved / "models.json").read_text())
    assert manifest["policy"] == "policy" and manifest["reward_model"] == "reward_model"
    assert not (saved / "policy" / "checkpoints").exists()
    fresh = rlhf.RLHFOrchestrator(config)
    models = fresh.load_models(saved)
    assert isinstance(models["policy"], rlhf.PolicyModel) and isinstance(models["reward_model"], rlhf.RewardEnsemble)
    assert fresh.current_model == str(saved / "policy")
    original = rlhf.PolicyModel.from_pretrained(orchestrator.current_model).model.state_dict()
    for name, value in models["policy"].model.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0)


# -- config and report, without models -----------------------------------------------------------------------

def test_pipeline_config_reads_gates_and_final_stages():
    config = rlhf.PipelineConfig.from_dict({"stages": ["sft", "eval", "best_of_n"], "sft": {"dataset": "demo_sft"},
                                            "capability_tests": {"a": {"dataset": "demo_eval"}},
                                            "capability_threshold": "0.1", "rollback_on_error": "false",
                                            "best_of_n.n": 4})
    assert config.capability_threshold == 0.1 and config.rollback_on_error is False
    assert (config.final_stage_options("best_of_n")["n"] == 4
            and config.final_stage_options("eval")["max_prompts"] == 100)
    assert rlhf.PipelineConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    with pytest.raises(rlhf.RLHFInputError, match=r"\[best_of_n\]: unknown key\(s\) samples"):
        rlhf.PipelineConfig.from_dict({"stages": ["best_of_n"], "best_of_n": {"samples": 4}})
    with pytest.raises(rlhf.RLHFInputError, match="did you mean 'best_of_n'"):
        rlhf.PipelineConfig.from_dict({"stages": ["best_of_m"]})
    with pytest.raises(rlhf.RLHFInputError, match="capability_threshold"):
        rlhf.PipelineConfig.from_dict({"capability_threshold": 2})


def test_merge_section_is_checked_before_any_stage_runs(tmp_path):
    """A mistake in the merge section used to surface after every training stage had run."""
    stages = {"stages": ["sft", "dpo", "merge"], "sft": {"dataset": "demo_sft"}, "dpo": {"dataset": "demo_preference"}}
    ok = rlhf.PipelineConfig.from_dict({**stages, "merge": {"method": "dare_ties", "density": 0.3, "models": ["dpo"]}})
    assert ok.final_stage_options("merge")["density"] == 0.3
    rlhf.PipelineConfig.from_dict({**stages, "merge": {"models": [{"model": "dpo", "weight": 0.5}, str(tmp_path)]}})
    cases = [
        ({"method": "tiez"}, r"^demo\.yaml \[merge\]: method 'tiez' is not one of .*did you mean 'ties'\?$"),
        ({"density": 1.5}, r"^demo\.yaml \[merge\]: density must be in \(0\.0, 1\.0\], got 1\.5$"),
        ({"weights": [1, 2]}, r"^demo\.yaml \[merge\]: unknown key 'weights'"),
        ({"models": ["dpo", "ppo"]}, r"^demo\.yaml \[merge\]: models names stage 'ppo', which is not in stages "
                                     r"\[sft, dpo, merge\]; add the stage or name a model directory$"),
        ({"models": [str(tmp_path / "gone")]}, r"^demo\.yaml \[merge\]: models: '.*gone' is neither a stage of this "
                                              r"pipeline nor a directory$"),
        ({"base_model": "rm"}, r"^demo\.yaml \[merge\]: base_model names stage 'rm', which is not in stages"),
    ]
    for options, message in cases:
        with pytest.raises(rlhf.RLHFInputError, match=message):
            rlhf.PipelineConfig.from_dict({**stages, "merge": options}, source="demo.yaml")
    # key=value overrides are blamed on the command line, as model_merging.py does
    with pytest.raises(rlhf.RLHFInputError, match=r"^command line: density must be in"):
        rlhf.PipelineConfig.from_dict({**stages, "merge.density": 2}, source="demo.yaml",
                                      command_line=["merge.density"])
    # without the stage, the section is not checked (a warning says its settings are unused)
    rlhf.PipelineConfig.from_dict({"stages": ["sft"], "sft": {"dataset": "demo_sft"}, "merge": {"method": "tiez"}})
    # with no model to merge the stage reports that itself when its turn comes
    rlhf.PipelineConfig.from_dict({"stages": ["sft", "merge"], "sft": {"dataset": "demo_sft"}, "merge": {"density": 5}})


def test_eval_and_best_of_n_values_are_checked_before_any_stage_runs():
    base = {"stages": ["sft", "eval", "best_of_n"], "sft": {"dataset": "demo_sft"}}
    rlhf.PipelineConfig.from_dict({**base, "best_of_n": {"n": 4, "temperature": 0.3, "max_new_tokens": None, "seed": 0,
                                                         "scorers": ["vote"]}, "eval": {"batch_size": 8}})
    cases = [
        ({"best_of_n": {"n": 0}}, r"^demo\.yaml \[best_of_n\]: n must be a whole number of at least 1, got 0$"),
        ({"best_of_n": {"temperature": 0}}, r"^demo\.yaml \[best_of_n\]: temperature must be a number above 0"),
        ({"best_of_n": {"seed": -1}}, r"\[best_of_n\]: seed must be a whole number of at least 0, got -1$"),
        ({"best_of_n": {"scorers": ["rm", "oracle"]}}, r"\[best_of_n\]: scorers must be a non-empty list "
                                                       r"of rm and/or vote"),
        ({"best_of_n": {"scorers": []}}, r"\[best_of_n\]: scorers must be a non-empty list"),
        ({"eval": {"max_prompts": "all"}}, r"^demo\.yaml \[eval\]: max_prompts must be a whole number of at least 1, "
                                           r"got 'all'$"),
        ({"eval": {"samples_per_prompt": 1.5}}, r"\[eval\]: samples_per_prompt must be a whole number"),
    ]
    for section, message in cases:
        with pytest.raises(rlhf.RLHFInputError, match=message):
            rlhf.PipelineConfig.from_dict({**base, **section}, source="demo.yaml")
    with pytest.raises(rlhf.RLHFInputError, match=r"^command line: best_of_n\.n must be a whole number"):
        rlhf.PipelineConfig.from_dict({**base, "best_of_n.n": True}, source="demo.yaml", command_line=["best_of_n.n"])


def test_pipeline_rows_by_hand():
    history = [
        {"stage": "sft", "status": "completed", "seconds": 10, "eval": {"eval/accuracy": 0.5}, "metrics": {}},
        {"stage": "dpo", "status": "rolled_back", "seconds": 5, "eval": {"eval/accuracy": 0.1}, "metrics": {},
         "reason": "capability regression: x -20.0%"},
        {"stage": "eval", "status": "completed", "seconds": 3, "eval": {}, "metrics": {
            "per_stage": {"sft": {"reward/mean": 1.25, "kl/k3": 0.0}},
            "final": {"win/win_rate": 0.5, "win/wins": 3, "win/ties": 4, "win/losses": 3}}},
        {"stage": "best_of_n", "status": "completed", "seconds": 2, "eval": {}, "metrics": {
            "n": 4, "prompts": 10, "scorers": ["vote"], "accuracy/vote": 0.6, "accuracy/greedy": 0.5,
            "accuracy/oracle": 0.9}},
    ]
    rows = rlhf.pipeline_rows(history)
    assert rows[0] == ["sft", "completed", "10s", "50.0%", "1.250", "0.000", ""]
    assert rows[1][:3] == ["dpo", "rolled back", "5s"] and rows[1][4:6] == ["-", "-"]
    assert rows[1][6] == "capability regression: x -20.0%"
    assert rows[2][6] == "win rate over the reference 0.50 (3 wins, 4 ties, 3 losses)"
    assert rows[3][6] == "10 prompts x 4: vote 60.0%; greedy 50.0%, any of n 90.0%"


def test_real_model_config_on_a_preset(repo, monkeypatch):
    monkeypatch.chdir(repo)
    config = rlhf.PipelineConfig.load("configs/real_model.yaml", ["model_name_or_path=Qwen/Qwen2.5-7B-Instruct"],
                                      preset="7b")
    assert config.stages == ["sft", "rm", "dpo", "grpo", "eval", "best_of_n", "merge"]
    for stage in ("sft", "rm", "dpo", "grpo"):
        stage_config = config.stage_config(stage)
        assert stage_config.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct"
        assert stage_config.bf16 and stage_config.gradient_checkpointing and stage_config.finetuning_type == "lora"
        assert rlhf.data_fingerprint(stage_config)  # every dataset it names resolves to files
    grpo = config.stage_config("grpo")
    assert (grpo.reward_names() == ["exact_answer", "reward_model"]
            and grpo.reward_model == str(Path("outputs/real_model/rm")))
    assert config.stage_config("dpo").learning_rate == rlhf.get_7b_model_config().stage_config("dpo").learning_rate
    assert rlhf.PipelineConfig.load("configs/real_model.yaml", ["dpo.pref_beta=0.05"], preset="70b"
                                    ).stage_config("dpo").pref_beta == 0.05


def test_later_policy_stages_keep_the_sft_model_as_reference(tmp_path):
    config = rlhf.PipelineConfig.from_dict({"stages": ["sft", "dpo", "orpo", "kto"], "output_dir": str(tmp_path)})
    orchestrator = rlhf.RLHFOrchestrator(config)
    orchestrator.models["sft"] = sft = str(tmp_path / "sft")
    dpo = config.stage_config("dpo", model_name_or_path=sft)
    assert orchestrator._with_sft_reference(dpo).ref_model is None  # starts from SFT: its own start is the reference
    kto = config.stage_config("kto", model_name_or_path=str(tmp_path / "dpo"))
    assert orchestrator._with_sft_reference(kto).ref_model == sft  # after DPO: still anchored to SFT
    orpo = config.stage_config("orpo", model_name_or_path=str(tmp_path / "dpo"))
    assert orchestrator._with_sft_reference(orpo).ref_model is None  # reference-free
    mine = rlhf.dataclasses.replace(kto, ref_model="my/ref")
    assert orchestrator._with_sft_reference(mine).ref_model == "my/ref"
