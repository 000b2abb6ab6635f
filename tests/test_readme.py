"""The README runs as written. Every ```python block is run verbatim, in order, as its own script in a scratch copy
of the checkout (each block may use the models the ones before it wrote, as the README says); the five-minute
section's files are written from its blocks, loaded, and its commands run; the cheap shell commands (``--help``,
``plan``) run and the memory table the README shows is the one ``plan`` prints; every path the README names
exists; the CI markers still give CI its commands. The examples keep their own step counts small, so this is a
real run of each one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

import rlhf

README = REPO / "README.md"
TEXT = README.read_text(encoding="utf-8")
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)
# the five-minute section's datasets and the record kind each is meant for
OWN_DATA_KINDS = {"my_sft": "sft", "my_chat": "sft", "my_pairs": "preference", "my_kto": "kto", "my_prompts": "prompt"}


def blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(offset, body) of every fenced block whose info string starts with ``language`` ('' = no language)."""
    found = []
    for match in FENCE.finditer(text):
        info = match.group("info").strip()
        if (info.split() or [""])[0] == language:
            found.append((match.start(), match.group("body")))
    return found


def section(title: str) -> str:
    start = TEXT.index(f"\n## {title}\n")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end if end > 0 else len(TEXT)]


def commands(body: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comment-only lines dropped."""
    return [line for line in body.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def scratch_checkout(root: Path) -> Path:
    """What the README's commands read: the modules, configs, examples and data (a copy: nothing may write there)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("rlhf.py", "inference_optimizations.py", "model_merging.py", "configs", "examples"):
        (root / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "data", root / "data")
    return root


def run(command: str | list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "160"}
    result = subprocess.run(command, cwd=cwd, env=env, shell=isinstance(command, str), capture_output=True, text=True,
                            timeout=timeout, executable="/bin/bash" if isinstance(command, str) else None)
    assert result.returncode == 0, (f"README command failed ({result.returncode}): {command}\n"
                                    + (result.stdout + result.stderr)[-4000:])
    return result


def test_ci_markers_give_the_install_and_test_commands():
    printed = subprocess.run([sys.executable, str(REPO / ".ci" / "readme_commands.py"), str(README)],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert printed[0].startswith("python -m venv .venv")
    assert "pip install -r requirements.txt -c constraints.txt" in printed
    assert "pip install -r requirements-dev.txt -c constraints.txt" in printed
    assert printed[-1] == "pytest"


def test_demo_table_markers_hold_one_fenced_block():
    start, end = TEXT.index("<!-- demo-table -->\n"), TEXT.index("<!-- /demo-table -->")
    inside = TEXT[start + len("<!-- demo-table -->\n"):end]
    assert inside.startswith("```") and inside.rstrip().endswith("```") and inside.count("```") == 2
    assert start < TEXT.index("\n## Your own data")  # in the quick start


def test_every_path_the_readme_names_exists():
    named = set(re.findall(r"`((?:configs|examples|data|experiments|bench|scripts|docs|tests)/[\w./-]*)`", TEXT))
    named |= {m for m in re.findall(r"\]\(((?:docs|examples|data|experiments)/[^)#\s]*)", TEXT)}
    named |= set(re.findall(r"(?:^|\s)((?:configs|examples|data)/[\w/-]+\.(?:ya?ml|jsonl?))", TEXT, re.M))
    missing = sorted(path for path in named if "<" not in path and not (REPO / path).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"
    assert len(TEXT.splitlines()) <= 420, "README.md is a user's guide: keep it near 400 lines, move the rest to docs/"


def test_own_data_section_loads_and_trains(tmp_path):
    root = scratch_checkout(tmp_path / "checkout")
    own = section("Your own data in five minutes")
    written = []
    for language in ("json", "yaml"):
        for offset, body in blocks(own, language):
            paragraph = own[:offset].rstrip("\n").split("\n\n")[-1]
            name = next(n for n in re.findall(r"`([^`\s]+)`", paragraph)
                        if re.fullmatch(r"[\w./-]+\.(jsonl?|ya?ml)", n))
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
            written.append(name)
    assert "my_dpo.yaml" in written and "my_data/dataset_info.json" in written
    info = json.loads((root / "my_data" / "dataset_info.json").read_text())
    assert set(info) == set(OWN_DATA_KINDS)
    for name, kind in OWN_DATA_KINDS.items():  # every record shown loads as the kind its stage reads
        records = rlhf.load_records(name, root / "my_data", kind)
        raw = (root / "my_data" / info[name]["file_name"]).read_text()
        expected = len(json.loads(raw)) if raw.lstrip().startswith("[") else len(raw.strip().splitlines())
        assert len(records) == expected, (name, records)
    config = rlhf.load_config(rlhf.DPOConfig, root / "my_dpo.yaml")  # every key the YAML shows is one the loader takes
    assert (config.finetuning_type, config.dataset, config.dataset_dir) == ("lora", "my_pairs", "my_data")
    (shell,) = [body for _, body in blocks(own, "bash")]
    for command in commands(shell):
        run(command, root)
    assert (root / "outputs" / "my_dpo" / "adapter_config.json").exists()


def test_cheap_shell_commands(tmp_path):
    root = scratch_checkout(tmp_path / "checkout")
    cheap = [c for _, body in blocks(TEXT, "bash") for c in commands(body)
             if re.match(r"python rlhf\.py (plan |.*--help$)", c)]
    cheap += [c for c in re.findall(r"`(python rlhf\.py [^`]*--help)`", TEXT) if not re.search(r"[A-Z]{3,}", c)]
    assert any(" plan " in c for c in cheap) and any(c.endswith("--help") for c in cheap)
    outputs = {command: run(command, root).stdout for command in dict.fromkeys(cheap)}
    shown = next(body for _, body in blocks(TEXT, "") if "GiB per GPU" in body)
    preset, gpus = re.search(r"\((\d+\.\d)B\), lora, (\d+) GPU", shown).groups()
    command = next(c for c in outputs
                   if " plan " in c and f"--gpus {gpus}" in c and ("70b" if preset == "70.6" else "7b") in c)
    totals = re.search(r"^ total\s+(.*)$", shown, re.M).group(1).split()
    printed = re.search(r"total\D*([\d.]+(?:\D+[\d.]+)*)", outputs[command]).group(0)
    assert re.findall(r"\d+\.\d", printed) == totals, (f"README's plan table differs from `{command}`:\n"
                                                       f"{outputs[command]}")


def test_python_examples_run_as_written(tmp_path):
    root = scratch_checkout(tmp_path / "checkout")
    examples = [body for _, body in blocks(TEXT, "python")]
    assert len(examples) >= 4
    for number, body in enumerate(examples):
        script = root / f"readme_example_{number}.py"
        script.write_text(body, encoding="utf-8")
        run([sys.executable, script.name], root)
    assert (root / "outputs" / "api" / "report.json").exists()
    assert (root / "outputs" / "api" / "ties" / "model.safetensors").exists()


@pytest.mark.parametrize("page", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md")))
def test_docs_links_resolve(page):
    """Relative links between the docs pages (and from them to the checkout) point at files that exist."""
    path = REPO / page
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    missing = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not missing, f"{page} links to missing files: {missing}"
