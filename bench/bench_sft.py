"""SFT throughput: ``rlhf.SFTTrainer`` against a bare PyTorch loop doing the same work.

    python bench/bench_sft.py                      # batch 32, cutoff 128, 5 warm-up + 60 timed steps, 3 repeats
    python bench/bench_sft.py --steps 100 --batch-size 16 --seq-len 256 --threads 1

Both loops get the same work:
  * model: the embedded tiny Llama (``rlhf.build_tiny_model()``), full fine-tuning, fp32, a fresh
    copy loaded from the same saved directory for every run, the same attention implementation;
  * batches: the same ``SFTDataset`` (demo_sft, cutoff ``--seq-len``) collated by the same
    ``SFTCollator`` in the same order (a ``ResumableBatchSampler`` with the same seed: what the
    trainer iterates; the bare loop feeds it to a plain ``torch.utils.data.DataLoader``);
  * optimizer: the fused ``torch.optim.AdamW`` (what ``rlhf.create_optimizer`` builds on CPU), same lr / betas / eps,
    no weight decay, constant learning rate (the trainer runs with ``lr_scheduler_type=constant``);
  * loss: summed token cross-entropy divided by the number of target tokens;
  * gradient clipping to norm 1.0 in both.
After each run the two models' weights are compared: they must agree (the same computation).

How time is measured (method: paired lockstep). Timing two whole runs one after the other on a
shared machine mostly measures the other processes, so the two loops advance in lockstep in one
process: the trainer's ``_optimizer_step`` is wrapped on the instance (the real method runs) and,
next to each trainer step, one step of the bare loop runs, timed separately and excluded from the
trainer's time. A trainer step's time runs from the moment control went back to the trainer after
its previous step to the end of this step, so it includes everything the trainer does between
steps (fetching and collating the batch, logging, progress, checks); a bare step's time includes
its ``next(loader)``. Step k of both loops thus runs back to back under the same background load.
Which loop goes first alternates per repeat. The first ``--warmup`` steps are excluded; model
loading, tokenisation, the trainer's final evaluation, checkpoint and save are outside the timed
steps (``save_steps=0``, no eval data). Tokens are the non-padding tokens (attention-mask sum) of
the timed steps' batches, counted identically for both (and checked equal).

Bursts of background load still hit single steps (a 40 ms step can take 1.5 s), so each step's
time is taken as its best over the repeats ("step-wise best"; the same step k has the same batch in
every repeat), and overhead = (sum of the trainer's step-wise best) / (the bare loop's) - 1. Also
printed: the plain ratio of all step times and the median of the per-step trainer/bare ratios.
The script prints a PASS/FAIL line against the target (default 10%) and always exits 0 for
timing results (only a broken run exits non-zero).

The limit (``bench/limits.py``): the peak fp32 matmul FLOP/s at ``--threads`` threads and the memory bandwidth are
measured in this process before the first repeat and after the last (the best of each is kept, printed above the
table). "GFLOP/s best" = 6 x parameters x tokens / best seconds (forward and backward of every parameter for every
non-padding token; attention's own FLOPs ignored; parameters = the tiny model's ``model_params``: all of them, the
tied embedding once); "% of peak" = that / the peak matmul FLOP/s: the headroom left on this machine.
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
from limits import Limits, fraction, giga, limits_epilog, model_params, training_flops  # bench/limits.py
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf  # noqa: E402

LABELS = {"trainer": "rlhf.SFTTrainer", "bare": "bare PyTorch"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GFLOP/s best = 6 x parameters x non-padding tokens / best s; % of peak = "
                                         "that / the peak matmul FLOP/s"))
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps excluded from timing")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128, help="cutoff_len: tokens per example at most")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="lockstep runs, alternating which loop steps first")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--logging-steps", type=int, default=10, help="the trainer's logging_steps")
    parser.add_argument("--progress-bar", action="store_true", help="show the trainer's rich progress bar")
    parser.add_argument("--target", type=float, default=10.0, help="overhead target in percent")
    parser.add_argument("--records", type=int, default=None, help="use only the first N demo_sft records")
    args = parser.parse_args(argv)
    if min(args.steps, args.warmup, args.batch_size, args.repeats, args.threads) < 1:
        parser.error("--steps, --warmup, --batch-size, --repeats and --threads must be >= 1")
    return args


def build_data(model_dir: Path, args: argparse.Namespace) -> tuple[rlhf.SFTDataset, rlhf.SFTCollator]:
    tokenizer = rlhf.load_tokenizer(model_dir)
    records = rlhf.load_records("demo_sft", rlhf.DEMO_DATA_DIR, "sft", max_samples=args.records)
    dataset = rlhf.SFTDataset(records, tokenizer, rlhf.ChatFormatter(tokenizer, "auto"), cutoff_len=args.seq_len)
    return dataset, rlhf.SFTCollator(tokenizer.pad_token_id)


class BareLoop:
    """The same training written directly in PyTorch, advanced one step at a time."""

    def __init__(self, model_dir: Path, dataset, collator, args: argparse.Namespace, seed: int, attn: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attn)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0, fused=True)
        sampler = rlhf.ResumableBatchSampler(len(dataset), args.batch_size, seed)  # what the trainer iterates
        self.batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collator))
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []

    def step(self) -> None:
        started = time.perf_counter()
        batch = next(self.batches)
        targets = batch["labels"][:, 1:].reshape(-1)
        units = int((targets != rlhf.IGNORE_INDEX).sum())
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            use_cache=False).logits
        loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets,
                                   ignore_index=rlhf.IGNORE_INDEX, reduction="sum")
        (loss_sum / max(units, 1)).backward()
        self.losses.append(float(loss_sum.detach()) / max(units, 1))
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens.append(int(batch["attention_mask"].sum()))
        self.seconds.append(time.perf_counter() - started)


def run_lockstep(model_dir: Path, dataset, collator, args: argparse.Namespace, seed: int, attn: str,
                 bare_first: bool, out: Path) -> dict:
    """One run of both loops in lockstep; returns per-step seconds and tokens of each, and checks."""
    config = rlhf.SFTConfig(
        model_name_or_path=str(model_dir), finetuning_type="full",
        learning_rate=args.lr, weight_decay=0.0, optim="adamw_torch_fused",
        lr_scheduler_type="constant", max_grad_norm=1.0, per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps, cutoff_len=args.seq_len, seed=seed, logging_steps=args.logging_steps,
        save_steps=0, eval_steps=0, report_to=[], disable_progress_bar=not args.progress_bar,
        output_dir=str(out), resume_from_checkpoint="none", attn_implementation="auto")
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path, dtype="float32",
                                              attn_implementation=config.attn_implementation)
    if policy.attn_implementation != attn:
        raise RuntimeError(f"attention differs: trainer {policy.attn_implementation}, bare {attn}")
    trainer = rlhf.SFTTrainer(config, policy, dataset)
    trainer.collator = collator
    bare = BareLoop(model_dir, dataset, collator, args, seed, attn)
    trainer_seconds: list[float] = []
    trainer_tokens: list[int] = []
    inner = trainer._optimizer_step
    back_in_trainer = time.perf_counter()

    def optimizer_step_in_lockstep(group, window):
        nonlocal back_in_trainer
        entered = time.perf_counter()
        between = entered - back_in_trainer  # the trainer's own work since its previous step (batch, logging)
        if bare_first:
            bare.step()
        started = time.perf_counter()
        result = inner(group, window)  # the real step
        trainer_seconds.append(between + time.perf_counter() - started)
        trainer_tokens.append(sum(int(b["attention_mask"].sum()) for b in group))
        if not bare_first:
            bare.step()
        back_in_trainer = time.perf_counter()
        return result

    trainer._optimizer_step = optimizer_step_in_lockstep
    started = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - started
    if result.global_step != args.warmup + args.steps or len(bare.seconds) != result.global_step:
        raise RuntimeError(f"steps: trainer {result.global_step}, bare {len(bare.seconds)}")
    if trainer_tokens != bare.tokens:
        raise RuntimeError("the loops saw different batches")
    timed = slice(args.warmup, args.warmup + args.steps)
    theirs = dict(bare.model.named_parameters())
    difference = max(float((p.detach() - theirs[name].detach()).abs().max())
                     for name, p in trainer.policy.model.named_parameters())
    return {"trainer": trainer_seconds[timed], "bare": bare.seconds[timed], "tokens": sum(bare.tokens[timed]),
            "difference": difference, "wall": wall, "final_loss": bare.losses[-1], "params": model_params(bare.model)}


# "best": each timed step's fastest repeat, summed (what the overhead uses); "all": every repeat's steps
HEADERS = ["loop", "steps", "tokens", "best (s)", "tok/s best", "all (s)", "tok/s all", "median step (ms)",
           "GFLOP/s best", "% of peak"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("rlhf").setLevel(logging.WARNING)
    seed = 0
    model_dir = rlhf.build_tiny_model()
    dataset, collator = build_data(model_dir, args)
    attn = rlhf.select_attention_implementation("auto", "cpu")[0]  # what the trainer picks on CPU
    needed = (args.warmup + args.steps) * args.batch_size
    print(f"model {model_dir.name} ({attn}): full fine-tuning, fp32, threads {args.threads}; {len(dataset)} demo_sft "
          f"sequences (cutoff {args.seq_len}), batch {args.batch_size}, {args.warmup} warm-up + {args.steps} timed "
          f"steps ({needed / len(dataset):.2f} epochs), {args.repeats} lockstep repeats")

    limits = Limits("float32").measure()  # before the timed runs, at --threads threads (and again after them)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        for repeat in range(args.repeats):
            gc.collect()
            bare_first = repeat % 2 == 1
            run = run_lockstep(model_dir, dataset, collator, args, seed, attn, bare_first, Path(tmp) / f"run-{repeat}")
            runs.append(run)
            print(f"repeat {repeat + 1} ({'bare' if bare_first else 'trainer'} steps first): trainer "
                  f"{sum(run['trainer']):.2f}s, bare {sum(run['bare']):.2f}s, max |weight difference| "
                  f"{run['difference']:.1e}, whole run {run['wall']:.1f}s (both loops, warm-up, final save)")

    limits.measure()
    if len({run["tokens"] for run in runs}) != 1:
        raise RuntimeError("repeats saw different batches")
    tokens = runs[0]["tokens"]
    flops = training_flops(runs[0]["params"], tokens)  # of the timed steps, the same for both loops
    best, totals, rows = {}, {}, []
    for which in ("trainer", "bare"):
        best[which] = sum(min(run[which][k] for run in runs) for k in range(args.steps))
        every = [d for run in runs for d in run[which]]
        totals[which] = sum(every)
        rows.append([LABELS[which], f"{args.steps}x{len(runs)}", f"{tokens:,}x{len(runs)}", f"{best[which]:.2f}",
                     f"{tokens / best[which]:,.0f}", f"{totals[which]:.2f}",
                     f"{tokens * len(runs) / totals[which]:,.0f}", f"{1000 * statistics.median(every):.1f}",
                     giga(flops / best[which]), fraction(flops / best[which], limits.peak)])
    title = (f"SFT throughput: batch {args.batch_size}, cutoff {args.seq_len}, threads {args.threads} "
             "(non-padding tokens)")
    print(limits.describe())
    print_table(HEADERS, rows, title, min_width=140)
    print(f"GFLOP/s best = 6 x {runs[0]['params'] / 1e6:.3f}M parameters x tokens / best s (attention FLOPs ignored); "
          "% of peak = that / the peak matmul FLOP/s above")
    ratios = [t / b for run in runs for t, b in zip(run["trainer"], run["bare"])]
    ratio = best["trainer"] / best["bare"]
    overhead = 100 * (ratio - 1)
    print(f"trainer / bare time: {ratio:.3f} step-wise best; {totals['trainer'] / totals['bare']:.3f} all steps; "
          f"median per-step ratio {statistics.median(ratios):.3f}")
    print(f"max |weight difference| between the loops: {max(run['difference'] for run in runs):.1e} "
          f"(same computation); final loss {runs[-1]['final_loss']:.4f}")
    print(f"overhead: {overhead:.1f}%")
    verdict = "PASS" if overhead <= args.target else "FAIL"
    print(f"{verdict}: trainer overhead {overhead:.1f}% vs target <= {args.target:g}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
