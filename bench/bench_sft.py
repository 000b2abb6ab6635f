"""SFT throughput: ``rlhf.SFTTrainer`` against a bare PyTorch loop doing the same work.

    python bench/bench_sft.py                      # 5 warm-up + 60 timed steps, batch 32, 3 repeats
    python bench/bench_sft.py --steps 100 --batch-size 16 --seq-len 256 --threads 2

Both loops get the same work:
  * model: the embedded tiny Llama (``rlhf.build_tiny_model()``), full fine-tuning, a fresh copy
    loaded from the same saved directory for every run, the same attention implementation, fp32;
  * batches: the same ``SFTDataset`` (demo_sft, cutoff ``--seq-len``) collated by the same
    ``SFTCollator`` in the same order (``ResumableBatchSampler`` with the same seed, which is what
    the trainer iterates; the bare loop feeds it to a plain ``torch.utils.data.DataLoader``);
  * optimizer: ``torch.optim.AdamW`` with the same lr / betas / eps, weight decay 0, constant
    learning rate (the trainer's scheduler is ``constant``);
  * loss: summed token cross-entropy divided by the number of target tokens;
  * gradient clipping to ``max_grad_norm`` (1.0) in both.

How time is measured: the end of every optimizer step is time-stamped (in the bare loop directly,
in the trainer by wrapping its ``_optimizer_step`` method on the instance; the real method runs).
The timed interval runs from the end of the last warm-up step to the end of the last step, so it
holds exactly ``--steps`` steps including everything the loop does between them (data loading and
collation, logging, progress bookkeeping), and excludes model loading, tokenisation, the final
evaluation, checkpoint and save. Tokens are the non-padding tokens (attention-mask sum) of the
timed steps' batches, counted the same way for both loops (and checked equal).

Runs alternate (trainer, bare, bare, trainer, ...) ``--repeats`` times to spread background load
evenly; the overhead is computed from each loop's best (fastest) repeat, the statistic least
disturbed by other processes, and the median is shown as well. After each pair the two models'
weights are compared: they must agree, which shows both loops did the same computation.

The script prints a PASS/FAIL line against the overhead target (default 10%) but always exits 0
for timing results (only a broken run exits non-zero).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps excluded from timing")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128, help="cutoff_len: tokens per example at most")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop (alternating)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--logging-steps", type=int, default=10, help="the trainer's logging_steps")
    parser.add_argument("--progress-bar", action="store_true", help="show the trainer's rich progress bar")
    parser.add_argument("--target", type=float, default=10.0, help="overhead target in percent")
    parser.add_argument("--records", type=int, default=None, help="use only the first N demo_sft records")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.batch_size < 1 or args.repeats < 1:
        parser.error("--steps, --warmup, --batch-size and --repeats must be >= 1")
    return args


def build_data(model_dir: Path, args: argparse.Namespace) -> tuple[rlhf.SFTDataset, rlhf.SFTCollator]:
    tokenizer = rlhf.load_tokenizer(model_dir)
    records = rlhf.load_records("demo_sft", rlhf.DEMO_DATA_DIR, "sft", max_samples=args.records)
    dataset = rlhf.SFTDataset(records, tokenizer, rlhf.ChatFormatter(tokenizer, "auto"), cutoff_len=args.seq_len)
    return dataset, rlhf.SFTCollator(tokenizer.pad_token_id)


def sampler(dataset: rlhf.SFTDataset, args: argparse.Namespace, seed: int) -> rlhf.ResumableBatchSampler:
    return rlhf.ResumableBatchSampler(len(dataset), args.batch_size, seed)


def timed_tokens(tokens_per_step: list[int], args: argparse.Namespace) -> int:
    return sum(tokens_per_step[args.warmup:args.warmup + args.steps])


def step_seconds(stamps: list[float], args: argparse.Namespace) -> list[float]:
    """Duration of each timed step: from the end of the previous step to the end of this one."""
    return [stamps[k] - stamps[k - 1] for k in range(args.warmup, args.warmup + args.steps)]


def run_trainer(model_dir: Path, dataset, collator, args: argparse.Namespace, seed: int, out: Path):
    """rlhf.SFTTrainer as train_sft builds it; returns (timed step seconds, tokens per step, model, train() wall, attention)."""
    config = rlhf.SFTConfig(
        model_name_or_path=str(model_dir), finetuning_type="full", learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=1.0, per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps, cutoff_len=args.seq_len, seed=seed, logging_steps=args.logging_steps,
        save_steps=0, eval_steps=0, report_to=[], disable_progress_bar=not args.progress_bar,
        output_dir=str(out), resume_from_checkpoint="none", attn_implementation="auto")
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path, dtype="float32",
                                              attn_implementation=config.attn_implementation)
    trainer = rlhf.SFTTrainer(config, policy, dataset)
    trainer.collator = collator
    stamps: list[float] = []
    tokens: list[int] = []
    inner = trainer._optimizer_step

    def optimizer_step_timed(group, window):  # the real step, time-stamped at its end
        tokens.append(sum(int(b["attention_mask"].sum()) for b in group))
        result = inner(group, window)
        stamps.append(time.perf_counter())
        return result

    trainer._optimizer_step = optimizer_step_timed
    started = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - started
    assert result.global_step == args.warmup + args.steps, result.global_step
    return step_seconds(stamps, args), tokens, policy.model, wall, policy.attn_implementation


def run_bare(model_dir: Path, dataset, collator, args: argparse.Namespace, seed: int, attn: str):
    """The same training written directly in PyTorch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attn)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler(dataset, args, seed), collate_fn=collator)
    stamps: list[float] = []
    tokens: list[int] = []
    losses: list[float] = []
    for step, batch in enumerate(loader):
        if step == args.warmup + args.steps:
            break
        labels = batch["labels"]
        targets = labels[:, 1:].reshape(-1)
        units = int((targets != rlhf.IGNORE_INDEX).sum())
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets,
                                   ignore_index=rlhf.IGNORE_INDEX, reduction="sum")
        (loss_sum / max(units, 1)).backward()
        losses.append(float(loss_sum.detach()) / max(units, 1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens.append(int(batch["attention_mask"].sum()))
        stamps.append(time.perf_counter())
    return step_seconds(stamps, args), tokens, model


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    theirs = dict(b.named_parameters())
    return max(float((p.detach() - theirs[name].detach()).abs().max()) for name, p in a.named_parameters())


def print_table(rows: list[list[str]], title: str) -> None:
    headers = ["loop", "steps", "tokens", "time best (s)", "tok/s best", "time median (s)", "tok/s median"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        print(title)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        for row in [headers, *rows]:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        return
    table = Table(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("rlhf").setLevel(logging.WARNING)
    seed = 0
    model_dir = rlhf.build_tiny_model()
    dataset, collator = build_data(model_dir, args)
    needed = (args.warmup + args.steps) * args.batch_size
    print(f"model {model_dir.name}: full fine-tuning, fp32, {args.threads} threads; "
          f"{len(dataset)} demo_sft sequences (cutoff {args.seq_len}), batch {args.batch_size}, "
          f"{args.warmup} warm-up + {args.steps} timed steps ({needed / len(dataset):.2f} epochs), {args.repeats} repeats")

    bare_attn = rlhf.select_attention_implementation("auto", "cpu")[0]  # what the trainer picks on CPU
    times: dict[str, list[float]] = {"rlhf.SFTTrainer": [], "bare PyTorch": []}
    tokens: dict[str, int] = {}
    walls: list[float] = []
    differences: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        for repeat in range(args.repeats):
            order = ["trainer", "bare"] if repeat % 2 == 0 else ["bare", "trainer"]
            models = {}
            for which in order:
                gc.collect()
                if which == "trainer":
                    seconds, per_step, model, wall, attn = run_trainer(model_dir, dataset, collator, args, seed,
                                                                       Path(tmp) / f"run-{repeat}")
                    name = "rlhf.SFTTrainer"
                    walls.append(wall)
                    if attn != bare_attn:
                        raise RuntimeError(f"attention differs: trainer {attn}, bare {bare_attn}")
                else:
                    seconds, per_step, model = run_bare(model_dir, dataset, collator, args, seed, bare_attn)
                    name = "bare PyTorch"
                times[name].append(seconds)
                count = timed_tokens(per_step, args)
                if tokens.setdefault(name, count) != count:
                    raise RuntimeError(f"{name} saw {count} tokens, earlier {tokens[name]}")
                models[which] = model
            differences.append(max_weight_difference(models["trainer"], models["bare"]))
            print(f"repeat {repeat + 1}: trainer {times['rlhf.SFTTrainer'][-1]:.3f}s, bare {times['bare PyTorch'][-1]:.3f}s, "
                  f"max |weight difference| {differences[-1]:.2e}")
    if tokens["rlhf.SFTTrainer"] != tokens["bare PyTorch"]:
        raise RuntimeError(f"the loops saw different tokens: {tokens}")

    rows = []
    for name, values in times.items():
        best, median = min(values), statistics.median(values)
        rows.append([name, str(args.steps), f"{tokens[name]:,}", f"{best:.3f}", f"{tokens[name] / best:,.0f}",
                     f"{median:.3f}", f"{tokens[name] / median:,.0f}"])
    print_table(rows, title=f"SFT throughput, {args.steps} steps x batch {args.batch_size} (non-padding tokens)")
    best_ratio = min(times["rlhf.SFTTrainer"]) / min(times["bare PyTorch"])
    median_ratio = statistics.median(times["rlhf.SFTTrainer"]) / statistics.median(times["bare PyTorch"])
    print(f"trainer / bare time ratio: {best_ratio:.3f} (best), {median_ratio:.3f} (median)")
    print(f"trainer.train() wall time incl. final save: median {statistics.median(walls):.2f}s")
    print(f"max |weight difference| after training: {max(differences):.2e} (same computation: ~0)")
    overhead = 100 * (best_ratio - 1)
    print(f"overhead: {overhead:.1f}%  (median-based: {100 * (median_ratio - 1):.1f}%)")
    verdict = "PASS" if overhead <= args.target else "FAIL"
    print(f"{verdict}: trainer overhead {overhead:.1f}% vs target <= {args.target:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
