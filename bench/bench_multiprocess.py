"""Multi-process training on CPU: 2 processes x accumulation A against 1 process x accumulation 2A.

    python bench/bench_multiprocess.py                          # SFT and DPO, 25 steps, then 6 GRPO steps
    python bench/bench_multiprocess.py --steps 30 --batch-size 4 --accumulation 2
    python bench/bench_multiprocess.py --grpo-policy outputs/demo/sft   # GRPO from the demo's SFT model

Every run goes through the command line (``python rlhf.py <stage> key=value ...``); the curves are
read back from each run's ``metrics.jsonl`` (one row per logged optimizer step, ``logging_steps=1``).

(a) one process:   python rlhf.py <stage> ... per_device_train_batch_size=B gradient_accumulation_steps=2A
(b) two processes: accelerate launch --multi_gpu --num_processes 2 rlhf.py <stage> ... gradient_accumulation_steps=A
    with ACCELERATE_USE_CPU=true (gloo). ``accelerate launch --cpu --num_processes 2`` starts ONE process
    (accelerate's simple launcher spawns several only through mpirun), and ``--multi_gpu`` on a machine
    without GPUs starts processes that each train alone unless accelerate is told to use the CPU;
    rlhf's DeviceManager now does that itself when it sees WORLD_SIZE > 1 and no backend, and the
    environment variable makes the bench explicit (and CPU-only on a GPU machine too).

Why the two runs see the same examples per optimizer step: ``ResumableBatchSampler`` draws one
permutation per epoch (seed + epoch) on every process, and process r takes positions r, r+W, r+2W, ...
of it; micro-batch k of process r is the k-th run of B of those. So optimizer step s of (b) covers
permutation positions [2sAB, 2(s+1)AB) (A micro-batches of B on each of 2 processes), which are exactly
the 2A micro-batches of step s in (a). Only how the examples are grouped into micro-batches differs
(interleaved), which changes padding widths and the order of floating-point sums, not the maths: the
SFT loss is a sum over target tokens and the DPO loss a sum over pairs, each divided by the units of the
whole step on all processes. Hence the expected difference is float32 rounding, amplified a little by
Adam over the steps: measured at most 1e-7 relative over 25 steps. The tolerance (``--tolerance``,
relative, default 1e-5) sits 100x above that and over 100x below the error of the bug this bench
guards against (forwards that bypassed DDP, so each process stepped on its own gradient: 1.6e-3
relative at step 2 already). The runs
stay inside the first epoch (steps x 2AB <= records) because the wrap-around padding of a last,
uneven epoch differs between the layouts. Dropout is 0 in the tiny model. Not comparable this way:
KTO with batch > 1 (each micro-batch pairs its own mismatched completions for the KL reference point)
and group_by_length (each process sorts its own shard).

GRPO samples, so its curve cannot match a single process's: the bench runs it on 2 processes only,
from a briefly fine-tuned policy (``--warmup-steps`` of single-process SFT, or ``--grpo-policy``), and
shows per-step reward, loss and KL with held-out accuracy before and after. It saves a checkpoint
inside a rollout (num_iterations 2, step 3) and checks that every process's rollout is in it, that
the final model and exactly one report.json entry were written.
Exits 1 if a comparison fails or a run breaks.

The limit (``bench/limits.py``): only the summary table times training, so only it has limit columns; the per-step
tables compare loss and gradient-norm curves (and GRPO's reward, loss and KL), which time nothing. The peak fp32
matmul FLOP/s on one thread (every run's processes have ``OMP_NUM_THREADS=1``) and the memory bandwidth are measured in
this (the driver's) process before the first run and after the last (the best of each is kept, printed above the
summary). "GFLOP/s 1p / 2p" = FLOPs per token x the median over the steps of the run's logged ``perf/tokens_per_s``
(non-padding tokens of every process's micro-batches per second of the step): SFT 6 x parameters, DPO 8 x parameters
(the policy's forward and backward plus the live reference's forward: ``precompute_ref_log_probs=false``), parameters =
the tiny model's ``model_params`` (all of them, the tied embedding once), attention FLOPs ignored. "% of peak 1p / 2p"
sets the 1-process run against the one-thread peak and the 2-process run against twice it (two processes, one thread
each).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from limits import (  # bench/limits.py
    Limits,
    folder_params,
    forward_flops,
    fraction,
    giga,
    limits_epilog,
    training_flops,
)
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]

COMMON = ["model_name_or_path=tiny", "finetuning_type=full", "dataset_dir=data/demo", "cutoff_len=128", "seed=0",
          "logging_steps=1", "save_steps=0", "plot_loss=false", "disable_progress_bar=true", "report_to=none",
          "overwrite_output_dir=true", "resume_from_checkpoint=none", "eval_dataset=", "val_size=0",
          "lr_scheduler_type=cosine", "warmup_ratio=0.1", "max_grad_norm=1.0"]
STAGES = {
    "sft": ["dataset=demo_sft", "learning_rate=1e-3", "weight_decay=0.1"],
    "dpo": ["dataset=demo_preference", "learning_rate=1e-4", "pref_beta=0.1", "pref_loss=sigmoid", "pref_ftx=1.0",
            "precompute_ref_log_probs=false"],
}
RECORDS = {"sft": 3000, "dpo": 1500}  # lines in data/demo/sft.jsonl and preference.jsonl


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", ACCELERATE_USE_CPU="true",
               TOKENIZERS_PARALLELISM="false")
    env.pop("WORLD_SIZE", None)
    return env


def launch_command(processes: int, port: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "rlhf.py"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), "rlhf.py"]


def run(stage: str, processes: int, overrides: list[str], output_dir: Path, log: Path) -> float:
    command = [*launch_command(processes, free_port()), stage, *overrides, f"output_dir={output_dir}"]
    shown = " ".join(c if c != sys.executable else "python" for c in command)
    print(f"$ {shown.replace('-m accelerate.commands.launch', '-m accelerate.commands.launch (accelerate launch)')}",
          flush=True)
    started = time.time()
    with log.open("w") as handle:
        result = subprocess.run(command, cwd=REPO, env=environment(), stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{stage} with {processes} process(es) failed (exit {result.returncode}); log {log}:\n{tail}")
    return time.time() - started


def metric_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curve(output_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in metric_rows(output_dir) if "loss" in row}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def flop_rate(output_dir: Path, stage: str, params: int) -> float | None:
    """The run's FLOP/s: FLOPs per token (SFT 6 x params; DPO 8 x params, the live reference's forward included) x the
    median over its logged steps of ``perf/tokens_per_s``; None when the rows have no such figure."""
    rates = sorted(row["perf/tokens_per_s"] for row in metric_rows(output_dir) if "perf/tokens_per_s" in row)
    if not rates:
        return None
    per_token = training_flops(params, 1) + (forward_flops(params, 1) if stage == "dpo" else 0.0)
    return per_token * rates[len(rates) // 2]


def compare(stage: str, args: argparse.Namespace, work: Path) -> dict:
    budget = args.steps * 2 * args.accumulation * args.batch_size
    if budget > RECORDS[stage]:
        raise SystemExit(f"{stage}: {args.steps} steps x {2 * args.accumulation * args.batch_size} examples leave the "
                         f"first epoch ({RECORDS[stage]} records); lower --steps or --batch-size")
    overrides = [*COMMON, *STAGES[stage], f"max_steps={args.steps}", f"per_device_train_batch_size={args.batch_size}"]
    one_dir, two_dir = work / f"{stage}-1proc", work / f"{stage}-2proc"
    seconds_one = run(stage, 1, [*overrides, f"gradient_accumulation_steps={2 * args.accumulation}"], one_dir,
                      work / f"{stage}-1proc.log")
    seconds_two = run(stage, 2, [*overrides, f"gradient_accumulation_steps={args.accumulation}"], two_dir,
                      work / f"{stage}-2proc.log")
    one, two = curve(one_dir), curve(two_dir)
    if sorted(one) != list(range(1, args.steps + 1)) or sorted(two) != sorted(one):
        raise SystemExit(f"{stage}: logged steps differ: {sorted(one)} vs {sorted(two)}")
    rows, worst = [], {"abs": 0.0, "rel": 0.0, "grad_rel": 0.0}
    for step in sorted(one):
        a, b = one[step], two[step]
        diff, rel, grad_rel = (abs(a["loss"] - b["loss"]), relative(a["loss"], b["loss"]),
                               relative(a["grad_norm"], b["grad_norm"]))
        worst = {"abs": max(worst["abs"], diff), "rel": max(worst["rel"], rel),
                 "grad_rel": max(worst["grad_rel"], grad_rel)}
        rows.append([str(step), f"{a['loss']:.7f}", f"{b['loss']:.7f}", f"{diff:.1e}", f"{rel:.1e}",
                     f"{a['grad_norm']:.5f}", f"{b['grad_norm']:.5f}", f"{grad_rel:.1e}"])
    print_table(["step", "loss, 1 proc", "loss, 2 proc", "|diff|", "rel diff", "grad norm, 1 proc", "grad norm, 2 proc",
                 "rel diff"], rows,
                f"{stage}: 1 process x accumulation {2 * args.accumulation} vs 2 processes x accumulation "
                f"{args.accumulation} (micro-batch {args.batch_size}, "
                f"{2 * args.accumulation * args.batch_size} examples/step)")
    passed = worst["rel"] <= args.tolerance
    return {"stage": stage, "steps": args.steps, **worst, "passed": passed,
            "seconds": (seconds_one, seconds_two),
            "flops": (flop_rate(one_dir, stage, args.params), flop_rate(two_dir, stage, args.params))}


def grpo(args: argparse.Namespace, work: Path) -> list[str]:
    policy = args.grpo_policy
    if policy is None:
        policy = str(work / "warmup-sft")
        run("sft", 1, [*COMMON, *STAGES["sft"], f"max_steps={args.warmup_steps}", "per_device_train_batch_size=16",
                       "logging_steps=50"], Path(policy), work / "warmup-sft.log")
    output_dir = work / "grpo-2proc"
    overrides = [f"model_name_or_path={Path(policy).resolve()}", "finetuning_type=full", "dataset=demo_rl",
                 "dataset_dir=data/demo", "eval_dataset=demo_eval", f"max_samples={args.grpo_prompts}", "seed=0",
                 "reward_funcs=[exact_answer,format]", "reward_weights=[1.0,0.1]", "num_generations=8",
                 "per_device_train_batch_size=16", "gradient_accumulation_steps=1", "max_completion_length=48",
                 "eval_max_new_tokens=48", "temperature=0.8", "beta=0.04", "num_iterations=2",
                 f"max_steps={args.grpo_steps}", "save_steps=3", "logging_steps=1", "learning_rate=2e-5",
                 "eval_before_training=true", "per_device_eval_batch_size=50", "generation_engine=static",
                 "disable_progress_bar=true", "plot_loss=false", "overwrite_output_dir=true",
                 "resume_from_checkpoint=none", "report_to=none"]
    run("grpo", 2, overrides, output_dir, work / "grpo-2proc.log")
    rows = metric_rows(output_dir)
    def cell(row: dict, key: str, digits: int) -> str:  # rollout figures are logged on a rollout's first step
        return f"{row[key]:.{digits}f}" if key in row else "-"

    table = [[str(r["step"]), cell(r, "loss", 5), cell(r, "reward", 3), cell(r, "rewards/exact_answer/mean", 3),
              cell(r, "reward_std", 3), cell(r, "kl", 5), cell(r, "completions/mean_length", 1),
              cell(r, "grad_norm", 4)]
             for r in rows if "loss" in r]
    print_table(["step", "loss", "reward", "exact answer", "reward std (groups)", "kl", "completion tokens",
                 "grad norm"],
                table, f"grpo on 2 processes (4 prompts x 8 samples per rollout, 2 steps per rollout) from {policy}")
    report = json.loads((output_dir / "report.json").read_text())["stages"]
    entry = report[-1]
    before, after = entry.get("eval_before", {}), entry["eval"]
    print_table(["held-out prompts", "before", "after"],
                [[k.removeprefix("eval/"), f"{before.get(k, float('nan')):.4f}", f"{after[k]:.4f}"]
                 for k in ("eval/accuracy", "eval/format_rate", "eval/mean_completion_tokens")],
                f"grpo held-out figures ({args.grpo_prompts} eval prompts, split across the 2 processes)")
    problems = []
    checkpoint = output_dir / "checkpoints" / "checkpoint-3"
    rollouts = sorted(p.name for p in checkpoint.glob("rollout*.safetensors"))
    if rollouts != ["rollout-1.safetensors", "rollout.safetensors"]:
        problems.append(f"checkpoint-3 (inside a rollout) holds {rollouts}, not both processes' rollouts")
    if entry["global_step"] != args.grpo_steps or len(report) != 1:
        problems.append(f"report.json has {len(report)} entries, last at step {entry['global_step']}")
    if not (output_dir / "model.safetensors").is_file():
        problems.append("no final model.safetensors")
    print(f"grpo: {entry['global_step']} steps, checkpoint-3 rollouts {rollouts}, {len(report)} report entry, "
          f"final model {'written' if (output_dir / 'model.safetensors').is_file() else 'MISSING'}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=limits_epilog(
                                         "summary: GFLOP/s = (SFT 6, DPO 8) x parameters x the median logged "
                                         "tokens/s; % of peak against the one-thread peak (the 2-process run against "
                                         "twice it)"))
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps of each SFT / DPO run")
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch per process (B)")
    parser.add_argument("--accumulation", type=int, default=2,
                        help="A: micro-batches per step per process in the 2-process run")
    parser.add_argument("--stages", default="sft,dpo", help="comparisons to run (sft, dpo)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference that passes")
    parser.add_argument("--grpo-steps", type=int, default=6, help="GRPO steps on 2 processes (0: skip)")
    parser.add_argument("--grpo-prompts", type=int, default=100,
                        help="RL prompts and held-out prompts used (max_samples)")
    parser.add_argument("--grpo-policy", default=None,
                        help="policy GRPO starts from (default: a --warmup-steps SFT run)")
    parser.add_argument("--warmup-steps", type=int, default=300, help="single-process SFT steps before GRPO (batch 16)")
    parser.add_argument("--workdir", default=None, help="where runs go (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-mp-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"runs in {work}; RLHF_CACHE={os.environ.get('RLHF_CACHE', '~/.cache/rlhf')}; OMP_NUM_THREADS=1 per process")
    import torch

    sys.path.insert(0, str(REPO))
    import rlhf

    args.params = folder_params(rlhf.resolve_model_path("tiny"))  # model_name_or_path=tiny in every run
    torch.set_num_threads(1)  # as each run's processes (OMP_NUM_THREADS=1)
    limits = Limits("float32").measure()  # before the runs (and again after them)
    results = [compare(stage.strip(), args, work) for stage in args.stages.split(",") if stage.strip()]
    limits.measure()
    if results:
        print(limits.describe())
        print_table(["stage", "steps", "max |loss diff|", "max rel loss diff", "max rel grad-norm diff", "tolerance",
                     "result", "s, 1p / 2p", "GFLOP/s 1p / 2p", "% of peak 1p / 2p"],
                    [[r["stage"], str(r["steps"]), f"{r['abs']:.1e}", f"{r['rel']:.1e}", f"{r['grad_rel']:.1e}",
                      f"{args.tolerance:.0e}", "PASS" if r["passed"] else "FAIL",
                      f"{r['seconds'][0]:.0f} / {r['seconds'][1]:.0f}",
                      f"{giga(r['flops'][0])} / {giga(r['flops'][1])}",
                      f"{fraction(r['flops'][0], limits.peak)} / {fraction(r['flops'][1], 2 * limits.peak)}"]
                     for r in results],
                    "2 processes x A vs 1 process x 2A: the same examples per optimizer step", min_width=170)
        print(f"GFLOP/s = (SFT 6, DPO 8) x {args.params / 1e6:.3f}M parameters x the median logged perf/tokens_per_s; "
              "% of peak: 1 process against the one-thread peak above, 2 processes against twice it")
    problems = [f"{r['stage']}: max relative loss difference {r['rel']:.1e} > {args.tolerance:.0e}"
                for r in results if not r["passed"]]
    if args.grpo_steps:
        problems += grpo(args, work)
    for problem in problems:
        print(f"FAIL {problem}")
    print("PASS" if not problems else "FAIL")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
