"""Mistakes a newcomer makes that used to pass silently, and progress a piped log can see.

Each case is one a trial run as a new user hit: a config that deletes the checkpoints an interrupt message
promised to resume, misspelt dataset_info.json keys, a pipeline that found a later stage's bad input only
after the earlier stages trained, a reference model error naming the wrong field, an unused reference model,
a reward model merged as a policy, ``train FILE stage=X``, a smoothed loss line far above its points, and a
log with no sign of life while a stage trains.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import captured_log

import model_merging as mm
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["model_name_or_path=tiny", "dataset=demo_sft", "finetuning_type=full", "max_samples=48", "cutoff_len=64",
         "per_device_train_batch_size=4", "report_to=none", "disable_progress_bar=true", "logging_steps=1"]


# ---------------------------------------------------------------- overwrite_output_dir and interrupts

def _interrupt_after_step(monkeypatch, step: int) -> None:
    """Ctrl-C right after the checkpoint of ``step`` is written (once)."""
    original = rlhf.BaseTrainer._save_checkpoint
    fired = []

    def save(self) -> None:
        original(self)
        if self.global_step == step and not fired:
            fired.append(step)
            raise KeyboardInterrupt

    monkeypatch.setattr(rlhf.BaseTrainer, "_save_checkpoint", save)


def test_interrupt_advice_is_true_for_a_config_that_overwrites(tmp_path, monkeypatch, capsys, demo_dir):
    """LLaMA-Factory's own examples set overwrite_output_dir: true. The interrupt message said "run the same
    command again to resume", and that rerun deleted the checkpoints: now the message says how to keep them, the
    rerun that overwrites says what it deletes first, and the advised rerun resumes."""
    out = tmp_path / "out"
    args = ["sft", *SMALL, f"dataset_dir={demo_dir}", "max_steps=4", "save_steps=2", f"output_dir={out}"]
    _interrupt_after_step(monkeypatch, 2)
    assert rlhf.main([*args, "overwrite_output_dir=true"]) == 130
    advice = capsys.readouterr().err
    assert "overwrite_output_dir=true, which deletes it" in advice and "overwrite_output_dir=false" in advice, advice
    assert (out / "checkpoints" / "checkpoint-2" / "COMPLETE").is_file()

    resumed = rlhf.train_sft(rlhf.load_config(rlhf.SFTConfig, None, [*SMALL[:], f"dataset_dir={demo_dir}",
                                                                     "max_steps=4", "save_steps=2", f"output_dir={out}",
                                                                     "overwrite_output_dir=false"]))
    first_logged = min(row["step"] for row in resumed.history if "loss" in row)
    assert resumed.global_step == 4 and first_logged == 1  # history kept up to step 2, then steps 3-4 trained
    assert [row["step"] for row in resumed.history if "loss" in row] == [1, 2, 3, 4]

    with captured_log() as records:
        rlhf.train_sft(rlhf.load_config(rlhf.SFTConfig, None, [*SMALL, f"dataset_dir={demo_dir}", "max_steps=2",
                                                               "save_steps=2", f"output_dir={out}",
                                                               "overwrite_output_dir=true"]))
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING" and "deleting" in r.getMessage()]
    assert (warnings and "overwrite_output_dir=true: deleting" in warnings[0]
            and "overwrite_output_dir=false" in warnings[0])


def test_interrupt_advice_for_a_resuming_config_and_before_any_checkpoint(tmp_path, monkeypatch, capsys, demo_dir):
    out = tmp_path / "out"
    _interrupt_after_step(monkeypatch, 2)
    assert rlhf.main(["sft", *SMALL, f"dataset_dir={demo_dir}", "max_steps=4", "save_steps=2",
                      f"output_dir={out}"]) == 130
    advice = capsys.readouterr().err
    assert "run the same command again to resume from it" in advice and "checkpoint-2" in advice, advice


# ---------------------------------------------------------------- dataset_info.json

def _registered(tmp_path: Path, entry: dict, records: list[dict], name: str = "mine") -> Path:
    (tmp_path / "mine.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"other": {"file_name": "x.json"}, name: entry}, indent=2))
    return tmp_path


ALPACA = [{"instruction": "What is 2 + 2?", "output": "4"}] * 4


@pytest.mark.parametrize("key,hint", [("colums", "columns"), ("formating", "formatting"), ("file", "file_name"),
                                      ("rankin", "ranking")])
def test_dataset_info_unknown_keys_are_errors_with_did_you_mean(tmp_path, key, hint):
    entry = {"file_name": "mine.json", key: {} if key == "colums" else "sharegpt"}
    directory = _registered(tmp_path, entry, ALPACA)
    text = (directory / "dataset_info.json").read_text().splitlines()
    line = next(i for i, row in enumerate(text, 1) if f'"{key}"' in row)
    with pytest.raises(rlhf.RLHFInputError, match=rf"dataset_info\.json:{line}: dataset 'mine': unknown key '{key}'; "
                                                  rf"did you mean '{hint}'\?"):
        rlhf.load_records("mine", str(directory), "sft")


@pytest.mark.parametrize("entry,pattern", [
    ({"file_name": "mine.json", "columns": {"promt": "question"}}, r"unknown column 'promt' for alpaca data; "
                                                                   r"did you mean 'prompt'\?"),
    ({"file_name": "mine.json", "formatting": "sharegp"}, r"formatting 'sharegp' is not alpaca or sharegpt; "
                                                          r"did you mean 'sharegpt'\?"),
    ({"file_name": "mine.json", "num_samples": 10}, r"'num_samples': .*use the config field max_samples"),
    ({"file_name": "mine.json", "formatting": "sharegpt", "tags": {"role": "from"}}, r"unknown tag 'role'.*"
                                                                                     r"did you mean 'role_tag'\?"),
    ({"file_name": "mine.json", "tags": {"role_tag": "from"}}, r"'tags' apply to sharegpt data only"),
    ({"file_name": "mine.json", "columns": {"videos": "videos"}}, r"column 'videos': videos are not supported "
                                                                  r"\(images are\)"),
])
def test_dataset_info_values_that_would_be_ignored_are_errors(tmp_path, entry, pattern):
    with pytest.raises(rlhf.RLHFInputError, match=pattern):
        rlhf.load_records("mine", str(_registered(tmp_path, entry, ALPACA)), "sft")


@pytest.mark.parametrize("formatting,records,column", [
    ("alpaca", [{"question": "What is 2 + 2?", "answer": "4"}], "prompt"),
    ("sharegpt", [{"dialog": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}], "messages"),
])
def test_registered_file_without_columns_says_to_add_columns(tmp_path, formatting, records, column):
    directory = _registered(tmp_path, {"file_name": "mine.json", "formatting": formatting}, records)
    with pytest.raises(rlhf.RLHFInputError, match=rf"mine\.json:\d+: record has no '\w+' field .*dataset_info\.json "
                                                  rf"entry, e\.g\. \"columns\": {{\"{column}\""):
        rlhf.load_records("mine", str(directory), "sft")


# ---------------------------------------------------------------- a pipeline checks every stage first

def _pipeline(tmp_path: Path, demo_dir: Path, dpo: dict) -> Path:
    config = {"stages": ["sft", "dpo"], "output_dir": str(tmp_path / "run"), "model_name_or_path": "tiny",
              "dataset_dir": str(demo_dir), "report_to": "none", "disable_progress_bar": True, "cutoff_len": 64,
              "max_samples": 16, "max_steps": 1, "finetuning_type": "full",
              "sft": {"dataset": "demo_sft"}, "dpo": {"dataset": "demo_preference", **dpo}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("dpo,pattern", [
    ({"dataset": "demo_preferense"}, r"\[dpo\]: config field 'dataset': dataset 'demo_preferense' is not in .*did you "
                                     r"mean 'demo_preference'\?"),
    ({"eval_dataset": "nowhere.jsonl"}, r"\[dpo\]: config field 'eval_dataset': "
                                        r"dataset file nowhere\.jsonl does not exist"),
    ({"ref_model": "./models/sft-v1"}, r"\[dpo\]: config field 'ref_model': '\./models/sft-v1' does not exist"),
])
def test_pipeline_checks_later_stages_inputs_before_the_first_trains(tmp_path, demo_dir, dpo, pattern):
    orchestrator = rlhf.RLHFOrchestrator(str(_pipeline(tmp_path, demo_dir, dpo)))
    with pytest.raises(rlhf.RLHFInputError, match=pattern):
        orchestrator.run_full_pipeline()
    assert not (tmp_path / "run" / "sft").exists()  # nothing trained


# ---------------------------------------------------------------- ref_model

def test_missing_ref_model_names_ref_model(tmp_path, demo_dir):
    config = rlhf.load_config(rlhf.DPOConfig, None, ["model_name_or_path=tiny", "dataset=demo_preference",
                                                     f"dataset_dir={demo_dir}", "ref_model=/no/such/model",
                                                     f"output_dir={tmp_path}", "report_to=none", "max_steps=1"])
    with pytest.raises(rlhf.RLHFInputError, match=r"^config field 'ref_model': '/no/such/model' does not exist"):
        rlhf.train_dpo(config)


@pytest.mark.parametrize("stage,keys", [("orpo", []), ("simpo", []), ("dpo", ["pref_loss=orpo"]),
                                        ("grpo", ["beta=0", "reward_funcs=[exact_answer]"])])
def test_ref_model_with_a_reference_free_loss_is_an_error(stage, keys):
    with pytest.raises(rlhf.RLHFInputError, match=r"config field 'ref_model' is unused: "):
        rlhf.load_config(rlhf.STAGE_CONFIGS[stage], None, ["model_name_or_path=tiny", "ref_model=tiny", *keys])


# ---------------------------------------------------------------- merging a reward model

def test_merging_a_reward_model_as_a_policy_is_an_error(tmp_path, llama_dir):
    reward = tmp_path / "rm"
    rlhf.RewardModel.from_pretrained(str(llama_dir), seed=0).save_pretrained(reward)
    config = tmp_path / "merge.yaml"
    config.write_text(f"method: linear\nmodels:\n  - {llama_dir}\n  - {reward}\noutput_dir: {tmp_path / 'out'}\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = mm.main(["--config", str(config), "--no-progress"])
    assert code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert re.search(r"merge\.yaml:4: models\[1\] .*reward_head\.safetensors.* not a policy.*combine-rm",
                     err.getvalue())
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- train FILE stage=X

def test_train_takes_the_stage_from_the_command_line(tmp_path, demo_dir, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text(f"model_name_or_path: tiny\ndataset: demo_sft\ndataset_dir: {demo_dir}\n")
    out = tmp_path / "out"
    assert rlhf.main(["train", str(config), "stage=sft", "max_steps=1", "report_to=none", "max_samples=8",
                      "disable_progress_bar=true", f"output_dir={out}"]) == 0, capsys.readouterr().err
    assert (out / "adapter_model.safetensors").is_file()  # finetuning_type's default, lora
    assert rlhf.main(["train", str(config), "max_steps=1"]) == 2
    assert "or give stage=sft (or another) after the file" in capsys.readouterr().err


# ---------------------------------------------------------------- plots and progress

def test_smoothed_line_ends_where_the_loss_ends():
    """A short run's loss falls 5.0 -> 3.16 over 15 points; the exponential average ended at 4.4. The centred
    average follows the trend: it stays inside the range of the points around it and ends on the last one."""
    losses = [5.0 - 1.84 * (1 - 0.8 ** i) / (1 - 0.8 ** 14) for i in range(15)]
    line = rlhf.smoothed(losses)
    assert line[-1] == losses[-1] and line[0] == losses[0]
    for i, value in enumerate(line):
        nearby = losses[max(0, i - 1):i + 2]
        assert min(nearby) - 1e-12 <= value <= max(nearby) + 1e-12
    noisy = [1.0, 3.0] * 20
    assert max(rlhf.smoothed(noisy)[1:-1]) < 2.5  # still smooths noise


def test_plain_progress_lines_when_output_is_not_a_terminal(tmp_path, demo_dir):
    """Under pytest (as in a pipe or CI) rich draws no bar: a log line every progress_interval seconds says
    step/total, rate, ETA and the last loss."""
    config = rlhf.load_config(rlhf.SFTConfig, None, [*SMALL, f"dataset_dir={demo_dir}", "max_steps=3",
                                                     "disable_progress_bar=false", "progress_interval=0",
                                                     f"output_dir={tmp_path}", "save_steps=0"])
    with captured_log() as records:
        rlhf.train_sft(config)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("sft: step")]
    assert len(lines) == 3, lines
    assert re.fullmatch(r"sft: step 3/3 \(100%\), [\d.]+ (steps/s|s/step), eta 0s, loss \d+\.\d{4} "
                        r"\(\d+ tok/s, MFU [\d.]+%\)", lines[-1]), lines


def test_plain_progress_waits_for_its_interval():
    progress = rlhf.PlainProgress("dpo", 100, 0, interval=3600)
    with captured_log() as records:
        for _ in range(99):
            progress.advance()
        assert not records  # nothing until the interval passes ...
        progress.update(loss="0.6931")
        progress.advance()
    assert [r.getMessage().split(",")[0] for r in records] == ["dpo: step 100/100 (100%)"]  # ... or the end
    assert records[0].getMessage().endswith("loss 0.6931")


def test_a_name_registered_in_a_subfolder_says_which_dataset_dir(repo):
    """The demo's names live in data/demo: with dataset_dir 'data' (LLaMA-Factory's files) the fix is the folder,
    not the closest name in data/dataset_info.json."""
    with pytest.raises(rlhf.RLHFInputError,
                       match=r"data/demo/dataset_info\.json registers it: set dataset_dir=\S*data/demo"):
        rlhf.resolve_dataset("demo_sft", str(repo / "data"))
