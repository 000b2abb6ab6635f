"""The machine's limits every bench sets its rows against: the peak matmul FLOP/s and the memory bandwidth, measured
in the same run as the timings, and the FLOP and byte counts that turn a row's seconds into a fraction of them.

    python bench/limits.py                             # this machine: peak fp32 matmul and bandwidth, one line
    python bench/limits.py --threads 1 --dtype bfloat16 --json

Peak FLOP/s: the best of ``repeats`` timings of one square ``torch.matmul`` (``matmul_size``, default 1024 on a CPU and
8192 on a GPU) in the bench's dtype, on random data, at the thread count torch runs with then. Bandwidth: the best
bytes/s of summing a 256 MiB float32 tensor (every byte read once), which is what a decode step, a weight copy or a
merge can use at most. Each bench measures both before and after its timed work and keeps the best of each, so a
burst of background load during one measurement does not lower the limit. Achieved FLOP/s count the model's
matmuls only: ``training_flops`` = 6 x parameters x tokens (forward 2, backward 4), ``forward_flops`` = 2 x parameters
x tokens; attention's own FLOPs (the score and value products, which grow with the context) are ignored, so a
fraction slightly understates the work at long contexts. "Parameters" are ``model_params``: every parameter once
(tied embeddings once: they are the output head) less an untied input embedding table, which a token only indexes.

Benches that run their measurements in subprocesses and report those processes' peak resident memory (``ru_maxrss``,
which a child inherits from its parent across fork and exec) measure the limits in a subprocess too
(``measure_limits_in_subprocess``), so the 256 MiB buffer counts in no run's memory. torch is imported lazily: the
pure helpers import without it (bench_real_learning's driver keeps torch out of its own process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

MARK = "BENCH_LIMITS_RESULT "
BANDWIDTH_BYTES = 256 * 2**20  # the tensor bandwidth_peak reads
DEFAULT_WHEN = "measured before and after the timed runs"


# -- pure helpers: no torch -----------------------------------------------------------------------------------------


def training_flops(params: float, tokens: float) -> float:
    """FLOPs of a forward and backward pass over ``tokens`` tokens: 6 x params x tokens (2 forward, 4 backward).
    Attention's score and value products are ignored."""
    return 6 * params * tokens


def forward_flops(params: float, tokens: float) -> float:
    """FLOPs of a forward pass (no backward) over ``tokens`` tokens: 2 x params x tokens, attention ignored. Sampling
    a token is one such forward; so is a reference model's or an old-log-prob pass."""
    return 2 * params * tokens


def rl_step_flops(params: float, generated: float, trained: float, extra_forward: float = 0.0) -> float:
    """One online-RL step: sampling ``generated`` tokens (2 x params each; prompt prefill not counted), a forward and
    backward over the ``trained`` tokens (prompt + completion of every trained row, 6 x params each), and forwards
    without backward over ``extra_forward`` tokens (a reference model, old log-probs: 2 x params each)."""
    return forward_flops(params, generated) + training_flops(params, trained) + forward_flops(params, extra_forward)


def fraction(achieved: float | None, peak: float | None) -> str:
    """``achieved / peak`` as a percentage with one decimal ("12.3%"); "-" when either is missing, not finite, or
    the peak is not positive."""
    if achieved is None or peak is None or not (math.isfinite(achieved) and math.isfinite(peak)) or peak <= 0:
        return "-"
    return f"{achieved / peak:.1%}"


def giga(value: float | None, digits: int = 2) -> str:
    """``value`` / 1e9 with ``digits`` decimals ("-" when missing or not finite): the GFLOP/s and GB/s cells."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value / 1e9:.{digits}f}"


def dtype_name(dtype) -> str:
    """"float32" for torch.float32 or "float32"."""
    return str(dtype).removeprefix("torch.")


def describe_limits(peaks: list[float], bandwidths: list[float], dtype, matmul_size: int,
                    when: str = DEFAULT_WHEN) -> str:
    """The one line every bench prints above its table: the best peak and bandwidth and every measurement."""
    if not peaks or not bandwidths:
        return "peak matmul and memory bandwidth: not measured"
    return (f"peak {dtype_name(dtype)} matmul: {max(peaks) / 1e9:.1f} GFLOP/s ({matmul_size}^2 torch.matmul, best of "
            f"{', '.join(f'{p / 1e9:.1f}' for p in peaks)} {when}); memory bandwidth: {max(bandwidths) / 1e9:.1f} "
            f"GB/s (best read of a 256 MiB tensor, {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)})")


def limits_epilog(columns: str) -> str:
    """The --help epilog of a bench: what its limit columns count (``columns``) and how the limits are measured."""
    return (f"Limit columns: {columns}. The peak matmul FLOP/s and the memory bandwidth are measured in the same run "
            "(bench/limits.py), before and after the timed work, best of each; attention FLOPs are ignored. The "
            "script's docstring says exactly what each row counts.")


def default_matmul_size(device) -> int:
    return 8192 if str(device).startswith("cuda") else 1024


# -- measurements (torch) -------------------------------------------------------------------------------------------


def _torch_dtype(dtype):
    import torch

    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def synchronize(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(size: int, device, dtype, repeats: int = 5) -> float:
    """Best FLOP/s of a square torch.matmul in ``dtype`` on ``device`` (random data, not zeros)."""
    import torch

    dtype = _torch_dtype(dtype)
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def bandwidth_peak(device, repeats: int = 5) -> float:
    """Best bytes/s of reading a 256 MiB tensor (a sum) on ``device``: the memory bandwidth a decode step, which
    reads every weight once, can use at most."""
    import torch

    data = torch.ones(BANDWIDTH_BYTES // 4, device=device)  # written once, so every page is real memory
    data.sum()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def measure_limits(device="cpu", dtype="float32", matmul_size: int | None = None) -> tuple[float, float]:
    """(peak matmul FLOP/s in ``dtype``, memory bandwidth in bytes/s) on ``device``, in this process at its current
    torch thread count; well under a second on a CPU with the default size."""
    size = matmul_size or default_matmul_size(device)
    return matmul_peak(size, device, dtype), bandwidth_peak(device)


def model_params(model) -> int:
    """Parameters a token's forward multiplies by: every parameter once (``parameters()`` yields tied ones once),
    less the input embedding table when it is not tied to the output head (a lookup, not a matmul)."""
    total = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and (head is None or head.weight is not embedding.weight):
        total -= embedding.weight.numel()
    return total


def model_weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: those of ``model_params`` in their stored dtype."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = embedding.weight if embedding is not None and (head is None or head.weight is not embedding.weight) else None
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def folder_params(directory) -> int:
    """``model_params`` of the causal LM saved in ``directory``, from its config alone (built on the meta device:
    no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_params(model)


class Limits:
    """The limits measured several times in one bench run (before and after its timed work); the best of each."""

    def __init__(self, dtype="float32", matmul_size: int | None = None, device="cpu") -> None:
        self.dtype, self.device = dtype_name(dtype), str(device)
        self.matmul_size = matmul_size or default_matmul_size(device)
        self.peaks: list[float] = []
        self.bandwidths: list[float] = []

    def measure(self) -> Limits:
        """One measurement in this process."""
        self.add(*measure_limits(self.device, self.dtype, self.matmul_size))
        return self

    def measure_in_subprocess(self, threads: int, *, model: str | Path | None = None,
                              pin_kernels: bool = False) -> dict:
        """One measurement in a subprocess (see ``measure_limits_in_subprocess``); returns its result."""
        result = measure_limits_in_subprocess(threads, self.dtype, self.matmul_size, device=self.device, model=model,
                                              pin_kernels=pin_kernels)
        self.add(result["peak"], result["bandwidth"])
        return result

    def add(self, peak: float, bandwidth: float) -> None:
        self.peaks.append(peak)
        self.bandwidths.append(bandwidth)

    @property
    def peak(self) -> float:
        return max(self.peaks) if self.peaks else float("nan")

    @property
    def bandwidth(self) -> float:
        return max(self.bandwidths) if self.bandwidths else float("nan")

    def describe(self, when: str = DEFAULT_WHEN) -> str:
        return describe_limits(self.peaks, self.bandwidths, self.dtype, self.matmul_size, when)

    def to_json(self) -> dict:
        return {"peak": self.peak, "bandwidth": self.bandwidth, "peaks": self.peaks, "bandwidths": self.bandwidths,
                "dtype": self.dtype, "matmul_size": self.matmul_size}


def measure_limits_in_subprocess(threads: int, dtype="float32", matmul_size: int | None = None, *, device="cpu",
                                 model: str | Path | None = None, pin_kernels: bool = False) -> dict:
    """``measure_limits`` in a fresh ``python bench/limits.py`` process on ``threads`` threads (``OMP_NUM_THREADS``
    too, as the benches' workers run), so its buffers count in no other process's peak memory. With ``model``, also
    that folder's ``folder_params`` ("params"). With ``pin_kernels``, the CPU kernels are pinned first as rlhf's CLI
    does (``inference_optimizations.pin_cpu_kernels``), for benches whose workers pin them. Returns {"peak",
    "bandwidth", "params" (None without ``model``)}; raises RuntimeError when the process fails."""
    command = [sys.executable, str(Path(__file__).resolve()), "--threads", str(threads), "--dtype", dtype_name(dtype),
               "--device", str(device), "--json"]
    if matmul_size:
        command += ["--matmul-size", str(matmul_size)]
    if model is not None:
        command += ["--model", str(model)]
    if pin_kernels:
        command.append("--pin-kernels")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-12:])
        raise RuntimeError(f"measuring the limits failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(MARK):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", help="the matmul's dtype (float32, bfloat16, float16)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--matmul-size", type=int, default=None, help="side of the square matmul (default 1024 on "
                        "cpu, 8192 on cuda)")
    parser.add_argument("--model", default=None, help="also count this model folder's parameters (model_params)")
    parser.add_argument("--pin-kernels", action="store_true", help="pin the CPU kernels first, as rlhf's CLI does")
    parser.add_argument("--json", action="store_true", help="print one machine-readable line")
    args = parser.parse_args(argv)
    if args.pin_kernels:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import inference_optimizations

        inference_optimizations.pin_cpu_kernels()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.matmul_size or default_matmul_size(args.device)
    peak, bandwidth = measure_limits(args.device, args.dtype, size)
    params = folder_params(args.model) if args.model else None
    if args.json:
        print(MARK + json.dumps({"peak": peak, "bandwidth": bandwidth, "params": params, "threads":
                                 torch.get_num_threads()}), flush=True)
    else:
        print(describe_limits([peak], [bandwidth], args.dtype, size, f"on {torch.get_num_threads()} thread(s)")
              + (f"; {args.model}: {params / 1e6:.2f}M parameters" if params else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
