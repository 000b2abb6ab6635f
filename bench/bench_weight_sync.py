"""Server-mode weight sync: a safetensors folder against a weight group (``vllm_weight_transfer: files`` against
``collective``), side by side on one ``rlhf.py vllm-serve`` process.

    python bench/bench_weight_sync.py                    # the 110M random-weight Llama of bench_rollouts.py, 3 syncs
    python bench/bench_weight_sync.py --model 23m --repeats 5
    python bench/bench_weight_sync.py --device cuda      # NCCL: the server must run on another GPU than the trainer

Needs vLLM (docs/vllm.md). The server starts once (``rlhf.py vllm-serve --model DIR`` on a free port of
127.0.0.1, its own process), then this process, holding the same model in fp32, syncs it ``--repeats`` times with
each transfer, the transfers alternating, each sync after a small random change to every weight, so each one
changes what the server holds. Timed: ``VLLMClient.load_weights`` end to end (files: write the shards to
/dev/shm, the server's workers read and reload them; collective: the server's workers receive each tensor by
broadcast and reload it as it arrives). The collective transfer's first sync forms the weight group; it is timed
apart ("first s"). After every sync one greedy request checks that the server answers with the new weights: its
first tokens must equal Hugging Face ``generate`` with the trainer's model. "best s" is the fastest sync, MB/s the
weights' bytes over it.

The limit (``bench/limits.py``): a sync moves bytes, so MB/s is set against the memory bandwidth of ``--device``
(the best read of a 256 MiB tensor, with the peak fp32 matmul FLOP/s beside it), measured in this process before the
first sync and after the last (the best of each is kept, printed above the table). "% of bandwidth" = the weights'
bytes / best s / that bandwidth: how far the transfer (serialisation, the socket or NCCL, the server's reload) stays
from one plain read of the same bytes.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_rollouts import SHAPES, demo_prompts, model_dir  # bench/ is on sys.path when run as a script
from limits import Limits, fraction, limits_epilog
from tables import print_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "% of bandwidth = the weights' bytes / best s / the memory bandwidth"))
    parser.add_argument("--model", default="110m", choices=("tiny", *SHAPES), help="the model synced")
    parser.add_argument("--repeats", type=int, default=3, help="syncs timed per transfer")
    parser.add_argument("--device", default="cpu", help="where the trainer's copy lives (cpu, or cuda: NCCL)")
    parser.add_argument("--cache-dir", default=None, help="where the random-weight models are built (default "
                        "$RLHF_CACHE or ~/.cache/rlhf)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(directory: Path, port: int, log) -> subprocess.Popen:
    """``log``: a file for the server's output (a pipe nobody reads would stall it once full)."""
    process = subprocess.Popen([sys.executable, str(REPO / "rlhf.py"), "vllm-serve", "--model", str(directory),
                                "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, text=True)
    client = io.VLLMClient("127.0.0.1", port, retries=1)
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"vllm-serve exited: {log.read()[-2000:]}")
        try:
            client.health()
            return process
        except io.VLLMServerError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("vllm-serve did not answer within 300 s")


def named_weights(model):
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # tied weights once, as the trainer sends them
            seen.add(tensor.data_ptr())
            yield name, tensor.detach()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = io.vllm_missing()
    if missing:
        raise SystemExit(missing)
    from transformers import AutoModelForCausalLM

    directory = model_dir(args.model, argparse.Namespace(cache_dir=args.cache_dir))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(args.device).eval()
    sys.path.insert(0, str(REPO))
    import rlhf

    tokenizer = rlhf.load_tokenizer(directory)
    prompt = demo_prompts(tokenizer, 1)[0]
    params = io.SamplingParams(max_new_tokens=4, do_sample=False)
    weight_bytes = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    port = free_port()
    server = start_server(directory, port, tempfile.TemporaryFile(mode="w+"))
    clients = {transfer: io.VLLMClient("127.0.0.1", port, weight_transfer=transfer)
               for transfer in io.WEIGHT_TRANSFERS}
    seconds: dict[str, list[float]] = {transfer: [] for transfer in clients}
    first: dict[str, float] = {}
    limits = Limits("float32", device=args.device).measure()  # before the first sync (and again after the last)
    try:
        for repeat in range(args.repeats + 1):  # the first round forms the weight group: timed apart
            for transfer, client in clients.items():
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(torch.randn_like(parameter), alpha=1e-3)
                started = time.perf_counter()
                client.load_weights(lambda: named_weights(model))
                took = time.perf_counter() - started
                (seconds[transfer].append(took) if repeat else first.__setitem__(transfer, took))
                got = client.generate([prompt], params).token_ids[0]
                with torch.no_grad():
                    want = model.generate(torch.tensor([prompt], device=args.device), max_new_tokens=4,
                                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                if got != want:
                    raise SystemExit(f"{transfer}: the server answered {got} after the sync, "
                                     f"the trainer's model {want}")
                print(f"  round {repeat}: {transfer} {took:.3f} s", flush=True)
        limits.measure()
    finally:
        server.kill()
        server.wait(timeout=30)
    rows = []
    for transfer, times in seconds.items():
        best = min(times)
        rows.append([transfer, f"{weight_bytes / 1e6:,.0f}", f"{first[transfer]:.3f}", f"{best:.3f}",
                     f"{sum(times) / len(times):.3f}", f"{weight_bytes / 1e6 / best:,.0f}",
                     fraction(weight_bytes / best, limits.bandwidth)])
    params_count = sum(p.numel() for p in model.parameters())
    print(limits.describe("measured before the first sync and after the last"))
    print_table(["transfer", "MB", "first s", "best s", "mean s", "MB/s", "% of bandwidth"], rows,
                title=f"Server-mode weight sync: {args.model} ({params_count / 1e6:.1f}M parameters, fp32), "
                      f"{args.repeats} syncs each, trainer on {args.device}")
    print("first s = the first sync (collective: forms the weight group); every sync was checked: the server's "
          "greedy tokens equal the trainer's model's; % of bandwidth = MB/s / the memory bandwidth above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
