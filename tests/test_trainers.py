"""Sections 5, 7 and 10: the SFT loss, the training loop (accumulation, exact resume in-process and
after SIGKILL, early stopping, LoRA, packing, streaming) and the orchestrator / CLI report.

Models are the tiny Llama of conftest.py (``tiny_arch_dir("llama")``) or the embedded ``tiny``
model; runs are a handful of steps on the bundled demo data.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import captured_log
from safetensors.torch import load_file

import rlhf


class _Interrupted(Exception):
    """Stands in for a crash right after a checkpoint was published."""


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def _config(tmp: Path, model: Path | str, demo_dir: Path, **overrides) -> rlhf.SFTConfig:
    settings = dict(model_name_or_path=str(model), dataset="demo_sft", dataset_dir=str(demo_dir), max_samples=48,
                    cutoff_len=64, finetuning_type="full", per_device_train_batch_size=4, max_steps=3,
                    learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=0,
                    disable_progress_bar=True, output_dir=str(tmp), seed=0)
    settings.update(overrides)
    return rlhf.SFTConfig(**settings)


def _weights(directory: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / name))


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _loss_rows(output_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def _interrupt_after(monkeypatch, step: int) -> None:
    """Make the trainer die right after publishing the checkpoint of ``step``."""
    original = rlhf.BaseTrainer._save_checkpoint

    def save_then_die(self):
        original(self)
        if self.global_step >= step:
            raise _Interrupted(self.global_step)

    monkeypatch.setattr(rlhf.BaseTrainer, "_save_checkpoint", save_then_die)


# -- section 5: the loss is a sum, normalised over the whole accumulated batch ----------------------


def test_causal_lm_loss_sum_normalisation_is_accumulation_invariant():
    torch.manual_seed(0)
    vocab = 11
    long_logits = torch.randn(1, 30, vocab, requires_grad=True)
    short_logits = torch.randn(1, 4, vocab, requires_grad=True)
    long_labels = torch.randint(0, vocab, (1, 30))
    short_labels = torch.randint(0, vocab, (1, 4))
    long_labels[0, :5] = rlhf.IGNORE_INDEX

    s1, n1 = rlhf.causal_lm_loss_sum(long_logits, long_labels)
    s2, n2 = rlhf.causal_lm_loss_sum(short_logits, short_labels)
    assert (n1, n2) == (25, 3)
    want = torch.nn.functional.cross_entropy(
        torch.cat([long_logits[0, :-1], short_logits[0, :-1]]), torch.cat([long_labels[0, 1:], short_labels[0, 1:]]),
        ignore_index=rlhf.IGNORE_INDEX)
    torch.testing.assert_close((s1 + s2) / (n1 + n2), want)
    # control: the naive mean of per-micro-batch means weights the 3 short tokens like the 25 long ones
    naive = (s1 / n1 + s2 / n2) / 2
    assert abs(float(naive.detach()) - float(want.detach())) > 1e-3


# -- (a) batch 8 x accumulation 1 == batch 1 x accumulation 8 ---------------------------------------


class _NaiveMeanTrainer(rlhf.SFTTrainer):
    """Control: the common mistake of averaging each micro-batch over its own tokens, then over micro-batches."""

    def _optimizer_step(self, group, window):
        self._group_units = sum(self.loss_units(b) for b in group)
        return super()._optimizer_step(group, window)

    def compute_loss(self, batch):
        loss_sum, metrics = super().compute_loss(batch)
        own_mean = loss_sum / self.loss_units(batch)
        return own_mean * self._group_units / self.config.gradient_accumulation_steps, metrics


def _train_weights(tmp: Path, llama_dir: Path, dataset, batch: int, accumulation: int,
                   trainer_cls: type = rlhf.SFTTrainer) -> dict[str, torch.Tensor]:
    config = rlhf.SFTConfig(model_name_or_path=str(llama_dir), output_dir=str(tmp), finetuning_type="full",
                            per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                            max_steps=2, learning_rate=1e-3, adam_epsilon=1e-6, lr_scheduler_type="constant",
                            max_grad_norm=1.0, seed=0, save_steps=0, logging_steps=1, disable_progress_bar=True,
                            resume_from_checkpoint="none")
    policy = rlhf.PolicyModel.from_pretrained(str(llama_dir))
    result = trainer_cls(config, policy, dataset).train()
    assert result.global_step == 2
    # .cpu(): trained on a GPU if any
    return {k: v.detach().cpu().clone() for k, v in policy.model.state_dict().items()}


def test_gradient_accumulation_is_equivalent_to_a_large_batch(tmp_path, llama_dir, tiny_tokenizer, demo_dir):
    records = rlhf.load_records("demo_sft", demo_dir, "sft", max_samples=32)
    dataset = rlhf.SFTDataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)
    lengths = {sum(label != rlhf.IGNORE_INDEX for label in dataset[i]["labels"]) for i in range(len(dataset))}
    assert len(lengths) > 1  # micro-batches have different numbers of target tokens
    big = _train_weights(tmp_path / "8x1", llama_dir, dataset, 8, 1)
    base = rlhf.PolicyModel.from_pretrained(str(llama_dir)).model.state_dict()
    assert max(float((big[k] - base[k]).abs().max()) for k in big) > 1e-4  # training moved the weights
    # Adam divides by sqrt(v) + eps: with the default eps=1e-8 an entry whose gradient is ~0 turns float
    # rounding (1e-11) into a visible step; eps=1e-6 keeps that noise ~1e-8, far below the tolerance, while
    # a per-micro-batch mean (gradients off by ~10%) moves weights by ~1e-4 (the control below).
    for batch, accumulation in ((1, 8), (2, 4)):
        small = _train_weights(tmp_path / f"{batch}x{accumulation}", llama_dir, dataset, batch, accumulation)
        for key in big:
            torch.testing.assert_close(small[key], big[key], atol=1e-6, rtol=0, msg=f"{batch}x{accumulation} {key}")
    naive = _train_weights(tmp_path / "naive", llama_dir, dataset, 2, 4, trainer_cls=_NaiveMeanTrainer)
    assert max(float((naive[k] - big[k]).abs().max()) for k in big) > 1e-4  # measured: 2e-3


def test_a_stage_run_leaves_logging_as_it_found_it(tmp_path, llama_dir, demo_dir):
    import transformers

    log = logging.getLogger("rlhf")
    before = (log.level, log.propagate, list(log.handlers), transformers.utils.logging.is_progress_bar_enabled())
    rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, max_steps=1))
    after = (log.level, log.propagate, list(log.handlers), transformers.utils.logging.is_progress_bar_enabled())
    assert after == before
    log_file = tmp_path / "logs" / "sft.log"
    assert "step 1: loss=" in log_file.read_text()  # the run's own lines are in its file
    log.warning("a message after the run")
    assert "a message after the run" not in log_file.read_text()  # which is closed when the run ends


# -- (b) resume after an interruption equals an uninterrupted run (in-process) -------------------------


@pytest.mark.parametrize("finetuning_type", ["full", "lora", "freeze"])
def test_resume_in_process_equals_uninterrupted_run(finetuning_type, tmp_path, llama_dir, demo_dir, monkeypatch):
    common = dict(max_steps=6, save_steps=3, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=1,
                  finetuning_type=finetuning_type, freeze_trainable_layers=1, lora_rank=4)
    weights_file = "adapter_model.safetensors" if finetuning_type == "lora" else "model.safetensors"
    reference = rlhf.train_sft(_config(tmp_path / "A", llama_dir, demo_dir, **common))
    assert reference.global_step == 6

    config = _config(tmp_path / "B", llama_dir, demo_dir, **common)
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Interrupted):
        rlhf.train_sft(config)
    monkeypatch.undo()
    checkpoints = rlhf.CheckpointManager(tmp_path / "B").checkpoints()
    assert [p.name for p in checkpoints] == ["checkpoint-3"]
    assert not (tmp_path / "B" / weights_file).exists()
    files = {p.name for p in checkpoints[0].iterdir()}
    assert {weights_file, "optimizer.safetensors", "optimizer.json", "scheduler.json", "rng_state.safetensors",
            "rng_state.json", "trainer_state.json", "COMPLETE"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]  # nothing pickled

    with captured_log() as records:
        resumed = rlhf.train_sft(config)
    assert any("resumed from" in r.getMessage() for r in records)
    assert resumed.global_step == 6
    _assert_bit_identical(_weights(tmp_path / "A", weights_file), _weights(tmp_path / "B", weights_file))
    assert _loss_rows(tmp_path / "B") == _loss_rows(tmp_path / "A")
    assert [s for s, _, _ in _loss_rows(tmp_path / "B")] == [1, 2, 3, 4, 5, 6]
    if finetuning_type == "freeze":  # the frozen half never moved
        base, trained = _weights(llama_dir), _weights(tmp_path / "B")
        assert all(torch.equal(base[k], trained[k]) for k in base if "layers.1." not in k)
        assert not all(torch.equal(base[k], trained[k]) for k in base if "layers.1." in k)


def test_resume_from_explicit_checkpoint_and_overwrite(tmp_path, llama_dir, demo_dir):
    out = tmp_path / "run"
    rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=4, save_steps=2))
    checkpoint_2 = out / "checkpoints" / "checkpoint-2"
    assert (checkpoint_2 / "COMPLETE").exists()
    with captured_log() as records:
        again = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=4, save_steps=2,
                                       resume_from_checkpoint=str(checkpoint_2)))
    assert again.global_step == 4
    assert any(f"resumed from {checkpoint_2}" in r.getMessage() for r in records)

    with captured_log() as records:
        fresh = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=1, overwrite_output_dir=True))
    assert fresh.global_step == 1 and not any("resumed" in r.getMessage() for r in records)
    assert [p.name for p in rlhf.CheckpointManager(out).checkpoints()] == ["checkpoint-1"]

    (out / "checkpoints" / "checkpoint-1" / "COMPLETE").unlink()
    with pytest.raises(rlhf.RLHFInputError, match="not a complete checkpoint"):
        rlhf.train_sft(_config(out, llama_dir, demo_dir,
                               resume_from_checkpoint=str(out / "checkpoints" / "checkpoint-1")))


def test_resume_survives_a_damaged_checkpoint(tmp_path, llama_dir, demo_dir):
    """A damaged file in the newest checkpoint costs save_steps, not the run: auto-resume reports it and
    takes the one before; an explicit path to it, or every checkpoint damaged, is a one-line error."""
    out = tmp_path / "run"
    rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=4, save_steps=2))
    checkpoint_2, checkpoint_4 = (out / "checkpoints" / f"checkpoint-{n}" for n in (2, 4))
    optimizer_file = checkpoint_4 / "optimizer.safetensors"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:40])  # a truncated write, a disk error
    with pytest.raises(rlhf.RLHFInputError,
                       match=r"checkpoint-4 cannot be read \(SafetensorError.*set resume_from_checkpoint=none"):
        rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=6, save_steps=2,
                               resume_from_checkpoint=str(checkpoint_4)))
    with pytest.raises(rlhf.RLHFInputError, match="does not exist"):
        rlhf.train_sft(_config(out, llama_dir, demo_dir,
                               resume_from_checkpoint=str(out / "checkpoints" / "checkpoint-9")))
    with captured_log() as records:
        resumed = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=6, save_steps=0))
    messages = [r.getMessage() for r in records]
    assert any("resumed from the older checkpoint-2 because checkpoint-4 cannot be read" in m
               for m in messages), messages
    assert any(f"resumed from {checkpoint_2} at step 2" in m for m in messages)
    assert resumed.global_step == 6
    found = rlhf.CheckpointManager(out).checkpoints()  # the resumed run saved its own at the end
    for checkpoint in found:
        (checkpoint / "trainer_state.json").write_text("{not json")
    with pytest.raises(rlhf.RLHFInputError,
                       match=f"no checkpoint in .* can be read: {found[-1].name} .*JSONDecodeError"):
        rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=8))


def test_resume_none_starts_fresh_without_the_old_checkpoints(tmp_path, llama_dir, demo_dir):
    out = tmp_path / "run"
    rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=4, save_steps=2))
    assert [p.name for p in rlhf.CheckpointManager(out).checkpoints()] == ["checkpoint-2", "checkpoint-4"]
    fresh = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=1, resume_from_checkpoint="none"))
    assert fresh.global_step == 1
    assert [p.name for p in rlhf.CheckpointManager(out).checkpoints()] == ["checkpoint-1"]


def test_resume_refuses_another_stages_checkpoint_and_warns_about_changed_settings(tmp_path, llama_dir, demo_dir):
    """One output_dir used for SFT, then a DPO run: the SFT checkpoint holds no reference state and its optimizer
    belongs to another loss, so the DPO run stops with a one-line error instead of a traceback. Resuming the same
    stage with a changed learning rate continues, with a warning that names the change."""
    out = tmp_path / "run"
    rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=2, save_steps=2))
    dpo = rlhf.DPOConfig(model_name_or_path=str(llama_dir), dataset="demo_preference", dataset_dir=str(demo_dir),
                         max_samples=8, cutoff_len=64, finetuning_type="full", per_device_train_batch_size=2,
                         max_steps=1, save_steps=0, disable_progress_bar=True, output_dir=str(out))
    sft_config = (out / "config.yaml").read_text()
    with pytest.raises(rlhf.RLHFInputError,
                       match=r"holds 'sft' checkpoints, and this run trains 'dpo': set output_dir"):
        rlhf.train_dpo(dpo)
    assert (out / "config.yaml").read_text() == sft_config  # refused before it wrote anything
    dpo.resume_from_checkpoint = str(out / "checkpoints" / "checkpoint-2")
    with pytest.raises(rlhf.RLHFInputError, match=r"resume_from_checkpoint': .* is a 'sft' checkpoint, and this run"):
        rlhf.train_dpo(dpo)

    with captured_log() as records:
        again = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=3, save_steps=2, learning_rate=1e-4,
                                       logging_steps=2))
    assert again.global_step == 3
    warnings = [r.getMessage() for r in records if "settings changed" in r.getMessage()]
    assert len(warnings) == 1 and "learning_rate 0.001 -> 0.0001" in warnings[0], warnings
    assert "max_steps" not in warnings[0] and "logging_steps" not in warnings[0]  # how long and how loud: no warning
    assert any("new length: max_steps 2 -> 3" in r.getMessage() for r in records)  # said, not warned


def test_resume_refuses_a_checkpoint_with_other_parameters(tmp_path, llama_dir, demo_dir):
    """A LoRA run's checkpoint holds adapter weights and their optimizer state; a full fine-tuning run in the same
    output_dir (or a LoRA run of another rank) cannot continue from it: one line, naming the change and the way out."""
    out = tmp_path / "run"
    rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=2, save_steps=2, finetuning_type="lora"))
    with pytest.raises(rlhf.RLHFInputError, match=r"holds checkpoints that this run cannot resume \(finetuning_type "
                                                   r"'lora' -> 'full'\): set output_dir to another directory"):
        rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=3, finetuning_type="full"))
    explicit = _config(out, llama_dir, demo_dir, max_steps=3, finetuning_type="lora", lora_rank=4,
                       resume_from_checkpoint=str(out / "checkpoints" / "checkpoint-2"))
    with pytest.raises(rlhf.RLHFInputError, match=r"resume_from_checkpoint': .*checkpoint-2 cannot be resumed with "
                                                   r"lora_rank 8 -> 4"):
        rlhf.train_sft(explicit)
    fresh = rlhf.train_sft(_config(out, llama_dir, demo_dir, max_steps=1, finetuning_type="full",
                                   resume_from_checkpoint="none"))
    assert fresh.global_step == 1


def test_run_without_eval_data_logs_no_empty_rows(tmp_path, llama_dir, demo_dir):
    rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, max_steps=2))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(set(row) - {"step"} for row in rows), rows


def test_batch_sampler_is_a_pure_function_of_position():
    sampler = rlhf.ResumableBatchSampler(10, 3, seed=1)
    first = [batch for batch, _ in zip(sampler, range(9))]
    assert sorted(i for batch in first[:4] for i in batch) == list(range(10))  # one epoch = every index once
    resumed = rlhf.ResumableBatchSampler(10, 3, seed=1, start=5)
    assert [batch for batch, _ in zip(resumed, range(4))] == first[5:9]


def test_group_by_length_keeps_every_index_and_cuts_padding():
    lengths = [int(n) for n in torch.randint(10, 100, (400,), generator=torch.Generator().manual_seed(0))]
    plain = rlhf.ResumableBatchSampler(400, 8, seed=0)
    grouped = rlhf.ResumableBatchSampler(400, 8, seed=0, lengths=lengths)
    assert sorted(grouped.epoch_indices(0)) == sorted(plain.epoch_indices(0)) == list(range(400))

    def padded_tokens(sampler):
        batches = [batch for batch, _ in zip(sampler, range(sampler.batches_per_epoch))]
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded_tokens(grouped) < 0.8 * padded_tokens(plain)
    assert grouped.epoch_indices(1) != grouped.epoch_indices(0)  # still reshuffled every epoch
    assert rlhf.group_by_length([0, 3, 2, 1], [5, 9, 1, 7], batch_size=2, megabatch=1) == [3, 0, 1, 2]


def test_group_by_length_run_learns_and_resumes(tmp_path, llama_dir, demo_dir):
    uninterrupted = rlhf.train_sft(_config(tmp_path / "a", llama_dir, demo_dir, max_steps=4, group_by_length=True))
    assert uninterrupted.global_step == 4
    rlhf.train_sft(_config(tmp_path / "b", llama_dir, demo_dir, max_steps=4, save_steps=2, group_by_length=True))
    checkpoints = tmp_path / "b" / "checkpoints"
    shutil.rmtree(checkpoints / "checkpoint-4")
    rlhf.train_sft(_config(tmp_path / "b", llama_dir, demo_dir, max_steps=4, save_steps=2, group_by_length=True))
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- (c) SIGKILL mid-run, rerun the same command: bit-identical to an uninterrupted run -----------------


def _cli_args(repo: Path, model: Path, out: Path) -> list[str]:
    return ["sft", f"model_name_or_path={model}", "dataset=demo_sft", f"dataset_dir={repo / 'data' / 'demo'}",
            "max_samples=160", "cutoff_len=64", "finetuning_type=full", "per_device_train_batch_size=4", "max_steps=40",
            "save_steps=5", "save_total_limit=2", "logging_steps=1", "learning_rate=1e-3", "lr_scheduler_type=cosine",
            "warmup_steps=3", "seed=3", "disable_progress_bar=true", "report_to=none", f"output_dir={out}"]


def _step_of(path: Path) -> int:
    suffix = path.name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def test_sigkill_and_rerun_is_bit_identical_to_uninterrupted(tmp_path, repo, llama_dir):
    """``python rlhf.py sft ...`` is SIGKILLed once checkpoint-10 exists; the same command run again
    resumes and ends with exactly the weights of an uninterrupted run of that command.

    Only the killed run is a subprocess (an interpreter start-up costs ~10 s of imports); the
    uninterrupted reference and the rerun go through the same CLI entry point (``rlhf.main``) in this
    process, single-threaded like the subprocess, so the resume still crosses a process boundary.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # RLHF_CACHE is inherited: the session's cache
    assert torch.get_num_threads() == 1
    reference_dir, victim_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    outcome: dict[str, int] = {}

    def kill_after_checkpoint_10(process: subprocess.Popen) -> None:
        deadline = time.time() + 300
        while time.time() < deadline and process.poll() is None:
            steps = [_step_of(p) for p in (victim_dir / "checkpoints").glob("checkpoint-*")]
            if steps and max(steps) >= 10:
                os.kill(process.pid, signal.SIGKILL)
                outcome["killed_at"] = max(steps)
                return
            time.sleep(0.01)

    with open(tmp_path / "victim.log", "wb") as log:
        victim = subprocess.Popen([sys.executable, str(repo / "rlhf.py"), *_cli_args(repo, llama_dir, victim_dir)],
                                  env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=kill_after_checkpoint_10, args=(victim,), daemon=True)
        watcher.start()
        try:
            assert rlhf.main(_cli_args(repo, llama_dir, reference_dir)) == 0  # meanwhile, the uninterrupted run
            watcher.join(timeout=300)
            victim.wait(timeout=60)
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
    assert "killed_at" in outcome, (tmp_path / "victim.log").read_text()[-3000:]
    assert victim.returncode == -signal.SIGKILL
    assert not (victim_dir / "model.safetensors").exists(), "the run finished before it could be killed"
    assert not (victim_dir / "report.json").exists()
    latest = rlhf.CheckpointManager(victim_dir).latest()  # (also removes a half-written .tmp-* checkpoint)
    assert 10 <= _step_of(latest) < 40

    with captured_log() as records:
        assert rlhf.main(_cli_args(repo, llama_dir, victim_dir)) == 0  # the same command, run again
    assert any(f"resumed from {latest}" in r.getMessage() for r in records)

    _assert_bit_identical(_weights(reference_dir), _weights(victim_dir))
    rows = _loss_rows(victim_dir)
    assert [s for s, _, _ in rows] == list(range(1, 41))  # each step logged once despite the kill
    assert rows == _loss_rows(reference_dir)
    report = json.loads((victim_dir / "report.json").read_text())
    assert len(report["stages"]) == 1 and report["stages"][0]["global_step"] == 40


def test_sigterm_and_sigusr1_finish_the_step_checkpoint_and_resume_bit_identical(tmp_path, repo, llama_dir):
    """A scheduler's stop: SIGTERM to a ``python rlhf.py sft ...`` process, and SIGUSR1 (SLURM's warning ahead of a
    job's end) to a run in this process, each after some logged steps and with no periodic checkpoint due
    (save_steps=100). Each finishes its optimizer step, writes a checkpoint of it, exits 128 + signal with one line
    that says how to resume, and the same command run again ends with exactly the weights and logged losses of an
    uninterrupted run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    assert torch.get_num_threads() == 1

    def args(out: Path) -> list[str]:
        return [*_cli_args(repo, llama_dir, out), "save_steps=100"]

    def logged_steps(out: Path) -> int:
        metrics = out / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    reference_dir, terminated_dir, warned_dir = tmp_path / "uninterrupted", tmp_path / "sigterm", tmp_path / "sigusr1"
    with open(tmp_path / "victim.log", "wb") as log:
        victim = subprocess.Popen([sys.executable, str(repo / "rlhf.py"), *args(terminated_dir)], env=env, cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while logged_steps(terminated_dir) < 8 and victim.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            victim.send_signal(signal.SIGTERM)
            victim.wait(timeout=120)
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
    output = (tmp_path / "victim.log").read_text()
    assert victim.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped = rlhf.CheckpointManager(terminated_dir).latest()
    assert stopped is not None and 8 <= _step_of(stopped) < 40
    assert f"stopped by SIGTERM after step {_step_of(stopped)} of 40" in output
    assert "run the same command again to resume" in output and "Traceback" not in output

    # SIGUSR1 to this process (the handler runs in the main thread, between the trainer's Python bytecodes)
    def warn_after_five_steps() -> None:
        deadline = time.time() + 300
        while logged_steps(warned_dir) < 5 and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    late = []  # a signal arriving outside the run (a slow machine) must not end pytest: SIGUSR1's default would

    def outside_the_run(*_):
        late.append(True)

    previous = signal.signal(signal.SIGUSR1, outside_the_run)
    try:
        sender = threading.Thread(target=warn_after_five_steps, daemon=True)
        sender.start()
        assert rlhf.main(args(warned_dir)) == 128 + signal.SIGUSR1
        sender.join(timeout=10)
        assert signal.getsignal(signal.SIGUSR1) is outside_the_run  # the run put back the handler it found
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not late
    warned = rlhf.CheckpointManager(warned_dir).latest()
    assert warned is not None and 5 <= _step_of(warned) < 40

    assert rlhf.main(args(reference_dir)) == 0
    for out, latest in ((terminated_dir, stopped), (warned_dir, warned)):
        with captured_log() as records:
            assert rlhf.main(args(out)) == 0  # the same command, run again
        assert any(f"resumed from {latest}" in r.getMessage() for r in records)
        _assert_bit_identical(_weights(reference_dir), _weights(out))
        assert _loss_rows(out) == _loss_rows(reference_dir)


# -- (d) SFT learns the demo task -------------------------------------------------------------------------


def test_bf16_mixed_precision_runs_the_exact_match_eval(tmp_path, llama_dir, demo_dir):
    """bf16=true wraps the model's forward in autocast, so the held-out generation decodes float32 keys
    (after RoPE) beside bfloat16 values; it used to stop the stage ('index_copy_(): self and source expected
    to have the same dtype'), which a GPU run of the demo pipeline found (every policy stage rolled back)."""
    result = rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, bf16=True, max_steps=1, eval_dataset="demo_eval",
                                    eval_max_new_tokens=8, per_device_eval_batch_size=100))
    assert result.global_step == 1 and result.eval["eval/mean_completion_tokens"] > 0


def test_sft_learns(tmp_path, tiny_model_dir, demo_dir):
    config = _config(tmp_path, "tiny", demo_dir, max_samples=400, val_size=32, max_steps=30,
                     per_device_train_batch_size=8, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3,
                     weight_decay=0.01, eval_before_training=True, logging_steps=5, per_device_eval_batch_size=32)
    result = rlhf.train_sft(config)
    assert result.global_step == 30
    before, after = result.eval_before["eval/loss"], result.eval["eval/loss"]
    assert after < before - 2.0, (before, after)
    assert result.eval["eval/perplexity"] < result.eval_before["eval/perplexity"] / 5
    losses = [row["loss"] for row in result.history if "loss" in row]
    assert losses[-1] < losses[0] - 2.0, losses
    assert result.metrics["final_loss"] == losses[-1]
    entry = result.report_entry()
    assert entry["eval_before"]["eval/loss"] == before and entry["eval"]["eval/loss"] == after
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "logs" / "sft.log").exists()


# -- (e) LoRA ----------------------------------------------------------------------------------------------


def test_lora_sft_trains_only_adapters_and_saves_adapter(tmp_path, llama_dir, demo_dir, tiny_tokenizer):
    result = rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, finetuning_type="lora", lora_rank=4,
                                    learning_rate=1e-2, save_steps=2, max_steps=3))
    assert result.global_step == 3
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    adapter = _weights(tmp_path, "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # the adapter trained

    checkpoint = rlhf.CheckpointManager(tmp_path).latest()
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    meta = json.loads((checkpoint / "optimizer.json").read_text())
    state_ids = {name.split(".", 1)[0] for name in load_file(str(checkpoint / "optimizer.safetensors"))}
    assert len(state_ids) == len(adapter) == sum(len(g["params"]) for g in meta["param_groups"])

    policy = rlhf.PolicyModel.from_pretrained(str(tmp_path))
    assert policy.is_peft
    base = _weights(llama_dir)  # the base stays as it was
    merged_free = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                   for k, v in policy.model.state_dict().items() if "lora_" not in k}
    for key, value in base.items():
        assert torch.equal(merged_free[key], value), key


# -- (f) packing -------------------------------------------------------------------------------------------


def test_packing_run_works(tmp_path, llama_dir, demo_dir):
    config = _config(tmp_path, llama_dir, demo_dir, packing=True, max_samples=40, cutoff_len=128, val_size=4)
    tokenizer = rlhf.load_tokenizer(str(llama_dir))
    devices = rlhf.DeviceManager()
    train, validation, _ = rlhf.build_sft_data(config, tokenizer, rlhf.ChatFormatter(tokenizer), devices)
    assert len(train) < 36 and "position_ids" in train[0]
    result = rlhf.train_sft(config)
    assert result.global_step == 3
    assert all(0 < row["loss"] < 20 for row in result.history if "loss" in row)
    assert "eval/loss" in result.eval and (tmp_path / "model.safetensors").exists()


def test_packed_row_scores_like_separate_examples(llama_dir, tiny_tokenizer, demo_dir):
    """Restarting position_ids must keep packed examples from attending to each other."""
    records = rlhf.load_records("demo_sft", demo_dir, "sft", max_samples=3)
    dataset = rlhf.SFTDataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=256)
    examples = [(dataset[i]["input_ids"], dataset[i]["labels"]) for i in range(3)]
    rows = rlhf.pack_sequences(examples, cutoff_len=256)
    assert len(rows) == 1
    batch = rlhf.SFTCollator(tiny_tokenizer.pad_token_id)(rows)
    policy = rlhf.PolicyModel.from_pretrained(str(llama_dir)).eval()
    with torch.no_grad():
        packed = policy.compute_log_probs(batch["input_ids"], None, batch["labels"], batch["position_ids"])
        separate = []
        for ids, labels in examples:
            ids_t = torch.tensor([ids])
            separate.append(policy.compute_log_probs(ids_t, torch.ones_like(ids_t), torch.tensor([labels])))
    assert int(packed.lengths[0]) == sum(int(s.lengths[0]) for s in separate)
    torch.testing.assert_close(packed.summed[0], sum(s.summed[0] for s in separate), atol=1e-4, rtol=1e-5)
    offset = 0
    for (ids, _), alone in zip(examples, separate):
        torch.testing.assert_close(packed.per_token[0, offset:offset + len(ids) - 1], alone.per_token[0],
                                   atol=1e-5, rtol=1e-5)
        offset += len(ids)


def test_packing_refused_for_mamba(tmp_path, tiny_arch_dir, demo_dir):
    with pytest.raises(rlhf.RLHFInputError, match="packing"):
        rlhf.train_sft(_config(tmp_path, tiny_arch_dir("mamba"), demo_dir, packing=True))


# -- (g) early stopping --------------------------------------------------------------------------------


def test_early_stopping_stops_when_metric_cannot_improve(tmp_path, llama_dir, demo_dir):
    # a learning rate far below fp32 resolution leaves the weights, hence eval/loss, exactly unchanged
    result = rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, learning_rate=1e-30, max_steps=20, eval_steps=1,
                                    early_stopping_patience=2, val_size=8, save_steps=10))
    assert result.stopped_early
    assert result.global_step == 3  # one evaluation sets the best, two more without improvement stop
    assert result.report_entry()["stopped_early"] is True
    latest = rlhf.CheckpointManager(tmp_path).latest()
    assert latest.name == "checkpoint-3"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["early_stopping"]["bad_evaluations"] == 2
    assert (tmp_path / "model.safetensors").exists()
    evals = [row["eval/loss"] for row in result.history if "eval/loss" in row]
    assert len(evals) == 3 and len(set(evals)) == 1


def test_early_stopping_on_missing_metric_is_an_input_error(tmp_path, llama_dir, demo_dir):
    with pytest.raises(rlhf.RLHFInputError, match="metric_for_best_model.*eval/loss"):
        rlhf.train_sft(_config(tmp_path, llama_dir, demo_dir, eval_steps=1, early_stopping_patience=1, val_size=4,
                               metric_for_best_model="eval/accuracy"))


def test_each_run_log_file_holds_only_its_own_run(tmp_path, llama_dir, demo_dir):
    rlhf.train_sft(_config(tmp_path / "first", llama_dir, demo_dir, max_steps=1))
    rlhf.train_sft(_config(tmp_path / "second", llama_dir, demo_dir, max_steps=1))
    first_log = (tmp_path / "first" / "logs" / "sft.log").read_text()
    assert first_log.count("trainable parameters") == 1


# -- (h) report.json ----------------------------------------------------------------------------------


def test_append_report_appends_atomically(tmp_path):
    rlhf.append_report(tmp_path, {"stage": "sft", "seconds": 1.0, "metrics": {"train_loss": 1.5}, "eval": {}})
    path = rlhf.append_report(tmp_path, {"stage": "sft", "seconds": 2.0, "metrics": {}, "eval": {"eval/loss": 1.0}})
    report = json.loads(path.read_text())
    assert [e["seconds"] for e in report["stages"]] == [1.0, 2.0]
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp file left behind


def test_cli_writes_report_and_second_run_appends(tmp_path, llama_dir, demo_dir, capsys):
    argv = ["sft", f"model_name_or_path={llama_dir}", "dataset=demo_sft", f"dataset_dir={demo_dir}", "max_samples=24",
            "cutoff_len=64", "finetuning_type=full", "max_steps=2", "per_device_train_batch_size=4", "val_size=4",
            "save_steps=0", "disable_progress_bar=true", "report_to=none", f"output_dir={tmp_path}"]
    assert rlhf.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["stages"]) == 1
    entry = report["stages"][0]
    assert entry["stage"] == "sft" and entry["global_step"] == 2
    assert isinstance(entry["seconds"], float) and entry["seconds"] > 0
    assert entry["metrics"]["steps"] == 2 and entry["metrics"]["train_loss"] > 0
    assert set(entry["eval"]) >= {"eval/loss", "eval/perplexity"}
    assert rlhf.main(argv) == 0  # the same command again: resumes at the end, evaluates and appends
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert [e["stage"] for e in stages] == ["sft", "sft"]
    assert stages[1]["eval"]["eval/loss"] == pytest.approx(entry["eval"]["eval/loss"], rel=1e-5)

    capsys.readouterr()
    assert rlhf.main(["sft", "learning_rate=-1", f"output_dir={tmp_path}"]) == 2
    assert "learning_rate" in capsys.readouterr().err


# -- (i) streaming -------------------------------------------------------------------------------------


def test_streaming_runs_and_resumes_from_its_data_position(tmp_path, llama_dir, demo_dir, monkeypatch):
    common = dict(streaming=True, max_steps=6, save_steps=3, max_samples=None, learning_rate=3e-3)
    reference = rlhf.train_sft(_config(tmp_path / "A", llama_dir, demo_dir, **common))
    assert reference.global_step == 6
    assert reference.metrics["data/records"] == 6 * 4

    config = _config(tmp_path / "B", llama_dir, demo_dir, **common)
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Interrupted):
        rlhf.train_sft(config)
    monkeypatch.undo()
    state = json.loads((tmp_path / "B" / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["data"] is not None and state["data"]["stats"]["records"] == 3 * 4

    resumed = rlhf.train_sft(config)
    assert resumed.global_step == 6 and resumed.metrics["data/records"] == 6 * 4
    _assert_bit_identical(_weights(tmp_path / "A"), _weights(tmp_path / "B"))
    assert _loss_rows(tmp_path / "B") == _loss_rows(tmp_path / "A")


def test_streaming_resume_at_an_epoch_boundary(tmp_path, llama_dir, demo_dir, monkeypatch):
    lines = (demo_dir / "sft.jsonl").read_text().splitlines()[:10]
    (tmp_path / "small.jsonl").write_text("\n".join(lines) + "\n")
    # 10 records in batches of 4: steps 1-3 are epoch 0 (4, 4, 2), so checkpoint-3 sits exactly at its end
    common = dict(streaming=True, dataset=str(tmp_path / "small.jsonl"), max_samples=None, max_steps=7, save_steps=3,
                  learning_rate=3e-3)
    reference = rlhf.train_sft(_config(tmp_path / "A", llama_dir, demo_dir, **common))
    assert reference.metrics["data/records"] == 20 + 4  # two passes and the first batch of a third

    config = _config(tmp_path / "B", llama_dir, demo_dir, **common)
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Interrupted):
        rlhf.train_sft(config)
    monkeypatch.undo()
    resumed = rlhf.train_sft(config)
    assert resumed.global_step == 7 and resumed.metrics["data/records"] == reference.metrics["data/records"]
    _assert_bit_identical(_weights(tmp_path / "A"), _weights(tmp_path / "B"))
    assert _loss_rows(tmp_path / "B") == _loss_rows(tmp_path / "A")


def test_streaming_requires_max_steps(tmp_path, demo_dir):
    with pytest.raises(rlhf.RLHFInputError, match="max_steps"):
        rlhf.SFTConfig(output_dir=str(tmp_path), dataset="demo_sft", dataset_dir=str(demo_dir), streaming=True)
