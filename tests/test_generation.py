"""The generation engine of inference_optimizations.py: greedy output equals Hugging Face's
``generate`` token for token, n samples share one prefill, seeds reproduce, log-probs are the
model's own, and stop tokens / stop strings / length limits end completions with their reason."""

from __future__ import annotations

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["What is 37 + 8?", "Compute 12 + 7 - 5.", "What is 90 - 9?", "hi"]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": p}]}) for p in PROMPTS]


def _model(tiny_arch_dir, arch: str, attn: str = "sdpa"):
    model, _ = rlhf.load_causal_lm(str(tiny_arch_dir(arch)), attn_implementation=attn)
    return model.eval()


def _hf_greedy(model, prompts, pad, eos, max_new_tokens):
    out = []
    for prompt in prompts:  # one at a time: no padding, the plainest reference
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos)
        out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gpt2", "sdpa"),
                                       ("mamba", "eager")])
def test_greedy_equals_hf_generate(arch, attn, tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, arch, attn)
    pad, eos = tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id
    ours = io.generate(model, prompts, io.SamplingParams(max_new_tokens=12, do_sample=False),
                       pad_token_id=pad, eos_token_id=eos)
    want = _hf_greedy(model, prompts, pad, eos, 12)
    for got, expected, reason in zip(ours.token_ids, want, ours.finish_reasons, strict=True):
        expected = expected[:expected.index(eos) + 1] if eos in expected else expected
        assert got == expected
        assert reason == ("stop" if got[-1] == eos else "length")


def test_logprobs_are_the_models_own(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    out = io.generate(model, prompts[:2], io.SamplingParams(max_new_tokens=6, temperature=0.7, seed=1),
                      pad_token_id=tiny_tokenizer.pad_token_id)
    for prompt, tokens, logprobs in zip(prompts, out.token_ids, out.logprobs):
        ids = torch.tensor([prompt + tokens])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / 0.7
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=1e-4)


def test_n_samples_share_the_prefill_and_seed_reproduces(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    params = io.SamplingParams(max_new_tokens=8, n=4, temperature=1.5, seed=7)
    first = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id)
    again = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id)
    assert first.token_ids == again.token_ids and first.prompt_index == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({tuple(t) for t in first.token_ids[:4]}) > 1  # samples differ
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id)
    hook.remove()
    assert calls[0][0] == 2  # the prompts were prefilled once each, not once per sample
    assert all(shape == (8, 1) for shape in calls[1:])  # then one new token per row per step


def test_top_k_one_is_greedy_and_top_p_filters(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    greedy = io.generate(model, prompts, io.SamplingParams(max_new_tokens=6, do_sample=False), pad_token_id=pad)
    top1 = io.generate(model, prompts, io.SamplingParams(max_new_tokens=6, top_k=1, seed=3), pad_token_id=pad)
    assert top1.token_ids == greedy.token_ids
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]])
    kept = io._filter_logits(logits, top_k=0, top_p=0.8).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # softmax mass 0.705 before the 2nd token, 0.965 after it


def test_stop_strings_and_lengths(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    free = io.generate(model, prompts[:1], io.SamplingParams(max_new_tokens=10, do_sample=False), pad_token_id=pad)
    assert free.finish_reasons == ["length"] and len(free.token_ids[0]) == 10
    text = tiny_tokenizer.decode(free.token_ids[0])
    stop = text[3:5]  # some string the greedy completion produces
    stopped = io.generate(model, prompts[:1], io.SamplingParams(max_new_tokens=10, do_sample=False, stop_strings=(stop,)),
                          pad_token_id=pad, tokenizer=tiny_tokenizer)
    assert stopped.finish_reasons == ["stop"] and stop in tiny_tokenizer.decode(stopped.token_ids[0])
    assert stopped.token_ids[0] == free.token_ids[0][:len(stopped.token_ids[0])]
    with pytest.raises(ValueError, match="tokenizer"):
        io.generate(model, prompts[:1], io.SamplingParams(stop_strings=("x",)), pad_token_id=pad)
    with pytest.raises(ValueError):
        io.SamplingParams(top_p=0)
