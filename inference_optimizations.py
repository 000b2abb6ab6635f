"""Inference-time machinery for any Hugging Face causal LM; imports torch and transformers only.

This module never imports ``rlhf``: rewards, process rewards and values come in as plain callables,
so it is usable on its own. Today it holds the attention-backend choice shared with training;
the generation engine, paged KV cache, Best-of-N, speculative decoding and MCTS build on it.

Public names: select_attention_implementation
"""

from __future__ import annotations

import importlib.util
import logging

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
