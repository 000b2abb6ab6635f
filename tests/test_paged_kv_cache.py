"""PagedKVCache (inference_optimizations.py): the block pool's bookkeeping (allocate, append, fork,
free, copy-on-write), the paged generation engine's greedy output against Hugging Face ``generate``
token for token, and the memory it saves when n samples share one prompt's blocks."""

from __future__ import annotations

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HEADS, DIM = 2, 2, 4


def _kv(tokens: int, start: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (heads, tokens, dim) keys/values whose entries say which token they belong to."""
    base = torch.arange(tokens, dtype=torch.float32)[None, :, None] + start
    keys = [base.expand(HEADS, tokens, DIM) + 1000 * layer for layer in range(LAYERS)]
    return keys, [-k for k in keys]


def test_append_read_and_block_accounting():
    cache = io.PagedKVCache(block_size=4, num_blocks=8)
    seq = cache.new_sequence()
    keys, values = _kv(6, 0)
    cache.append(seq, keys, values)
    assert cache.length(seq) == 6 and len(cache.tables[seq]) == 2  # 4 + 2 tokens: two blocks
    more_keys, more_values = _kv(3, 6)
    cache.append(seq, more_keys, more_values)
    got_keys, got_values = cache.read(seq)
    for layer in range(LAYERS):
        torch.testing.assert_close(got_keys[layer], torch.cat([keys[layer], more_keys[layer]], 1))
        torch.testing.assert_close(got_values[layer], torch.cat([values[layer], more_values[layer]], 1))
    stats = cache.memory_stats()
    assert (stats["stored_tokens"], stats["blocks_in_use"], stats["allocated_slots"]) == (9, 3, 12)
    assert stats["utilisation"] == 0.75
    assert stats["kv_bytes"] == 12 * 2 * LAYERS * HEADS * DIM * 4  # slots x (keys + values) x layers x heads x dim x fp32
    cache.free(seq)
    assert cache.memory_stats()["blocks_in_use"] == 0 and len(cache.free_blocks) == 8


def test_fork_shares_blocks_and_copies_on_write():
    cache = io.PagedKVCache(block_size=4, num_blocks=8)
    parent = cache.new_sequence()
    cache.append(parent, *_kv(6, 0))  # one full block, one half-full block
    children = [cache.fork(parent) for _ in range(3)]
    assert all(cache.tables[c] == cache.tables[parent] for c in children)
    assert cache.memory_stats()["blocks_in_use"] == 2  # four sequences, two blocks
    full, partial = cache.tables[parent]
    assert cache.ref_counts[full] == cache.ref_counts[partial] == 4
    cache.append(children[0], *_kv(1, 100))  # writes into the shared half block: copy it first
    assert cache.tables[children[0]][0] == full and cache.tables[children[0]][1] != partial
    assert cache.ref_counts[partial] == 3 and cache.copied_blocks == 1
    parent_keys, _ = cache.read(parent)
    child_keys, _ = cache.read(children[0])
    torch.testing.assert_close(parent_keys[1], _kv(6, 0)[0][1])  # the parent never sees the child's token
    torch.testing.assert_close(child_keys[1], torch.cat([_kv(6, 0)[0][1], _kv(1, 100)[0][1]], 1))
    cache.append(children[1], *_kv(3, 200))  # fills its copy of the half block and starts a new one
    assert cache.copied_blocks == 2 and len(cache.tables[children[1]]) == 3
    for seq in [parent] + children:
        cache.free(seq)
    assert all(count == 0 for count in cache.ref_counts) and len(cache.free_blocks) == cache.capacity


def test_fork_at_a_block_boundary_copies_nothing_and_the_pool_grows_to_its_limit():
    cache = io.PagedKVCache(block_size=4, num_blocks=2, max_blocks=4)
    parent = cache.new_sequence()
    cache.append(parent, *_kv(4, 0))
    child = cache.fork(parent)
    cache.append(child, *_kv(4, 4))  # a fresh block, nothing shared is written
    assert cache.copied_blocks == 0 and cache.capacity == 2
    cache.append(parent, *_kv(1, 9))  # third block: the pool doubles to its limit
    assert cache.capacity == 4
    torch.testing.assert_close(cache.read(child)[0][0], torch.cat([_kv(4, 0)[0][0], _kv(4, 4)[0][0]], 1))
    cache.append(parent, *_kv(4, 10))  # fourth block
    with pytest.raises(RuntimeError, match="out of blocks.*max_blocks"):
        cache.append(child, *_kv(1, 50))
    with pytest.raises(ValueError):
        io.PagedKVCache(block_size=0)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    texts = ["What is 37 + 8?", "Compute 12 + 7 - 5.", "hi"]
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": p}]}) for p in texts]


def _hf_greedy(model, prompt, pad, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gpt2", "sdpa")])
def test_paged_greedy_equals_hf_generate(arch, attn, tiny_arch_dir, tiny_tokenizer, prompts):
    """Prompts of different widths, small blocks so completions cross several block boundaries."""
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir(arch)), attn_implementation=attn)
    model.eval()
    pad = tiny_tokenizer.pad_token_id
    batch = [prompts[0], prompts[2][:3], prompts[1] + prompts[0]]
    cache = io.PagedKVCache(block_size=4, num_blocks=4)
    ours = io.generate(model, batch, io.SamplingParams(max_new_tokens=20, do_sample=False), pad_token_id=pad,
                       engine="paged", paged_cache=cache)
    assert ours.token_ids == [_hf_greedy(model, p, pad, 20) for p in batch]
    assert ours.finish_reasons == ["length"] * 3 and cache.capacity > 4  # the pool grew
    assert cache.memory_stats()["sequences"] == 0  # every sequence gave its blocks back


def test_paged_stops_free_rows_and_logprobs_are_the_models_own(tiny_arch_dir, tiny_tokenizer, prompts):
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir("llama")))
    model.eval()
    pad = tiny_tokenizer.pad_token_id
    free = io.generate(model, prompts, io.SamplingParams(max_new_tokens=16, do_sample=False), pad_token_id=pad,
                       engine="static")
    stop_ids = (free.token_ids[0][2], free.token_ids[1][9])
    stop_text = tiny_tokenizer.decode(free.token_ids[2][5:7])
    params = io.SamplingParams(max_new_tokens=16, do_sample=False, stop_token_ids=stop_ids, stop_strings=(stop_text,))
    static = io.generate(model, prompts, params, pad_token_id=pad, tokenizer=tiny_tokenizer, engine="static")
    paged = io.generate(model, prompts, params, pad_token_id=pad, tokenizer=tiny_tokenizer, engine="paged")
    assert paged.token_ids == static.token_ids and paged.finish_reasons == static.finish_reasons
    assert paged.finish_reasons[:2] == ["stop", "stop"]
    sampled = io.generate(model, prompts[:2], io.SamplingParams(max_new_tokens=8, temperature=0.7, n=3, seed=1),
                          pad_token_id=pad, engine="paged")
    again = io.generate(model, prompts[:2], io.SamplingParams(max_new_tokens=8, temperature=0.7, n=3, seed=1),
                        pad_token_id=pad, engine="paged")
    assert sampled.token_ids == again.token_ids and sampled.prompt_index == [0, 0, 0, 1, 1, 1]
    for row, (tokens, logprobs) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        prompt = prompts[row // 3]
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1] / 0.7
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=1e-4)


def test_sixteen_samples_of_one_long_prompt_share_its_blocks(tiny_arch_dir, tiny_tokenizer, prompts):
    """The issue's figure: 16 samples of one 200-token prompt. A contiguous per-sequence cache holds
    16 x (200 + generated) positions; the paged cache holds the prompt once plus each sample's own
    tokens (and one copied half block each)."""
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir("llama")))
    model.eval()
    prompt = (prompts[1] * 20)[:200]
    cache = io.PagedKVCache(block_size=16)
    out = io.generate(model, [prompt], io.SamplingParams(max_new_tokens=32, n=16, temperature=1.0, seed=0),
                      pad_token_id=tiny_tokenizer.pad_token_id, engine="paged", paged_cache=cache)
    peak = out.cache_stats
    longest = max(len(t) for t in out.token_ids)
    assert longest == 32 and peak["sequences"] == 16
    assert peak["copied_blocks"] == 15  # the prompt's half-full last block: one copy per fork (the parent keeps it)
    # the prompt once, 15 copies of its last 8 tokens, and each sample's tokens but the last (never fed back)
    assert peak["stored_tokens"] == 200 + 15 * (200 % 16) + 16 * 31
    contiguous = 16 * (200 + longest) * cache.bytes_per_token
    assert peak["kv_bytes"] <= 0.3 * contiguous
    assert peak["utilisation"] > 0.8
