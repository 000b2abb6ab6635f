"""Inference-time machinery for any Hugging Face causal LM; imports torch and transformers only.

This module never imports ``rlhf``: rewards, process rewards and values come in as plain callables,
so it is usable on its own. Today it holds the attention-backend choice shared with training and
the generation engine (batched sampling over a KV cache); the paged KV cache, Best-of-N, speculative decoding and MCTS build on it.

Public names: select_attention_implementation, SamplingParams, GenerationOutput, generate
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

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


# -- generation engine -----------------------------------------------------------------------------------

RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "rwkv")  # no per-position KV cache: recompute the sequence each step


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

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError("max_new_tokens and n must be >= 1")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.temperature < 0:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0 and temperature >= 0")

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


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask everything outside the top-k tokens and outside the smallest set with mass >= top_p."""
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


@torch.inference_mode()
def generate(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams | None = None, *,
             pad_token_id: int, eos_token_id: int | None = None, tokenizer=None) -> GenerationOutput:
    """Batched sampling for any Hugging Face causal LM over its KV cache.

    Prompts are left-padded and prefilled once; with ``n > 1`` the cache is repeated so the samples
    share that prefill. Each step feeds only the new tokens. Greedy output equals
    ``model.generate(do_sample=False)`` token for token. ``stop_strings`` need ``tokenizer``.
    Shapes: prompts are token-id lists; every output list has len(prompts) * n rows.
    """
    params = params or SamplingParams()
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the completions")
    device = next(model.parameters()).device
    stops = set(params.stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    generator = torch.Generator(device=device)
    # no seed: draw one from torch's global generator, so set_seed still makes the run reproducible
    generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)
    rows = ids.shape[0]
    recurrent = getattr(model.config, "model_type", "") in RECURRENT_MODEL_TYPES
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if recurrent:
        logits, cache = model(input_ids=ids, attention_mask=mask).logits[:, -1], None
    else:  # prefill each distinct prompt once, then share its cache among the n samples
        out = model(input_ids=ids[::params.n], attention_mask=mask[::params.n], position_ids=positions[::params.n],
                    use_cache=True)
        cache = out.past_key_values
        if params.n > 1:
            cache.batch_repeat_interleave(params.n)
        logits = out.logits[:, -1].repeat_interleave(params.n, 0)
    stop_ids = torch.tensor(sorted(stops), device=device, dtype=torch.long)
    tokens = torch.full((rows, params.max_new_tokens), pad_token_id, device=device, dtype=torch.long)
    logprobs = torch.zeros(rows, params.max_new_tokens, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    next_position = positions[:, -1] + 1
    for step in range(params.max_new_tokens):
        scaled = logits.float() / (params.temperature if not params.greedy else 1.0)
        if params.greedy:
            chosen = scaled.argmax(-1)
        else:
            filtered = _filter_logits(scaled, params.top_k, params.top_p)
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
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if recurrent:
            ids = torch.cat([ids, chosen[:, None]], 1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        else:
            logits = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
        next_position = next_position + 1
    counts = lengths.tolist()
    token_lists = [row[:count] for row, count in zip(tokens.tolist(), counts)]
    logprob_lists = [row[:count] for row, count in zip(logprobs.tolist(), counts)]
    reasons = ["stop" if s else "length" for s in stopped.tolist()]
    return GenerationOutput(token_lists, logprob_lists, reasons, [r // params.n for r in range(rows)])
