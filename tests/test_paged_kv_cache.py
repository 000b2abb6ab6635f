"""PagedKVCache (inference_optimizations.py): the block pool's bookkeeping (allocate, append, fork,
free, forks that leave a shared partial block in place behind a masked hole, and copy-on-write), the
paged generation engine's greedy output against Hugging Face ``generate`` token for token, and the
memory it saves when n samples share one prompt's blocks."""

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


def _free_all(cache: io.PagedKVCache, seqs: list[int]) -> None:
    """Free ``seqs``; then every block must be back in the pool."""
    for seq in seqs:
        cache.free(seq)
    assert all(count == 0 for count in cache.ref_counts) and len(cache.free_blocks) == cache.capacity


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
    # slots x (keys + values) x layers x heads x dim x fp32
    assert stats["kv_bytes"] == 12 * 2 * LAYERS * HEADS * DIM * 4
    cache.free(seq)
    assert cache.memory_stats()["blocks_in_use"] == 0 and len(cache.free_blocks) == 8


def test_fork_leaves_the_shared_partial_block_in_place_behind_a_hole():
    cache = io.PagedKVCache(block_size=4, num_blocks=8)
    parent = cache.new_sequence()
    cache.append(parent, *_kv(6, 0))  # one full block, one half-full block
    children = [cache.fork(parent) for _ in range(3)]
    full, partial = cache.tables[parent]
    assert cache.ref_counts[full] == cache.ref_counts[partial] == 4
    cache.append(children[0], *_kv(1, 100))  # no copy: its own token goes into a fresh block
    own = cache.tables[children[0]][2]
    assert cache.tables[children[0]][:2] == [full, partial] and cache.fills[children[0]] == [4, 2, 1]
    assert cache.ref_counts[partial] == 4 and cache.copied_blocks == 0 and own not in (full, partial)
    assert cache.visible([children[0]], reserved=False)[0].tolist() == [True] * 6 + [False] * 2 + [True] + [False] * 3
    torch.testing.assert_close(cache.read(parent)[0][1], _kv(6, 0)[0][1])
    child_keys, child_values = cache.read(children[0])  # in order, the hole left out
    torch.testing.assert_close(child_keys[1], torch.cat([_kv(6, 0)[0][1], _kv(1, 100)[0][1]], 1))
    torch.testing.assert_close(child_values[0], torch.cat([_kv(6, 0)[1][0], _kv(1, 100)[1][0]], 1))
    cache.append(children[0], *_kv(4, 101))  # fills its own block in place, then one more
    assert cache.fills[children[0]] == [4, 2, 4, 1] and cache.length(children[0]) == 11
    cache.append(parent, *_kv(1, 50))  # the parent too: the partial block is still shared
    assert len(cache.tables[parent]) == 3 and cache.copied_blocks == 0
    stats = cache.memory_stats()
    # blocks: full, partial, child 0's two, the parent's one; the hole (2 slots) is allocated, not stored
    assert (stats["blocks_in_use"], stats["stored_tokens"], stats["logical_tokens"]) == (5, 6 + 5 + 1, 11 + 7 + 6 + 6)
    for seq in children[1:]:  # the others stop: the parent now holds the partial block alone
        cache.free(seq)
    assert cache.ref_counts[partial] == 2
    cache.free(children[0])
    assert cache.ref_counts[partial] == 1
    _free_all(cache, [parent])


def test_fork_of_a_fork_with_a_hole_and_a_private_last_block_is_extended_in_place():
    cache = io.PagedKVCache(block_size=4, num_blocks=4, max_blocks=16)
    parent = cache.new_sequence()
    cache.append(parent, *_kv(3, 0))
    child = cache.fork(parent)
    cache.append(child, *_kv(2, 10))  # hole of one slot after the shared 3
    grandchild = cache.fork(child)  # shares the prompt block and the child's half-full block
    cache.append(grandchild, *_kv(3, 20))  # a second hole (two slots) after the child's two tokens
    cache.append(child, *_kv(1, 30))  # the child's own block is shared with the grandchild now: fresh block
    want = {parent: [_kv(3, 0)], child: [_kv(3, 0), _kv(2, 10), _kv(1, 30)],
            grandchild: [_kv(3, 0), _kv(2, 10), _kv(3, 20)]}
    for seq, parts in want.items():
        keys, values = cache.read(seq)
        for layer in range(LAYERS):
            torch.testing.assert_close(keys[layer], torch.cat([p[0][layer] for p in parts], 1))
            torch.testing.assert_close(values[layer], torch.cat([p[1][layer] for p in parts], 1))
    assert cache.fills[grandchild] == [3, 2, 3] and cache.fills[child] == [3, 2, 1]
    assert cache.copied_blocks == 0 and cache.memory_stats()["blocks_in_use"] == 4
    cache.free(grandchild)
    cache.append(child, *_kv(2, 40))  # its last block is private: extended in place, no new block
    assert cache.fills[child] == [3, 2, 3] and cache.memory_stats()["blocks_in_use"] == 3
    cache.append(parent, *_kv(1, 5))  # the prompt block is still shared with the child: fresh block
    assert cache.fills[parent] == [3, 1]
    slot = cache.reserve(parent)
    with pytest.raises(ValueError, match="commit"):
        cache.fork(parent)
    assert slot == [(cache.tables[parent][1], 1)]
    cache.commit(parent)
    _free_all(cache, [parent, child])


def test_fork_shares_blocks_and_copies_on_write():
    cache = io.PagedKVCache(block_size=4, num_blocks=8, copy_on_write=True)
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
    _free_all(cache, [parent] + children)


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


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_paged_forked_samples_read_past_the_hole(arch, tiny_arch_dir, tiny_tokenizer, prompts):
    """n > 1 samples of prompts whose lengths are not multiples of the block size: every fork starts its
    own tokens behind a hole in the prompt's last block. Greedy samples all equal HF ``generate``, and
    sampling draws the same tokens as the copy-on-write layout (no holes) on the same seed."""
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir(arch)))
    model.eval()
    pad = tiny_tokenizer.pad_token_id
    batch = [prompts[0], prompts[2][:3], prompts[1] + prompts[0]]
    assert any(len(p) % 4 for p in batch)
    cache = io.PagedKVCache(block_size=4, num_blocks=4)
    greedy = io.generate(model, batch, io.SamplingParams(max_new_tokens=12, do_sample=False, n=3), pad_token_id=pad,
                         engine="paged", paged_cache=cache)
    want = [_hf_greedy(model, p, pad, 12) for p in batch]
    assert greedy.token_ids == [want[i // 3] for i in range(9)]
    assert greedy.cache_stats["copied_blocks"] == 0 and cache.memory_stats()["sequences"] == 0
    assert len(cache.free_blocks) == cache.capacity and not any(cache.ref_counts)
    params = io.SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=3)
    holes = io.generate(model, batch, params, pad_token_id=pad, engine="paged",
                        paged_cache=io.PagedKVCache(block_size=4))
    copies = io.generate(model, batch, params, pad_token_id=pad, engine="paged",
                         paged_cache=io.PagedKVCache(block_size=4, copy_on_write=True))
    assert holes.token_ids == copies.token_ids and len(set(map(tuple, holes.token_ids))) > 3
    torch.testing.assert_close(torch.tensor(holes.logprobs), torch.tensor(copies.logprobs), atol=1e-5, rtol=1e-5)
    assert holes.cache_stats["copied_blocks"] == 0 and copies.cache_stats["copied_blocks"] > 0
    assert holes.cache_stats["blocks_in_use"] <= copies.cache_stats["blocks_in_use"]


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


@pytest.mark.parametrize("new_tokens", [32, 64])
def test_sixteen_samples_of_one_long_prompt_share_its_blocks(new_tokens, tiny_arch_dir, tiny_tokenizer, prompts):
    """The issue's figure: 16 samples of one 200-token prompt. A contiguous per-sequence cache holds
    16 x (200 + generated - 1) positions (the last sampled token is never fed back); the paged cache
    holds the prompt's 13 blocks once (its last one half full, shared behind each sample's hole) plus
    each sample's own blocks, and copies nothing."""
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir("llama")))
    model.eval()
    prompt = (prompts[1] * 20)[:200]
    cache = io.PagedKVCache(block_size=16)
    out = io.generate(model, [prompt], io.SamplingParams(max_new_tokens=new_tokens, n=16, temperature=1.0, seed=0),
                      pad_token_id=tiny_tokenizer.pad_token_id, engine="paged", paged_cache=cache)
    peak = out.cache_stats
    assert [len(t) for t in out.token_ids] == [new_tokens] * 16 and peak["sequences"] == 16
    own = new_tokens - 1  # tokens each sample feeds back
    blocks = 13 + 16 * -(-own // 16)  # 64 new tokens: 13 + 16 x 4 = 77 blocks, 1,232 slots
    assert peak["copied_blocks"] == 0
    assert (peak["blocks_in_use"], peak["allocated_slots"]) == (blocks, 16 * blocks)
    assert peak["stored_tokens"] == 200 + 16 * own and peak["logical_tokens"] == 16 * (200 + own)
    assert peak["kv_bytes"] == 16 * blocks * cache.bytes_per_token
    contiguous = 16 * (200 + own) * cache.bytes_per_token
    assert peak["kv_bytes"] <= 0.3 * contiguous
    if new_tokens == 64:
        assert peak["kv_bytes"] / contiguous == pytest.approx(1232 / 4208)  # 0.293 (0.2917 vs 16 x 264)
    assert peak["utilisation"] > 0.95
    assert cache.memory_stats()["blocks_in_use"] == 0 and len(cache.free_blocks) == cache.capacity
