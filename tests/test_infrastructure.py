"""Section 2 (infrastructure): checkpoints, optimizer / RNG state, early stopping, optimizer groups,
compilation fallback, the training logger and the attention-backend choice."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import captured_log
from safetensors.torch import load_file, save_file
from torch import nn

import rlhf


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# -- CheckpointManager ----------------------------------------------------------------------------------


def test_checkpoint_save_writes_into_temp_dir_then_renames(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path, save_total_limit=3)
    seen = {}

    def write(directory):
        seen["dir"] = directory
        seen["final_existed"] = (manager.root / "checkpoint-7").exists()
        (directory / "weights.txt").write_text("w")

    final = manager.save(7, write)
    assert final == tmp_path / "checkpoints" / "checkpoint-7"
    assert seen["dir"].name.startswith(".tmp-") and seen["dir"].parent == manager.root
    assert not seen["final_existed"]  # nothing published before the write finished
    assert not seen["dir"].exists()
    assert (final / "weights.txt").read_text() == "w"
    assert (final / "COMPLETE").read_text() == "7"
    assert [p.name for p in manager.root.iterdir()] == ["checkpoint-7"]


def test_checkpoint_failing_write_leaves_nothing(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path)
    manager.save(1, lambda d: (d / "a").write_text("ok"))

    def broken(directory):
        (directory / "half").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, broken)
    assert [p.name for p in manager.root.iterdir()] == ["checkpoint-1"]  # no checkpoint-2, no .tmp-*
    assert manager.latest() == manager.root / "checkpoint-1"


def test_checkpoint_rolling_and_latest_sort_numerically(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path, save_total_limit=2)
    for step in (5, 9, 10, 100):
        manager.save(step, lambda d, s=step: (d / "step").write_text(str(s)))
    assert [p.name for p in manager.checkpoints()] == ["checkpoint-10", "checkpoint-100"]
    assert manager.latest().name == "checkpoint-100"
    assert (manager.latest() / "step").read_text() == "100"
    read = []
    assert manager.load_latest(lambda d: read.append((d / "step").read_text())) == manager.root / "checkpoint-100"
    assert read == ["100"]


def test_checkpoint_resave_same_step_replaces_it(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path)
    manager.save(3, lambda d: (d / "v").write_text("old"))
    manager.save(3, lambda d: (d / "v").write_text("new"))
    assert [p.name for p in manager.checkpoints()] == ["checkpoint-3"]
    assert (manager.latest() / "v").read_text() == "new"


def test_checkpoint_without_its_complete_marker_is_never_resumed(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path)
    manager.save(2, lambda d: (d / "v").write_text("2"))
    manager.save(4, lambda d: (d / "v").write_text("4"))
    (manager.root / "checkpoint-4" / "COMPLETE").unlink()  # e.g. left half-deleted by an older version
    assert manager.latest().name == "checkpoint-2"
    assert manager.load_latest(lambda d: None) == manager.root / "checkpoint-2"
    manager.clear()  # removes the incomplete one too
    assert list(manager.root.iterdir()) == []


def test_checkpoint_killed_while_replacing_or_rolling_keeps_complete_checkpoints(tmp_path, monkeypatch):
    """The old copy of a re-saved step, and a rolled-out checkpoint, are renamed away before they are deleted:
    a kill during the delete leaves complete checkpoint-N directories plus a .tmp-* leftover for the next start."""
    manager = rlhf.CheckpointManager(tmp_path, save_total_limit=1)
    manager.save(3, lambda d: (d / "v").write_text("old"))
    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        if Path(path).name.startswith(".tmp-old-") or Path(path).name.startswith(".tmp-discard-"):
            (Path(path) / "v").unlink()  # part of the delete happened
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(rlhf.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.save(3, lambda d: (d / "v").write_text("new"))
    assert (manager.latest() / "v").read_text() == "new"
    with pytest.raises(KeyboardInterrupt):
        manager.save(5, lambda d: (d / "v").write_text("five"))  # rolls checkpoint-3 out
    assert [p.name for p in manager.checkpoints()] == ["checkpoint-5"]
    monkeypatch.setattr(rlhf.shutil, "rmtree", real_rmtree)
    again = rlhf.CheckpointManager(tmp_path, save_total_limit=1)
    assert sorted(p.name for p in again.root.iterdir()) == ["checkpoint-5"]  # leftovers removed on start


def test_checkpoint_init_removes_stale_temp_dirs_only(tmp_path):
    manager = rlhf.CheckpointManager(tmp_path)
    manager.save(4, lambda d: None)
    stale = manager.root / ".tmp-checkpoint-8-deadbeef"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"half")
    (manager.root / "checkpoint-notanumber").mkdir()
    again = rlhf.CheckpointManager(tmp_path)
    assert not stale.exists()
    assert [p.name for p in again.checkpoints()] == ["checkpoint-4"]
    assert again.latest().name == "checkpoint-4"
    again.clear()
    assert again.latest() is None


def test_checkpoint_empty_dir_has_no_latest(tmp_path):
    assert rlhf.CheckpointManager(tmp_path / "new").latest() is None
    assert rlhf.CheckpointManager(tmp_path / "new").load_latest(lambda d: pytest.fail("nothing to read")) is None


# -- optimizer and RNG state as safetensors + JSON ---------------------------------------------------------


def _adam_steps(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: list[int]) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        loss = model(torch.randn(5, 4, generator=gen)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_optimizer_state_safetensors_round_trip(tmp_path):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), learning_rate=1e-2, weight_decay=0.1)
    model = _small_net()
    optimizer, _ = rlhf.create_optimizer(model, config, num_training_steps=10)
    _adam_steps(model, optimizer, [1, 2, 3])

    tensors, meta = rlhf.optimizer_state_to_safetensors(optimizer.state_dict())
    save_file(tensors, str(tmp_path / "optimizer.safetensors"))
    (tmp_path / "optimizer.json").write_text(json.dumps(meta))

    clone = copy.deepcopy(model)
    clone_optimizer, _ = rlhf.create_optimizer(clone, config, num_training_steps=10)
    restored = rlhf.optimizer_state_from_safetensors(load_file(str(tmp_path / "optimizer.safetensors")),
                                                     json.loads((tmp_path / "optimizer.json").read_text()))
    clone_optimizer.load_state_dict(restored)
    for (key, value), (key2, value2) in zip(optimizer.state_dict()["state"].items(),
                                            clone_optimizer.state_dict()["state"].items()):
        assert key == key2 and value.keys() == value2.keys()
        for name in value:
            assert torch.equal(torch.as_tensor(value[name]), torch.as_tensor(value2[name])), name

    _adam_steps(model, optimizer, [4, 5])
    _adam_steps(clone, clone_optimizer, [4, 5])
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)

    fresh = copy.deepcopy(clone)  # control: without the state the next step differs
    _adam_steps(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1), [6])
    _adam_steps(clone, clone_optimizer, [6])
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), clone.parameters()))


def _draws() -> list:
    return [torch.rand(3).tolist(), torch.randn(2).tolist(), np.random.rand(3).tolist(),
            np.random.standard_normal(3).tolist(), random.random(), random.gauss(0, 1), random.gauss(0, 1),
            torch.randperm(10).tolist()]


def test_rng_capture_restore_reproduces_draws(tmp_path):
    rlhf.set_seed(123)
    np.random.standard_normal()  # leave numpy with a cached gaussian
    random.gauss(0, 1)  # and python with one
    tensors, meta = rlhf.capture_rng_state()
    save_file(tensors, str(tmp_path / "rng.safetensors"))
    (tmp_path / "rng.json").write_text(json.dumps(meta))
    first = _draws()
    assert _draws() != first  # the generators moved on
    rlhf.restore_rng_state(load_file(str(tmp_path / "rng.safetensors")),
                           json.loads((tmp_path / "rng.json").read_text()))
    assert _draws() == first


def test_set_seed_is_repeatable():
    rlhf.set_seed(7)
    first = _draws()
    rlhf.set_seed(7)
    assert _draws() == first


# -- early stopping ----------------------------------------------------------------------------------------


def test_early_stopping_min_mode():
    stopper = rlhf.EarlyStopping(patience=2, mode="min")
    assert [stopper.step(v) for v in (1.0, 0.9, 0.95, 0.9)] == [False, False, False, True]
    assert stopper.best == 0.9 and stopper.bad_evaluations == 2


def test_early_stopping_max_mode_and_min_delta():
    stopper = rlhf.EarlyStopping(patience=2, mode="max", min_delta=0.05)
    assert not stopper.step(0.5)
    assert not stopper.step(0.52)  # below min_delta: not an improvement
    assert not stopper.step(0.6)  # improvement resets the count
    assert stopper.bad_evaluations == 0 and stopper.best == 0.6
    assert not stopper.step(0.1)
    assert stopper.step(0.62)


def test_early_stopping_state_dict_round_trip():
    stopper = rlhf.EarlyStopping(patience=3)
    for value in (2.0, 1.0, 1.5, 1.2):
        stopper.step(value)
    state = json.loads(json.dumps(stopper.state_dict()))
    resumed = rlhf.EarlyStopping(patience=3)
    resumed.load_state_dict(state)
    assert (resumed.best, resumed.bad_evaluations) == (1.0, 2)
    assert resumed.step(1.1) and stopper.step(1.1)


def test_early_stopping_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        rlhf.EarlyStopping(patience=1, mode="median")


# -- create_optimizer ------------------------------------------------------------------------------------


def test_create_optimizer_groups_and_warmup(tmp_path):
    model = _small_net()
    model[3].weight.requires_grad_(False)  # frozen parameters are left out
    config = rlhf.SFTConfig(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, warmup_steps=4,
                            lr_scheduler_type="linear")
    optimizer, scheduler = rlhf.create_optimizer(model, config, num_training_steps=8)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias),
                                                   id(model[3].bias)}
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[5:] == pytest.approx([7.5e-4, 5e-4, 2.5e-4])
    assert optimizer.defaults["betas"] == (config.adam_beta1, config.adam_beta2)


def test_create_optimizer_warmup_ratio_and_constant(tmp_path):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), learning_rate=2e-3, warmup_ratio=0.25,
                            lr_scheduler_type="constant_with_warmup")
    optimizer, scheduler = rlhf.create_optimizer(_small_net(), config, num_training_steps=8)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 1e-3, 2e-3, 2e-3, 2e-3, 2e-3])


@pytest.mark.parametrize("name", rlhf.SCHEDULERS)
def test_every_accepted_scheduler_runs_like_the_trainer_steps_it(name, tmp_path):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), lr_scheduler_type=name, warmup_steps=2, learning_rate=1e-3)
    optimizer, scheduler = rlhf.create_optimizer(_small_net(), config, num_training_steps=10)
    for _ in range(10):  # what BaseTrainer._optimizer_step does each step
        optimizer.step()
        scheduler.step()
        assert math.isfinite(scheduler.get_last_lr()[0])
    json.dumps(scheduler.state_dict())  # checkpoints store it as JSON


def test_create_optimizer_without_trainable_parameters_is_an_input_error(tmp_path):
    model = _small_net().requires_grad_(False)
    with pytest.raises(rlhf.RLHFInputError, match="no trainable parameters"):
        rlhf.create_optimizer(model, rlhf.SFTConfig(output_dir=str(tmp_path)), num_training_steps=1)


# -- compile_model -----------------------------------------------------------------------------------------


def test_compile_model_disabled_returns_same_object():
    model = _small_net()
    assert rlhf.compile_model(model, enabled=False) is model


def test_compile_model_bad_backend_warns_and_keeps_working():
    model = _small_net()
    x = torch.randn(2, 4)
    want = model(x)
    with captured_log() as records:
        out = rlhf.compile_model(model, enabled=True, backend="no_such_backend")
    assert any(r.levelno == logging.WARNING and "torch.compile failed" in r.getMessage() for r in records)
    torch.testing.assert_close(out(x), want)
    out(x).sum().backward()
    assert model[0].weight.grad is not None


def _backend_that_fails(graph_module, example_inputs):
    raise RuntimeError("this graph cannot be compiled")


def test_compiled_model_runs_a_graph_that_fails_to_compile_eagerly_without_changing_the_process():
    import torch._dynamo

    model, x = _small_net(), torch.randn(2, 4)
    want = model(x)
    try:
        with pytest.raises(Exception, match="this graph cannot be compiled"):  # torch.compile alone: a hard error
            torch.compile(_small_net(), backend=_backend_that_fails)(x)
        torch._dynamo.reset()
        out = rlhf.compile_model(model, enabled=True, backend=_backend_that_fails)
        torch.testing.assert_close(out(x), want)  # the failed graph ran eagerly
        assert torch._dynamo.config.suppress_errors is False  # only while the model ran, never for the process
        torch._dynamo.reset()  # forget that the failed frame runs eagerly
        with pytest.raises(Exception, match="this graph cannot be compiled"):  # so other compiled code still fails
            torch.compile(_small_net(), backend=_backend_that_fails)(x)
    finally:
        torch._dynamo.reset()


# -- TrainingLogger ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def devices():
    return rlhf.DeviceManager()


def test_device_manager_on_cpu(devices):
    assert devices.device.type == "cpu"
    assert devices.is_main_process and devices.num_processes == 1 and devices.process_index == 0
    assert devices.sum_across_processes(3) == 3.0
    model = _small_net()
    model(torch.randn(3, 4)).sum().mul(100).backward()
    norm = devices.clip_grad_norm(model.parameters(), 0.0)  # 0: report, do not clip
    assert norm > 1.0
    clipped = devices.clip_grad_norm(model.parameters(), 1.0)
    assert clipped == pytest.approx(norm, rel=1e-5)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert float(total) == pytest.approx(1.0, rel=1e-4)


def test_lockstep_share_splits_batches_round_robin_with_equal_turns(devices):
    assert devices.lockstep_share(3) == [(0, True), (1, True), (2, True)]  # one process: everything, kept
    assert devices.lockstep_share(0) == []

    class Process:  # the same method on rank r of p processes
        lockstep_share = rlhf.DeviceManager.lockstep_share

        def __init__(self, rank: int, processes: int) -> None:
            self.process_index, self.num_processes = rank, processes

    assert Process(0, 2).lockstep_share(5) == [(0, True), (2, True), (4, True)]
    assert Process(1, 2).lockstep_share(5) == [(1, True), (3, True), (4, False)]  # repeats the last, discarded
    assert Process(2, 3).lockstep_share(1) == [(0, False)]  # nothing of its own, still one forward in step
    for processes in (1, 2, 3, 4):
        shares = [Process(rank, processes).lockstep_share(7) for rank in range(processes)]
        assert len({len(share) for share in shares}) == 1  # the same number of forwards on every process
        assert sorted(index for share in shares for index, keep in share if keep) == list(range(7))


def test_wandb_without_an_account_runs_offline_and_leaves_the_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = rlhf.SFTConfig(output_dir=str(tmp_path), report_to="wandb", disable_progress_bar=True)
    devices = rlhf.DeviceManager(log_with=config.report_to, project_dir=tmp_path / "runs")
    training_logger = rlhf.TrainingLogger(tmp_path, total_steps=1, devices=devices, config=config)
    training_logger.log(1, {"loss": 1.0})
    training_logger.close()
    devices.accelerator.end_training()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert "WANDB_MODE" not in os.environ


def test_training_logger_writes_jsonl_and_plots(tmp_path, devices):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), plot_loss=True, disable_progress_bar=True)
    training_logger = rlhf.TrainingLogger(tmp_path, total_steps=3, devices=devices, config=config)
    for step, loss in enumerate([2.0, 1.5, 1.2], start=1):
        training_logger.log(step, {"loss": torch.tensor(loss), "learning_rate": 1e-3, "note": "text"})
        training_logger.advance()
    training_logger.log(3, {"eval/loss": 1.4})
    written = training_logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert rows[0] == {"step": 1, "loss": 2.0, "learning_rate": 1e-3, "note": "text"}
    assert rows[-1] == {"step": 3, "eval/loss": 1.4}
    names = {p.name for p in written}
    assert {"plot_loss.png", "plot_eval_loss.png", "plot_learning_rate.png"} <= names
    for path in written:
        assert path.parent == tmp_path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_plots_smooth_only_metrics_logged_often_enough(tmp_path, monkeypatch):
    """An average over three eval points lags far behind them (0.65, 0.71, 0.71 smoothed to 0.66), so a metric
    logged fewer than SMOOTH_FROM_POINTS times is drawn as its points alone; a dense one gets the smoothed line."""
    import matplotlib.pyplot as plt

    figures = {}
    monkeypatch.setattr(plt, "close", lambda fig: figures.setdefault(fig.axes[0].get_title(), fig))
    many = rlhf.SMOOTH_FROM_POINTS
    history = [{"step": s, "loss": 1.0 / s} for s in range(1, many + 1)]
    history += [{"step": s, "eval/accuracy": a} for s, a in [(100, 0.65), (200, 0.71), (300, 0.71)]]
    rlhf.plot_metrics(history, tmp_path)
    labels = {key: [line.get_label() for line in fig.axes[0].get_lines()] for key, fig in figures.items()}
    assert labels == {"loss": ["raw", "smoothed"], "eval/accuracy": ["raw"]}
    raw = figures["eval/accuracy"].axes[0].get_lines()[0]
    assert list(raw.get_ydata()) == [0.65, 0.71, 0.71] and raw.get_alpha() == 1

def test_training_logger_no_plots_unless_asked_and_resume_trims_history(tmp_path, devices):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), disable_progress_bar=True)
    first = rlhf.TrainingLogger(tmp_path, total_steps=4, devices=devices, config=config)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    assert first.close() == []
    assert not list(tmp_path.glob("*.png"))

    resumed = rlhf.TrainingLogger(tmp_path, total_steps=4, devices=devices, config=config, start_step=2)
    assert [r["step"] for r in resumed.history] == [1, 2]  # rows after the checkpoint are dropped
    resumed.log(3, {"loss": 30.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    resumed.close()

    restarted = rlhf.TrainingLogger(tmp_path, total_steps=4, devices=devices, config=config, start_step=0)
    assert restarted.history == [] and (tmp_path / "metrics.jsonl").read_text() == ""
    restarted.close()


# -- attention backend -------------------------------------------------------------------------------------


def test_select_attention_implementation_on_cpu():
    assert rlhf.select_attention_implementation("auto", "cpu")[0] == "sdpa"
    assert rlhf.select_attention_implementation("sdpa", "cpu")[0] == "sdpa"
    assert rlhf.select_attention_implementation("eager", "cpu")[0] == "eager"
    implementation, reason = rlhf.select_attention_implementation("flash_attention_2", torch.device("cpu"))
    assert implementation == "sdpa" and "CUDA" in reason
    for requested in ("auto", "flash_attention_2", "sdpa", "eager"):
        assert rlhf.select_attention_implementation(requested, "cpu")[0] != "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        rlhf.select_attention_implementation("flash3", "cpu")


def test_optimizer_state_keyed_by_parameter_name_round_trips():
    """A sharded run gathers its optimizer state keyed by parameter name (dotted), not by index: the split
    back into parameter and state key takes the last dot, and index keys stay integers."""
    moment = torch.arange(3.0)
    state = {"state": {"model.layers.0.mlp.up_proj.weight": {"exp_avg": moment, "step": 4.0},
                       7: {"exp_avg_sq": moment}},
             "param_groups": [{"lr": 0.1, "params": ["model.layers.0.mlp.up_proj.weight", 7]}]}
    tensors, meta = rlhf.optimizer_state_to_safetensors(state)
    assert sorted(tensors) == ["7.exp_avg_sq", "model.layers.0.mlp.up_proj.weight.exp_avg"]
    restored = rlhf.optimizer_state_from_safetensors(tensors, json.loads(json.dumps(meta)))
    assert set(restored["state"]) == {"model.layers.0.mlp.up_proj.weight", 7}
    assert restored["state"]["model.layers.0.mlp.up_proj.weight"]["step"] == 4.0
    assert torch.equal(restored["state"][7]["exp_avg_sq"], moment)
