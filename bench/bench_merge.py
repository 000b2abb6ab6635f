"""Streaming merge memory: a TIES merge of several ~200 MB checkpoints, streaming versus loading them whole.

    python bench/bench_merge.py                        # base + 3 fine-tuned Llama checkpoints of ~200 MB, TIES 0.5
    python bench/bench_merge.py --repeats 3 --workdir /tmp/bench-merge   # keep the checkpoints between runs

The driver writes random-weight Llama checkpoints in fp32 (hidden 1024, MLP 2048, 4 layers, vocabulary 8000,
tied embeddings: 50.1M parameters, 200 MB each), saved as safetensors shards of ``--shard-size`` with an index and
a config.json, as ``save_pretrained`` lays them out: a base and ``--models`` fine-tuned copies (base + N(0, 1e-3)
noise, one seed each). Each measurement is a subprocess (``--worker streaming|whole``) that merges the fine-tuned
models onto the base with TIES (density ``--density``, weights 1, lambda 1) into a new directory:

  * streaming: ``model_merging.ModelMerger(MergeConfig(...)).merge()``: every tensor is read in row chunks of
    about ``--chunk-elements`` entries per model with positioned reads, merged in float32 and appended to the
    output shard; TIES makes a first pass per model to find its magnitude threshold.
  * whole: what a merge script usually does: ``safetensors.torch.load_file`` every shard of every model, then
    ``model_merging.ties`` per tensor on the whole tensors (PEFT's semantics), the merged state dict kept in
    memory and saved with ``save_file`` at the end.

Memory is the worker's peak resident set size (``VmHWM`` in /proc/self/status: the Python interpreter, torch and
everything the merge touched; not ``ru_maxrss``, which Linux carries over from the driver across ``exec``). The worker
also reports its resident size right after its imports, before it reads a checkpoint (the "baseline": Python + torch
alone); "peak - baseline" is what the merge itself added. Both are printed, against one checkpoint's size on disk; the
target is a streaming peak of at most 1.5x one model. Before every worker the driver reads all checkpoint files once so
each mode starts with the same warm page cache (page cache is not part of a process's resident size), and measures the
CPU other processes used meanwhile ("bg cores"; times on a busy 2-core machine are not trustworthy). Both outputs are
compared tensor by tensor at the end: the streaming trim keeps exactly PEFT's top-k set unless magnitudes tie at the
threshold, where either choice is arbitrary; the fine-tuned - base differences of float32 weights are quantised, so a
few such ties do occur.

The limit (``bench/limits.py``): a merge is bound by memory traffic, so each row is set against the memory bandwidth,
measured in this (the driver's) process at ``--threads`` threads before the first worker and after the last (the best
of each is kept, printed above the table, with the peak fp32 matmul FLOP/s); the workers' peak is VmHWM, which the
driver's buffers do not reach. "GB/s moved" = (the bytes of every input checkpoint, read once, + the merged output's
bytes, written once) / the row's seconds: the least traffic the merge needs (the streaming TIES's first pass over each
fine-tuned model and the page-cache copies are not counted); "% of bandwidth" = that / the measured bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from limits import Limits, fraction, giga, limits_epilog  # bench/limits.py
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
MARK = "BENCH_MERGE_RESULT "
MODES = ("streaming", "whole")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GB/s moved = (input checkpoints read + merged output written) bytes / s; % "
                                         "of bandwidth = that / the memory bandwidth"))
    parser.add_argument("--models", type=int, default=3, help="fine-tuned models merged onto the base (default 3)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP size (default 2048)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default 8000)")
    parser.add_argument("--shard-size", default="100MB", help="input and output shard size (default 100MB)")
    parser.add_argument("--density", type=float, default=0.5, help="TIES density (default 0.5)")
    parser.add_argument("--chunk-elements", type=int, default=None, help="streaming chunk size (default: the module's)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: streaming, whole")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (alternating order); rows show the "
                        "best time and the highest peak")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--target", type=float, default=1.5, help="target: streaming peak / model size at most")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints here (reused when present)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    # internal: one measurement in this process
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        parser.error(f"--modes: comma-separated values from {', '.join(MODES)}")
    if min(args.models, args.hidden, args.layers, args.vocab, args.repeats, args.threads) < 1:
        parser.error("--models, --hidden, --layers, --vocab, --repeats and --threads must be >= 1")
    return args


# -- checkpoints ----------------------------------------------------------------------------------------------


def llama_shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    h, m = args.hidden, args.intermediate
    shapes = {"model.embed_tokens.weight": (args.vocab, h)}
    for i in range(args.layers):
        prefix = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}self_attn.{name}.weight"] = (h, h)
        shapes[f"{prefix}mlp.gate_proj.weight"] = (m, h)
        shapes[f"{prefix}mlp.up_proj.weight"] = (m, h)
        shapes[f"{prefix}mlp.down_proj.weight"] = (h, m)
        shapes[f"{prefix}input_layernorm.weight"] = (h,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    return shapes


def save_sharded(state: dict, directory: Path, shard_bytes: int) -> None:
    """Shards of at most ``shard_bytes`` plus model.safetensors.index.json, as save_pretrained writes them."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def build_checkpoints(args: argparse.Namespace, root: Path) -> list[Path]:
    """base, ft1, ..., ftN under ``root`` (reused when a previous run with the same shape left them)."""
    import torch
    from transformers import LlamaConfig

    sys.path.insert(0, str(REPO))
    import model_merging as mm

    shard_bytes = mm._parse_size(args.shard_size, "--shard-size")
    names = ["base"] + [f"ft{i + 1}" for i in range(args.models)]
    stamp = {"shapes": {k: list(v) for k, v in llama_shapes(args).items()}, "shard": shard_bytes}
    stamp_file = root / "checkpoints.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and all((root / n).is_dir() for n in names):
        return [root / n for n in names]
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                         vocab_size=args.vocab, tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in llama_shapes(args).items()}
    for index, name in enumerate(names):
        directory = root / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        config.save_pretrained(directory)
        if index == 0:
            state = base
        else:
            noise = torch.Generator().manual_seed(index)
            state = {k: v + torch.randn(v.shape, generator=noise) * 1e-3 for k, v in base.items()}
        save_sharded(state, directory, shard_bytes)
        print(f"wrote {directory} ({dir_bytes(directory) / 2**20:.0f} MiB)", flush=True)
        del state
    stamp_file.write_text(json.dumps(stamp))
    return [root / n for n in names]


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


# -- worker side -----------------------------------------------------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """VmHWM, the peak resident size of this process image. Not ``getrusage(...).ru_maxrss``: Linux carries it over
    ``exec`` from the parent, so a worker started by a driver that built 800 MB of checkpoints would report those."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB


def run_streaming(args: argparse.Namespace, inputs: list[Path], output: Path) -> dict:
    import model_merging as mm

    baseline = rss_mib()
    started = time.perf_counter()
    config = mm.MergeConfig(method="ties", base_model=str(inputs[0]), models=[str(p) for p in inputs[1:]],
                            density=args.density, output_dir=str(output), max_shard_size=args.shard_size,
                            overwrite=True)
    kwargs = {"chunk_elements": args.chunk_elements} if args.chunk_elements else {}
    mm.ModelMerger(config, **kwargs).merge()
    return {"seconds": time.perf_counter() - started, "baseline": baseline}


def run_whole(args: argparse.Namespace, inputs: list[Path], output: Path) -> dict:
    from safetensors.torch import load_file, save_file

    import model_merging as mm

    baseline = rss_mib()
    started = time.perf_counter()
    states = []
    for directory in inputs:
        state = {}
        for shard in sorted(directory.glob("*.safetensors")):
            state.update(load_file(str(shard)))
        states.append(state)
    base, finetuned = states[0], states[1:]
    merged = {}
    for name, tensor in base.items():
        tasks = [ft[name] - tensor for ft in finetuned]
        merged[name] = tensor + mm.ties(tasks, [1.0] * len(tasks), args.density)
    output.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(output / "model.safetensors"), metadata={"format": "pt"})
    return {"seconds": time.perf_counter() - started, "baseline": baseline}


def worker(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(REPO))
    torch.set_num_threads(args.threads)
    root = Path(args.workdir)
    inputs = [root / "base"] + [root / f"ft{i + 1}" for i in range(args.models)]
    output = Path(args.output)
    result = (run_streaming if args.worker == "streaming" else run_whole)(args, inputs, output)
    result["peak"] = peak_rss_mib()
    print(MARK + json.dumps(result), flush=True)
    return 0


# -- driver side -----------------------------------------------------------------------------------------------


def warm_page_cache(directories: list[Path]) -> None:
    for directory in directories:
        for file in directory.glob("*.safetensors"):
            with open(file, "rb") as f:
                while f.read(1 << 24):
                    pass


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_worker(args: argparse.Namespace, mode: str, root: Path, output: Path) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--workdir", str(root),
               "--output", str(output), "--models", str(args.models), "--density", repr(args.density),
               "--shard-size", args.shard_size, "--threads", str(args.threads)]
    if args.chunk_elements:
        command += ["--chunk-elements", str(args.chunk_elements)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    busy, own, started = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    # other processes' CPU use while the worker ran, in cores: what the machine did minus what the worker did
    background = max(0.0, (busy_cpu_seconds() - busy) - (children_cpu_seconds() - own)) / elapsed
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-12:]
        return {"error": "\n".join(tail) or f"exit status {proc.returncode}"}
    return {**json.loads(lines[-1][len(MARK):]), "process": elapsed, "background": background}


def compare_outputs(first: Path, second: Path) -> tuple[float, int, int]:
    """(largest absolute difference, entries that differ, entries) between two merged checkpoints."""
    sys.path.insert(0, str(REPO))
    import model_merging as mm

    a, b = mm.Checkpoint(first, "streaming"), mm.Checkpoint(second, "whole")
    if set(a.names) != set(b.names):
        return float("inf"), -1, -1
    worst, differ, total = 0.0, 0, 0
    for name in a.names:
        with a.open(name) as x, b.open(name) as y:
            rows = a.infos[name].shape[0] if a.infos[name].shape else 1
            gap = (x.rows(0, rows) - y.rows(0, rows)).abs()
        worst, differ, total = max(worst, float(gap.max())), differ + int((gap > 0).sum()), total + gap.numel()
    return worst, differ, total


@contextlib.contextmanager
def working_directory(workdir: Path | None) -> Iterator[Path]:
    """``--workdir`` when given (kept for the next run), else a temporary directory removed at the end."""
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    with working_directory(args.workdir) as root:
        inputs = build_checkpoints(args, root)
        args.workdir = root
        model_mib = dir_bytes(inputs[0]) / 2**20
        print(f"{args.models} fine-tuned + base Llama checkpoints of {model_mib:.0f} MiB each (fp32, hidden "
              f"{args.hidden}, MLP {args.intermediate}, {args.layers} layers, vocab {args.vocab}, shards "
              f"{args.shard_size}); TIES density {args.density:g}; threads {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
        limits = Limits("float32").measure()  # here: the workers' peak is VmHWM, which this process does not reach
        runs: dict[str, list[dict]] = {m: [] for m in args.modes}
        outputs = {m: root / f"merged-{m}" for m in args.modes}
        for repeat in range(args.repeats):
            for mode in (args.modes if repeat % 2 == 0 else args.modes[::-1]):
                shutil.rmtree(outputs[mode], ignore_errors=True)
                warm_page_cache(inputs)
                result = run_worker(args, mode, root, outputs[mode])
                runs[mode].append(result)
                if "error" in result:
                    print(f"{mode} (repeat {repeat + 1}) FAILED:\n  " + result["error"].replace("\n", "\n  "))
                else:
                    print(f"{mode} (repeat {repeat + 1}): {result['seconds']:.1f} s, peak {result['peak']:.0f} MiB, "
                          f"baseline {result['baseline']:.0f} MiB, background load {result['background']:.2f} cores",
                          flush=True)
        limits.measure()
        read_bytes = sum(dir_bytes(p) for p in inputs)
        difference = (compare_outputs(outputs["streaming"], outputs["whole"])
                      if all(runs[m] and "error" not in runs[m][-1] for m in MODES if m in runs) and len(runs) == 2
                      else None)
        if args.json:
            args.json.write_text(json.dumps({"model_mib": model_mib, "runs": runs, "difference": difference,
                                             "limits": limits.to_json()}, indent=1))
        rows, verdict = [], None
        for mode in args.modes:
            ok = [r for r in runs[mode] if "error" not in r]
            if not ok:
                rows.append([mode, "failed"] + ["-"] * 9)
                continue
            seconds = min(r["seconds"] for r in ok)
            peak = max(r["peak"] for r in ok)
            baseline = statistics.median(r["baseline"] for r in ok)
            written = dir_bytes(outputs[mode]) or dir_bytes(inputs[0])  # the merged model (one checkpoint's size)
            moved = (read_bytes + written) / seconds
            rows.append([mode, f"{seconds:.1f}", giga(moved), fraction(moved, limits.bandwidth),
                         f"{baseline:.0f}", f"{peak:.0f}", f"{peak - baseline:.0f}",
                         f"{peak / model_mib:.2f}x", f"{(peak - baseline) / model_mib:.2f}x", f"{len(ok)}",
                         f"{max(r['background'] for r in ok):.2f}"])
            if mode == "streaming":
                raw, added = peak / model_mib, (peak - baseline) / model_mib
                verdict = (f"{'PASS' if added <= args.target else 'FAIL'} streaming: peak - baseline "
                           f"{added:.2f}x one model (target <= {args.target:g}x); raw peak {raw:.2f}x "
                           f"({'within' if raw <= args.target else 'above'} the target: the raw figure includes "
                           f"{baseline:.0f} MiB of Python + torch)")
        print(limits.describe())
        print_table(["mode", "seconds", "GB/s moved", "% of bandwidth", "baseline MiB", "peak MiB",
                     "peak - baseline MiB", "peak / model", "(peak - baseline) / model", "runs", "bg cores"], rows,
                    f"TIES merge of {args.models} x {model_mib:.0f} MiB checkpoints onto a base "
                    f"(peak = max RSS of the merging process; baseline = RSS after importing torch)",
                    wrap_values=True, min_width=140)
        print("GB/s moved = (every input checkpoint's bytes, read once, + the merged output's, written once) / "
              "seconds; % of bandwidth = that / the memory bandwidth above")
        if verdict:
            print(verdict)
        if difference is not None:
            worst, differ, total = difference
            print(f"streaming vs whole: {differ} of {total} entries differ (max |difference| {worst:g}); TIES keeps "
                  "k entries per task, and where magnitudes tie at the threshold torch.topk (whole) and the streaming "
                  "trim (earliest entries) keep different ones")
    return 1 if any("error" in r for value in runs.values() for r in value) else 0


if __name__ == "__main__":
    sys.exit(main())
