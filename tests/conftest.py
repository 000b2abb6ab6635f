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
    """Import a file of bench/ or scripts/, which are scripts rather than packages. bench/ goes on sys.path
    first: its scripts import bench/tables.py (and scripts/make_demo_data.py, which they find themselves)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

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
