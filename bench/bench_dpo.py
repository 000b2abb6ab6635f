"""DPO speed and memory: ``rlhf.DPOTrainer`` against TRL's ``DPOTrainer`` on the same work.

    python bench/bench_dpo.py                      # 256 pairs, batch 8, cutoff 128, 20 steps (2 warm-up), 2 threads
    python bench/bench_dpo.py --variants precompute --steps 40 --repeats 3

Two variants, each run by both trainers:
  * live: a frozen reference model is kept in memory and run on every batch;
  * precompute: the reference log-probs of the whole training set are computed once before training
    (TRL: ``DPOConfig(precompute_ref_log_probs=True)``; ours: ``rlhf.DPOConfig(precompute_ref_log_probs=True)``)
    and the reference model is not run during the steps.

Both trainers get the same work: the embedded tiny Llama (``rlhf.resolve_model_path("tiny")``), full fine-tuning,
fp32, the same attention implementation, no gradient checkpointing (TRL turns it on by default; ours does not); the
first ``--records`` pairs of ``data/demo/preference.jsonl`` rendered with the tokenizer's ChatML template (TRL gets
them in its conversational format so it applies the same template); cutoff / max_length ``--seq-len``; batch
``--batch-size`` pairs per optimizer step, no gradient accumulation; the fused ``torch.optim.AdamW`` with the same lr /
betas / eps (ours: ``optim="adamw_torch_fused"``; TRL: the same, transformers 5's default), no weight decay, a constant
learning rate without warm-up, gradient clipping at 1.0; the sigmoid loss with beta ``--beta``; CPU, ``--threads`` torch
threads, seed 0; no evaluation, no checkpoints.

Every measurement runs in its own subprocess (``--worker ours|trl --variant live|precompute``, one JSON line on
stdout), so the peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``: Python, the imported libraries, models,
optimizer state, data) belongs to that run alone. Workers run one at a time.

Time per optimizer step. TRL: a ``TrainerCallback`` stamps ``on_step_begin`` and ``on_step_end`` (forward and backward
of policy and live reference, clipping, optimizer and scheduler step). Ours: the ``perf/step_seconds`` of each
``result.history`` row (``logging_steps=1``); where that key is missing, ``DPOTrainer._optimizer_step`` is timed.
The first ``--warmup`` steps are dropped. The "cycle" column is the time from the end of one step to the end of the
next, measured the same way for both (it adds the trainer's own work between steps: fetching and collating the
batch, logging); when the step and cycle ratios disagree, the two step timers cover different work. Precomputing the
reference log-probs is timed separately (its own column) and is not part of any step. Model loading, tokenisation
and the final save are not timed.

The verdict compares the median seconds per step (``--metric cycle`` to use the cycle instead) against
``--target-time`` (default: ours <= 0.6x TRL) and the peak memory against ``--target-memory`` (default: ours <= 1.0x
TRL). With ``--repeats`` > 1 the order of the trainers alternates and each row shows the best median time and the
highest peak memory over the repeats. On 2 cores another busy process slows a run many times over, so the driver
measures the CPU the rest of the machine used during each run ("bg cores": /proc/stat minus the worker's own CPU time)
and warns above ``--max-background``. The exit status is 0 whatever the timing (non-zero only if a run breaks).

The limit (``bench/limits.py``): the peak fp32 matmul FLOP/s at ``--threads`` threads and the memory bandwidth are
measured before the first worker and after the last (the best of each is kept, printed above the table), each time in
a subprocess of its own, so its 256 MiB buffer counts in no worker's peak memory. Every worker counts the non-padding
tokens of each optimizer step's batch (the attention-mask sum: prompt + chosen and prompt + rejected of every pair;
ours in ``_optimizer_step``, TRL in ``training_step``), the same for both trainers. "GFLOP/s" = (6 x parameters x
tokens, the policy's forward and backward, + 2 x parameters x tokens for the live reference's forward in the live
variant) per step, mean over the timed steps, / the median seconds per step; parameters = the model's
``model_params`` (all of them, the tied embedding once); attention's own FLOPs ignored; ours may run a pair's
shared prompt once, which this count (the workload's) does not credit. "% of peak" = GFLOP/s / the peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from limits import Limits, forward_flops, fraction, giga, limits_epilog, training_flops  # bench/limits.py
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "demo" / "preference.jsonl"
MARK = "BENCH_DPO_RESULT "
IMPLS = ("ours", "trl")
VARIANTS = ("live", "precompute")
LABELS = {"ours": "ours (rlhf)", "trl": "TRL"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GFLOP/s = (6 x parameters x tokens per step, + 2 x parameters x tokens for "
                                         "the live reference) / median s per step; % of peak = that / the peak matmul"
                                         " FLOP/s"))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--batch-size", type=int, default=8, help="preference pairs per optimizer step")
    parser.add_argument("--seq-len", type=int, default=128, help="cutoff_len / max_length: tokens per sequence at most")
    parser.add_argument("--records", type=int, default=256, help="use the first N pairs of data/demo/preference.jsonl")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant, no warm-up)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (sigmoid loss)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: live, precompute")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated: ours, trl")
    parser.add_argument("--repeats", type=int, default=1, help="runs per trainer and variant (order alternates)")
    parser.add_argument("--metric", choices=("step", "cycle"), default="step",
                        help="time the verdict uses: the step timers or the end-to-end cycle")
    parser.add_argument("--target-time", type=float, default=0.6, help="target: ours / TRL seconds per step at most")
    parser.add_argument("--target-memory", type=float, default=1.0, help="target: ours / TRL peak memory at most")
    parser.add_argument("--max-background", type=float, default=0.25,
                        help="warn when other processes used more CPU cores than this during a run")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's raw results to this file")
    # internal: one measurement in this process
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--attn", default="sdpa", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batch_size, args.seq_len, args.records, args.threads, args.repeats) < 1 or args.warmup < 0:
        parser.error("--batch-size, --seq-len, --records, --threads and --repeats must be >= 1, --warmup >= 0")
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    args.variants = _choices(parser, args.variants, VARIANTS, "--variants")
    args.impls = _choices(parser, args.impls, IMPLS, "--impls")
    return args


def _choices(parser: argparse.ArgumentParser, value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    picked = [v.strip() for v in value.split(",") if v.strip()]
    if not picked or any(v not in allowed for v in picked):
        parser.error(f"{flag}: comma-separated values from {', '.join(allowed)}")
    return picked


# -- worker side: one trainer, one variant, in this process ---------------------------------------------------------


def rss_mib() -> float:
    """Current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def read_pairs(n: int) -> list[dict[str, str]]:
    pairs = []
    with open(DATA) as f:
        for line in f:
            if line.strip():
                pairs.append(json.loads(line))
            if len(pairs) == n:
                break
    return pairs


def trl_step_timer():
    """A transformers ``TrainerCallback`` that stamps each optimizer step's begin and end (``begins``, ``ends``):
    TRL's seconds per step, for the benches that compare with it."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    return StepTimer()


def batch_tokens(batch: dict) -> int:
    """Non-padding tokens of one collated batch: its attention-mask sum (all of ``input_ids`` without a mask), as
    rlhf's trainers count them for ``perf/tokens_per_s``; used for both trainers' steps."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def count_trl_tokens(trainer, counts: list[int]) -> None:
    """Append the non-padding tokens of every batch TRL's ``training_step`` trains on to ``counts`` (wraps the
    instance's method; the real one runs)."""
    inner = trainer.training_step

    def counted(model, inputs, *args, **kwargs):
        counts.append(batch_tokens(inputs))
        return inner(model, inputs, *args, **kwargs)

    trainer.training_step = counted


def step_times(begins: list[float], ends: list[float], warmup: int) -> dict:
    """Per-step seconds (begin -> end) and cycle seconds (previous end -> end) of the timed steps."""
    cycles = [b - a for a, b in zip(ends, ends[1:])]  # cycles[k - 1] ends at step k
    return {"step": [e - b for b, e in zip(begins, ends)][warmup:], "cycle": cycles[max(warmup - 1, 0):]}


def run_trl(args: argparse.Namespace, precompute: bool) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    base = rss_mib()

    precompute_seconds: list[float] = []
    inner = trl.DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **kw):
        started = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            precompute_seconds.append(time.perf_counter() - started)

    trl.DPOTrainer._precompute_ref_logps = timed_precompute

    # conversational format, so that TRL renders prompt and answers with the model's chat template, as ours does
    rows = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in read_pairs(args.records)]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    # no activation checkpointing (TRL's default is on, ours off); transformers 5 renamed the option and warns when
    # only the old name is set
    checkpointing = {"gradient_checkpointing": False}
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(trl.DPOConfig)}:
        checkpointing["activation_checkpointing"] = False
    config = trl.DPOConfig(
        **checkpointing, output_dir=str(Path(args.workdir) / "trl"), seed=0, use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": args.attn},
        max_length=args.seq_len, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, beta=args.beta, loss_type=["sigmoid"], precompute_ref_log_probs=precompute,
        report_to=[], logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False)
    timer = trl_step_timer()
    started = time.perf_counter()
    trainer = trl.DPOTrainer(model=args.model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[timer])
    tokens: list[int] = []
    count_trl_tokens(trainer, tokens)
    setup = time.perf_counter() - started
    loaded = rss_mib()
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    if output.global_step != args.steps or len(timer.ends) != args.steps:
        raise RuntimeError(f"TRL ran {output.global_step} steps ({len(timer.ends)} timed), expected {args.steps}")
    return {**step_times(timer.begins, timer.ends, args.warmup), "step_source": "on_step_begin/on_step_end",
            "step_tokens": tokens[args.warmup:],
            "precompute": sum(precompute_seconds) if precompute else None, "setup": setup, "wall": wall,
            "mean_loss": output.training_loss, "reference_in_memory": trainer.ref_model is not None,
            "rss_base": base, "rss_loaded": loaded, "version": f"trl {trl.__version__}"}


def run_ours(args: argparse.Namespace, precompute: bool) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import rlhf

    base = rss_mib()
    missing = [name for name in ("DPOConfig", "train_dpo") if not hasattr(rlhf, name)]
    if missing:
        raise SystemExit(f"rlhf has no {' / '.join(missing)} yet: our DPO side cannot run (rlhf.py at {rlhf.__file__})")

    # time every optimizer step (the fallback timer and the cycle); the real method runs
    begins: list[float] = []
    ends: list[float] = []
    tokens: list[int] = []
    trainer_cls = rlhf.DPOTrainer
    inner_step = trainer_cls._optimizer_step

    def timed_step(self, group, window):
        tokens.append(sum(batch_tokens(batch) for batch in group))
        begins.append(time.perf_counter())
        try:
            return inner_step(self, group, window)
        finally:
            ends.append(time.perf_counter())

    trainer_cls._optimizer_step = timed_step
    precompute_seconds: list[float] = []
    if hasattr(rlhf, "precompute_ref_log_probs"):
        inner_pre = rlhf.precompute_ref_log_probs

        def timed_precompute(*a, **kw):
            started = time.perf_counter()
            try:
                return inner_pre(*a, **kw)
            finally:
                precompute_seconds.append(time.perf_counter() - started)

        rlhf.precompute_ref_log_probs = timed_precompute

    data = Path(args.workdir) / "preference.jsonl"
    with open(data, "w") as f:
        for pair in read_pairs(args.records):
            f.write(json.dumps({k: pair[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    config = rlhf.DPOConfig(
        model_name_or_path=args.model_dir, dataset=str(data), dataset_dir=str(data.parent), cutoff_len=args.seq_len,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch_fused", pref_beta=args.beta, pref_loss="sigmoid",
        precompute_ref_log_probs=precompute, finetuning_type="full",
        attn_implementation=args.attn, gradient_checkpointing=False, output_dir=str(Path(args.workdir) / "ours"),
        save_steps=0, logging_steps=1, disable_progress_bar=True, report_to="none", seed=0,
        resume_from_checkpoint="none")
    started = time.perf_counter()
    result = rlhf.train_dpo(config)
    wall = time.perf_counter() - started
    if len(ends) != args.steps:
        raise RuntimeError(f"ours ran {len(ends)} optimizer steps, expected {args.steps}")
    times = step_times(begins, ends, args.warmup)
    source = "_optimizer_step"
    history = sorted((row for row in result.history if "step" in row), key=lambda row: row["step"])
    timed_rows = [row for row in history if "perf/step_seconds" in row]
    if len(timed_rows) == args.steps:
        times["step"] = [float(row["perf/step_seconds"]) for row in timed_rows][args.warmup:]
        source = "history perf/step_seconds"
    losses = [float(row["loss"]) for row in history if "loss" in row]
    return {**times, "step_source": source, "step_tokens": tokens[args.warmup:],
            "precompute": sum(precompute_seconds) if precompute else None,
            "setup": None, "wall": wall, "mean_loss": statistics.fmean(losses) if losses else None,
            "reference_in_memory": None, "rss_base": base, "rss_loaded": None,
            "version": f"rlhf {getattr(rlhf, '__version__', '')}".strip()}


def worker(args: argparse.Namespace) -> int:
    if not (args.variant and args.model_dir and args.workdir):
        raise SystemExit("--worker needs --variant, --model-dir and --workdir")
    run = run_ours if args.worker == "ours" else run_trl
    result = run(args, args.variant == "precompute")
    result.update(impl=args.worker, variant=args.variant, peak_rss=peak_rss_mib())
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)
    return 0


# -- driver side: run the workers one by one and print the table -----------------------------------------------------


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_measured(command: list[str], threads: int, mark: str) -> dict:
    """Run one worker process quietly on ``threads`` threads and return the JSON it printed after ``mark``,
    plus its wall time ("process") and the CPU other processes used meanwhile ("background", in cores);
    on failure ``{"error": the last lines of its output}``. Shared by the benches that compare with TRL."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "PYTHONWARNINGS": "ignore", "WANDB_DISABLED": "true", "HF_HUB_OFFLINE": "1"}
    busy, own, started = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    # other processes' CPU use while the worker ran, in cores: what the machine did minus what the worker did
    background = max(0.0, (busy_cpu_seconds() - busy) - (children_cpu_seconds() - own)) / elapsed
    lines = [line for line in proc.stdout.splitlines() if line.startswith(mark)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-12:]
        return {"error": "\n".join(tail) or f"exit status {proc.returncode}"}
    return {**json.loads(lines[-1][len(mark):]), "process": elapsed, "background": background}


def run_worker(args: argparse.Namespace, impl: str, variant: str, model_dir: str, attn: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-dpo-{impl}-{variant}-") as tmp:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--variant", variant,
                   "--model-dir", model_dir, "--attn", attn, "--workdir", tmp, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                   "--records", str(args.records), "--threads", str(args.threads), "--lr", repr(args.lr),
                   "--beta", repr(args.beta)]
        result = run_measured(command, args.threads, MARK)
    return {"impl": impl, "variant": variant, **result} if "error" in result else result


def bench_setup() -> tuple:
    """(torch, the tiny model's directory, the attention our trainer picks on CPU, TRL's version) for the header."""
    sys.path.insert(0, str(REPO))
    import torch

    import rlhf

    try:
        from importlib.metadata import version

        trl_version = version("trl")
    except Exception:  # only for the header line
        trl_version = "not installed"
    # TRL gets the same attention implementation as ours
    return torch, rlhf.resolve_model_path("tiny"), rlhf.select_attention_implementation("auto", "cpu")[0], trl_version


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def summarise(runs: list[dict]) -> dict:
    """One row from the repeats of one trainer and variant: best median time, highest peak memory."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    best = min(ok, key=lambda r: statistics.median(r["step"]))
    precomputes = [r["precompute"] for r in ok if r["precompute"] is not None]
    return {"step": min(statistics.median(r["step"]) for r in ok),
            "mean": min(statistics.fmean(r["step"]) for r in ok),
            "cycle": min(statistics.median(r["cycle"]) for r in ok),
            "precompute": min(precomputes) if precomputes else None,
            "peak": max(r["peak_rss"] for r in ok), "base": max(r["rss_base"] for r in ok),
            "background": max(r["background"] for r in ok),
            "timed": len(best["step"]), "runs": len(ok), "source": best["step_source"],
            "mean_loss": best["mean_loss"], "version": best["version"],
            "tokens": statistics.fmean(best["step_tokens"]) if best.get("step_tokens") else None}


def step_flops(params: int, tokens: float | None, live_reference: bool) -> float | None:
    """A DPO step's FLOPs: the policy's forward and backward over the step's tokens, plus the live reference's
    forward when it runs on every batch."""
    if tokens is None:
        return None
    return training_flops(params, tokens) + (forward_flops(params, tokens) if live_reference else 0.0)


HEADERS = ["variant", "trainer", "timed steps", "s/step median", "s/step mean", "cycle s median", "precompute s",
           "tokens per step", "GFLOP/s", "% of peak", "base MiB", "peak MiB", "time ours/TRL", "memory ours/TRL",
           "bg cores"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    torch, model_dir, attn, trl_version = bench_setup()
    print(f"model {Path(model_dir).name} ({attn}): full fine-tuning, fp32, CPU, threads {args.threads}; first "
          f"{args.records} pairs of {DATA.relative_to(REPO)}, cutoff {args.seq_len}, batch {args.batch_size} pairs, "
          f"lr {args.lr:g} constant, beta {args.beta:g} sigmoid; {args.steps} steps, first {args.warmup} untimed; "
          f"torch {torch.__version__}, trl {trl_version}")

    # the limits in a process of their own (not this one, whose peak memory every worker's ru_maxrss starts from)
    limits = Limits("float32")
    params = limits.measure_in_subprocess(args.threads, model=model_dir)["params"]
    runs: dict[tuple[str, str], list[dict]] = {}
    for variant in args.variants:
        for repeat in range(args.repeats):
            order = args.impls if repeat % 2 == 0 else args.impls[::-1]
            for impl in order:
                result = run_worker(args, impl, variant, model_dir, attn)
                runs.setdefault((variant, impl), []).append(result)
                if "error" in result:
                    print(f"{variant} / {LABELS[impl]} (repeat {repeat + 1}) FAILED:\n  "
                          + result["error"].replace("\n", "\n  "))
                else:
                    pre = "" if result["precompute"] is None else f", precompute {result['precompute']:.2f}s"
                    print(f"{variant} / {LABELS[impl]} (repeat {repeat + 1}): median step "
                          f"{statistics.median(result['step']):.4f}s ({result['step_source']}){pre}, peak "
                          f"{result['peak_rss']:.0f} MiB, mean training loss {_fmt(result['mean_loss'])}, "
                          f"process {result['process']:.1f}s, background load {result['background']:.2f} cores")
                    if result["background"] > args.max_background:
                        print(f"  warning: other processes used {result['background']:.2f} CPU cores during this run "
                              f"(> {args.max_background:g}); its times are not trustworthy, rerun on a quiet machine")
    limits.measure_in_subprocess(args.threads)
    if args.json:
        args.json.write_text(json.dumps({**{f"{v}/{i}": r for (v, i), r in runs.items()},
                                         "limits": {**limits.to_json(), "params": params}}, indent=1))

    rows, verdicts = [], []
    summary = {key: summarise(value) for key, value in runs.items()}
    for variant in args.variants:
        ours, theirs = summary.get((variant, "ours")), summary.get((variant, "trl"))
        both = ours and theirs and "error" not in ours and "error" not in theirs
        for impl in args.impls:
            s = summary[(variant, impl)]
            if "error" in s:
                rows.append([variant, LABELS[impl], "failed"] + ["-"] * (len(HEADERS) - 3))
                continue
            time_ratio = mem_ratio = "-"
            if both and impl == "ours":
                time_ratio = f"{s[args.metric] / theirs[args.metric]:.2f}x"
                mem_ratio = f"{s['peak'] / theirs['peak']:.2f}x"
            flops = step_flops(params, s["tokens"], variant == "live")
            rate = flops / s["step"] if flops is not None else None
            rows.append([variant, LABELS[impl], f"{s['timed']}x{s['runs']}", f"{s['step']:.4f}", f"{s['mean']:.4f}",
                         f"{s['cycle']:.4f}", "-" if s["precompute"] is None else f"{s['precompute']:.2f}",
                         "-" if s["tokens"] is None else f"{s['tokens']:.0f}", giga(rate), fraction(rate, limits.peak),
                         f"{s['base']:.0f}", f"{s['peak']:.0f}", time_ratio, mem_ratio, f"{s['background']:.2f}"])
        if both:
            t, m = ours[args.metric] / theirs[args.metric], ours["peak"] / theirs["peak"]
            ok_t, ok_m = t <= args.target_time, m <= args.target_memory
            verdicts.append(f"{'PASS' if ok_t and ok_m else 'FAIL'} {variant}: time {t:.2f}x TRL "
                            f"(target <= {args.target_time:g}x, {'met' if ok_t else 'missed'}; {args.metric}), "
                            f"peak memory {m:.2f}x TRL (target <= {args.target_memory:g}x, "
                            f"{'met' if ok_m else 'missed'}); cycle ratio {ours['cycle'] / theirs['cycle']:.2f}x"
                            + ("; MACHINE BUSY, times unreliable"
                               if max(ours["background"], theirs["background"]) > args.max_background else ""))
        elif len(args.impls) < 2:
            verdicts.append(f"n/a {variant}: no ratio, only {LABELS[args.impls[0]]} was run (--impls)")
        else:
            verdicts.append(f"n/a {variant}: no ratio, a trainer's run broke")
    print(limits.describe())
    print_table(HEADERS, rows, f"DPO: batch {args.batch_size} pairs, cutoff {args.seq_len}, threads {args.threads}, "
                f"fp32 CPU (seconds per optimizer step; peak = max RSS of the run's process)", label_columns=2,
                wrap_values=True, min_width=170)
    print(f"tokens per step = non-padding tokens of the step's batch (prompt + chosen, prompt + rejected), mean over "
          f"the timed steps; GFLOP/s = (6 x {params / 1e6:.3f}M parameters x tokens, + 2 x parameters x tokens for the "
          "live reference's forward) / median s/step, attention FLOPs ignored; % of peak = that / the peak matmul "
          "FLOP/s above")
    for line in verdicts:
        print(line)
    return 1 if any("error" in r for value in runs.values() for r in value) else 0


if __name__ == "__main__":
    sys.exit(main())
