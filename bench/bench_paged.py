"""Paged KV cache: memory of 16 samples of one 200-token prompt, and Best-of-16 tokens/s with prefix
sharing versus 16 independent generations.

    python bench/bench_paged.py                       # the demo SFT policy if trained, else the tiny model
    python bench/bench_paged.py --policy DIR --samples 16 --prompt-tokens 200 --new-tokens 64 --repeats 3

The prompt: few-shot worked examples from data/demo/sft.jsonl followed by one held-out question
(data/demo/eval.jsonl), rendered with the tokenizer's chat template and cut to ``--prompt-tokens``
tokens from the left (so it still ends with the question and the assistant header). Sampling at
temperature 1.0, every row runs all ``--new-tokens`` tokens (no stop token), so the memory figures
are for a known length.

Memory (KV bytes = positions x 2 (keys, values) x layers x kv_heads x head_dim x bytes/element):
  * contiguous per-sequence: 16 rows x (prompt + generated) positions: what 16 independent
    generations hold (Hugging Face's DynamicCache; our static engine preallocates more, its bucketed
    cache length is printed too);
  * paged (``engine="paged"``, one row per ``--block-sizes``): the cache's own peak accounting
    (``GenerationOutput.cache_stats``): blocks in use x block size, the prompt stored once (its
    partly filled last block shared too: each sample's own tokens start in a fresh block behind a
    masked hole, nothing is copied). ``--copy-on-write`` adds a row per block size with the vLLM
    layout (a private copy of that block per fork) for comparison. Target: <= 0.3x contiguous.
Speed (tokens generated / seconds of one generate call, prefill included; best of ``--repeats``,
order rotating): paged with prefix sharing (n = 16), our static engine with n = 16 (prefill shared,
cache repeated per row), 16 independent generations (the prompt 16 times, n = 1: 16 prefills), and
Hugging Face ``generate(num_return_sequences=16)``.

The limit (``bench/limits.py``), speed table only (the memory table times nothing: it counts KV bytes): the peak
fp32 matmul FLOP/s and the memory bandwidth, measured in this process at ``--threads`` threads before the timed calls
and after them (the best of each is kept, printed above the table). Every engine decodes the 16 rows as one batch,
so a call makes ``--new-tokens`` decode steps, each reading every weight once: "weights GB/s" = the weights' bytes
(``model_weight_bytes``: fp32, the tied embedding once) x new tokens / seconds, against the bandwidth ("% of
bandwidth"; decoding at this batch is bound by that traffic); "GFLOP/s" = 2 x parameters (``model_params``) x
generated tokens / seconds (attention FLOPs and the prefill ignored), against the peak ("% of peak").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from limits import (  # bench/limits.py
    Limits,
    forward_flops,
    fraction,
    giga,
    limits_epilog,
    model_params,
    model_weight_bytes,
)
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "speed table: GFLOP/s = 2 x parameters x tokens / s (% of peak); weights "
                                         "GB/s = weight bytes x new tokens / s (% of bandwidth)"))
    parser.add_argument("--policy", default=str(REPO / "outputs/demo/sft"),
                        help="policy directory (default: the demo SFT output; the untrained tiny model if absent)")
    parser.add_argument("--samples", type=int, default=16, help="samples of the one prompt")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sample")
    parser.add_argument("--block-sizes", default="16,8", help="comma-separated tokens per KV block (memory rows; "
                        "the speed run uses the first)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine; best is kept")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--target", type=float, default=0.3, help="paged / contiguous KV bytes target")
    parser.add_argument("--copy-on-write", action="store_true",
                        help="also measure the memory of copy-on-write forks (the vLLM layout)")
    parser.add_argument("--output", help="also write the figures as JSON here")
    return parser.parse_args(argv)


def load_policy(directory: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(directory) / "config.json").exists():
        directory = str(rlhf.build_tiny_model())
        print(f"(no trained policy found: using the untrained tiny model {directory})")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory).eval(), tokenizer, directory


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """Few-shot worked examples, then a held-out question; the last ``tokens`` tokens of its chat rendering."""
    examples = [json.loads(line) for line in (REPO / "data/demo/sft.jsonl").read_text().splitlines()[:40]]
    question = json.loads((REPO / "data/demo/eval.jsonl").read_text().splitlines()[0])["prompt"]
    shots = "\n\n".join(f"Q: {e['prompt']}\n{e['response']}" for e in examples)
    ids = io.chat_prompt_ids(tokenizer, f"Worked examples:\n{shots}\n\nNow solve: {question}")
    if len(ids) < tokens:
        raise SystemExit(f"error: the few-shot prompt has only {len(ids)} tokens; lower --prompt-tokens")
    return ids[-tokens:]


def run(engine: str, model, prompt: list[int], args, pad: int, seed: int) -> tuple[float, int, dict]:
    started = time.perf_counter()
    stats: dict = {}
    if engine == "hf":
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             num_return_sequences=args.samples, pad_token_id=pad, eos_token_id=None)
        generated = (out.shape[1] - len(prompt)) * out.shape[0]
    else:
        independent = engine == "independent"
        params = io.SamplingParams(max_new_tokens=args.new_tokens, n=1 if independent else args.samples, seed=seed)
        prompts = [prompt] * args.samples if independent else [prompt]
        kwargs = ({"paged_cache": io.PagedKVCache(block_size=args.block_size,
                                                  copy_on_write=getattr(args, "cow", False))}
                  if engine == "paged" else {})
        out = io.generate(model, prompts, params, pad_token_id=pad, engine="paged" if engine == "paged" else "static",
                          **kwargs)
        generated, stats = sum(len(t) for t in out.token_ids), out.cache_stats
    return time.perf_counter() - started, generated, stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer, directory = load_policy(args.policy)
    prompt = long_prompt(tokenizer, args.prompt_tokens)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    args.block_size = block_sizes[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engines = ["paged", "shared", "independent", "hf"]
    labels = {"paged": "ours paged, prefix shared (n=16)", "shared": "ours static, prefill shared (n=16)",
              "independent": "ours static, 16 independent prompts", "hf": "HF generate(num_return_sequences=16)"}
    for engine in engines:  # warm-up (one-time allocations, kernel selection)
        run(engine, model, prompt, argparse.Namespace(**{**vars(args), "new_tokens": 4}), pad, seed=0)
    limits = Limits("float32").measure()  # before the timed calls (and again after them)
    best: dict[str, float] = {}
    spread: dict[str, list[float]] = {e: [] for e in engines}
    tokens: dict[str, int] = {}
    for repeat in range(args.repeats):
        order = engines[repeat % len(engines):] + engines[:repeat % len(engines)]
        for engine in order:
            seconds, generated, stats = run(engine, model, prompt, args, pad, seed=repeat)
            spread[engine].append(seconds)
            best[engine] = min(best.get(engine, float("inf")), seconds)
            tokens[engine] = generated
    limits.measure()
    expected = args.samples * args.new_tokens
    if any(count != expected for count in tokens.values()):
        raise SystemExit(f"error: engines generated {tokens} tokens, expected {expected} each")

    peaks = {}  # one sampled run per block size (and fork layout): the peak accounting of the paged cache
    for cow in [False, True] if args.copy_on_write else [False]:
        for size in block_sizes:
            peaks[size, cow] = run("paged", model, prompt,
                                   argparse.Namespace(**{**vars(args), "block_size": size, "cow": cow}), pad, 0)[2]
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads \
        * (model.config.hidden_size // model.config.num_attention_heads) * next(model.parameters()).element_size()
    positions = args.prompt_tokens + args.new_tokens - 1  # the last token is sampled, never fed back
    contiguous = args.samples * positions * per_token
    static_len = io._cache_length(args.prompt_tokens + args.new_tokens)
    memory_rows = [
        ["contiguous per sequence (16 x (prompt + generated))", f"{args.samples * positions:,}",
         f"{args.samples * positions:,}", "100.0%", f"{contiguous / 2**20:.2f}", "1.00x"],
        ["our static engine (preallocated, bucketed length)", f"{args.samples * positions:,}",
         f"{args.samples * static_len:,}", f"{positions / static_len:.1%}",
         f"{args.samples * static_len * per_token / 2**20:.2f}", f"{static_len / positions:.2f}x"],
    ] + [[f"paged, {size}-token blocks, {'copy-on-write forks' if cow else 'shared partial block'}",
          f"{peak['stored_tokens']:,}", f"{peak['allocated_slots']:,}", f"{peak['utilisation']:.1%}",
          f"{peak['kv_bytes'] / 2**20:.2f}", f"{peak['kv_bytes'] / contiguous:.3f}x"]
         for (size, cow), peak in peaks.items()]
    print_table(["KV cache", "stored tokens", "allocated slots", "stored / allocated", "KV MiB", "vs contiguous"],
                memory_rows, f"KV memory: {args.samples} samples of one {args.prompt_tokens}-token prompt, "
                f"{args.new_tokens} new tokens each ({Path(directory).name}, {per_token} bytes/token)")
    params, weight_bytes = model_params(model), model_weight_bytes(model)
    flops = {e: forward_flops(params, tokens[e]) / best[e] for e in engines}
    reads = {e: weight_bytes * args.new_tokens / best[e] for e in engines}  # one batched decode step per new token
    speed_rows = [[labels[e], f"{best[e]:.3f}", f"{tokens[e] / best[e]:,.0f}", f"{best['independent'] / best[e]:.2f}x",
                   f"{max(spread[e]) / min(spread[e]):.2f}", giga(flops[e]), fraction(flops[e], limits.peak),
                   giga(reads[e]), fraction(reads[e], limits.bandwidth)] for e in engines]
    print(limits.describe())
    print_table(["engine", "seconds", "tokens/s", "vs independent", "spread max/min", "GFLOP/s", "% of peak",
                 "weights GB/s", "% of bandwidth"], speed_rows,
                f"Best-of-{args.samples} generation speed (best of {args.repeats}, {args.threads} threads)",
                min_width=150)
    print(f"GFLOP/s = 2 x {params / 1e6:.3f}M parameters x generated tokens / s (attention and prefill ignored); "
          f"weights GB/s = {weight_bytes / 1e6:.1f} MB of weights x {args.new_tokens} decode steps / s; % of peak and "
          "% of bandwidth against the limits above")
    floor = (args.prompt_tokens + args.samples * (args.new_tokens - 1)) / (args.samples * positions)
    for (size, cow), peak in peaks.items():
        ratio = peak["kv_bytes"] / contiguous
        print(f"{size}-token blocks{', copy-on-write' if cow else ''}: paged / contiguous KV bytes = {ratio:.3f} "
              f"(target <= {args.target}: {'met' if ratio <= args.target else 'NOT met'}; "
              f"{peak['copied_blocks']} copy-on-write copies)")
    print(f"(no waste at all would be {floor:.3f}: the prompt once plus every sample's own tokens)")
    if args.output:
        Path(args.output).write_text(json.dumps({"memory": memory_rows, "speed": speed_rows, "limits": limits.to_json(),
                                                 "paged_peaks": {f"{size}{'-cow' if cow else ''}": v
                                                                 for (size, cow), v in peaks.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
