"""``torch_compile``: the training step under torch.compile (each decoder block's forward and backward, and the
chunked output head's per-chunk loss) gives the eager step's values and gradients, leaves the module tree and its
state-dict names alone, keeps decoding (a forward with a KV cache) eager, trains SFT, DPO and GRPO as the eager step
does, and caches compiled kernels where a later run finds them."""

from __future__ import annotations

import os

import pytest
import torch
from test_output_head import VOCAB, _grads, _model

import rlhf


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models; forget them after (dynamo's per-code-object recompile limit is shared)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _frames() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["frames"])


def test_a_compiled_training_step_gives_the_eager_values_and_gradients_with_the_chunked_head():
    from torch._dynamo.utils import counters

    eager, compiled = _model("llama"), _model("llama")
    names = list(compiled.state_dict())
    rlhf.compile_training_step(compiled)
    assert list(compiled.state_dict()) == names  # nothing renamed: checkpoints and adapters load either way
    head = rlhf.OutputHead.of(compiled)
    assert head.chunked and head.vocab == VOCAB  # the chunked head stays on (a whole-model compile turns it off)
    ids = torch.randint(3, VOCAB, (2, 12))
    counters.clear()
    values, grads = [], []
    for model in (eager, compiled):
        scores, _ = rlhf.OutputHead.of(model).scores(model, input_ids=ids, use_cache=False)
        loss = -rlhf.OutputHead.of(model).log_probs(scores[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        values.append(loss.detach())
        grads.append(_grads(model))
    frames = _frames()
    assert frames.get("ok", 0) >= 2 and frames.get("ok") == frames.get("total")  # blocks and head, none fell back
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-5)
    for name in grads[0]:
        scale = max(1.0, float(grads[0][name].abs().max()))
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_decoding_with_a_kv_cache_stays_eager():
    from torch._dynamo.utils import counters

    model = rlhf.compile_training_step(_model("llama"))
    ids = torch.randint(3, VOCAB, (1, 6))
    counters.clear()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
    assert _frames().get("total", 0) == 0  # nothing compiled: the cache grows every step


def test_a_backend_that_cannot_start_leaves_the_model_eager(caplog):
    model = _model("llama")
    with rlhf.logging_restored():
        out = rlhf.compile_training_step(model, backend="no_such_backend")
    assert out is model and not any("forward" in vars(block) for block in rlhf._decoder_blocks(model))
    assert not getattr(rlhf.innermost_model(model), "_rlhf_compiled_step", False)


def test_compiled_kernels_are_cached_under_rlhf_cache_unless_torch_is_told_otherwise(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert rlhf.use_persistent_compile_cache() == tmp_path / "torch_compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch_compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert rlhf.use_persistent_compile_cache() == tmp_path / "mine"


def test_the_old_compile_key_means_torch_compile():
    assert rlhf.load_config(rlhf.SFTConfig, None, ["compile=true"]).torch_compile is True
    assert rlhf.load_config(rlhf.SFTConfig, None, ["torch_compile=true"]).torch_compile is True


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_each_stage_trains_compiled_as_it_trains_eagerly(stage, tmp_path, llama_dir, demo_dir, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    common = dict(model_name_or_path=str(llama_dir), dataset_dir=str(demo_dir), max_samples=16, cutoff_len=96,
                  per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3, lr_scheduler_type="constant",
                  logging_steps=1, save_steps=0, disable_progress_bar=True, report_to="none", seed=0,
                  resume_from_checkpoint="none", finetuning_type="full")
    cls, train, extra = {
        "sft": (rlhf.SFTConfig, rlhf.train_sft, dict(dataset="demo_sft")),
        "dpo": (rlhf.DPOConfig, rlhf.train_dpo, dict(dataset="demo_preference")),
        "grpo": (rlhf.GRPOConfig, rlhf.train_grpo, dict(dataset="demo_rl", num_generations=4,
                                                         max_completion_length=16, reward_funcs=["exact_answer"])),
    }[stage]
    from torch._dynamo.utils import counters

    losses = {}
    for compiled in (False, True):
        config = cls(**common, **extra, output_dir=str(tmp_path / str(compiled)), torch_compile=compiled)
        counters.clear()
        result = train(config)
        losses[compiled] = [row["loss"] for row in result.history if "loss" in row]
    frames = _frames()
    assert frames.get("ok", 0) >= 1 and frames.get("ok") == frames.get("total")  # compiled, and nothing fell back
    assert len(losses[True]) == 2
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)
