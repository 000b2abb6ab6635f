"""Generation speed: ``inference_optimizations.generate`` against Hugging Face ``model.generate``.

    python bench/bench_generation.py                          # tiny demo model, batch 16 and 128, 64 new tokens
    python bench/bench_generation.py --threads 1 --repeats 5 --batch-sizes 16
    python bench/bench_generation.py --model medium           # a bigger random-weight Llama config

Both engines get the same work:
  * model: the embedded tiny Llama (``rlhf.build_tiny_model()``, fp32, sdpa attention) or, with
    ``--model medium``, a randomly initialised Llama of the same family (hidden 512, 8 layers,
    GQA 8/4 heads, the demo tokenizer's vocabulary); one model object serves every engine;
  * prompts: the first B distinct prompts of data/demo/rl_prompts.jsonl rendered with
    ``rlhf.ChatFormatter`` (user turn + assistant header), left-padded to the longest, n = 1;
  * sampling at temperature 1.0 from the full distribution (top-k 0, top-p 1.0), and every row runs
    all ``--new-tokens`` tokens: no stop token for either (ours: ``eos_token_id=None``, no stop ids;
    HF: ``eos_token_id=None`` and ``min_new_tokens = max_new_tokens``), so both produce exactly
    B x new-tokens tokens (checked).

How it times: one generate call end to end (tokenisation excluded, prefill included) per engine per
repeat; within a repeat the engines run back to back and the order rotates between repeats; each
engine's time is its best over the repeats (the machine is shared: the spread max/min is printed).
Every engine first gets one untimed warm-up call per batch size; for ``ours (compiled)`` that call
compiles the decode step, its seconds are printed as "first call" and the compile time as measured
inside the engine (``inference_optimizations.compile_seconds``). Peak fp32 matmul FLOP/s is
measured in the same run (best of square ``torch.matmul`` timings at the same thread count);
achieved FLOP/s = 2 x parameters x generated tokens / seconds, which ignores attention FLOPs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402

ENGINES = ("hf", "compiled", "static", "eager")
LABELS = {"hf": "HF generate", "compiled": "ours compiled", "static": "ours static", "eager": "ours eager"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "medium"), default="tiny", help="tiny demo model or a bigger config")
    parser.add_argument("--batch-sizes", default="16,128", help="comma-separated numbers of distinct prompts")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (all rows run them all)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (order rotates); best is kept")
    parser.add_argument("--engines", default="hf,compiled,static",
                        help=f"comma-separated subset of {','.join(ENGINES)} (hf is the reference)")
    parser.add_argument("--matmul-size", type=int, default=1024, help="side of the square matmul timed for the peak")
    parser.add_argument("--target", type=float, default=1.5, help="ours (compiled) / HF tokens/s target at batch 16")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    if not set(args.engines) <= set(ENGINES) or "hf" not in args.engines:
        parser.error(f"--engines must be a subset of {','.join(ENGINES)} that includes hf")
    if min(args.batch_sizes + [args.new_tokens, args.threads, args.repeats]) < 1:
        parser.error("--batch-sizes, --new-tokens, --threads and --repeats must be >= 1")
    return args


def matmul_peak(size: int, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of a square torch.matmul at the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def load_model(kind: str, tokenizer):
    if kind == "tiny":
        model, _ = rlhf.load_causal_lm(str(rlhf.build_tiny_model()), attn_implementation="sdpa")
        return model.eval()
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    formatter = rlhf.ChatFormatter(tokenizer)
    lines = (REPO / "data" / "demo" / "rl_prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    if count > len(records):
        raise SystemExit(f"batch {count} > {len(records)} demo prompts")
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": r["prompt"]}]})
            for r in records[:count]]


def run_once(engine: str, model, prompts: list[list[int]], new_tokens: int, pad: int, seed: int) -> tuple[float, int]:
    """Seconds for one generate call and the tokens it generated."""
    if engine == "hf":
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                                 eos_token_id=None)
        seconds = time.perf_counter() - start
        return seconds, (out.shape[1] - width) * out.shape[0]
    params = io.SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    start = time.perf_counter()
    out = io.generate(model, prompts, params, pad_token_id=pad, eos_token_id=None, engine=engine)
    seconds = time.perf_counter() - start
    return seconds, sum(len(t) for t in out.token_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rlhf.setup_logging()
    tokenizer = rlhf.load_tokenizer(rlhf.build_tiny_model())
    model = load_model(args.model, tokenizer)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once (they are the lm_head)
    pad = tokenizer.pad_token_id
    peaks = [matmul_peak(args.matmul_size)]
    print(f"model {args.model}: {params / 1e6:.2f}M parameters, {args.threads} thread(s), "
          f"{args.new_tokens} new tokens, {args.repeats} repeats; distinct prompts, n=1", flush=True)
    rows, ratios = [], {}
    for batch in args.batch_sizes:
        prompts = demo_prompts(tokenizer, batch)
        first = {}
        for engine in args.engines:  # warm-up (compiles the decode step for ours (compiled))
            first[engine], _ = run_once(engine, model, prompts, args.new_tokens, pad, seed=0)
            print(f"  batch {batch}: warm-up {LABELS[engine]} {first[engine]:.2f} s", flush=True)
        times: dict[str, list[float]] = {e: [] for e in args.engines}
        for repeat in range(args.repeats):
            shift = repeat % len(args.engines)
            for engine in args.engines[shift:] + args.engines[:shift]:
                seconds, tokens = run_once(engine, model, prompts, args.new_tokens, pad, seed=repeat + 1)
                if tokens != batch * args.new_tokens:
                    raise SystemExit(f"{engine} generated {tokens} tokens, expected {batch * args.new_tokens}")
                times[engine].append(seconds)
            print(f"  batch {batch}: repeat {repeat + 1}: "
                  + ", ".join(f"{e} {times[e][-1]:.3f} s" for e in args.engines), flush=True)
        peaks.append(matmul_peak(args.matmul_size))
        tokens = batch * args.new_tokens
        hf_rate = tokens / min(times["hf"])
        compiled = io.compile_seconds(model)
        for engine in args.engines:
            best = min(times[engine])
            rate = tokens / best
            ratios[(batch, engine)] = rate / hf_rate
            compile_note = ", ".join(f"{s:.1f}" for (r, *_), s in compiled.items() if r == batch) \
                if engine == "compiled" else ""
            rows.append([args.model, str(batch), LABELS[engine], str(tokens), f"{best:.3f}",
                         f"{max(times[engine]) / best:.2f}", f"{rate:,.0f}", f"{rate / hf_rate:.2f}x",
                         f"{2 * params * tokens / best / 1e9:.2f}", "", f"{first[engine]:.1f}",
                         compile_note or "-"])
    peak = max(peaks)
    for row in rows:
        row[9] = f"{float(row[8]) * 1e9 / peak:.2%}"
    print(f"peak fp32 matmul: {peak / 1e9:.1f} GFLOP/s ({args.matmul_size}^2 torch.matmul, best of "
          f"{', '.join(f'{p / 1e9:.1f}' for p in peaks)} measured before and after each batch size)")
    print_table(["model", "batch", "engine", "tokens", "best s", "spread", "tokens/s", "vs HF", "GFLOP/s",
                 "% of peak", "first call s", "compile s"], rows,
                title=f"Generation: {args.new_tokens} new tokens per row, sampling T=1.0, {args.threads} thread(s)",
                label_columns=3, min_width=150)
    print("spread = slowest / best repeat (background load); GFLOP/s = 2 x params x tokens / s, attention FLOPs "
          "ignored; first call includes compilation for ours (compiled); compile s = first compiled decode step")
    if "compiled" in args.engines and 16 in args.batch_sizes:
        ratio = ratios[(16, "compiled")]
        print(f"{'PASS' if ratio >= args.target else 'FAIL'}: ours compiled at batch 16 is {ratio:.2f}x HF "
              f"tokens/s (target {args.target}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
