"""examples/: every LLaMA-Factory-style YAML parses and validates as the stage its `stage:` key names, reads the data
bundled in data/ with the embedded tiny model, says in its header how to run it and what to change for a real model,
and trains end to end through the command line (`rlhf.main(["train", FILE, ...])`) for two steps; the ones copied
from seed 001's blocks ("RLHF / Preference Training Templates") still are those blocks.

The runs override only max_steps, output_dir and bf16 (CPU autocast to bf16 makes these tiny runs about ten times
slower; the files keep bf16: true for the GPU; one run below keeps it). Multi-GPU examples run in one process, as
their headers say they can: the launches are tested by test_sharded.py and bench/bench_multiprocess.py. QLoRA ones
need bitsandbytes and are skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "examples").rglob("*.yaml")
                  if p.parent.name != "real_models")
# real pretrained models (scripts/fetch_real_models.py): checked here as configs; tests/test_pretrained.py trains
# SmolLM2 through the command line and docs/experiments/real-models.md runs these files as written
REAL_MODEL_EXAMPLES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "examples" / "real_models").glob("*.yaml"))
FAST = ["max_steps=2", "bf16=false"]
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None


def test_every_stage_and_method_has_an_example():
    expected = {"train_full/sft.yaml", "train_full/dpo.yaml", "train_lora/sft.yaml", "train_lora/rm.yaml",
                "train_lora/dpo.yaml", "train_lora/kto.yaml", "train_lora/orpo.yaml", "train_lora/simpo.yaml",
                "train_lora/ppo.yaml", "train_lora/grpo.yaml", "train_lora/rloo.yaml", "train_lora/reinforce_pp.yaml",
                "train_lora/online_dpo.yaml", "train_lora/distill.yaml", "train_qlora/sft.yaml", "train_qlora/dpo.yaml",
                "train_lora/qwen3vl_sft.yaml", "train_lora/qwen3vl_dpo.yaml",
                "multi_gpu/sft_lora_ddp.yaml", "multi_gpu/sft_full_fsdp.yaml", "multi_gpu/dpo_lora_ds3.yaml"}
    assert {path.removeprefix("examples/") for path in EXAMPLES} == expected


@pytest.mark.parametrize("path", REAL_MODEL_EXAMPLES)
def test_real_model_example_is_a_valid_config_on_the_bundled_data(path, monkeypatch):
    monkeypatch.chdir(REPO)
    raw = rlhf.read_yaml(REPO / path)
    if "stages" in raw:
        config = rlhf.PipelineConfig.load(path)
        configs = [config.stage_config(stage) for stage in config.stages if stage in rlhf.STAGE_CONFIGS]
    else:
        configs = [rlhf.load_config(rlhf.STAGE_CONFIGS[str(raw["stage"])], path)]
    for config in configs:
        assert config.model_name_or_path.startswith(("~/.cache/rlhf/models/", "outputs/real_models/")), path
        assert rlhf.data_fingerprint(config) and config.eval_dataset == "demo_eval"
    header = comments(path)
    assert ("python scripts/fetch_real_models.py" in header
            or "outputs/real_models" in str(configs[0].model_name_or_path))
    assert re.search(rf"python rlhf\.py (train|pipeline --config) {re.escape(path)}\b", header)
    assert "docs/experiments/real-models.md" in header


def stage_of(path: str) -> str:
    return str(rlhf.read_yaml(REPO / path)["stage"])


def comments(path: str) -> str:
    return "\n".join(line for line in (REPO / path).read_text(encoding="utf-8").splitlines() if line.startswith("#"))


@pytest.mark.parametrize("path", EXAMPLES)
def test_example_is_a_valid_config_on_the_bundled_data(path, monkeypatch):
    monkeypatch.chdir(REPO)  # dataset_dir: data is relative to the repository root, where the commands run
    stage = stage_of(path)
    config = rlhf.load_config(rlhf.STAGE_CONFIGS[stage], path)
    assert config.model_name_or_path in ("tiny", "tiny-vl") and config.dataset_dir == "data"
    assert config.max_samples is not None and config.max_samples <= 16 and config.cutoff_len <= 128
    assert config.max_steps == -1  # the file runs whole; the tests shorten it
    assert rlhf.data_fingerprint(config)  # every dataset it names resolves to bundled files
    header = comments(path)
    assert "real model" in header and "model_name_or_path" in header, "say what to change for a real model"
    assert re.search(rf"(python rlhf\.py train|accelerate launch .*rlhf\.py train) {re.escape(path)}\b", header)
    if config.quantization_bit:
        assert "bitsandbytes" in header and config.finetuning_type == "lora"
    for named in re.findall(r"\b((?:configs|examples|data)/[\w./-]+\.(?:yaml|jsonl|json))", header):
        assert (REPO / named).is_file(), f"{path} names {named}, which does not exist"


def run_example(path: str, output_dir: Path, *extra: str) -> int:
    return rlhf.main(["train", path, f"output_dir={output_dir}", *FAST, *extra])


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """examples/train_lora/rm.yaml's output, which examples/train_lora/ppo.yaml scores with."""
    output_dir = tmp_path_factory.mktemp("example-rm") / "rm"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        patch.setattr(rlhf, "plot_metrics", lambda history, output_dir, keys=None: [])
        assert run_example("examples/train_lora/rm.yaml", output_dir) == 0
    return output_dir


@pytest.mark.parametrize("path", EXAMPLES)
def test_example_trains_end_to_end(path, tmp_path, monkeypatch, capsys, request):
    if "quantization_bit" in rlhf.read_yaml(REPO / path) and not HAS_BITSANDBYTES:
        pytest.skip("QLoRA needs bitsandbytes (pip install '.[qlora]')")
    monkeypatch.chdir(REPO)
    plots = []  # plot_loss: true is honoured; rendering a dozen PNGs per run would cost seconds, so only record it
    monkeypatch.setattr(rlhf, "plot_metrics", lambda history, output_dir, keys=None: plots.append(output_dir) or [])
    stage = stage_of(path)
    if path == "examples/train_lora/rm.yaml":
        output_dir, overrides = request.getfixturevalue("reward_model"), []
    else:
        output_dir = tmp_path / "out"
        overrides = [f"reward_model={request.getfixturevalue('reward_model')}"] if stage == "ppo" else []
        assert run_example(path, output_dir, *overrides) == 0, capsys.readouterr().err
        assert plots == ([output_dir] if rlhf.read_yaml(REPO / path).get("plot_loss") else [])
    entries = json.loads((output_dir / "report.json").read_text())["stages"]
    assert [(e["stage"], e["global_step"]) for e in entries] == [(stage, 2)]
    # the run used the file's settings, with nothing but the overrides changed
    expected = rlhf.load_config(rlhf.STAGE_CONFIGS[stage], path, [f"output_dir={output_dir}", *FAST, *overrides])
    assert (yaml.safe_load((output_dir / "config.yaml").read_text())
            == yaml.safe_load(yaml.safe_dump(expected.to_dict())))
    weights = "adapter_model.safetensors" if expected.finetuning_type == "lora" else "model.safetensors"
    assert (output_dir / weights).is_file()
    if stage == "rm":
        assert (output_dir / "reward_head.safetensors").is_file()


def test_the_llamafactory_command_form_runs_a_file_as_written(tmp_path, monkeypatch, capsys):
    """`python rlhf.py --config FILE`, as LLaMA-Factory users type it, with the file's bf16: true kept."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(rlhf, "plot_metrics", lambda history, output_dir, keys=None: [])
    output_dir = tmp_path / "out"
    assert rlhf.main(["--config", "examples/train_lora/dpo.yaml", "max_steps=2", f"output_dir={output_dir}"]) == 0, \
        capsys.readouterr().err
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert saved["bf16"] is True and saved["pref_loss"] == "sigmoid" and saved["finetuning_type"] == "lora"
    assert json.loads((output_dir / "report.json").read_text())["stages"][0]["global_step"] == 2


def test_the_readme_lists_every_example_with_its_command():
    readme = (REPO / "examples" / "README.md").read_text(encoding="utf-8")
    for path in EXAMPLES + REAL_MODEL_EXAMPLES:
        assert re.search(rf"(python rlhf\.py (train|pipeline --config)|accelerate launch .*rlhf\.py train) "
                         rf"{re.escape(path)}\b", readme), path
    for named in re.findall(r"\b((?:configs|examples)/[\w./-]+\.yaml)", readme):
        assert (REPO / named).is_file(), named


# -- seed 001's blocks ----------------------------------------------------------------------------------------------
# The blocks are copied from seed 001 ("RLHF / Preference Training Templates"); swapped: model_name_or_path
# (Qwen/Qwen3-8B-Instruct -> tiny), template (qwen3_nothink -> chatml), cutoff_len (2048 -> 64), output_dir; added:
# dataset_dir and max_samples. ORPO and SimPO are "stage: dpo" with the DPO block's other keys, as seed 001 says.
# PPO also: reward_model (the rm example's output), report_to (wandb -> none), max_completion_length. The DeepSpeed
# DPO block also: its `deepspeed:` key left out (the accelerate file picks DeepSpeed).

_DPO_HEAD = """\
model_name_or_path: tiny
trust_remote_code: true

stage: dpo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

"""
_DPO_DATA = """
dataset: dpo_en_demo
dataset_dir: data
template: chatml
cutoff_len: 64
max_samples: 16

output_dir: {output_dir}
"""
_DPO_TAIL = _DPO_DATA + """\
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
logging_steps: 10
save_steps: 500
plot_loss: true
"""
SEED_001_BLOCKS = {  # example -> YAML
    "train_lora/rm.yaml": """\
model_name_or_path: tiny
trust_remote_code: true

stage: rm
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

dataset: dpo_en_demo
dataset_dir: data
template: chatml
cutoff_len: 64
max_samples: 16

output_dir: {output_dir}
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 1.0
bf16: true
""",
    "train_lora/dpo.yaml": _DPO_HEAD + "pref_beta: 0.1\npref_loss: sigmoid\n" + _DPO_TAIL,
    "train_lora/orpo.yaml": _DPO_HEAD + "pref_loss: orpo\npref_beta: 0.1\n" + _DPO_TAIL,
    "train_lora/simpo.yaml": _DPO_HEAD + "pref_loss: simpo\npref_beta: 2.0\nsimpo_gamma: 0.5\n" + _DPO_TAIL,
    # seed 001 has per_device_train_batch_size: 1 x gradient_accumulation_steps: 8; rlhf's KTO needs >= 2 examples
    # per micro-batch (test_kto_batch_size_one_is_a_config_error), so: 2 x 4, the same 8 per step
    "train_lora/kto.yaml": """\
model_name_or_path: tiny
trust_remote_code: true

stage: kto
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

pref_beta: 0.1
kto_chosen_weight: 1.0
kto_rejected_weight: 1.0

dataset: kto_en_demo
dataset_dir: data
template: chatml
cutoff_len: 64
max_samples: 16

output_dir: {output_dir}
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 5.0e-6
num_train_epochs: 3.0
bf16: true
""",
    "train_lora/ppo.yaml": """\
model_name_or_path: tiny
trust_remote_code: true

stage: ppo
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

reward_model: outputs/examples/lora/rm
reward_model_type: lora

dataset: alpaca_en_demo
dataset_dir: data
template: chatml
cutoff_len: 64
max_samples: 16
max_completion_length: 32

output_dir: {output_dir}
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-6
num_train_epochs: 1.0
bf16: true
report_to: none
""",
    "multi_gpu/dpo_lora_ds3.yaml": _DPO_HEAD + "pref_beta: 0.1\npref_loss: sigmoid\n" + _DPO_DATA + """\
per_device_train_batch_size: 1
gradient_accumulation_steps: 4
learning_rate: 5.0e-6
num_train_epochs: 3.0
bf16: true
""",
}


@pytest.mark.parametrize("name", list(SEED_001_BLOCKS))
def test_seed_001_examples_are_its_blocks(name):
    path = REPO / "examples" / name
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#") and "seed 001" in text.split("\n\n")[0]
    output_dir = yaml.safe_load(text)["output_dir"]
    assert output_dir.startswith("outputs/examples/")
    assert yaml.safe_load(text) == yaml.safe_load(SEED_001_BLOCKS[name].format(output_dir=output_dir))
