"""Greedy speculative decoding: ``SpeculativeDecoder`` against target-only decoding and HF assisted generation.

    python bench/bench_speculative.py                           # demo SFT target, outputs/demo/draft, 3 repeats
    python bench/bench_speculative.py --build-draft             # build + train the draft first if it is missing
    python bench/bench_speculative.py --k 4 --k-max 12 --repeats 5 --eval-prompts 40 --multistep-prompts 40

Models: the target is the demo-trained SFT policy (``outputs/demo/sft``, from ``python rlhf.py pipeline
--config configs/demo.yaml``); the draft a much smaller Llama with the same tokenizer, trained by this
project's SFT stage on the demo data (``python scripts/make_draft_model.py``, which ``--build-draft``
runs). Both fp32, sdpa attention, on CPU; one model object of each serves every method.

Workload: the first ``--eval-prompts`` prompts of data/demo/eval.jsonl and the first
``--multistep-prompts`` of data/demo/multistep.jsonl (held out from training), each rendered with the
tokenizer's chat template (``chat_prompt_ids``: user turn + assistant header), decoded one at a time
(batch 1) greedily for at most ``--new-tokens`` tokens, stopping at the end-of-turn token
(``stop_token_ids``; the stop token is part of the output).

Methods, all greedy on the same prompts:
  * ``hf``: target-only ``target.generate(do_sample=False)``: THE BASELINE ("target-only" below);
  * ``loop``: target-only greedy loop over a ``DynamicCache``, one token per forward, making the same
    model calls the speculative decoder makes (no ``generate`` machinery): how much of a speedup comes
    from drafting rather than from skipping ``generate``'s per-token overhead;
  * ``static`` / ``compiled``: ours, ``inference_optimizations.generate(engine="static" | "compiled")`` on the
    single sequence (target-only; ``compiled`` compiles its decode step in the untimed pass, one graph for
    batch 1 and the bucketed cache length: it is the fastest target-only path here, so "vs fastest
    target-only" compares with it);
  * ``spec``: ours, ``SpeculativeDecoder(target, draft, k=--k, engine=--spec-engine).generate(prompt,
    temperature=0)`` (a fresh decoder per prompt). ``compiled`` (default): static caches, the k draft steps
    fused, draft round and verify under torch.compile (compiled in the untimed pass), fixed k; ``eager``:
    dynamic caches, k adapting from --k;
  * ``assisted``: HF assisted generation, ``target.generate(..., assistant_model=draft, do_sample=False)``
    with transformers' defaults (20 draft tokens, constant schedule, draft confidence threshold 0.4).
Before timing, an untimed pass runs every method on every prompt (the warm-up) and asserts that all
outputs are token-identical to ``hf``; the timed calls are checked again. A mismatch stops the bench
with exit status 1 and prints the first differing position.

How it times: one repeat runs every method on every prompt, methods back to back per prompt, their
order rotating between prompts and repeats. A method's time for a prompt is its best over the repeats
(background load only ever adds time), and the table's "best s" sums those over the prompts; "median s"
sums the per-prompt medians. Tokens/s = generated tokens / best s (prefill included in the time).
Acceptance = accepted / proposed draft tokens (HF's are counted by wrapping its candidate generator in
the untimed pass); "tok/fwd" = generated tokens per target forward; "mean k" = drafted tokens per round.
A profile of single forwards (target with 1 and k+1 tokens, draft with 1, over a DynamicCache) explains
the result: with cost ratio c = draft / target forward, drafting pays only when tokens per round beat
k * c + (target k+1 forward / target 1 forward). The CPU that other processes used during the timed
repeats is measured (/proc/stat minus this process) and a warning printed above 0.25 cores.

The limit (``bench/limits.py``): decoding one sequence is bound by memory traffic, each target forward reading every
target weight once, so the rows are set against the memory bandwidth (and the peak fp32 matmul FLOP/s), measured in
this process at ``--threads`` threads before the timed repeats and after them (the best of each is kept, printed
above the table). "equiv. weights GB/s" = generated tokens x the target's weight bytes (``model_weight_bytes``: its
fp32 parameters, the tied embedding once) / best s: the bytes a target-only decoder reads for those tokens, one
forward per token. For the target-only rows that is what they read; for ``spec`` and ``assisted`` it is an
equivalent: several tokens are accepted per target forward (one weight read), and the draft's reads are not counted,
so their figure can exceed 100% of the bandwidth: how far drafting takes decoding past the single-token limit.
"% of bandwidth" = that / the measured bandwidth.

Output: progress lines, the table (rich if installed, plain otherwise), the cost model and a PASS/FAIL
line for ``spec`` against ``--target-speedup`` x target-only. Exit status 0 whatever the timing, 1 when
an output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from limits import Limits, fraction, giga, limits_epilog, model_weight_bytes  # bench/limits.py
from tables import print_table  # bench/tables.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402

METHODS = ("hf", "loop", "static", "compiled", "spec", "assisted")
TARGET_ONLY = ("hf", "loop", "static", "compiled")
LABELS = {"hf": "target-only HF generate (baseline)", "loop": "target-only greedy loop",
          "static": "target-only ours static", "compiled": "target-only ours compiled",
          "spec": "ours SpeculativeDecoder", "assisted": "HF assisted generation"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "equiv. weights GB/s = tokens x the target's weight bytes / best s, which "
                                         "can pass 100% of the bandwidth because drafting accepts several tokens per "
                                         "target forward"))
    parser.add_argument("--target", default="outputs/demo/sft", help="target model directory")
    parser.add_argument("--draft", default="outputs/demo/draft", help="draft model directory")
    parser.add_argument("--build-draft", action="store_true",
                        help="run scripts/make_draft_model.py --output DRAFT first when the draft is missing")
    parser.add_argument("--eval-prompts", type=int, default=20, help="first N prompts of data/demo/eval.jsonl")
    parser.add_argument("--multistep-prompts", type=int, default=20, help="first N of data/demo/multistep.jsonl")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens (stops at the end-of-turn token)")
    parser.add_argument("--k", type=int, default=4, help="SpeculativeDecoder's initial draft length")
    parser.add_argument("--k-min", type=int, default=1, help="SpeculativeDecoder k_min")
    parser.add_argument("--k-max", type=int, default=8, help="SpeculativeDecoder k_max")
    parser.add_argument("--fixed-k", action="store_true", help="adaptive=False (k stays --k)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts; best per prompt kept")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (hf, the baseline, is always run)")
    parser.add_argument("--spec-engine", default="compiled", choices=("eager", "static", "compiled"),
                        help="SpeculativeDecoder engine: compiled (static caches, fused draft round and verify "
                        "under torch.compile; fixed k), static (the same uncompiled) or eager (dynamic caches, "
                        "adaptive k)")
    parser.add_argument("--target-speedup", type=float, default=2.0, help="spec / target-only (hf) tokens/s target")
    parser.add_argument("--json", help="write the per-prompt timings and statistics here")
    args = parser.parse_args(argv)
    args.methods = ["hf"] + [m for m in args.methods.split(",") if m and m != "hf"]
    if not set(args.methods) <= set(METHODS):
        parser.error(f"--methods must be a subset of {','.join(METHODS)}")
    if min(args.new_tokens, args.threads, args.repeats, args.k_min) < 1 or not args.k_min <= args.k <= args.k_max:
        parser.error("need --new-tokens, --threads, --repeats >= 1 and 1 <= --k-min <= --k <= --k-max")
    if args.eval_prompts + args.multistep_prompts < 1:
        parser.error("need at least one prompt")
    return args


# -- the machine ------------------------------------------------------------------------------------------------------

def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    return time.process_time()


# -- models and prompts -----------------------------------------------------------------------------------------------

def ensure_draft(args: argparse.Namespace) -> Path:
    draft = (REPO / args.draft).resolve()
    if (draft / "config.json").exists():
        return draft
    command = [sys.executable, str(REPO / "scripts" / "make_draft_model.py"), "--target", args.target,
               "--output", args.draft]
    if not args.build_draft:
        raise SystemExit(f"error: no draft model at {draft}; build it with `{' '.join(command[1:])}` "
                         f"(or pass --build-draft)")
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    return draft


def load(path: Path):
    model, _ = rlhf.load_causal_lm(str(path), attn_implementation="sdpa")
    return model.eval()


def describe(model) -> str:
    return (f"{model.config.num_hidden_layers} layer(s), hidden {model.config.hidden_size}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params")


def load_prompts(tokenizer, eval_count: int, multistep_count: int) -> list[tuple[str, list[int]]]:
    """(kind, token ids) for the first prompts of the held-out eval and multistep sets."""
    prompts = []
    for name, count in (("eval", eval_count), ("multistep", multistep_count)):
        lines = (REPO / "data" / "demo" / f"{name}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()][:count]
        if len(records) < count:
            raise SystemExit(f"error: data/demo/{name}.jsonl has only {len(records)} prompts")
        prompts += [(name, io.chat_prompt_ids(tokenizer, r["prompt"])) for r in records]
    return prompts


# -- the methods: each returns the generated ids (stop token included) and its statistics ---------------------------

class Runner:
    def __init__(self, args: argparse.Namespace, target, draft, tokenizer) -> None:
        self.args, self.target, self.draft = args, target, draft
        self.stops = io.stop_token_ids(tokenizer)
        self.pad = tokenizer.pad_token_id
        self.eos = tokenizer.eos_token_id

    def __call__(self, method: str, prompt: list[int]) -> tuple[list[int], dict]:
        return getattr(self, method)(prompt)

    def _hf_generate(self, prompt: list[int], **extra) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=self.args.new_tokens, eos_token_id=list(self.stops),
                                       pad_token_id=self.pad, **extra)
        return out[0, len(prompt):].tolist()

    def hf(self, prompt: list[int]) -> tuple[list[int], dict]:
        tokens = self._hf_generate(prompt)
        return tokens, {"target_forwards": len(tokens)}

    def assisted(self, prompt: list[int]) -> tuple[list[int], dict]:
        return self._hf_generate(prompt, assistant_model=self.draft), {}

    @torch.inference_mode()
    def loop(self, prompt: list[int]) -> tuple[list[int], dict]:
        from transformers import DynamicCache

        cache, tokens = DynamicCache(), []
        logits = self.target(input_ids=torch.tensor([prompt]), **io.cache_argument(self.target, cache),
                             use_cache=True).logits[0, -1]
        while True:
            token = int(logits.argmax())
            tokens.append(token)
            if token in self.stops or len(tokens) == self.args.new_tokens:
                return tokens, {"target_forwards": len(tokens)}
            logits = self.target(input_ids=torch.tensor([[token]]), **io.cache_argument(self.target, cache),
                                 use_cache=True).logits[0, -1]

    def _ours(self, prompt: list[int], engine: str) -> tuple[list[int], dict]:
        params = io.SamplingParams(max_new_tokens=self.args.new_tokens, temperature=0.0, do_sample=False,
                                   stop_token_ids=self.stops)
        out = io.generate(self.target, [prompt], params, pad_token_id=self.pad, eos_token_id=self.eos, engine=engine)
        return out.token_ids[0], {}

    def static(self, prompt: list[int]) -> tuple[list[int], dict]:
        return self._ours(prompt, "static")

    def compiled(self, prompt: list[int]) -> tuple[list[int], dict]:
        return self._ours(prompt, "compiled")

    def spec(self, prompt: list[int]) -> tuple[list[int], dict]:
        decoder = io.SpeculativeDecoder(self.target, self.draft, k=self.args.k, adaptive=not self.args.fixed_k,
                                        k_min=self.args.k_min, k_max=self.args.k_max, engine=self.args.spec_engine)
        out = decoder.generate(prompt, self.args.new_tokens, temperature=0.0, stop_token_ids=self.stops)
        return out.token_ids, {"accepted": out.accepted, "proposed": out.proposed,
                               "target_forwards": out.target_forwards, "rounds": len(out.k_history)}


class CountAssisted:
    """Counts HF assisted generation's drafted / accepted tokens and target forwards (rounds) by wrapping
    ``AssistedCandidateGenerator.update_candidate_strategy``; used in the untimed pass only."""

    def __enter__(self) -> dict:
        from transformers.generation.candidate_generator import AssistedCandidateGenerator

        self.cls, self.original = AssistedCandidateGenerator, AssistedCandidateGenerator.update_candidate_strategy
        stats = self.stats = {"accepted": 0, "proposed": 0, "target_forwards": 0, "rounds": 0}
        original = self.original

        def counted(generator, input_ids, scores, num_matches):
            stats["proposed"] += scores.shape[1] - 1  # candidate_length + 1 logits per round
            stats["accepted"] += int(num_matches)
            stats["target_forwards"] += 1
            stats["rounds"] += 1
            return original(generator, input_ids, scores, num_matches)

        AssistedCandidateGenerator.update_candidate_strategy = counted
        return stats

    def __exit__(self, *exc) -> None:
        self.cls.update_candidate_strategy = self.original


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_identical(method: str, tokens: list[int], reference: list[int], prompt_no: int, tokenizer) -> None:
    if tokens == reference:
        return
    at = first_difference(tokens, reference)
    print(f"FAIL: prompt {prompt_no}: {LABELS[method]} differs from target-only HF generate at token {at}\n"
          f"  hf:     {tokenizer.decode(reference)!r}\n  {method}: {tokenizer.decode(tokens)!r}\n"
          f"  ids from {at}: hf {reference[at:at + 8]} vs {method} {tokens[at:at + 8]}", flush=True)
    raise SystemExit(1)


# -- profile of single forwards ---------------------------------------------------------------------------------------

@torch.inference_mode()
def forward_profile(target, draft, prompt: list[int], ks: list[int], calls: int = 100) -> dict:
    """Milliseconds of one forward over a DynamicCache holding the prompt plus 24 tokens (lower quartile of
    ``calls``, robust to background load): target with 1 and k+1 new tokens, draft with 1; and of the
    DynamicCache.crop that takes the k+1 positions back off (the decoder's cache bookkeeping)."""
    from transformers import DynamicCache

    context = prompt + prompt[-1:] * 24
    result = {}

    def timed(model, new: int, key: str) -> None:
        cache = DynamicCache()
        model(input_ids=torch.tensor([context]), **io.cache_argument(model, cache), use_cache=True)
        ids, times, crops = torch.tensor([[prompt[-1]] * new]), [], []
        for _ in range(calls):
            start = time.perf_counter()
            model(input_ids=ids, **io.cache_argument(model, cache), use_cache=True)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            cache.crop(-new)
            crops.append(time.perf_counter() - start)
        result[key] = statistics.quantiles(times, n=4)[0] * 1e3
        result[f"crop {key}"] = statistics.quantiles(crops, n=4)[0] * 1e3

    timed(target, 1, "target 1")
    for k in ks:
        timed(target, k + 1, f"target {k + 1}")
    timed(draft, 1, "draft 1")
    return result


# -- main -------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rlhf.setup_logging("WARNING")
    transformers.logging.set_verbosity_error()  # assisted generation's internal generate() warns on every call
    target_dir = (REPO / args.target).resolve()
    if not (target_dir / "config.json").exists():
        raise SystemExit(f"error: no target model at {target_dir}; run `python rlhf.py pipeline --config "
                         f"configs/demo.yaml` (or pass --target)")
    draft_dir = ensure_draft(args)
    tokenizer = rlhf.load_tokenizer(target_dir)
    if rlhf.load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise SystemExit("error: the draft's tokenizer differs from the target's; token ids would not match")
    target, draft = load(target_dir), load(draft_dir)
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
    prompts = load_prompts(tokenizer, args.eval_prompts, args.multistep_prompts)
    runner = Runner(args, target, draft, tokenizer)
    print(f"target {args.target}: {describe(target)}; draft {args.draft}: {describe(draft)} "
          f"({sizes['draft'] / sizes['target']:.1%} of the target)")
    print(f"{len(prompts)} prompts ({args.eval_prompts} eval + {args.multistep_prompts} multistep), batch 1, greedy, "
          f"<= {args.new_tokens} new tokens, stop ids {list(runner.stops)}; {args.threads} thread(s), "
          f"{args.repeats} repeats; k={args.k} ({'fixed' if args.fixed_k else f'adaptive {args.k_min}..{args.k_max}'})",
          flush=True)

    # untimed pass: warm-up, the identity check against hf, acceptance statistics
    reference, stats = [], {m: {} for m in args.methods}
    started = time.perf_counter()
    for number, (_, prompt) in enumerate(prompts):
        tokens, _ = runner("hf", prompt)
        reference.append(tokens)
        for method in args.methods:
            if method == "assisted":
                with CountAssisted() as extra:
                    out, _ = runner(method, prompt)
            else:
                out, extra = runner(method, prompt)
            check_identical(method, out, tokens, number, tokenizer)
            for key, value in extra.items():
                stats[method][key] = stats[method].get(key, 0) + value
    total_tokens = sum(len(t) for t in reference)
    stopped = sum(bool(t) and t[-1] in runner.stops for t in reference)
    print(f"untimed pass ({time.perf_counter() - started:.1f} s): every method token-identical to target-only HF "
          f"generate on all {len(prompts)} prompts; {total_tokens} tokens, {stopped} stopped at end of turn"
          + ("; compiled engine: first compiled step(s) "
             f"{', '.join(f'{v:.1f}' for v in io.compile_seconds(target).values())} s"
             if "compiled" in args.methods else ""), flush=True)

    ks = sorted({args.k, round(stats["spec"]["proposed"] / stats["spec"]["rounds"])} if "spec" in args.methods
                else {args.k})
    profile = forward_profile(target, draft, prompts[0][1], ks)

    # timed repeats, between two measurements of the limits
    limits = Limits("float32").measure()
    times: dict[str, list[list[float]]] = {m: [[] for _ in prompts] for m in args.methods}
    background = []
    for repeat in range(args.repeats):
        busy, own, wall = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
        for number, (_, prompt) in enumerate(prompts):
            shift = (number + repeat) % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                start = time.perf_counter()
                tokens, _ = runner(method, prompt)
                times[method][number].append(time.perf_counter() - start)
                check_identical(method, tokens, reference[number], number, tokenizer)
        wall = time.perf_counter() - wall
        background.append(max(0.0, (busy_cpu_seconds() - busy) - (own_cpu_seconds() - own)) / wall)
        print(f"  repeat {repeat + 1}: " + ", ".join(f"{m} {sum(t[-1] for t in times[m]):.3f} s" for m in args.methods)
              + f"; background {background[-1]:.2f} cores", flush=True)

    limits.measure()
    target_bytes = model_weight_bytes(target)
    profile = {key: min(value, after) for (key, value), after in
               zip(profile.items(), forward_profile(target, draft, prompts[0][1], ks).values())}
    print("forward profile (ms, lower quartile, best of before and after the repeats; cache = prompt + 24 tokens): "
          + ", ".join(f"{key} {value:.3f}" for key, value in profile.items() if not key.startswith("crop"))
          + f"; DynamicCache.crop {max(v for k, v in profile.items() if k.startswith('crop')):.3f} or less")
    best = {m: sum(min(t) for t in times[m]) for m in args.methods}
    median = {m: sum(statistics.median(t) for t in times[m]) for m in args.methods}
    fastest_plain = min(best[m] for m in args.methods if m in TARGET_ONLY)
    rows = []
    for method in args.methods:
        s = stats[method]
        forwards = s.get("target_forwards")
        equivalent = total_tokens * target_bytes / best[method]  # bytes/s a one-token-per-forward decoder would read
        rows.append([LABELS[method], str(total_tokens), f"{best[method]:.3f}", f"{median[method]:.3f}",
                     f"{total_tokens / best[method]:,.0f}", f"{best['hf'] / best[method]:.2f}x",
                     f"{fastest_plain / best[method]:.2f}x",
                     f"{best['assisted'] / best[method]:.2f}x" if "assisted" in args.methods else "-",
                     f"{s['accepted'] / s['proposed']:.1%}" if s.get("proposed") else "-",
                     f"{s['proposed'] / s['rounds']:.2f}" if s.get("rounds") else "-",
                     f"{total_tokens / forwards:.2f}" if forwards else "-", giga(equivalent, 1),
                     fraction(equivalent, limits.bandwidth)])
    print(limits.describe())
    print_table(["method", "tokens", "best s", "median s", "tokens/s", "vs target-only", "vs fastest target-only",
                 "vs HF assisted", "acceptance", "mean k", "tok/fwd", "equiv. weights GB/s", "% of bandwidth"], rows,
                title=f"Greedy speculative decoding, batch 1: {len(prompts)} demo prompts, <= {args.new_tokens} new "
                      f"tokens, {args.threads} thread(s), best of {args.repeats}",
                label_columns=1, min_width=210)
    print("vs target-only = HF generate(do_sample=False) seconds / method seconds (the baseline); vs fastest "
          "target-only = the fastest of the target-only rows; acceptance = accepted / drafted tokens; mean k = drafted "
          "tokens per round; tok/fwd = generated tokens per target forward (prefill not counted); equiv. weights "
          f"GB/s = tokens x the target's {target_bytes / 1e6:.1f} MB of weights / best s, what one-token-per-forward "
          "decoding would read: above 100% of the bandwidth only because drafting accepts several tokens per target "
          "forward")
    if max(background) > 0.25:
        print(f"WARNING: other processes used up to {max(background):.2f} cores during the timed repeats; "
              f"the figures are unreliable, rerun on a quiet machine")
    if "spec" in args.methods:
        s = stats["spec"]
        tokens_per_round = total_tokens / s["rounds"]
        mean_k = s["proposed"] / s["rounds"]
        c = profile["draft 1"] / profile["target 1"]
        verify = profile[f"target {round(mean_k) + 1}"] / profile["target 1"]
        if "loop" in args.methods:
            print(f"cost model: {tokens_per_round:.2f} tokens per round for {mean_k:.2f} draft forwards (c = draft / "
                  f"target forward = {c:.2f}) + 1 target forward of ~{round(mean_k) + 1} tokens "
                  f"({verify:.2f}x a 1-token "
                  f"one): ~{tokens_per_round / (mean_k * c + verify):.2f}x a plain target loop before the decoder's "
                  f"own overhead (measured {best['loop'] / best['spec']:.2f}x)")
        ratio = best["hf"] / best["spec"]
        print(f"{'PASS' if ratio >= args.target_speedup else 'FAIL'}: SpeculativeDecoder is {ratio:.2f}x target-only "
              f"HF generate (target {args.target_speedup}x), {fastest_plain / best['spec']:.2f}x the fastest "
              f"target-only method" + (f", {best['assisted'] / best['spec']:.2f}x HF assisted generation"
                                       if "assisted" in args.methods else "")
              + f"; acceptance {s['accepted'] / s['proposed']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sizes": sizes, "stats": stats, "profile": profile,
                                               "background": background, "tokens": total_tokens,
                                               "limits": limits.to_json(), "target_bytes": target_bytes,
                                               "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
