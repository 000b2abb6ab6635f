"""Section 1 (Configs): defaults, validation, YAML + key=value overrides, LLaMA-Factory keys,
pipeline configs and the ``--help`` table. No model is built here; every test is pure Python."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import textwrap

import pytest
import torch
from conftest import rlhf_log

import rlhf
from rlhf import BaseConfig, PipelineConfig, RLHFInputError, SFTConfig


def write(path, text: str):
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path




def raises_input_error(match: str):
    return pytest.raises(RLHFInputError, match=match)


# ---------------------------------------------------------------- defaults


def test_base_config_defaults():
    config = BaseConfig()
    assert config.model_name_or_path == "tiny"
    assert config.trust_remote_code is False
    assert config.attn_implementation == "auto"
    assert config.finetuning_type == "lora"
    assert config.lora_rank == 8
    assert config.lora_alpha == 16  # 2 * lora_rank, as LLaMA-Factory
    assert config.lora_target == "all"
    assert config.learning_rate == 5e-5
    assert config.lr_scheduler_type == "linear"
    assert config.cutoff_len == 2048
    assert config.max_samples is None
    assert config.report_to == []
    assert config.max_steps == -1 and config.num_train_epochs == 1.0
    assert config.resume_from_checkpoint == "auto"
    assert config.mixed_precision == "no"
    assert config.stage == "base"


def test_sft_config_defaults_and_stage():
    config = SFTConfig()
    assert config.stage == "sft"
    assert (config.packing, config.train_on_prompt, config.mask_history) == (False, False, False)
    assert rlhf.STAGE_CONFIGS["sft"] is SFTConfig
    assert {f.name for f in dataclasses.fields(BaseConfig)} < {f.name for f in dataclasses.fields(SFTConfig)}
    # dataclass list defaults are not shared between instances
    a, b = SFTConfig(), SFTConfig()
    a.report_to.append("wandb")
    assert b.report_to == []


def test_derived_values():
    assert SFTConfig(lora_rank=4).lora_alpha == 8
    assert SFTConfig(lora_rank=4, lora_alpha=32).lora_alpha == 32
    assert SFTConfig(bf16=True).mixed_precision == "bf16"
    assert SFTConfig(report_to="all").report_to == ["tensorboard", "wandb"]
    assert SFTConfig(report_to=["none"]).report_to == []
    assert SFTConfig(report_to="tensorboard,wandb").report_to == ["tensorboard", "wandb"]
    assert SFTConfig(resume_from_checkpoint=False).resume_from_checkpoint == "none"
    assert SFTConfig(resume_from_checkpoint=True).resume_from_checkpoint == "auto"


def test_to_dict_has_every_field():
    config = SFTConfig(learning_rate=1e-3)
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(SFTConfig)}
    assert data["learning_rate"] == 1e-3


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"learning_rate": -1}, "learning_rate"),
    ({"learning_rate": 0}, "learning_rate"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"cutoff_len": 0}, "cutoff_len"),
    ({"lora_rank": 0}, "lora_rank"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_ratio": 1.5}, "warmup_ratio"),
    ({"warmup_ratio": 1.0}, "warmup_ratio"),
    ({"warmup_ratio": -0.1}, "warmup_ratio"),
    ({"lora_dropout": 1.0}, "lora_dropout"),
    ({"lora_dropout": -0.5}, "lora_dropout"),
    ({"adam_beta1": 1.0}, "adam_beta1/adam_beta2"),
    ({"adam_beta2": 0.0}, "adam_beta1/adam_beta2"),
    ({"max_samples": 0}, "max_samples"),
    ({"early_stopping_patience": 0}, "early_stopping_patience"),
    ({"val_size": -1}, "val_size"),
    ({"val_size": 1.5}, "val_size"),
    ({"num_train_epochs": 0, "max_steps": -1}, "max_steps"),
    ({"bf16": True, "fp16": True}, "bf16/fp16"),
    ({"streaming": True}, "max_steps"),
    ({"buffer_size": -1}, "buffer_size"),
])
def test_range_errors_name_the_field(kwargs, field):
    with pytest.raises(RLHFInputError) as info:
        SFTConfig(**kwargs)
    message = str(info.value)
    assert f"'{field}'" in message
    assert "\n" not in message


def test_valid_edge_values_pass():
    SFTConfig(warmup_ratio=0.0, lora_dropout=0.0, val_size=0.0)
    SFTConfig(val_size=200)  # a whole number of records
    SFTConfig(val_size=0.1)
    SFTConfig(streaming=True, max_steps=10)
    SFTConfig(num_train_epochs=0, max_steps=5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is allowed on CUDA")
def test_fp16_needs_cuda():
    with raises_input_error(r"'fp16'.*CUDA.*bf16=true"):
        SFTConfig(fp16=True)


@pytest.mark.parametrize(("field", "value", "suggestion"), [
    ("lr_scheduler_type", "cosin", "cosine"),
    ("finetuning_type", "loar", "lora"),
    ("attn_implementation", "spda", "sdpa"),
    ("model_dtype", "bfloat61", "bfloat16"),
    ("report_to", ["tensorbord"], "tensorboard"),
])
def test_bad_choice_suggests(field, value, suggestion):
    with pytest.raises(RLHFInputError) as info:
        SFTConfig(**{field: value})
    message = str(info.value)
    assert f"'{field}'" in message
    assert f"did you mean '{suggestion}'" in message


def test_bad_choice_without_close_match_lists_choices():
    with pytest.raises(RLHFInputError) as info:
        SFTConfig(lr_scheduler_type="zzzz")
    assert "did you mean" not in str(info.value)
    assert "cosine" in str(info.value) and "linear" in str(info.value)


def test_reduce_lr_on_plateau_is_refused_at_config_time():
    # it steps on a metric, not per optimizer step; accepting it would crash on the first step
    with pytest.raises(RLHFInputError, match="lr_scheduler_type"):
        SFTConfig(lr_scheduler_type="reduce_lr_on_plateau")


# ---------------------------------------------------------------- key=value overrides and YAML


def test_unknown_key_suggests():
    with raises_input_error(r"unknown key 'learnig_rate'.*did you mean 'learning_rate'"):
        rlhf.load_config(SFTConfig, None, ["learnig_rate=1e-4"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = write(tmp_path / "c.yaml", "cutof_len: 12\n")
    with pytest.raises(RLHFInputError) as info:
        rlhf.load_config(SFTConfig, path)
    assert str(path) in str(info.value)
    assert "did you mean 'cutoff_len'" in str(info.value)


def test_overrides_are_coerced():
    config = rlhf.load_config(SFTConfig, None, [
        "learning_rate=5e-5",  # YAML 1.1 reads this as a string
        "bf16=true", "packing=yes", "train_on_prompt=False",
        "num_train_epochs=2", "cutoff_len=1e3", "max_samples=null",
        "report_to=tensorboard,wandb", "dataset=a.jsonl,b.jsonl", "seed=7",
    ])
    assert config.learning_rate == 5e-5 and isinstance(config.learning_rate, float)
    assert config.bf16 is True and config.packing is True and config.train_on_prompt is False
    assert config.num_train_epochs == 2.0 and isinstance(config.num_train_epochs, float)
    assert config.cutoff_len == 1000 and isinstance(config.cutoff_len, int)
    assert config.max_samples is None
    assert config.report_to == ["tensorboard", "wandb"]
    assert config.dataset == "a.jsonl,b.jsonl"
    assert config.seed == 7


@pytest.mark.parametrize(("pair", "message"), [
    ("cutoff_len=abc", r"'cutoff_len' must be a whole number"),
    ("cutoff_len=1.5", r"'cutoff_len' must be a whole number"),
    ("bf16=maybe", r"'bf16' must be true or false"),
    ("learning_rate=fast", r"'learning_rate' must be a number"),
    ("learning_rate=true", r"'learning_rate' must be a number"),
    ("template=[a, b]", r"'template' must be a string"),
    ("learning_rate", r"not key=value"),
])
def test_override_type_errors(pair, message):
    with raises_input_error(message):
        rlhf.load_config(SFTConfig, None, [pair])


def test_int_field_rejects_non_integral_string():
    with raises_input_error(r"'per_device_train_batch_size' must be a whole number"):
        rlhf.build_config(SFTConfig, {"per_device_train_batch_size": "2.5"})


def test_yaml_values_and_overrides(tmp_path):
    path = write(tmp_path / "sft.yaml", """
        learning_rate: 5e-5
        lr_scheduler_type: cosine
        report_to: none
        cutoff_len: 256
        bf16: true
        max_samples: 100
        """)
    config = rlhf.load_config(SFTConfig, path, ["cutoff_len=64", "report_to=[tensorboard]"])
    assert config.learning_rate == 5e-5 and isinstance(config.learning_rate, float)
    assert config.lr_scheduler_type == "cosine"
    assert config.cutoff_len == 64  # the command line wins over the file
    assert config.report_to == ["tensorboard"]
    assert config.bf16 is True and config.max_samples == 100
    assert rlhf.load_config(SFTConfig, path).report_to == []


@pytest.mark.parametrize(("value", "expected"), [
    ("none", []),
    ("[]", []),
    ("tensorboard", ["tensorboard"]),
    ("[tensorboard, wandb]", ["tensorboard", "wandb"]),
    ("all", ["tensorboard", "wandb"]),
])
def test_report_to_in_yaml(tmp_path, value, expected):
    path = write(tmp_path / "c.yaml", f"report_to: {value}\n")
    assert rlhf.load_config(SFTConfig, path).report_to == expected


def test_empty_yaml_gives_defaults(tmp_path):
    path = write(tmp_path / "empty.yaml", "# nothing here\n")
    assert rlhf.load_config(SFTConfig, path) == SFTConfig()


def test_missing_config_file(tmp_path):
    with raises_input_error("does not exist"):
        rlhf.load_config(SFTConfig, tmp_path / "nope.yaml")


def test_top_level_must_be_mapping(tmp_path):
    path = write(tmp_path / "list.yaml", "- a\n- b\n")
    with raises_input_error(r"list\.yaml: expected a mapping"):
        rlhf.load_config(SFTConfig, path)


@pytest.mark.parametrize(("text", "line"), [
    ("seed: 1\nlearning_rate: 0.1\n cutoff_len: 5\n", 3),
    ("seed: 1\nreport_to: [a, b\nlearning_rate: 0.1\n", 3),
    ("seed: 1\n\nlearning_rate: 0.1\n\tcutoff_len: 5\n", 4),
])
def test_invalid_yaml_reports_file_line(tmp_path, text, line):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RLHFInputError) as info:
        rlhf.load_config(SFTConfig, path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: invalid YAML")
    assert "\n" not in message


def test_save_load_round_trip(tmp_path):
    config = SFTConfig(learning_rate=3e-4, lora_rank=4, report_to=["tensorboard"], max_samples=10, packing=True,
                       lr_scheduler_type="cosine", dataset="demo_sft", val_size=0.1, bf16=True, run_name="x",
                       resume_from_checkpoint="none", cutoff_len=128)
    path = tmp_path / "sub" / "config.yaml"
    rlhf.save_config(config, path)
    assert rlhf.load_config(SFTConfig, path) == config
    # and the defaults survive the trip too (None, empty lists, derived lora_alpha)
    rlhf.save_config(SFTConfig(), path)
    assert rlhf.load_config(SFTConfig, path) == SFTConfig()


# ---------------------------------------------------------------- LLaMA-Factory keys

LLAMAFACTORY_SFT_YAML = """
### model
model_name_or_path: tiny
trust_remote_code: true
flash_attn: fa2

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
deepspeed: examples/deepspeed/ds_z3_config.json
quantization_bit: 4

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### eval
val_size: 0.1
per_device_eval_batch_size: 1
eval_strategy: steps
eval_steps: 500
"""


def test_llamafactory_sft_yaml_loads(tmp_path, caplog):
    path = write(tmp_path / "llama3_lora_sft.yaml", LLAMAFACTORY_SFT_YAML)
    with rlhf_log(caplog):
        config = rlhf.load_config(SFTConfig, path)
    assert isinstance(config, SFTConfig)
    assert config.attn_implementation == "flash_attention_2"  # flash_attn: fa2
    assert config.trust_remote_code is True
    assert config.finetuning_type == "lora" and config.lora_target == "all" and config.lora_alpha == 16
    assert config.dataset == "identity,alpaca_en_demo" and config.template == "llama3"
    assert config.cutoff_len == 2048 and config.max_samples == 1000
    assert config.preprocessing_num_workers == 16 and config.dataloader_num_workers == 4
    assert config.output_dir == "saves/llama3-8b/lora/sft"
    assert config.plot_loss is True and config.overwrite_output_dir is True and config.save_only_model is False
    assert config.report_to == []
    assert config.per_device_train_batch_size == 1 and config.gradient_accumulation_steps == 8
    assert config.learning_rate == 1e-4 and config.num_train_epochs == 3.0
    assert config.lr_scheduler_type == "cosine" and config.warmup_ratio == 0.1
    assert config.bf16 is True and config.ddp_timeout == 180000000
    assert config.val_size == 0.1 and config.per_device_eval_batch_size == 1 and config.eval_steps == 500

    notices = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert config.quantization_bit == 4  # QLoRA, honoured
    for key in ("do_train", "deepspeed", "overwrite_cache", "eval_strategy"):
        matching = [m for m in notices if f"ignoring '{key}'" in m]
        assert len(matching) == 1, (key, notices)
        message = matching[0]
        assert str(path) in message
        assert rlhf.LLAMAFACTORY_IGNORED[key] in message  # the reason is given
        assert "\n" not in message
    assert len(notices) == 4


@pytest.mark.parametrize(("value", "expected"), [
    ("fa2", "flash_attention_2"), ("sdpa", "sdpa"), ("disabled", "eager"), ("auto", "auto")])
def test_flash_attn_mapping(value, expected):
    assert rlhf.load_config(SFTConfig, None, [f"flash_attn={value}"]).attn_implementation == expected


def test_flash_attn_bad_value_lists_valid():
    with raises_input_error(r"'flash_attn' is 'fa3'; valid: fa2, sdpa, disabled, auto"):
        rlhf.load_config(SFTConfig, None, ["flash_attn=fa3"])


def test_other_llamafactory_renames():
    config = rlhf.load_config(SFTConfig, None, ["neat_packing=true", "lora_targets=q_proj,v_proj",
                                                "infer_dtype=bfloat16"])
    assert config.packing is True
    assert config.lora_target == "q_proj,v_proj"
    assert config.model_dtype == "bfloat16"


def test_renamed_key_does_not_silently_replace_explicit_key(tmp_path):
    path = write(tmp_path / "c.yaml", "dataset_dir: train_data\neval_dataset_dir: eval_data\n")
    try:
        config = rlhf.load_config(SFTConfig, path)
    except RLHFInputError as err:  # refusing the conflict is fine too
        assert "eval_dataset_dir" in str(err) and "dataset_dir" in str(err)
    else:
        assert config.dataset_dir == "train_data"


def test_every_ignored_key_is_accepted(caplog):
    pairs = [f"{key}=1" for key in rlhf.LLAMAFACTORY_IGNORED]
    with rlhf_log(caplog):
        config = rlhf.load_config(SFTConfig, None, pairs)
    assert config == SFTConfig()
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == len(rlhf.LLAMAFACTORY_IGNORED)
    assert all(r.levelno == logging.INFO for r in caplog.records if "ignoring" in r.getMessage())


def test_messages_name_the_command_line_for_keys_given_there(tmp_path, caplog):
    path = tmp_path / "sft.yaml"
    path.write_text("do_train: true\nlearning_rate: 1.0e-4\n")
    with rlhf_log(caplog):
        rlhf.load_config(SFTConfig, path, ["deepspeed=ds.json"])
    notices = {r.getMessage().split(": ignoring")[0] for r in caplog.records if "ignoring" in r.getMessage()}
    assert notices == {f"{path}:1", "command line"}  # the file's key by its line
    with pytest.raises(rlhf.RLHFInputError, match="^command line: 'max_steps' must be a whole number"):
        rlhf.load_config(SFTConfig, path, ["max_steps=many"])
    with pytest.raises(rlhf.RLHFInputError, match="^command line: 'packing' must be true or false"):
        rlhf.load_config(SFTConfig, path, ["neat_packing=many"])  # a LLaMA-Factory name, typed under ours
    path.write_text("max_steps: many\n")
    with pytest.raises(rlhf.RLHFInputError, match=f"^{re.escape(str(path))}:1: 'max_steps' must be a whole number"):
        rlhf.load_config(SFTConfig, path, ["learning_rate=1e-3"])


def test_messages_point_at_the_line_of_the_key(tmp_path):
    """Unknown keys, wrong types and failed value checks name file:line and the pipeline section; a key the
    file does not hold (set on the command line, or by the pipeline) is named by where it came from."""
    single = tmp_path / "sft.yaml"
    single.write_text("# a comment\nlearning_rate: 1.0e-4\n\nwarmup_ratio: 2.0\n")
    with pytest.raises(rlhf.RLHFInputError, match=f"^{re.escape(str(single))}:4: config field 'warmup_ratio' must"):
        rlhf.load_config(SFTConfig, single)
    with pytest.raises(rlhf.RLHFInputError, match="^command line: config field 'warmup_ratio' must"):
        rlhf.load_config(SFTConfig, single, ["warmup_ratio=-1"])
    pipeline = tmp_path / "pipeline.yaml"
    text = ("stages: [sft, dpo]\nmodel_name_or_path: tiny\nseed: 0\nsft:\n  dataset: demo_sft\n"
            "  learning_rate: 1.0e-3\ndpo:\n  dataset: demo_preference\n  pref_beta: 0.1\n")
    pipeline.write_text(text.replace("learning_rate", "learning_rat"))
    with pytest.raises(rlhf.RLHFInputError, match=re.escape(f"{pipeline}:6 [sft]: unknown key 'learning_rat'")):
        rlhf.PipelineConfig.load(pipeline)
    pipeline.write_text(text.replace("seed: 0", "seed: x"))
    with pytest.raises(rlhf.RLHFInputError, match=re.escape(f"{pipeline}:3 [sft]: 'seed' must be a whole number")):
        rlhf.PipelineConfig.load(pipeline)  # a shared key: its top-level line, in the first stage that reads it
    pipeline.write_text(text.replace("pref_beta: 0.1", "pref_beta: -1"))
    with pytest.raises(rlhf.RLHFInputError, match=re.escape(f"{pipeline}:9 [dpo]: config field 'pref_beta' must")):
        rlhf.PipelineConfig.load(pipeline)
    with pytest.raises(rlhf.RLHFInputError, match="^command line: config field 'pref_beta' must"):
        rlhf.PipelineConfig.load(pipeline, ["dpo.pref_beta=-2"])
    pipeline.write_text(text)
    assert rlhf.PipelineConfig.load(pipeline).stage_config("dpo").pref_beta == 0.1


def test_renamed_and_ignored_keys_are_not_fields():
    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    assert not fields & set(rlhf.LLAMAFACTORY_IGNORED)
    assert not fields & set(rlhf.LLAMAFACTORY_RENAMES)
    assert all(target in fields for target, _ in rlhf.LLAMAFACTORY_RENAMES.values())


def test_stage_sft_accepted_other_stage_tells_command(tmp_path):
    assert isinstance(rlhf.load_config(SFTConfig, write(tmp_path / "ok.yaml", "stage: sft\n")), SFTConfig)
    path = write(tmp_path / "dpo.yaml", "stage: dpo\nlearning_rate: 1e-6\n")
    with pytest.raises(RLHFInputError) as info:
        rlhf.load_config(SFTConfig, path)
    message = str(info.value)
    assert str(path) in message
    assert "stage: dpo" in message
    assert "python rlhf.py dpo --config" in message


@pytest.mark.parametrize("value", ["null", "false"])
def test_resume_from_checkpoint_null_or_false_means_none(tmp_path, value):
    path = write(tmp_path / "c.yaml", f"resume_from_checkpoint: {value}\n")
    assert rlhf.load_config(SFTConfig, path).resume_from_checkpoint == "none"


def test_resume_from_checkpoint_strings():
    assert rlhf.load_config(SFTConfig, None, ["resume_from_checkpoint=none"]).resume_from_checkpoint == "none"
    assert rlhf.load_config(SFTConfig, None, ["resume_from_checkpoint=out/c-5"]).resume_from_checkpoint == "out/c-5"


# ---------------------------------------------------------------- pipeline configs

PIPELINE_YAML = """
stages: [sft]
output_dir: {out}
model_name_or_path: tiny
cutoff_len: 128
learning_rate: 1.0e-4
report_to: none
sft:
  dataset: demo_sft
  learning_rate: 3.0e-3
  num_train_epochs: 2
"""


def test_pipeline_shared_and_stage_sections(tmp_path):
    path = write(tmp_path / "p.yaml", PIPELINE_YAML.format(out=tmp_path / "runs"))
    pipeline = PipelineConfig.load(path)
    assert pipeline.stages == ["sft"]
    sft = pipeline.stage_config("sft")
    assert isinstance(sft, SFTConfig)
    assert sft.cutoff_len == 128  # shared
    assert sft.learning_rate == 3e-3  # the section wins over the shared key
    assert sft.num_train_epochs == 2.0 and sft.dataset == "demo_sft"
    assert sft.output_dir == str(tmp_path / "runs" / "sft")
    assert pipeline.stage_config("sft", model_name_or_path="some/dir").model_name_or_path == "some/dir"


def test_pipeline_overrides(tmp_path):
    path = write(tmp_path / "p.yaml", PIPELINE_YAML.format(out="o"))
    pipeline = PipelineConfig.load(path, ["sft.learning_rate=0.1", "cutoff_len=64", "output_dir=elsewhere",
                                          "sft.packing=true"])
    sft = pipeline.stage_config("sft")
    assert sft.learning_rate == 0.1 and isinstance(sft.learning_rate, float)
    assert sft.cutoff_len == 64 and sft.packing is True
    assert sft.dataset == "demo_sft"  # the rest of the section survives a dotted override
    assert sft.output_dir == str(rlhf.Path("elsewhere") / "sft")


def test_pipeline_unknown_key_in_stage_fails_at_load(tmp_path):
    path = write(tmp_path / "p.yaml", "stages: [sft]\nsft:\n  learnig_rate: 0.1\n")
    with pytest.raises(RLHFInputError) as info:
        PipelineConfig.load(path)
    message = str(info.value)
    assert "[sft]" in message and str(path) in message
    assert "unknown key 'learnig_rate'" in message and "did you mean 'learning_rate'" in message


def test_pipeline_bad_value_in_stage_fails_at_load(tmp_path):
    path = write(tmp_path / "p.yaml", "sft:\n  warmup_ratio: 2\n")
    with raises_input_error("'warmup_ratio'"):
        PipelineConfig.load(path)


def test_pipeline_unknown_stage(tmp_path):
    with raises_input_error(r"'stages' is 'sfft' \(did you mean 'sft'\?\)"):
        PipelineConfig.from_dict({"stages": "sfft"})


def test_pipeline_refuses_a_stage_output_dir():
    """Stages chain through output_dir/<stage>: a stage's own output_dir would be ignored, so it is an error
    that says what to set instead, from the YAML section and from a dotted override alike."""
    with raises_input_error(r"'rm\.output_dir' cannot be set in a pipeline: each stage writes to the pipeline's "
                            r"output_dir/rm"):
        PipelineConfig.from_dict({"stages": ["rm"], "rm": {"output_dir": "elsewhere"}})
    with raises_input_error(r"'sft\.output_dir' cannot be set in a pipeline"):
        PipelineConfig.from_dict({"stages": ["sft"], "sft.output_dir": "elsewhere"})


def test_pipeline_stages_string():
    assert PipelineConfig.from_dict({"stages": "sft"}).stages == ["sft"]


def test_pipeline_round_trip(tmp_path):
    pipeline = PipelineConfig.from_dict({"output_dir": str(tmp_path), "cutoff_len": 99, "report_to": "none",
                                         "sft": {"learning_rate": 0.01, "dataset": "demo_sft"}})
    path = tmp_path / "pipeline.yaml"
    rlhf.save_config(pipeline, path)
    again = PipelineConfig.load(path)
    assert again.stages == pipeline.stages and again.output_dir == pipeline.output_dir
    assert again.stage_config("sft") == pipeline.stage_config("sft")


def test_demo_pipeline_config_loads(repo):
    """The quick start's demo: the careless teacher's data, one reward model, every stage and final stage."""
    pipeline = PipelineConfig.load(repo / "configs" / "demo.yaml")
    sft = pipeline.stage_config("sft")
    assert sft.dataset == "demo_sft_careless" and sft.finetuning_type == "full" and sft.cutoff_len == 128
    assert sft.report_to == [] and sft.output_dir == str(rlhf.Path("outputs/demo/sft"))
    assert pipeline.stages == ["sft", "rm", "dpo", "grpo", "eval", "best_of_n", "merge"]
    assert set(pipeline.capability_tests) == {"multistep"} and pipeline.capability_threshold == 0.05
    assert pipeline.final_stage_options("merge")["models"] == ["dpo", "grpo"]
    assert pipeline.final_stage_options("best_of_n")["scorers"] == ["rm", "vote"]
    rm, dpo = pipeline.stage_config("rm"), pipeline.stage_config("dpo")
    assert isinstance(rm, rlhf.RewardModelConfig) and rm.dataset == "demo_rm_careless" and rm.ensemble_size == 1
    assert rm.val_split_by_prompt and dpo.dataset == "demo_preference_careless"
    assert isinstance(dpo, rlhf.DPOConfig) and dpo.pref_loss == "sigmoid" and dpo.precompute_ref_log_probs
    grpo = pipeline.stage_config("grpo")
    assert isinstance(grpo, rlhf.GRPOConfig) and grpo.reward_names() == ["exact_answer"] and grpo.beta == 0
    assert grpo.per_device_train_batch_size % grpo.num_generations == 0 and grpo.eval_dataset == "demo_eval"


def test_long_ensemble_demo_config_loads(repo):
    """The documented long option: the clean data and four boosted reward models."""
    pipeline = PipelineConfig.load(repo / "configs" / "demo_ensemble.yaml")
    sft, rm = pipeline.stage_config("sft"), pipeline.stage_config("rm")
    assert sft.dataset == "demo_sft" and sft.output_dir == str(rlhf.Path("outputs/demo_ensemble/sft"))
    assert rm.dataset == "demo_rm" and rm.ensemble_size == 4 and rm.ensemble_strategy == "boosting"
    assert pipeline.stages == ["sft", "rm", "dpo", "grpo", "eval", "best_of_n", "merge"]


# ---------------------------------------------------------------- --help


def test_config_help_lists_every_field():
    text = rlhf.config_help(SFTConfig)
    lines = text.splitlines()
    fields = dataclasses.fields(SFTConfig)
    assert len(lines) == len(fields)
    for line, f in zip(lines, fields):
        assert line.split()[0] == f.name
        help_text = f.metadata.get("help")
        assert help_text, f"field {f.name} has no help text"
        assert line.rstrip().endswith(help_text)
    assert "default 5e-05" in next(line for line in lines if line.split()[0] == "learning_rate")


def test_command_line_lists_keep_commas_inside_brackets_and_escapes(tmp_path):
    """A list field from the command line splits at top-level commas only: a regex's {1,3} or [a,b]
    and an escaped \\, stay in their item; a YAML flow list is taken as it is."""
    overrides = rlhf.parse_overrides([
        r"constitution=answer_line,regex=^\d{1,3}$@0.5,regex=[a,b]x,critique=Be brief\, kind.",
        "reward_funcs=[exact_answer, format]"])
    config = rlhf.build_config(rlhf.GRPOConfig, {"output_dir": str(tmp_path), **overrides})
    assert config.constitution == ["answer_line", r"regex=^\d{1,3}$@0.5", "regex=[a,b]x", "critique=Be brief, kind."]
    assert config.reward_funcs == ["exact_answer", "format"]
    assert [p.name for p in map(rlhf.Principle.parse, config.constitution)][:3] == ["answer_line", r"regex=^\d{1,3}$",
                                                                                   "regex=[a,b]x"]
    assert rlhf._split_list("a,,b, c") == ["a", "", "b", " c"]  # empty items are dropped by the caller
    with pytest.raises(RLHFInputError, match=r"'constitution': a bracket opened in this list is never closed"):
        rlhf.build_config(rlhf.GRPOConfig, {"output_dir": str(tmp_path),
                                            **rlhf.parse_overrides([r"constitution=regex=[(],answer_line"])})


# ---------------------------------------------------------------- YAML keys and output folders


def test_a_key_given_twice_in_yaml_is_an_error(tmp_path):
    path = write(tmp_path / "dup.yaml", "seed: 1\nlearning_rate: 1.0e-3\nmax_steps: 2\nlearning_rate: 2.0e-3\n")
    with raises_input_error(re.escape(f"{path}:4: duplicate key 'learning_rate' (first at line 2)")):
        rlhf.load_config(SFTConfig, path)
    nested = write(tmp_path / "nested.yaml", "stages: [sft]\nsft:\n  seed: 1\n  seed: 2\n")
    with raises_input_error(r"nested\.yaml:4: duplicate key 'seed'"):
        rlhf.read_yaml(nested)


def test_config_path_that_is_a_directory(tmp_path):
    with raises_input_error("is a directory; give a YAML file"):
        rlhf.load_config(SFTConfig, tmp_path)


def test_empty_output_dir_is_refused():
    # Path("") is the working directory: a run would write its model card over the project's README.md
    with raises_input_error("config field 'output_dir' is empty"):
        SFTConfig(output_dir=" ")


def test_output_dir_checks_before_anything_is_written(tmp_path):
    afile = write(tmp_path / "afile", "x")
    with raises_input_error(f"'output_dir': {afile} is a file"):
        rlhf._prepare_output_dir(SFTConfig(output_dir=str(afile)))
    foreign = tmp_path / "project"
    foreign.mkdir()
    write(foreign / "README.md", "# my project\n")
    write(foreign / "config.yaml", "name: my project\n")
    with raises_input_error(r"holds no earlier run \(README\.md, config\.yaml, \.\.\.\).*overwrite_output_dir=true"):
        rlhf._prepare_output_dir(SFTConfig(output_dir=str(foreign)))
    assert (foreign / "README.md").read_text() == "# my project\n"
    rlhf._prepare_output_dir(SFTConfig(output_dir=str(foreign), overwrite_output_dir=True))  # asked for
    earlier = tmp_path / "earlier"
    rlhf.save_config(SFTConfig(output_dir=str(earlier)), earlier / "config.yaml")  # an earlier run's folder
    write(earlier / "README.md", "model card\n")
    rlhf._prepare_output_dir(SFTConfig(output_dir=str(earlier)))
    rlhf._prepare_output_dir(SFTConfig(output_dir=str(tmp_path / "new" / "run")))
    assert (tmp_path / "new" / "run").is_dir()
    with raises_input_error(r"'output_dir': cannot create .*afile/run"):
        rlhf._prepare_output_dir(SFTConfig(output_dir=str(afile / "run")))


def test_pipeline_sections_that_cannot_be_what_was_meant(tmp_path):
    with raises_input_error(r"section 'sft' must be a mapping"):
        PipelineConfig.from_dict({"stages": ["sft"], "sft": 3})
    with raises_input_error(r"unknown section 'stf'; did you mean 'sft'\?"):
        PipelineConfig.from_dict({"stages": ["sft"], "stf": {"learning_rate": 1e-3}})
    with rlhf_log_records() as records:
        PipelineConfig.from_dict({"stages": ["sft"], "output_dir": str(tmp_path), "dpo": {"pref_beta": 0.2}})
    assert any("section 'dpo' is not in stages [sft]; its settings are unused" in r.getMessage() for r in records)


def rlhf_log_records():
    from conftest import captured_log

    return captured_log()


def test_optim_picks_the_adamw_kernel():
    model = torch.nn.Linear(4, 2)
    plain, _ = rlhf.create_optimizer(model, SFTConfig(), 10)
    fused, _ = rlhf.create_optimizer(model, SFTConfig(optim="adamw_torch_fused"), 10)
    assert not plain.defaults["fused"] and fused.defaults["fused"]
    with raises_input_error(r"'optim' is 'adamw_8bit'.*valid: adamw_torch, adamw_torch_fused"):
        SFTConfig(optim="adamw_8bit")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_names_the_install_command():
    with pytest.raises(rlhf.RLHFInputError, match=r"config field 'use_vllm' vLLM is not installed: pip install "
                                                  r"'rlhf\[vllm\]' \(GPU\), or on a CPU-only machine "
                                                  r"scripts/install_vllm_cpu.sh"):
        rlhf.GRPOConfig(reward_funcs=["format"], use_vllm=True)
    rlhf.GRPOConfig(reward_funcs=["format"], use_vllm=True, vllm_mode="server")  # a server's trainer needs no vLLM


@pytest.mark.parametrize("overrides, message", [
    ({"min_p": 0.1}, "are sampled by vLLM only"),
    ({"repetition_penalty": 1.1}, "are sampled by vLLM only"),
    ({"async_rollouts": True}, "set use_vllm: true and vllm_mode: server"),
    ({"max_staleness": 2}, "set use_vllm: true and vllm_mode: server"),
    ({"vllm_servers": ["127.0.0.1:8000"]}, "set use_vllm: true and vllm_mode: server"),
])
def test_vllm_only_options_without_use_vllm_are_refused(overrides, message):
    with pytest.raises(rlhf.RLHFInputError, match=message):
        rlhf.GRPOConfig(reward_funcs=["format"], **overrides)


def test_trl_openrlhf_verl_key_names_map_to_ours():
    every_field = {f.name for cls in rlhf.STAGE_CONFIGS.values() for f in dataclasses.fields(cls)}
    assert not every_field & set(rlhf.TRL_OPENRLHF_RENAMES)
    assert all(target in every_field for target, _ in rlhf.TRL_OPENRLHF_RENAMES.values())
    grpo = rlhf.load_config(rlhf.GRPOConfig, overrides=[
        "reward_funcs=exact_answer", "dynamic_filtering=true", "n_samples_per_prompt=4", "loss_agg_mode=token-mean",
        "clip_ratio_low=0.2", "clip_ratio_high=0.28", "adv_estimator=reinforce_plus_plus_baseline",
        "scale_rewards=none"])
    assert (grpo.dynamic_sampling, grpo.num_generations, grpo.loss_type) == (True, 4, "dapo")
    assert (grpo.epsilon_low, grpo.epsilon_high, grpo.advantage_estimator) == (0.2, 0.28, "reinforce_pp_baseline")
    assert rlhf.load_config(rlhf.GRPOConfig, overrides=["reward_funcs=exact_answer", "advantage_estimator=group_norm",
                                                                "epsilon=0.1"]
                            ).advantage_estimator == "grpo"
    distill = rlhf.load_config(rlhf.DistillConfig, overrides=["teacher_model_name_or_path=tiny"])
    assert distill.teacher_model == "tiny"
    with pytest.raises(RLHFInputError, match="^command line: 'teacher_model_name_or_path' is 'teacher_model' here, "
                                             "which the sft stage does not have"):
        rlhf.load_config(SFTConfig, overrides=["teacher_model_name_or_path=tiny"])
    with pytest.raises(RLHFInputError, match="'loss_agg_mode' is 'seq-mean'; valid: token-mean"):
        rlhf.load_config(rlhf.GRPOConfig, overrides=["reward_funcs=exact_answer", "loss_agg_mode=seq-mean"])


def test_null_unsets_a_text_field_instead_of_naming_a_dataset_none():
    config = rlhf.load_config(SFTConfig, overrides=["eval_dataset=null", "dataset=demo_sft"])
    assert config.eval_dataset == ""
