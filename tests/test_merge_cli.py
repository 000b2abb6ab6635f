"""``python model_merging.py --config merge.yaml``: YAML configs, overrides, the summary, one-line errors with
exit status 2, and the example configs in configs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import model_merging as mm

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tiny_family(tmp_path):
    """Three bare checkpoints (one tensor each, no config) whose merges are easy to work out by hand."""
    values = {"base": [0.0, 0.0, 0.0, 0.0], "a": [1.0, -2.0, 0.5, 4.0], "b": [3.0, 2.0, -1.0, 0.0]}
    for name, value in values.items():
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor(value)}, str(tmp_path / name / "model.safetensors"))
    return tmp_path


def write_config(directory: Path, **data) -> Path:
    path = directory / "merge.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_merges_and_prints_a_summary(tiny_family, capsys):
    config = write_config(tiny_family, method="ties", base_model=str(tiny_family / "base"), density=0.5,
                          models=[str(tiny_family / "a"), {"model": str(tiny_family / "b"), "weight": 0.5}],
                          output_dir=str(tiny_family / "out"))
    assert mm.main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"merged 2 model(s) with ties onto {tiny_family / 'base'} into {tiny_family / 'out'}" in out
    assert "tensors: 1 merged, 0 copied | 1 shard(s)" in out
    # density 0.5 keeps 2 of 4: a -> [0, -2, 0, 4], b -> [3, 2, 0, 0]; signs (total) [+, 0 -> +, +, +];
    # agreeing: entry 0 only b (0.5 * 3), entry 1 only b (0.5 * 2, a's -2 disagrees), entry 3 only a (4)
    torch.testing.assert_close(load_file(str(tiny_family / "out" / "model.safetensors"))["w"],
                               torch.tensor([1.5, 1.0, 0.0, 4.0]))


def test_cli_overrides(tiny_family, capsys):
    config = write_config(tiny_family, method="task_arithmetic", base_model=str(tiny_family / "base"),
                          models=[str(tiny_family / "a"), str(tiny_family / "b")], output_dir=str(tiny_family / "out"))
    assert mm.main(["--config", str(config), "lambda=0.5", f"output_dir={tiny_family / 'other'}"]) == 0
    # 0.5 * (a + b) = 0.5 * [4, 0, -0.5, 4]
    torch.testing.assert_close(load_file(str(tiny_family / "other" / "model.safetensors"))["w"],
                               torch.tensor([2.0, 0.0, -0.25, 2.0]))
    assert not (tiny_family / "out").exists()


def test_cli_dry_run_writes_nothing(tiny_family, capsys):
    config = write_config(tiny_family, method="linear", models=[str(tiny_family / "a"), str(tiny_family / "b")],
                          output_dir=str(tiny_family / "out"))
    assert mm.main(["--config", str(config), "--dry-run"]) == 0
    assert "ok: 1 tensors from 2 checkpoints would be merged with linear" in capsys.readouterr().out
    assert not (tiny_family / "out").exists()


@pytest.mark.parametrize(("data", "extra", "message"), [
    ({"method": "ties", "desnity": 0.5}, [], r"merge.yaml:1: unknown key 'desnity'; did you mean 'density'\?"),
    ({"method": "ties"}, [], r"merge.yaml:1: method ties merges task vectors"),
    ({"method": "linear"}, ["oops"], r"^error: command line: override 'oops' must look like key=value"),
    ({"method": "linear"}, ["=3"], r"^error: command line: override '=3' must look like key=value"),
    ({"method": "linear", "models": ["missing-dir"]}, [], r"models\[0\] \(missing-dir\): directory not found"),
])
def test_cli_errors_are_one_line(tiny_family, capsys, data, extra, message):
    data = {"models": [str(tiny_family / "a")], "output_dir": str(tiny_family / "out"), **data}
    config = write_config(tiny_family, **data)
    assert mm.main(["--config", str(config), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err


@pytest.mark.parametrize(("overrides", "message"), [
    (["method=tiess"], r"^error: command line: method 'tiess' is not one of .*; did you mean 'ties'\?$"),
    (["density=1.5"], r"^error: command line: density must be in \(0.0, 1.0\], got 1.5$"),
    (["density=0"], r"^error: command line: density must be in \(0.0, 1.0\], got 0$"),
    (["desnity=0.3"], r"^error: command line: unknown key 'desnity'; did you mean 'density'\?$"),
    (["density=[1,"], r"^error: command line: density must be a number or a non-empty list"),  # kept as text
    (["lambda=x"], r"^error: command line: lambda must be a number"),
    (["base_model=null"], r"^error: command line: method ties merges task vectors"),
    (["models=[]"], r"^error: command line: models is empty"),
    (["output_dir="], r"^error: command line: output_dir is missing"),
])
def test_cli_override_mistakes_blame_the_command_line(tiny_family, capsys, overrides, message):
    config = write_config(tiny_family, method="ties", base_model=str(tiny_family / "base"), density=0.5,
                          models=[str(tiny_family / "a")], output_dir=str(tiny_family / "out"))
    assert_one_line_error(mm.main(["--config", str(config), *overrides]), capsys.readouterr().err, message)
    assert not (tiny_family / "out").exists()


def test_cli_file_mistakes_keep_the_file_name(tiny_family, capsys):
    config = write_config(tiny_family, method="ties", base_model=str(tiny_family / "base"), density=1.5,
                          models=[str(tiny_family / "a")], output_dir=str(tiny_family / "out"))
    assert_one_line_error(mm.main(["--config", str(config), "lambda=0.5", "method=dare_ties"]), capsys.readouterr().err,
                          rf"^error: {re.escape(str(config))}:2: density must be in \(0.0, 1.0\], got 1.5$")


def test_cli_missing_config_file(capsys, tmp_path):
    assert mm.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.yaml'}: config file not found\n"


def test_cli_config_file_problems(capsys, tmp_path):
    assert_one_line_error(mm.main(["--config", str(tmp_path)]), capsys.readouterr().err,
                          rf"^error: {re.escape(str(tmp_path))}: is a directory; give the merge YAML file")
    assert_one_line_error(mm.main(["--config", ""]), capsys.readouterr().err, r"^error: the config path is empty")
    (tmp_path / "twice.yaml").write_text("method: ties\ndensity: 0.5\ndensity: 0.3\n")
    assert_one_line_error(mm.main(["--config", str(tmp_path / "twice.yaml")]), capsys.readouterr().err,
                          r"twice\.yaml:3: duplicate key 'density' \(first at line 2\); keep one$")
    (tmp_path / "latin1.yaml").write_bytes(b"method: t\xe9\n")
    assert_one_line_error(mm.main(["--config", str(tmp_path / "latin1.yaml")]), capsys.readouterr().err,
                          r"latin1\.yaml: not UTF-8 text")


def test_cli_output_dir_and_model_paths_checked_up_front(tiny_family, capsys):
    (tiny_family / "file").write_text("x")
    config = write_config(tiny_family, method="linear", models=[str(tiny_family / "a")],
                          output_dir=str(tiny_family / "file" / "out"))
    assert_one_line_error(mm.main(["--config", str(config)]), capsys.readouterr().err,
                          r"output_dir \S+out cannot be created \(\S+file is a file\); choose another output_dir$")
    assert_one_line_error(mm.main(["--config", str(config), f"models=[{tiny_family / 'file'}]",
                                   f"output_dir={tiny_family / 'out'}"]), capsys.readouterr().err,
                          r"models\[0\] \(\S+file\): is a file, not a model directory$")


def test_script_entry_point_exits_2_on_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("method: [unclosed\n")
    proc = subprocess.run([sys.executable, str(REPO / "model_merging.py"), "--config", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {tmp_path / 'bad.yaml'}:2: invalid YAML") and "Traceback" not in proc.stderr


def test_example_configs_cover_every_method():
    configs = sorted((REPO / "configs").glob("merge_*.yaml"))
    loaded = {path.name: mm.MergeConfig.from_yaml(path) for path in configs}
    assert {c.method for c in loaded.values()} == set(mm.MERGE_METHODS)
    for name, config in loaded.items():
        assert config.output_dir.startswith("outputs/merged/"), name
        assert config.unused_fields() == [], name  # every key in an example means something to its method


def test_help_lists_every_config_key():
    """`--help` explains each MergeConfig key once (YAML names: lambda, not lambda_)."""
    import dataclasses

    keys = {"lambda" if f.name == "lambda_" else f.name for f in dataclasses.fields(mm.MergeConfig)}
    listed = {line.split()[0] for line in mm.CONFIG_KEYS_HELP.splitlines()[1:]
              if line.startswith("  ") and not line.startswith("   ")}
    assert listed == keys
