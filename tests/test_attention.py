"""OptimizedAttention: every backend available here computes the same attention as a plain formula
written out in the test (grouped-query heads, bottom-right causal masks, boolean and additive masks);
the backend choice falls back flash -> sdpa -> eager with a reason; a model loaded with each backend
gives the same logits."""

from __future__ import annotations

import math

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(query, key, value, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v head by head; query head h reads key/value head h // (H / H_kv)."""
    batch, heads, q_len, dim = query.shape
    group = heads // key.shape[1]
    out = torch.zeros_like(query, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h // group].double(), value[b, h // group].double()
            scores = query[b, h].double() @ k.T / math.sqrt(dim)
            scores = scores.masked_fill(~allowed[b], float("-inf"))
            out[b, h] = scores.softmax(-1) @ v
    return out


def _inputs(seed: int = 0, q_len: int = 3, kv_len: int = 7):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 4, q_len, 8, generator=generator)
    key = torch.randn(2, 2, kv_len, 8, generator=generator)
    value = torch.randn(2, 2, kv_len, 8, generator=generator)
    padding = torch.ones(2, kv_len, dtype=torch.bool)
    padding[1, :2] = False  # the second row is left-padded by two
    return query, key, value, padding


BACKENDS = ["sdpa", "eager"] + (["flash_attention_2"] if io.flash_attention_available("cuda")[0] else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_with_the_formula(backend):
    query, key, value, padding = _inputs()
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)  # last query sees every key
    device = "cuda" if backend == "flash_attention_2" else "cpu"
    attention = io.OptimizedAttention(backend, device)
    assert attention.implementation == backend
    cases = [(None, False, torch.ones(2, q_len, kv_len, dtype=torch.bool)),
             (None, True, causal.expand(2, -1, -1))]
    if backend != "flash_attention_2":  # flash-attn takes no arbitrary mask (the module falls back to sdpa for one)
        bool_mask = padding[:, None, None, :]
        additive = torch.zeros(2, 1, 1, kv_len).masked_fill(~bool_mask, float("-inf"))
        cases += [(bool_mask, True, padding[:, None, :] & causal),
                  (additive, False, padding[:, None, :].expand(-1, q_len, -1))]
    for mask, is_causal, allowed in cases:
        dtype = torch.bfloat16 if backend == "flash_attention_2" else torch.float32
        args = [t.to(device, dtype) for t in (query, key, value)]
        got = attention(*args, attention_mask=None if mask is None else mask.to(device), is_causal=is_causal)
        want = _reference(query, key, value, allowed)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double().cpu(), want, atol=tolerance, rtol=tolerance)


def test_backend_choice_falls_back_with_a_reason():
    attention = io.OptimizedAttention("flash_attention_2", "cpu")
    assert attention.implementation == "sdpa" and "CUDA" in attention.reason
    assert io.OptimizedAttention("auto", "cpu").implementation == "sdpa"
    with pytest.raises(ValueError, match="not one of"):
        io.OptimizedAttention("xformers")
    with pytest.raises(ValueError, match="cannot share"):
        io.OptimizedAttention("sdpa")(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))


def test_a_model_gives_the_same_logits_on_each_backend(tiny_arch_dir, tiny_tokenizer):
    tokens = tiny_tokenizer("What is 37 + 8?")["input_ids"]
    ids = torch.tensor([tokens, [tiny_tokenizer.pad_token_id] * 2 + tokens[2:]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second row is left-padded
    logits = {}
    for backend in ("sdpa", "eager"):
        model, _ = rlhf.load_causal_lm(str(tiny_arch_dir("llama")), attn_implementation=backend)
        logits[backend] = model.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits["sdpa"][mask.bool()], logits["eager"][mask.bool()], atol=1e-4, rtol=1e-4)
