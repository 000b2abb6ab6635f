"""The command line as a user runs it: ``python rlhf.py ...`` in a subprocess.

Every bad input must end with exit status 2 and ONE line on stderr that starts with ``error:``,
names the file:line (exact line number) or the config field, and shows no traceback. Happy paths
check the files a run leaves behind (report.json, the model in Hugging Face layout, metrics,
logs) and the printed summary.

Each CLI call pays the torch/transformers import (seconds of CPU), so the subprocesses of all the
tests selected in this session are started together by one pool (``cli`` fixture) and each test
only waits for and checks its own result. The embedded tiny model is built once, in this process,
into RLHF_CACHE, which the subprocesses inherit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import rlhf

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "rlhf.py"
DEMO = REPO / "data" / "demo"
TIMEOUT_S = 600

# A small, fast SFT run; cases append the one thing they get wrong.
SMALL_RUN = ["model_name_or_path=tiny", "finetuning_type=full", "max_steps=1", "report_to=none",
             "disable_progress_bar=true", "cutoff_len=128", "per_device_train_batch_size=4"]

GOOD = [{"prompt": "What is 12 + 3?", "response": "12 + 3 = 15\nAnswer: 15"},
        {"prompt": "What is 40 - 7?", "response": "40 - 7 = 33\nAnswer: 33"},
        {"prompt": "What is 21 + 5?", "response": "21 + 5 = 26\nAnswer: 26"},
        {"prompt": "What is 66 - 2?", "response": "66 - 2 = 64\nAnswer: 64"}]


def _jsonl(*lines: object) -> str:
    """File text, one JSON record per line; a str is written verbatim (malformed or blank lines)."""
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)


# name of a file in the work directory -> its text
FILES: dict[str, str] = {
    # the bad line of each data file is the one the test expects in the error (1-based)
    "bad_json.jsonl": _jsonl(GOOD[0], GOOD[1], '{"prompt": "What is 1 + 1?", "response": }', GOOD[2]),
    "missing_response.jsonl": _jsonl(GOOD[0], GOOD[1], GOOD[2], {"prompt": "What is 9 + 9?"}, GOOD[3]),
    "wrong_type.jsonl": _jsonl(GOOD[0], {"prompt": "What is 2 + 2?", "response": 4}, GOOD[1]),
    "empty_response.jsonl": _jsonl(GOOD[0], GOOD[1], "", GOOD[2], {"prompt": "What is 3 + 3?", "response": ""}),
    "unknown_format.jsonl": _jsonl(GOOD[0], GOOD[1], {"foo": "What is 5 + 5?", "bar": "10"}),
    "invalid.yaml": "model_name_or_path: tiny\nlearning_rate: 1.0e-4\ntemplate: chatml: extra\nmax_steps: 1\n",
    "stage_dpo.yaml": "stage: dpo\nmodel_name_or_path: tiny\nfinetuning_type: full\nmax_steps: 1\n",
    "stage_unknown.yaml": "stage: rlhf_magic\nmodel_name_or_path: tiny\nmax_steps: 1\n",
    "pipeline_typo.yaml": "stages: [sft]\noutput_dir: pipe-typo\nsft:\n  lerning_rate: 1.0e-3\n",
    "pipeline.yaml": f"""\
stages: [sft]
output_dir: pipe
model_name_or_path: tiny
dataset_dir: {DEMO}
cutoff_len: 128
report_to: none
disable_progress_bar: true
sft:
  dataset: demo_sft
  max_samples: 16
  finetuning_type: full
  per_device_train_batch_size: 4
  max_steps: 2
""",
    # LLaMA-Factory style (examples/train_full/*.yaml): section comments, `stage:`, HF Trainer keys
    "llamafactory.yaml": f"""\
### model
model_name_or_path: tiny
trust_remote_code: false

### method
stage: sft
do_train: true
finetuning_type: full

### dataset
dataset: demo_sft
dataset_dir: {DEMO}
template: chatml
cutoff_len: 128
max_samples: 16
overwrite_cache: true
preprocessing_num_workers: 1

### output
output_dir: lf-out
logging_steps: 1
save_steps: 500
plot_loss: false
overwrite_output_dir: true
save_strategy: steps

### train
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
num_train_epochs: 1.0
max_steps: 2
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: false
ddp_timeout: 180000000
report_to: none
disable_progress_bar: true
""",
}


@dataclasses.dataclass
class Run:
    argv: list[str]  # arguments after rlhf.py
    cwd: str = "work"  # "work" (the per-session directory holding FILES) or "repo"
    heavy: bool = False  # loads a model: started first


def _abs_out(name: str) -> str:
    return f"output_dir=@WORK@/{name}"


RUNS: dict[str, Run] = {
    # -- bad data: file:line
    "malformed_jsonl": Run(["sft", "dataset=bad_json.jsonl", "dataset_dir=.", _abs_out("o-json"), *SMALL_RUN],
                           heavy=True),
    "missing_field": Run(["sft", "dataset=missing_response.jsonl", "dataset_dir=.", _abs_out("o-missing"), *SMALL_RUN],
                         heavy=True),
    "wrong_type": Run(["sft", "dataset=wrong_type.jsonl", "dataset_dir=.", _abs_out("o-type"), *SMALL_RUN], heavy=True),
    "empty_completion": Run(["sft", "dataset=empty_response.jsonl", "dataset_dir=.", _abs_out("o-empty"), *SMALL_RUN],
                            heavy=True),
    "unknown_format": Run(["sft", "dataset=unknown_format.jsonl", "dataset_dir=.", _abs_out("o-format"), *SMALL_RUN],
                          heavy=True),
    # -- bad config: the field (or file:line)
    "missing_model": Run(["sft", f"dataset={DEMO / 'sft.jsonl'}", "dataset_dir=.", _abs_out("o-model"),
                          *SMALL_RUN, "model_name_or_path=/no/such/model"], heavy=True),
    "unknown_key": Run(["sft", "dataset=demo_sft", f"dataset_dir={DEMO}", _abs_out("o-key"), *SMALL_RUN,
                        "lerning_rate=1e-3"]),
    "invalid_value": Run(["sft", "dataset=demo_sft", f"dataset_dir={DEMO}", _abs_out("o-lr"), *SMALL_RUN,
                          "learning_rate=-1"]),
    "missing_config": Run(["sft", "--config", "missing.yaml", "dataset=demo_sft"]),
    "invalid_yaml": Run(["sft", "--config", "invalid.yaml", "dataset=demo_sft"]),
    "stage_mismatch": Run(["sft", "--config", "stage_dpo.yaml", "dataset=demo_sft"]),
    "train_unknown_stage": Run(["train", "--config", "stage_unknown.yaml"]),
    "pipeline_stage_typo": Run(["pipeline", "--config", "pipeline_typo.yaml"]),
    # -- help
    "help": Run(["--help"]),
    "sft_help": Run(["sft", "--help"]),
    "pipeline_help": Run(["pipeline", "--help"]),
    # -- happy paths
    "sft_run": Run(["sft", "dataset=demo_sft", "dataset_dir=data/demo", "max_samples=64", "val_size=8", "max_steps=3",
                    "model_name_or_path=tiny", "finetuning_type=full", "per_device_train_batch_size=8",
                    "cutoff_len=128", "logging_steps=1", "report_to=none", "disable_progress_bar=true",
                    _abs_out("sft-run")],
                   cwd="repo", heavy=True),
    "train_llamafactory": Run(["train", "--config", "llamafactory.yaml"], heavy=True),
    "pipeline_run": Run(["pipeline", "--config", "pipeline.yaml"], heavy=True),
}

# test function -> the runs it reads (parametrised tests name theirs in the `case` parameter)
RUNS_OF_TEST = {
    "test_top_level_help": ["help"],
    "test_sft_help_lists_every_config_field": ["sft_help"],
    "test_pipeline_help": ["pipeline_help"],
    "test_sft_run_writes_report_model_metrics_and_logs": ["sft_run"],
    "test_train_reads_stage_from_llamafactory_yaml": ["train_llamafactory"],
    "test_pipeline_run": ["pipeline_run"],
}


def cli_env() -> dict[str, str]:
    env = dict(os.environ)  # RLHF_CACHE (set by conftest) points at the tiny model built in this session
    env.update(COLUMNS="400", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


class CLIPool:
    """Starts the selected CLI runs concurrently; ``result(name)`` waits for one."""

    def __init__(self, names: list[str], work: Path) -> None:
        self.work = work
        self.futures: dict[str, Future] = {}
        self.executor = ThreadPoolExecutor(max_workers=min(6, max(1, len(names))))
        for name in sorted(names, key=lambda n: not RUNS[n].heavy):  # model-loading runs first
            self.futures[name] = self.executor.submit(self._run, RUNS[name])

    def _run(self, run: Run) -> subprocess.CompletedProcess:
        argv = [a.replace("@WORK@", str(self.work)) for a in run.argv]
        return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=self.work if run.cwd == "work" else REPO,
                              env=cli_env(), capture_output=True, text=True, timeout=TIMEOUT_S)

    def result(self, name: str) -> subprocess.CompletedProcess:
        if name not in self.futures:  # not pre-selected (e.g. a test called from another): run it now
            self.futures[name] = self.executor.submit(self._run, RUNS[name])
        return self.futures[name].result()


@pytest.fixture(scope="session")
def cli(request, tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("cli")
    for name, text in FILES.items():
        (work / name).write_text(text, encoding="utf-8")
    wanted: set[str] = set()
    for item in request.session.items:
        if item.path != Path(__file__):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "case" in callspec.params:
            wanted.add(callspec.params["case"])
        wanted.update(RUNS_OF_TEST.get(getattr(item, "originalname", item.name), []))
    pool = CLIPool(sorted(wanted), work)
    yield pool
    pool.executor.shutdown(wait=True, cancel_futures=True)


def _describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Exit 2, no traceback, and the error is the last line of stderr, alone; returns it."""
    assert proc.returncode == 2, _describe(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, _describe(proc)
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, _describe(proc)
    assert lines[-1] == errors[0], "the error message continues on more lines:\n" + _describe(proc)
    return errors[0]


# case -> patterns (regular expressions) the error line must contain
BAD_INPUT = {
    "malformed_jsonl": [r"bad_json\.jsonl:3\b", r"invalid JSON"],
    "missing_field": [r"missing_response\.jsonl:4\b", r"response"],
    "wrong_type": [r"wrong_type\.jsonl:2\b", r"'response'", r"string", r"\bint\b"],
    "empty_completion": [r"empty_response\.jsonl:5\b", r"empty"],
    "unknown_format": [r"unknown_format\.jsonl:3\b", r"unknown record format", r"\bfoo\b", r"\bbar\b"],
    "missing_model": [r"'model_name_or_path'", r"/no/such/model"],
    "unknown_key": [r"'lerning_rate'", re.escape("did you mean 'learning_rate'")],
    "invalid_value": [r"'learning_rate'", r"> 0"],
    "missing_config": [r"missing\.yaml", r"does not exist"],
    "invalid_yaml": [r"invalid\.yaml:3\b", r"invalid YAML"],
    "stage_mismatch": [r"stage_dpo\.yaml", r"\bstage\b", r"\bdpo\b", r"'sft'"],
    "train_unknown_stage": [r"stage_unknown\.yaml", r"'stage'", r"'rlhf_magic'",
                            r"valid: sft, rm, prm, dpo, .*grpo, .*ppo"],
    "pipeline_stage_typo": [r"pipeline_typo\.yaml", r"'lerning_rate'", re.escape("did you mean 'learning_rate'")],
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_error(cli, case):
    error = assert_one_line_error(cli.result(case))
    for pattern in BAD_INPUT[case]:
        assert re.search(pattern, error), f"{pattern!r} not in: {error}"


def test_top_level_help(cli):
    proc = cli.result("help")
    assert proc.returncode == 0, _describe(proc)
    for command in ("sft", "pipeline", "train"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.M), proc.stdout


def test_sft_help_lists_every_config_field(cli):
    proc = cli.result("sft_help")
    assert proc.returncode == 0, _describe(proc)
    listed = set(re.findall(r"^\s{2}(\w+)\s", proc.stdout, re.M))
    fields = {f.name for f in dataclasses.fields(rlhf.SFTConfig)}
    assert fields <= listed, f"missing from `sft --help`: {sorted(fields - listed)}"
    assert "--config" in proc.stdout


def test_pipeline_help(cli):
    proc = cli.result("pipeline_help")
    assert proc.returncode == 0, _describe(proc)
    assert "--config" in proc.stdout and "stages" in proc.stdout
    listed = set(re.findall(r"^\s{2}(\w+)\s", proc.stdout, re.M))
    assert {f.name for f in dataclasses.fields(rlhf.SFTConfig)} <= listed


def _report(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def test_sft_run_writes_report_model_metrics_and_logs(cli):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = cli.result("sft_run")
    assert proc.returncode == 0, _describe(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    out = cli.work / "sft-run"
    report = _report(out / "report.json")
    assert [entry["stage"] for entry in report["stages"]] == ["sft"]
    entry = report["stages"][0]
    assert isinstance(entry["seconds"], (int, float)) and entry["seconds"] > 0
    assert entry["global_step"] == 3 and entry["metrics"]["steps"] == 3
    assert math.isfinite(entry["metrics"]["train_loss"])
    assert entry["metrics"]["data/records"] == 64 - 8  # val_size=8 held out
    assert math.isfinite(entry["eval"]["eval/loss"]) and entry["eval"]["eval/perplexity"] > 1

    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "config.yaml"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [row for row in rows if "loss" in row]
    assert [row["step"] for row in losses] == [1, 2, 3]  # logging_steps=1
    assert all(row["perf/tokens_per_s"] > 0 and math.isfinite(row["loss"]) for row in losses)
    log = (out / "logs" / "sft.log").read_text()
    assert "trainable parameters" in log

    assert "rlhf run summary" in proc.stdout
    assert re.search(r"│\s*sft\s*│.*│\s*3\s*│", proc.stdout), proc.stdout


def test_train_reads_stage_from_llamafactory_yaml(cli):
    proc = cli.result("train_llamafactory")
    assert proc.returncode == 0, _describe(proc)
    out = cli.work / "lf-out"  # relative output_dir: relative to where the command runs
    report = _report(out / "report.json")
    assert [entry["stage"] for entry in report["stages"]] == ["sft"]
    assert report["stages"][0]["global_step"] == 2
    assert (out / "model.safetensors").is_file()
    assert "ignoring 'do_train'" in proc.stdout + proc.stderr  # LLaMA-Factory keys are explained, not fatal
    assert "rlhf run summary" in proc.stdout


# -- regressions for bugs these tests found (now fixed in rlhf.py): LLaMA-Factory's `resume_from_checkpoint: null`,
# unregistered OpenAI {"messages"} files, and unreadable files escaping as tracebacks. They call the same entry
# point in-process (rlhf.main, what `python rlhf.py` runs) so that they cost a fraction of a subprocess.


def _main_in(directory: Path, argv: list[str], monkeypatch) -> int:
    monkeypatch.chdir(directory)
    return rlhf.main(argv)


def test_llamafactory_resume_from_checkpoint_null(tmp_path, tiny_model_dir, monkeypatch, capsys):
    config = tmp_path / "llamafactory.yaml"
    text = FILES["llamafactory.yaml"].replace("overwrite_output_dir: true\n", "") + "resume_from_checkpoint: null\n"
    config.write_text(text, encoding="utf-8")
    status = _main_in(tmp_path, ["train", "--config", str(config), "max_steps=1", "gradient_accumulation_steps=1"],
                      monkeypatch)
    assert status == 0, capsys.readouterr().err
    assert (tmp_path / "lf-out" / "model.safetensors").is_file()


def test_train_file_without_a_stage_key(tmp_path, monkeypatch, capsys):
    config = tmp_path / "nostage.yaml"
    config.write_text("learning_rate: 1.0e-4\n", encoding="utf-8")
    assert _main_in(tmp_path, ["train", "--config", str(config)], monkeypatch) == 2
    error = capsys.readouterr().err
    assert "has no 'stage:' key" in error and "Traceback" not in error


def test_openai_messages_file_without_registration(tmp_path, tiny_model_dir, monkeypatch, capsys):
    rows = [{"messages": [{"role": "user", "content": g["prompt"]}, {"role": "assistant", "content": g["response"]}]}
            for g in GOOD]
    (tmp_path / "openai.jsonl").write_text(_jsonl(*rows), encoding="utf-8")
    status = _main_in(tmp_path, ["sft", "dataset=openai.jsonl", "dataset_dir=.", "output_dir=out", *SMALL_RUN],
                      monkeypatch)
    assert status == 0, capsys.readouterr().err


UNREADABLE = {  # file name -> bytes a user may well have
    "latin1.jsonl": (_jsonl(GOOD[0]) + '{"prompt": "caf\xe9?", "response": "ok"}\n').encode("latin-1"),
    "corrupt.parquet": b"PAR1 this is not a parquet file",
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_unreadable_data_file_is_one_line_error(tmp_path, tiny_model_dir, monkeypatch, capsys, name):
    (tmp_path / name).write_bytes(UNREADABLE[name])
    status = _main_in(tmp_path, ["sft", f"dataset={name}", "dataset_dir=.", "output_dir=out", *SMALL_RUN], monkeypatch)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and error.startswith("error:") and name in error, error


def test_pipeline_run(cli):
    proc = cli.result("pipeline_run")
    assert proc.returncode == 0, _describe(proc)
    root = cli.work / "pipe"
    report = _report(root / "report.json")
    assert [entry["stage"] for entry in report["stages"]] == ["sft"]
    assert report["stages"][0]["global_step"] == 2
    assert (root / "sft" / "model.safetensors").is_file()
    assert (root / "pipeline_config.yaml").is_file()
    assert "pipeline summary" in proc.stdout


@pytest.mark.skipif(shutil.which("rlhf") is None, reason="console script `rlhf` not installed (pip install -e .)")
def test_console_script(tmp_path):
    exe = shutil.which("rlhf")
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, env=cli_env(), cwd=tmp_path,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "pipeline" in proc.stdout, _describe(proc)
    proc = subprocess.run([exe, "sft", "lerning_rate=1e-3"], capture_output=True, text=True, env=cli_env(),
                          cwd=tmp_path, timeout=TIMEOUT_S)
    assert "did you mean 'learning_rate'" in assert_one_line_error(proc)


@pytest.mark.parametrize("stage", sorted(rlhf.STAGE_CONFIGS))
def test_every_stage_help_lists_its_fields(stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rlhf.main([stage, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listed = set(re.findall(r"^\s{2}(\w+)\s", out, re.M))
    fields = {f.name for f in dataclasses.fields(rlhf.STAGE_CONFIGS[stage])}
    assert fields <= listed, f"missing from `{stage} --help`: {sorted(fields - listed)}"


@pytest.mark.parametrize("name", ["grpo", "ppo", "prm"])
def test_example_stage_configs_load(repo, name):
    config = rlhf.load_config(rlhf.STAGE_CONFIGS[name], repo / "configs" / f"{name}.yaml")
    assert config.stage == name
    if name == "ppo":  # a separate critic (the demo's reward model): a head on the policy retrains it
        assert config.value_model == "outputs/demo/rm"
    if name == "prm":  # the reward model's 12,000 pairs, held out by prompt, labelled by the demo's verifier
        assert (config.dataset, config.val_split_by_prompt, config.prm_step_labeler) == ("demo_rm", True, "arithmetic")


def test_merge_command_runs_model_merging(tmp_path, capsys):
    """``rlhf.py merge --config FILE`` is model_merging's command: same merge, same one-line errors."""
    import torch
    import yaml
    from safetensors.torch import load_file, save_file

    for name, value in {"base": [0.0, 0.0], "a": [1.0, -2.0], "b": [3.0, 2.0]}.items():
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(value)}, str(tmp_path / name / "model.safetensors"))
    config = tmp_path / "merge.yaml"
    config.write_text(yaml.safe_dump({"method": "task_arithmetic", "base_model": str(tmp_path / "base"),
                                      "models": [str(tmp_path / "a"), str(tmp_path / "b")],
                                      "output_dir": str(tmp_path / "out")}))
    assert rlhf.main(["merge", "--config", str(config), "lambda=0.5", "--dry-run"]) == 0
    assert not (tmp_path / "out").exists()
    assert rlhf.main(["merge", "--config", str(config), "lambda=0.5"]) == 0
    torch.testing.assert_close(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], torch.tensor([2.0, 0.0]))
    assert rlhf.main(["merge", "--config", str(config), "desnity=0.5"]) == 2
    assert "did you mean 'density'" in capsys.readouterr().err


def test_a_template_that_refuses_a_record_is_one_line_naming_its_file_and_line(tmp_path, tiny_model_dir, monkeypatch,
                                                                                 capsys):
    """Gemma 2's own template raises 'System role not supported': the SFT stage reports it as file:line, no
    jinja traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = rlhf.load_tokenizer(model)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}"
                               "{% endif %}" + rlhf.CHAT_TEMPLATES["chatml"])
    tokenizer.save_pretrained(model)
    rows = [GOOD[0], {**GOOD[1], "system": "Be brief."}]
    (tmp_path / "data.jsonl").write_text(_jsonl(*rows), encoding="utf-8")
    status = _main_in(tmp_path, ["sft", "dataset=data.jsonl", "dataset_dir=.", "output_dir=out",
                                 f"model_name_or_path={model}", *SMALL_RUN[1:]], monkeypatch)
    error = capsys.readouterr().err
    assert status == 2 and "Traceback" not in error
    assert re.search(r"data\.jsonl:2: chat template 'tokenizer' refuses this record: System role not supported", error)
