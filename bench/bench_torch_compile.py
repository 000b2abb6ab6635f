"""Our trainers' seconds per optimizer step eager and with ``torch_compile: true``, stage by stage, on one model and
the demo data: what the compiled training step (each decoder block's forward and backward, and the output head's
per-chunk loss) gains or costs. TRL beside it at a real size: bench_real_size.py ``--impls ours,ours-compiled,trl``.

    python bench/bench_torch_compile.py                                   # the embedded model: sft, dpo, grpo
    python bench/bench_torch_compile.py --model ~/.cache/rlhf/models/SmolLM2-135M-Instruct --stages sft --steps 14

Each run is a process of its own with a fresh inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary folder), so
the compiled run pays its compilation as a first run would; "first s" is the first step (compilation included) and
the table's s/step the median of the steps after ``--warmup``. The settings: full fine-tuning in fp32, constant lr,
``--batch-size`` rows (GRPO: completions, G 8, 32 new tokens, beta 0) of at most ``--seq-len`` tokens, the demo's
records, DPO with a live reference (precompute_ref_log_probs=false). Every run's step count and losses are checked to
match between the two modes (a compiled step that ran eagerly, or computed something else, would show).

The limit: the peak matmul FLOP/s (bench/limits.py) measured before and after the runs; GFLOP/s = 6 x parameters x
the median step's tokens (+ 2 x parameters x tokens for DPO's live reference) / s/step, attention ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_dpo import batch_tokens  # noqa: E402
from limits import Limits, forward_flops, fraction, giga, training_flops  # noqa: E402
from tables import print_table  # noqa: E402

MARK = "BENCH_TORCH_COMPILE_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (the embedded model) or a model folder")
    parser.add_argument("--stages", default="sft,dpo,grpo", help="comma-separated: sft, dpo, grpo")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    return args


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import rlhf

    seconds, tokens = [], []
    inner = rlhf.BaseTrainer._optimizer_step

    def timed(trainer, group, window):
        started = time.perf_counter()
        out = inner(trainer, group, window)
        seconds.append(time.perf_counter() - started)
        tokens.append(sum(batch_tokens(batch) for batch in group))
        return out

    rlhf.BaseTrainer._optimizer_step = timed
    common = dict(model_name_or_path=args.model, dataset_dir=str(REPO / "data" / "demo"), cutoff_len=args.seq_len,
                  max_samples=args.batch_size * args.steps, per_device_train_batch_size=args.batch_size,
                  max_steps=args.steps, learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=1,
                  save_steps=0, disable_progress_bar=True, report_to="none", seed=0, resume_from_checkpoint="none",
                  finetuning_type="full", output_dir=args.workdir, torch_compile=args.compiled, eval_steps=0)
    if args.worker == "sft":
        result = rlhf.train_sft(rlhf.SFTConfig(**common, dataset="demo_sft"))
    elif args.worker == "dpo":
        result = rlhf.train_dpo(rlhf.DPOConfig(**common, dataset="demo_preference", precompute_ref_log_probs=False))
    else:
        result = rlhf.train_grpo(rlhf.GRPOConfig(**common, dataset="demo_rl", num_generations=8,
                                                 max_completion_length=32, reward_funcs=["exact_answer"], beta=0.0))
    losses = [float(row["loss"]) for row in result.history if "loss" in row]
    timed_steps = slice(args.warmup, None)
    print(MARK + json.dumps({"first": seconds[0], "step": statistics.median(seconds[timed_steps]),
                             "tokens": statistics.median(tokens[timed_steps]), "losses": losses}), flush=True)
    return 0


def run(args: argparse.Namespace, stage: str, compiled: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", stage, "--model", args.model,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--threads", str(args.threads), "--workdir", str(Path(tmp) / "out")]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
               "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(command + (["--compiled"] if compiled else []), capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    return json.loads(lines[-1][len(MARK):])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(REPO))
    import rlhf

    args.model = str(rlhf.resolve_model_path(args.model))
    limits = Limits("float32")
    params = limits.measure_in_subprocess(args.threads, model=Path(args.model))["params"]
    rows, failures = [], 0
    for stage in [s.strip() for s in args.stages.split(",") if s.strip()]:
        results = {compiled: run(args, stage, compiled) for compiled in (False, True)}
        for compiled, result in results.items():
            if "error" in result:
                failures += 1
                print(f"{stage} {'compiled' if compiled else 'eager'} failed:\n{result['error']}", file=sys.stderr)
        if any("error" in r for r in results.values()):
            continue
        eager, compiled = results[False], results[True]
        same = len(eager["losses"]) == len(compiled["losses"]) and all(
            abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(eager["losses"], compiled["losses"]))
        for name, result in (("eager", eager), ("torch_compile", compiled)):
            flops = training_flops(params, result["tokens"])
            if stage == "dpo":
                flops += forward_flops(params, result["tokens"])
            rate = flops / result["step"] if stage != "grpo" else None  # GRPO's step is mostly sampling
            rows.append([stage, name, f"{result['first']:.2f}", f"{result['step']:.3f}",
                         f"{result['step'] / eager['step']:.2f}x", giga(rate, 1), fraction(rate, limits.peak),
                         "yes" if same else "NO"])
    limits.measure_in_subprocess(args.threads)
    print(limits.describe())
    print_table(["stage", "step", "first s", "s/step", "vs eager", "GFLOP/s", "% of peak", "same losses"], rows,
                f"{Path(args.model).name} ({params / 1e6:.1f}M parameters): batch {args.batch_size}, at most "
                f"{args.seq_len} tokens, {args.steps} steps (median after {args.warmup}), {args.threads} threads, "
                f"fp32 CPU", label_columns=2)
    print("GFLOP/s = 6 x parameters x the step's tokens (+ 2 x for DPO's live reference) / s/step; GRPO's step is "
          "mostly sampling, which torch_compile leaves to the generation engine, so it gets no FLOP figure")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
