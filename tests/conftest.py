"""Shared fixtures: a per-session model cache and tiny models of several architectures.

No model is ever downloaded: every model is built from a config with the embedded tokenizer
(trained on data/demo) and saved/reloaded through ``from_pretrained``, as users' models are.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RLHF_CACHE", tempfile.mkdtemp(prefix="rlhf-test-cache-"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import inference_optimizations  # noqa: E402
import rlhf  # noqa: E402

# the CLI's AVX2 kernels, before any test runs a torch operation: the numeric thresholds below then hold on
# every x86-64 machine, not just on CPUs that round like the one they were measured on
inference_optimizations.pin_cpu_kernels()
torch.set_num_threads(min(2, torch.get_num_threads()))



def load_script(relative_path: str) -> types.ModuleType:
    """Import a file of bench/, experiments/ or scripts/, which are scripts rather than packages. bench/ and
    experiments/ go on sys.path first, as each is for a script run from it: the scripts import bench/tables.py
    and experiments/stats.py (and the repository root and scripts/, which they put on sys.path themselves)."""
    for folder in ("bench", "experiments"):
        if str(REPO / folder) not in sys.path:
            sys.path.insert(0, str(REPO / folder))
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

_MISSING = object()


def _torch_config_values(module_name: str) -> dict[str, object]:
    """Every entry of a torch config module as code reads it (``getattr``): an entry that a ``delattr`` hid reads
    as missing, which ``get_config_copy`` would not show."""
    module = sys.modules.get(module_name)
    if module is None:
        return {}
    with warnings.catch_warnings():  # reading a deprecated entry warns
        warnings.simplefilter("ignore")
        return {name: getattr(module, name, _MISSING) for name in module._config}


# environment variables pytest sets per test, and ones torch's compiler records on its first use (its cache folders,
# CUDA tool paths, internal flags) and the address of the service wandb starts: theirs, not a test's doing
_SET_BY_OTHERS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "WANDB_SERVICE")


def _global_state() -> dict[str, object]:
    """Process-wide settings a test, or a library call inside it, could leave changed for every later test."""
    rlhf_logger = logging.getLogger("rlhf")
    return {
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch inference mode": torch.is_inference_mode_enabled(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch anomaly detection": torch.is_anomaly_enabled(),
        "torch float32 matmul precision": torch.get_float32_matmul_precision(),
        "torch threads": torch.get_num_threads(),
        "torch._dynamo.config": _torch_config_values("torch._dynamo.config"),
        "torch._inductor.config": _torch_config_values("torch._inductor.config"),
        "environment variables": {k: v for k, v in os.environ.items() if not k.startswith(_SET_BY_OTHERS)},
        "run folders locked": sorted(rlhf.RunFolderLock.held),  # a run that ended, however, lets go of its folder
        "'rlhf' logger": (rlhf_logger.level, rlhf_logger.propagate,  # pytest's own handlers come and go per phase
                          [h for h in rlhf_logger.handlers if not type(h).__module__.startswith("_pytest")]),
    }


def _changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    changed = []
    for name, old in before.items():
        new = after[name]
        if isinstance(old, dict):
            keys = sorted(k for k in old.keys() | new.keys() if old.get(k, _MISSING) is not new.get(k, _MISSING)
                          and old.get(k, _MISSING) != new.get(k, _MISSING))
            keys = [k for k in keys if not (name.startswith("torch._") and (k not in old or k not in new))]
            if keys:
                changed.append(f"{name}: {', '.join(map(str, keys))}")
        elif old != new:
            changed.append(f"{name}: {old!r} -> {new!r}")
    return changed


@pytest.fixture(autouse=True)
def leaves_global_state_alone():
    """Every test must leave the process as it found it, so the suite passes in any order: a setting one test
    (or a library call) flips would otherwise change what every later test runs."""
    before = _global_state()
    yield
    changed = _changes(before, _global_state())
    if changed:
        pytest.fail("the test changed process-wide state: " + "; ".join(changed), pytrace=False)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded default model (built once per session into RLHF_CACHE)."""
    return rlhf.build_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    return rlhf.load_tokenizer(tiny_model_dir)


def _tiny_config(arch: str, tokenizer):
    from transformers import GPT2Config, LlamaConfig, MambaConfig, Qwen2Config

    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **common)
    if arch == "mamba":
        return MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, **common)
    raise ValueError(arch)


ARCHITECTURES = ("llama", "qwen2", "gpt2", "mamba")


@pytest.fixture(scope="session")
def tiny_arch_dir(tmp_path_factory, tiny_tokenizer):
    """Factory: ``tiny_arch_dir("gpt2")`` -> a saved tiny model directory of that architecture."""
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch, tiny_tokenizer))
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            built[arch] = path
        return built[arch]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_arch_dir) -> Path:
    """The tiny Llama most trainer tests start from."""
    return tiny_arch_dir("llama")


@pytest.fixture(scope="session")
def demo_dir(repo) -> Path:
    return repo / "data" / "demo"


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, tiny_model_dir, demo_dir) -> Path:
    """The embedded model after 40 SFT steps on the demo: SFT loss 2.33 on its first 64 records, and the
    'Answer:' line on every multistep probe (the EWC and orchestrator tests start from it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that use it train (their figures were measured so)
    try:
        out = tmp_path_factory.mktemp("sft-40-steps")
        rlhf.train_sft(rlhf.SFTConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_sft",
                                      dataset_dir=str(demo_dir), max_samples=256, cutoff_len=96, finetuning_type="full",
                                      per_device_train_batch_size=16, max_steps=40, learning_rate=1e-3, save_steps=0,
                                      disable_progress_bar=True, output_dir=str(out), resume_from_checkpoint="none"))
    finally:
        torch.set_num_threads(previous)
    return out


@pytest.fixture
def keeps_torch_threads():
    """For tests that run a script's main() in this process: the script sets the thread count for its process, as
    an entry point may, and the test puts it back."""
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models train fastest on one thread: on a shared 2-core machine a second one mostly waits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def killed_after_checkpoint(trainer: rlhf.BaseTrainer, step: int) -> list[str]:
    """Run ``trainer`` and stop it as a kill would, right after it has written the checkpoint of ``step``;
    returns the names of the checkpoint's files."""
    original = trainer._save_checkpoint

    def save() -> None:
        original()
        if trainer.global_step == step:
            raise KeyboardInterrupt

    trainer._save_checkpoint = save
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    checkpoint = trainer.output_dir / "checkpoints" / f"checkpoint-{step}"
    assert (checkpoint / "COMPLETE").is_file()
    return sorted(p.name for p in checkpoint.iterdir())


@contextlib.contextmanager
def captured_log(logger_name: str = "rlhf"):
    """Records of a logger, whatever ``setup_logging`` did to its propagation."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    target = logging.getLogger(logger_name)
    handler, old_level = Keep(level=logging.DEBUG), target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)


@contextlib.contextmanager
def rlhf_log(caplog, level=logging.INFO):
    """Capture the 'rlhf' logger in caplog exactly once, whether or not setup_logging turned propagation off."""
    log = logging.getLogger("rlhf")
    caplog.set_level(level, logger="rlhf")
    propagate = log.propagate
    log.propagate = False
    log.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.propagate = propagate


def sample_episodes(trainer: rlhf._OnlineRLTrainer, prompts: list, params) -> rlhf.Episodes:
    """An online trainer's episode source sampling ``prompts`` once with ``params``, on its engine at the trainer's
    step (what a rollout's scheduler does, without the rollout)."""
    engine = trainer.engine.at(trainer.global_step)
    try:
        return trainer.source.sample(prompts, params, engine, lambda what: None)
    finally:
        engine.sleep()


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers parses a GGUF's metadata (the whole vocabulary, a Python object per token) once for the config,
    once for the tokenizer's class and once more with the tensors: 20-30 s each for a 262k vocabulary. Reading one
    file, each parse gives the same answer, so the reader and the metadata parse are kept per file (by size and
    modification time) for the module that asks for it; what is read is still transformers' own reading of our file."""
    import copy
    import functools

    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    reader, parse = gguf.GGUFReader, gguf_utils.load_gguf_checkpoint

    def stamp(path) -> tuple:
        status = Path(path).stat()
        return str(path), status.st_size, status.st_mtime_ns

    @functools.cache
    def read(key: tuple, mode: str):
        return reader(key[0], mode)

    @functools.cache
    def metadata(key: tuple) -> dict:
        return parse(key[0], return_tensors=False)

    def reading(path, mode="r"):
        return read(stamp(path), mode)

    def parsing(path, return_tensors=False, **options):
        if return_tensors or options:
            return parse(path, return_tensors=return_tensors, **options)
        return copy.deepcopy(metadata(stamp(path)))

    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = reading, parsing
    yield
    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = reader, parse
