"""Generation speed: ``inference_optimizations.generate`` against Hugging Face ``model.generate``.

    python bench/bench_generation.py                          # tiny demo model, batch 16 and 128, 64 new tokens
    python bench/bench_generation.py --threads 1 --repeats 5 --batch-sizes 16
    python bench/bench_generation.py --model medium           # a bigger random-weight Llama config
    python bench/bench_generation.py --device cuda --dtype bfloat16 --model large --batch-sizes 16,128
    python bench/bench_generation.py --model tiny-vl --batch-sizes 16,64   # image prompts (1.02M Qwen3-VL)
    python bench/bench_generation.py --model ~/.cache/rlhf/models/SmolLM2-135M-Instruct --batch-sizes 16,64 \
        --engines hf,auto,compiled,fp16,int8,vllm    # a real model (scripts/fetch_real_models.py); vllm: in the
                                                             # environment of scripts/install_vllm_cpu.sh

Both engines get the same work:
  * model: any Hugging Face model folder given as ``--model PATH`` (its own tokenizer and chat template), or the
    embedded tiny Llama (``rlhf.build_tiny_model()``, fp32, sdpa attention) or, with
    ``--model medium``, a randomly initialised Llama of the same family (hidden 512, 8 layers,
    GQA 8/4 heads, the demo tokenizer's vocabulary) or ``--model large`` (hidden 1024, 16 layers, GQA
    16/8 heads, a 32,000-token vocabulary: about 0.2B parameters, for a GPU); one model object serves
    every engine, on ``--device`` in ``--dtype``; ``--model tiny-vl`` is the embedded vision-language
    model (a 1.02M Qwen3-VL);
  * prompts: the first B distinct prompts of data/demo/rl_prompts.jsonl rendered with
    ``rlhf.ChatFormatter`` (user turn + assistant header), left-padded to the longest, n = 1; for
    tiny-vl the first B of data/demo_vl's RL prompts, one 64x64 picture each (16 image tokens), with
    their pixel inputs (both engines preprocess and encode the pictures inside the timed call);
  * sampling at temperature 1.0 from the full distribution (top-k 0, top-p 1.0), and every row runs
    all ``--new-tokens`` tokens: no stop token for either (ours: ``eos_token_id=None``, no stop ids;
    HF: ``eos_token_id=None`` and ``min_new_tokens = max_new_tokens``), so both produce exactly
    B x new-tokens tokens (checked).

Engines: HF ``generate``; ours ``auto`` (what rollouts and evaluation use by default: it runs on a deep copy of
the model, so it decides from its own measurements as in a short run, not from the compiled engine's graphs in
this process; the row says which step it chose), ``compiled``, ``static``, ``eager``, ``paged``, ``fp16`` and ``int8``
(the copies ``rollout_dtype`` samples from, ``inference_optimizations.QuantizedEngine``, on the static path; their
weights GB/s counts the bytes they read); and ``vllm``
(``inference_optimizations.VLLMEngine``, in-process eager fp32 on a CPU, as ``use_vllm`` runs it), measured in a
subprocess of this script after the others are loaded, since its CPU backend binds its own OpenMP threads (same
prompts, warm-up call, repeats and token count). CPU kernels are pinned to AVX2 first (``pin_cpu_kernels``), as the
command line does for training, so every engine runs the kernels training runs (``--no-pin-kernels``: torch's own).

How it times: one generate call end to end (tokenisation excluded, prefill included) per engine per
repeat; within a repeat the engines run back to back and the order rotates between repeats; each
engine's time is its best over the repeats (the machine is shared: the spread max/min is printed).
Every engine first gets one untimed warm-up call per batch size; for ``ours (compiled)`` that call
compiles the decode step, its seconds are printed as "first call" and the compile time as measured
inside the engine (``inference_optimizations.compile_seconds``). Peak matmul FLOP/s is measured in
the same run (``bench/limits.py``, which every bench shares: best of square ``torch.matmul`` timings in ``--dtype``
at the same thread count, or on the GPU); on CUDA every timing ends with ``torch.cuda.synchronize()``;
achieved FLOP/s = 2 x parameters x generated tokens / seconds, which ignores attention FLOPs. The limit at small
batches is memory: each decode step reads every weight once, so "weights GB/s" (the weights' bytes x new tokens /
seconds) is set beside the measured bandwidth (the best read of a 256 MiB tensor, before and after each batch size).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from limits import bandwidth_peak, describe_limits, fraction, limits_epilog, matmul_peak, synchronize  # bench/limits.py
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402

ENGINES = ("hf", "auto", "compiled", "static", "eager", "paged", "fp16", "int8", "vllm")
LABELS = {"hf": "HF generate", "auto": "ours auto", "compiled": "ours compiled", "static": "ours static",
          "eager": "ours eager", "paged": "ours paged", "fp16": "ours fp16 copy", "int8": "ours int8 copy",
          "vllm": "vLLM"}
NAMED_MODELS = ("tiny", "medium", "large", "tiny-vl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GFLOP/s = 2 x parameters x tokens / best s (% of peak); weights GB/s = "
                                         "weight bytes x new tokens / best s (% of bandwidth)"))
    parser.add_argument("--model", default="tiny",
                        help="tiny demo model, a bigger random-weight Llama: medium (34M) or large (0.2B, for a GPU), "
                             "tiny-vl (the embedded Qwen3-VL, image prompts), or PATH: any Hugging Face model folder "
                             "(or .gguf file; e.g. SmolLM2 from scripts/fetch_real_models.py), prompted through its "
                             "own chat template")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights dtype")
    parser.add_argument("--batch-sizes", default="16,128", help="comma-separated numbers of distinct prompts")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (all rows run them all)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (order rotates); best is kept")
    parser.add_argument("--engines", default="hf,compiled,static",
                        help=f"comma-separated subset of {','.join(ENGINES)} (hf is the reference)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the square matmul timed for the peak (default 1024 on cpu, 8192 on cuda)")
    parser.add_argument("--target", type=float, default=2.0, help="ours (compiled) / HF tokens/s target")
    parser.add_argument("--target-int8", type=float, default=2.5, help="ours int8 or fp16 copy / HF tokens/s target")
    parser.add_argument("--no-pin-kernels", dest="pin_kernels", action="store_false",
                        help="leave the CPU kernels to torch (default: pin them to AVX2 as the CLI does, "
                             "for every engine)")
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    if not set(args.engines) <= set(ENGINES) or "hf" not in args.engines:
        parser.error(f"--engines must be a subset of {','.join(ENGINES)} that includes hf")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device} is not a device; use cpu or cuda")
    if device.type not in ("cpu", "cuda") or device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: use cpu" + (", or cuda on a machine with a CUDA GPU"
                                                            if device.type == "cuda" else " or cuda"))
    if args.matmul_size is None:
        args.matmul_size = 8192 if args.device.startswith("cuda") else 1024
    if min(args.batch_sizes + [args.new_tokens, args.threads, args.repeats]) < 1:
        parser.error("--batch-sizes, --new-tokens, --threads and --repeats must be >= 1")
    return args


SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary (None: the demo tokenizer's)
    "medium": (512, 1536, 8, 8, 4, None),
    "large": (1024, 2816, 16, 16, 8, 32000),
}


def load_model(kind: str, tokenizer, device: torch.device, dtype: torch.dtype):
    """(model, its PolicyModel for tiny-vl (the image inputs) or None)."""
    if kind == "tiny-vl":
        policy = rlhf.PolicyModel.from_pretrained("tiny-vl")
        return policy.model.to(device, dtype).eval(), policy
    if kind == "tiny":
        model, _ = rlhf.load_causal_lm(str(rlhf.build_tiny_model()), attn_implementation="sdpa")
        return model.to(device, dtype).eval(), None
    if kind not in NAMED_MODELS:  # a model folder: its own tokenizer and template
        policy = rlhf.PolicyModel.from_pretrained(kind, attn_implementation="sdpa", is_trainable=False)
        return policy.model.to(device, dtype).eval(), policy
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, intermediate, layers, heads, kv_heads, vocab = SHAPES[kind]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype).eval(), None


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    formatter = rlhf.ChatFormatter(tokenizer)  # a real model's own chat template (the tiny model's is ChatML)
    lines = (REPO / "data" / "demo" / "rl_prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    if count > len(records):
        raise SystemExit(f"batch {count} > {len(records)} demo prompts")
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": r["prompt"]}]})
            for r in records[:count]]


def vl_prompts(policy, count: int) -> tuple[list[list[int]], list[list[str]]]:
    formatter = rlhf.ChatFormatter(policy.tokenizer, "qwen3_vl_nothink", vision=policy.vision)
    records = rlhf.load_records("demo_vl_rl", REPO / "data" / "demo_vl", "prompt", max_samples=count)
    if count > len(records):
        raise SystemExit(f"batch {count} > {len(records)} demo_vl prompts")
    return [formatter.prompt_ids(r) for r in records], [r["images"] for r in records]


def run_once(engine: str, model, prompts: list[list[int]], new_tokens: int, pad: int, seed: int,
             policy=None, images=None) -> tuple[float, int]:
    """Seconds for one generate call and the tokens it generated (with ``images``: their pixels made inside it)."""
    device = next(model.parameters()).device
    synchronize(device)
    if images is not None:
        policy.vision._cache.clear()  # both engines preprocess the pictures inside the timed call
    if engine == "hf":
        width = max(len(p) for p in prompts)
        start = time.perf_counter()
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        pixels = {k: v.to(device) for k, v in policy.vision.batch(images, ids).items()} if images else {}
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                                 eos_token_id=None, **pixels)
        synchronize(device)
        seconds = time.perf_counter() - start
        return seconds, (out.shape[1] - width) * out.shape[0]
    params = io.SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    start = time.perf_counter()
    out = io.generate(model, prompts, params, pad_token_id=pad, eos_token_id=None,
                      engine="static" if engine in io.QUANTIZED_ROLLOUT_DTYPES else engine,
                      vision=policy.vision_for(images) if images else None)
    seconds = time.perf_counter() - start  # the engine returns host lists: its GPU work is finished
    return seconds, sum(len(t) for t in out.token_ids)


def copy_kl(model: torch.nn.Module, copy_model: torch.nn.Module, prompts: list[list[int]], pad: int) -> float:
    """Mean KL(model || copy) in nats per prompt position (the next-token distributions over every prompt token):
    how far the policy a low-precision copy samples is from the model's."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        reference = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
        other = copy_model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    per_position = (reference.exp() * (reference - other)).sum(-1)
    return float(per_position[mask.bool()].mean())


def quantized_weight_bytes(model: torch.nn.Module, dtype: str) -> int:
    """Bytes a decode step of a QuantizedEngine copy reads: its linear weights in their format (int8 with a scale
    per row, or fp16) and the other parameters but the input embedding, which a step gathers a row of."""
    linear = [m for m in model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    embedding = model.get_input_embeddings().weight
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if dtype == "fp16":
        return sum(2 * m.weight().numel() for m in linear) + rest
    return sum(m.weight().numel() + 8 * m.weight().shape[0] for m in linear) + rest


def vllm_rates(args: argparse.Namespace) -> dict:
    """vLLM's best seconds per batch size, measured in a subprocess of this script (``--vllm-worker``): its CPU backend
    binds its own OpenMP threads, which must not change the other engines' threads. Needs vLLM in this environment."""
    command = [sys.executable, __file__, "--vllm-worker", "--model", args.model, "--new-tokens", str(args.new_tokens),
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    if result.returncode or not lines:
        raise SystemExit(f"the vLLM worker failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    return json.loads(lines[-1].removeprefix("VLLM_RESULT "))


def vllm_worker(args: argparse.Namespace) -> int:
    """One vLLM engine (inference_optimizations.VLLMEngine, as use_vllm runs it: in-process, eager, fp32 on a CPU)
    on the same prompts; prints the start time and every batch's warm-up and timed seconds as one JSON line."""
    import os

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    folder = rlhf.resolve_model_path(args.model)
    tokenizer = rlhf.load_tokenizer(folder)
    engine = io.VLLMEngine(str(folder), seed=0)
    out: dict = {"start": engine.start_seconds, "batches": {}}
    for batch in args.batch_sizes:
        prompts = demo_prompts(tokenizer, batch)
        times = []
        for repeat in range(args.repeats + 1):  # the first call is the warm-up
            params = io.SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=repeat)
            start = time.perf_counter()
            tokens = sum(len(t) for t in engine.generate(prompts, params).token_ids)
            times.append(time.perf_counter() - start)
            if tokens != batch * args.new_tokens:
                raise SystemExit(f"vllm generated {tokens} tokens, expected {batch * args.new_tokens}")
        out["batches"][str(batch)] = {"first": times[0], "times": times[1:]}
    print("VLLM_RESULT " + json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pin_kernels:
        io.pin_cpu_kernels()  # as the CLI does, before any torch operation: every engine runs the same CPU kernels
    torch.set_num_threads(args.threads)
    rlhf.setup_logging()
    if args.vllm_worker:
        return vllm_worker(args)
    tokenizer = rlhf.load_tokenizer(rlhf.build_tiny_model())
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, policy = load_model(args.model, tokenizer, device, dtype)
    vision = policy is not None and policy.vision is not None
    if policy is not None:
        tokenizer = policy.tokenizer
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once (they are the lm_head)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pad = tokenizer.pad_token_id
    # ours (auto) decides by what it has measured in its own process: it gets a model of its own, so the compiled
    # engine's graphs (and timings) in this process do not count for it, as in a short run of its own
    models = {engine: (copy.deepcopy(model) if engine == "auto" else model)
              for engine in args.engines if engine not in ("vllm", *io.QUANTIZED_ROLLOUT_DTYPES)}
    bytes_read = dict.fromkeys(args.engines, weight_bytes)
    for fmt in io.QUANTIZED_ROLLOUT_DTYPES:  # the copies rollout_dtype samples from, as the trainer makes them
        if fmt in args.engines:
            models[fmt] = io.QuantizedEngine(model, dtype=fmt, pad_token_id=pad, tokenizer=tokenizer).model
            bytes_read[fmt] = quantized_weight_bytes(models[fmt], fmt)
            if device.type == "cpu":
                kl = copy_kl(model, models[fmt], demo_prompts(tokenizer, 16), pad)
                print(f"  ours {fmt} copy: KL(model || copy) = {kl:.2e} nats per prompt token (16 prompts)",
                      flush=True)
    in_process = [engine for engine in args.engines if engine != "vllm"]
    peaks = [matmul_peak(args.matmul_size, device, dtype)]
    bandwidths = [bandwidth_peak(device)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} CPU thread(s)"
    name = args.model if args.model in NAMED_MODELS else Path(args.model).name
    print(f"model {name}: {params / 1e6:.2f}M parameters, {args.dtype}, {where}, "
          f"{args.new_tokens} new tokens, {args.repeats} repeats; distinct prompts, n=1", flush=True)
    vllm = vllm_rates(args) if "vllm" in args.engines else None
    if vllm:
        print(f"  vLLM (its own process) started in {vllm['start']:.1f} s", flush=True)
    rows, ratios = [], {}
    for batch in args.batch_sizes:
        prompts, images = vl_prompts(policy, batch) if vision else (demo_prompts(tokenizer, batch), None)
        first = {}
        for engine in in_process:  # warm-up (compiles the decode step for ours (compiled))
            first[engine], _ = run_once(engine, models[engine], prompts, args.new_tokens, pad, seed=0, policy=policy,
                                        images=images)
            print(f"  batch {batch}: warm-up {LABELS[engine]} {first[engine]:.2f} s", flush=True)
        times: dict[str, list[float]] = {e: [] for e in in_process}
        for repeat in range(args.repeats):
            shift = repeat % len(in_process)
            for engine in in_process[shift:] + in_process[:shift]:
                seconds, tokens = run_once(engine, models[engine], prompts, args.new_tokens, pad, seed=repeat + 1,
                                           policy=policy, images=images)
                if tokens != batch * args.new_tokens:
                    raise SystemExit(f"{engine} generated {tokens} tokens, expected {batch * args.new_tokens}")
                times[engine].append(seconds)
            print(f"  batch {batch}: repeat {repeat + 1}: "
                  + ", ".join(f"{e} {times[e][-1]:.3f} s" for e in in_process), flush=True)
        if vllm:
            first["vllm"], times["vllm"] = vllm["batches"][str(batch)]["first"], vllm["batches"][str(batch)]["times"]
        peaks.append(matmul_peak(args.matmul_size, device, dtype))
        bandwidths.append(bandwidth_peak(device))
        tokens = batch * args.new_tokens
        hf_rate = tokens / min(times["hf"])
        compiled = io.compile_seconds(models["compiled"]) if "compiled" in models else {}
        auto_choice = "compiled" if "auto" in models and io.compile_seconds(models["auto"]) else "static"
        for engine in args.engines:
            best = min(times[engine])
            rate = tokens / best
            ratios[(batch, engine)] = rate / hf_rate
            compile_note = ", ".join(f"{s:.1f}" for (r, *_), s in compiled.items() if r == batch) \
                if engine == "compiled" else ""
            label = LABELS[engine] + (f" ({auto_choice})" if engine == "auto" else "")
            rows.append([name, str(batch), label, str(tokens), f"{best:.3f}",
                         f"{max(times[engine]) / best:.2f}", f"{rate:,.0f}", f"{rate / hf_rate:.2f}x",
                         f"{2 * params * tokens / best / 1e9:.2f}", "",
                         f"{bytes_read[engine] * args.new_tokens / best / 1e9:.1f}",
                         "", f"{first[engine]:.1f}", compile_note or "-"])
    peak, bandwidth = max(peaks), max(bandwidths)
    for row in rows:
        row[9] = fraction(float(row[8]) * 1e9, peak)
        row[11] = fraction(float(row[10]) * 1e9, bandwidth)
    print(describe_limits(peaks, bandwidths, args.dtype, args.matmul_size,
                          "measured before and after each batch size"))
    print_table(["model", "batch", "engine", "tokens", "best s", "spread", "tokens/s", "vs HF", "GFLOP/s",
                 "% of peak", "weights GB/s", "% of bandwidth", "first call s", "compile s"], rows,
                title=f"Generation: {args.new_tokens} new tokens per row, sampling T=1.0, {args.dtype}, {where}",
                label_columns=3, min_width=170)
    print("spread = slowest / best repeat (background load); GFLOP/s = 2 x params x tokens / s, attention FLOPs "
          "ignored; weights GB/s = the weights' bytes read once per decode step x steps / s (the limit at small "
          "batches); first call includes compilation for ours (compiled); compile s = first compiled decode step; "
          "ours auto runs with a model of its own, as in a short run, and says which step it chose")
    for batch in args.batch_sizes:
        if "auto" in args.engines:
            ratio = ratios[(batch, "auto")]
            print(f"{'PASS' if ratio >= 1.0 else 'FAIL'}: ours auto at batch {batch} is {ratio:.2f}x HF tokens/s "
                  f"(target: never slower)")
        for fmt in [f for f in io.QUANTIZED_ROLLOUT_DTYPES if f in args.engines]:
            ratio = ratios[(batch, fmt)]
            print(f"{'PASS' if ratio >= args.target_int8 else 'FAIL'}: ours {fmt} copy at batch {batch} is "
                  f"{ratio:.2f}x HF tokens/s (target {args.target_int8}x)")
        if "compiled" in args.engines:
            ratio = ratios[(batch, "compiled")]
            print(f"{'PASS' if ratio >= args.target else 'FAIL'}: ours compiled at batch {batch} is {ratio:.2f}x HF "
                  f"tokens/s (target {args.target}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
