"""Speculative decoding: greedy mode reproduces the target's greedy output token for token; sampling
mode (Leviathan et al.'s rejection rule) follows the target's distribution, checked by exact
enumeration on a tiny vocabulary; k adapts to the acceptance rate."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import inference_optimizations as io


def _llama(vocab: int, hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper distributions than the default init, so drafts are sometimes right
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def pair():
    return _llama(50, 32, 2, seed=0), _llama(50, 16, 1, seed=1)


@pytest.mark.parametrize("prompt,length", [([1], 12), ([3, 9, 4], 20), ([7, 7, 7, 7, 2, 5], 30)])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_greedy(pair, prompt, length, k):
    target, draft = pair
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    out = io.SpeculativeDecoder(target, draft, k=k, k_max=max(k, 8)).generate(prompt, length)
    assert out.token_ids == expected
    assert out.target_forwards <= length and 0 <= out.acceptance_rate <= 1


def test_draft_equal_to_target_accepts_everything(pair):
    target, _ = pair
    out = io.SpeculativeDecoder(target, target, k=4, adaptive=False).generate([1, 2], 20)
    assert out.acceptance_rate == 1.0 and out.target_forwards == 4  # 4 rounds of 4 drafts + 1 bonus token


def test_k_adapts_to_the_acceptance_rate(pair):
    target, draft = pair
    always = io.SpeculativeDecoder(target, target, k=2, k_max=6)
    always.generate([1, 2], 30)
    assert always.k == 6  # everything accepted: k grows to its ceiling
    rarely = io.SpeculativeDecoder(target, _llama(50, 16, 1, seed=5), k=6, k_min=1)
    out = rarely.generate([3], 30)
    assert out.acceptance_rate < 0.5 and rarely.k < 6


def test_stop_token_ends_generation(pair):
    target, draft = pair
    full = io.SpeculativeDecoder(target, draft).generate([3, 9, 4], 20).token_ids
    stop = full[5]
    out = io.SpeculativeDecoder(target, draft).generate([3, 9, 4], 20, stop_token_ids=(stop,))
    assert out.token_ids == full[:full.index(stop) + 1]


def _exact_two_token_distribution(model, prompt, vocab, temperature):
    probs = {}
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        for a in range(vocab):
            second = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / temperature, -1)
            for b in range(vocab):
                probs[(a, b)] = float(first[a] * second[b])
    return probs


def test_sampling_preserves_the_target_distribution():
    vocab, prompt, temperature, draws = 5, [1, 3], 1.0, 2000
    target, draft = _llama(vocab, 16, 1, seed=11), _llama(vocab, 16, 1, seed=12)
    with torch.no_grad():
        for model in (target, draft):
            model.lm_head.weight.mul_(0.5)  # undo most of the sharpening: spread mass over the tiny vocabulary
    exact_target = _exact_two_token_distribution(target, prompt, vocab, temperature)
    exact_draft = _exact_two_token_distribution(draft, prompt, vocab, temperature)
    outcomes = list(itertools.product(range(vocab), repeat=2))
    gap = 0.5 * sum(abs(exact_target[o] - exact_draft[o]) for o in outcomes)
    assert gap > 0.2, "draft and target too alike for the test to tell them apart"
    decoder = io.SpeculativeDecoder(target, draft, k=2, adaptive=False)
    counts = dict.fromkeys(outcomes, 0)
    for seed in range(draws):
        counts[tuple(decoder.generate(prompt, 2, temperature=temperature, seed=seed).token_ids)] += 1
    empirical_tv = 0.5 * sum(abs(counts[o] / draws - exact_target[o]) for o in outcomes)
    assert empirical_tv < 0.07, f"total variation to the target {empirical_tv:.3f} (draft is {gap:.3f} away)"
    chi2 = sum((counts[o] - draws * exact_target[o]) ** 2 / (draws * exact_target[o]) for o in outcomes
               if draws * exact_target[o] >= 5)
    assert chi2 < 70  # df <= 24; the 99.99% quantile of chi2(24) is about 62, so this fails only on a real bias


@pytest.mark.parametrize("prompt,length", [([1], 12), ([3, 9, 4], 20), ([7, 7, 7, 7, 2, 5], 30)])
@pytest.mark.parametrize("k", [1, 4])
def test_static_cache_path_equals_target_greedy(pair, prompt, length, k):
    """engine="static": StaticCaches rewound on rejection, the k draft steps fused, fixed k."""
    target, draft = pair
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    out = io.SpeculativeDecoder(target, draft, k=k, engine="static").generate(prompt, length)
    assert out.token_ids == expected
    assert set(out.k_history) == {k} and out.proposed == k * out.target_forwards
    again = io.SpeculativeDecoder(target, target, k=k, engine="static").generate(prompt, length)
    assert again.token_ids == expected and again.acceptance_rate == 1.0  # a draft equal to the target


def test_compiled_path_equals_target_greedy(pair):
    target, draft = pair
    decoder = io.SpeculativeDecoder(target, draft, k=3, engine="compiled")
    for prompt, length in (([3, 9, 4], 20), ([7, 7, 7, 7, 2, 5], 17)):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length,
                                    do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert decoder.generate(prompt, length).token_ids == expected
    with pytest.raises(ValueError, match="engine"):
        io.SpeculativeDecoder(target, draft, engine="paged")


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_greedy_under_bf16_autocast_equals_target_greedy(pair, engine):
    """A model whose forward runs under autocast (bf16 mixed precision) hands the caches float32 keys and
    bfloat16 values; the static caches cast them to one dtype from their first update on."""
    target, draft = pair
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = target.generate(torch.tensor([[3, 9, 4]]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, 3:].tolist()
        out = io.SpeculativeDecoder(target, draft, k=3, engine=engine).generate([3, 9, 4], 16)
    assert out.token_ids == expected
