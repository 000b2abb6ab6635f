"""The generation engine of inference_optimizations.py: greedy output equals Hugging Face's
``generate`` token for token, n samples share one prefill, seeds reproduce, log-probs are the
model's own, and stop tokens / stop strings / length limits end completions with their reason.
Both decode loops are covered: ``static`` (StaticCache + fused step, what ``auto`` runs) and
``eager`` (the model's own cache); one smoke test compiles the static step."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("arch,attn,engine", [("llama", "sdpa", "auto"), ("llama", "eager", "auto"),
                                              ("llama", "sdpa", "eager"), ("qwen2", "sdpa", "auto"),
                                              ("gpt2", "sdpa", "auto"), ("gpt2", "sdpa", "eager"),
                                              ("mamba", "eager", "auto")])
def test_greedy_equals_hf_generate(arch, attn, engine, tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, arch, attn)
    pad, eos = tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id
    assert bool(io._static_path_unsupported(model)) == (arch == "mamba")  # auto: static path, mamba: eager loop
    ours = io.generate(model, prompts, io.SamplingParams(max_new_tokens=12, do_sample=False),
                       pad_token_id=pad, eos_token_id=eos, engine=engine)
    want = _hf_greedy(model, prompts, pad, eos, 12)
    for got, expected, reason in zip(ours.token_ids, want, ours.finish_reasons, strict=True):
        expected = expected[:expected.index(eos) + 1] if eos in expected else expected
        assert got == expected
        assert reason == ("stop" if got[-1] == eos else "length")


@pytest.mark.parametrize("engine", ["static", "eager"])
def test_logprobs_are_the_models_own(engine, tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    out = io.generate(model, prompts[:2], io.SamplingParams(max_new_tokens=6, temperature=0.7, seed=1),
                      pad_token_id=tiny_tokenizer.pad_token_id, engine=engine)
    for prompt, tokens, logprobs in zip(prompts, out.token_ids, out.logprobs):
        ids = torch.tensor([prompt + tokens])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / 0.7
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", ["static", "eager"])
def test_n_samples_share_the_prefill_and_seed_reproduces(engine, tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    params = io.SamplingParams(max_new_tokens=8, n=4, temperature=1.5, seed=7)
    first = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id, engine=engine)
    again = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id, engine=engine)
    assert first.token_ids == again.token_ids and first.prompt_index == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({tuple(t) for t in first.token_ids[:4]}) > 1  # samples differ
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id, engine=engine)
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


@pytest.mark.parametrize("engine", ["static", "eager", "paged"])
def test_suppressed_tokens_are_never_sampled_and_log_probs_stay_the_models(engine, tiny_arch_dir, tiny_tokenizer,
                                                                           prompts):
    """Suppressing the tokens greedy decoding picks gives another completion free of them; greedy then takes the best
    token left, and a sampled token's log-prob is still its log-prob under the model's whole distribution."""
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    greedy = io.generate(model, prompts[:2], io.SamplingParams(max_new_tokens=6, do_sample=False), pad_token_id=pad,
                         engine=engine)
    banned = tuple(sorted({t for row in greedy.token_ids for t in row}))
    for params in (io.SamplingParams(max_new_tokens=6, do_sample=False, suppress_token_ids=banned),
                   io.SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=2, suppress_token_ids=banned)):
        out = io.generate(model, prompts[:2], params, pad_token_id=pad, engine=engine)
        for row, (tokens, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
            assert not set(tokens) & set(banned)
            prompt = prompts[row // params.n]
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=1e-4)
            if params.greedy:
                allowed = logits.index_fill(-1, torch.tensor(banned), float("-inf"))
                assert tokens == allowed.argmax(-1).tolist()


def test_stop_strings_and_lengths(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    free = io.generate(model, prompts[:1], io.SamplingParams(max_new_tokens=10, do_sample=False), pad_token_id=pad)
    assert free.finish_reasons == ["length"] and len(free.token_ids[0]) == 10
    text = tiny_tokenizer.decode(free.token_ids[0])
    stop = text[3:5]  # some string the greedy completion produces
    stopped = io.generate(model, prompts[:1],
                          io.SamplingParams(max_new_tokens=10, do_sample=False, stop_strings=(stop,)),
                          pad_token_id=pad, tokenizer=tiny_tokenizer)
    assert stopped.finish_reasons == ["stop"] and stop in tiny_tokenizer.decode(stopped.token_ids[0])
    assert stopped.token_ids[0] == free.token_ids[0][:len(stopped.token_ids[0])]
    with pytest.raises(ValueError, match="tokenizer"):
        io.generate(model, prompts[:1], io.SamplingParams(stop_strings=("x",)), pad_token_id=pad)
    with pytest.raises(ValueError):
        io.SamplingParams(top_p=0)


def test_static_path_matches_eager_across_lengths_and_stops(tiny_arch_dir, tiny_tokenizer, prompts):
    """Different prompt widths (one crossing a cache-length bucket), rows stopping at different steps,
    before and after the periodic done check, by stop id and by stop string: the fused static loop
    ends every row exactly where the step-by-step loop does."""
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    batch = [prompts[0], prompts[3][:3], prompts[1] + prompts[2]]  # widths differ a lot
    free = io.generate(model, batch, io.SamplingParams(max_new_tokens=30, do_sample=False), pad_token_id=pad,
                       engine="eager")
    want = _hf_greedy(model, batch, pad, None, 30)
    assert free.token_ids == want
    long_prompt = [batch[2] * 3]  # width + max_new_tokens beyond the first 64-position bucket
    assert io._cache_length(len(long_prompt[0]) + 30) > 64
    assert io.generate(model, long_prompt, io.SamplingParams(max_new_tokens=30, do_sample=False), pad_token_id=pad,
                       engine="static").token_ids == _hf_greedy(model, long_prompt, pad, None, 30)
    stop_ids = (free.token_ids[0][2], free.token_ids[1][11])  # rows end near the start / after a done check
    stop_text = tiny_tokenizer.decode(free.token_ids[2][17:19])
    for params in (io.SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=stop_ids),
                   io.SamplingParams(max_new_tokens=30, do_sample=False, stop_token_ids=stop_ids,
                                     stop_strings=(stop_text,)),
                   io.SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=3, stop_token_ids=stop_ids,
                                     stop_strings=(stop_text,))):
        eager = io.generate(model, batch, params, pad_token_id=pad, tokenizer=tiny_tokenizer, engine="eager")
        static = io.generate(model, batch, params, pad_token_id=pad, tokenizer=tiny_tokenizer, engine="static")
        if params.greedy:
            assert static.token_ids == eager.token_ids
            assert static.finish_reasons == eager.finish_reasons == ["stop", "stop", "stop" if params.stop_strings
                                                                     else static.finish_reasons[2]]
            assert len(static.token_ids[0]) <= 3 and len(static.token_ids[1]) <= 12
        for tokens, reason, logprobs in zip(static.token_ids, static.finish_reasons, static.logprobs):
            ends_on_stop = tokens[-1] in stop_ids or stop_text in tiny_tokenizer.decode(tokens)
            assert reason == ("stop" if ends_on_stop else "length") and len(logprobs) == len(tokens)
            assert not any(t in stop_ids for t in tokens[:-1])  # nothing after the first stop token


def test_cache_length_buckets_and_auto_engine(tiny_arch_dir):
    sizes = (1, 64, 65, 81, 86, 255, 257, 500, 513, 700, 2000)
    assert [io._cache_length(n) for n in sizes] == [16, 64, 80, 96, 96, 256, 288, 512, 576, 704, 2048]
    assert [io._cache_length(n, coarse=True) for n in sizes] == [64, 64, 128, 128, 128, 256, 320, 512, 640, 768, 2048]
    model = _model(tiny_arch_dir, "llama")
    params = io.SamplingParams(max_new_tokens=8)
    assert io._choose_engine(model, "auto", params, 16, 64)[0] == "static"  # nothing measured yet
    assert io._choose_engine(model, "eager", params, 16, 64)[0] == "eager"
    with pytest.raises(ValueError, match="engine"):
        io.generate(model, [[1, 2]], params, pad_token_id=0, engine="fast")


def test_auto_compiles_a_shape_when_its_measured_costs_say_it_pays(tiny_arch_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # no earlier process's compilations
    model = _model(tiny_arch_dir, "llama")
    params = io.SamplingParams(max_new_tokens=8)
    key = (16, 64, False, 0, 1.0, 0)  # rows, cache length, greedy, top_k, top_p, suppressed tokens
    state = io._FAST_STATE.setdefault(model, io._FastState())
    estimate = io.compile_estimate(model, state)
    assert estimate == pytest.approx(io.COMPILE_SECONDS_BASE + 2 * io.COMPILE_SECONDS_PER_LAYER)  # 2 layers
    gain = io.EXPECTED_COMPILE_GAIN
    # a caller's plan: after one timed call, compile when the calls ahead save more than compiling costs
    assert io._choose_engine(model, "auto", params, 16, 64, expected_calls=10_000)[0] == "static"  # none timed
    state.uncompiled_cost[key] = [1.0, 1, 128]
    enough = math.ceil(estimate / gain)
    assert io._choose_engine(model, "auto", params, 16, 64, expected_calls=enough) == ("compiled", key)
    assert io._choose_engine(model, "auto", params, 16, 64, expected_calls=enough - 1)[0] == "static"
    # no plan: once the time a compiled step would already have saved reaches the compilation's cost
    state.uncompiled_cost[key] = [0.99 * estimate / gain, 40, 5120]
    assert io._choose_engine(model, "auto", params, 16, 64)[0] == "static"
    state.uncompiled_cost[key][0] = estimate / gain
    assert io._choose_engine(model, "auto", params, 16, 64) == ("compiled", key)
    assert io._choose_engine(model, "auto", params, 16, 128)[0] == "static"  # another shape: its own costs
    # measured figures replace the assumptions: this model's compile time and its compiled steps' saving
    other = (8, 64, False, 0, 1.0, 0)
    state.compile_seconds[other] = 30.0
    state.uncompiled_cost[other], state.compiled_cost[other] = [10.0, 2, 1000], [6.0, 2, 1000]
    assert io.compile_estimate(model, state) == 30.0 and io.compile_gain(state) == pytest.approx(0.4)
    assert io._choose_engine(model, "auto", params, 8, 64)[0] == "compiled"  # compiled before: stays compiled


def test_the_compile_estimate_knows_a_warm_cache_from_earlier_processes(tiny_arch_dir, tmp_path, monkeypatch):
    """A later process's estimate for the same model comes from what earlier ones measured: a cold compilation's
    seconds x WARM_COMPILE_SHARE (its graphs are now in the cache), then a measured warm one; an emptied cache or
    another model's signature falls back to the layer-count estimate."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(io, "_RECORDED_HERE", set())
    model = _model(tiny_arch_dir, "llama")
    by_layers = io.COMPILE_SECONDS_BASE + 2 * io.COMPILE_SECONDS_PER_LAYER
    assert io.compile_estimate(model, io._FastState()) == pytest.approx(by_layers)
    io.record_compile_seconds(model, 20.0)  # the first process: a cold compilation
    (cache / "fxgraph").mkdir()  # what inductor leaves in the cache
    assert io.recorded_compile_seconds(model) == {"cold": 20.0}
    assert io.compile_estimate(model, io._FastState()) == pytest.approx(20.0 * io.WARM_COMPILE_SHARE)
    io.record_compile_seconds(model, 99.0)  # the same process again: its first figure stands
    assert io.recorded_compile_seconds(model) == {"cold": 20.0}
    monkeypatch.setattr(io, "_RECORDED_HERE", set())  # a second process, the cache warm
    io.record_compile_seconds(model, 3.0)
    assert io.compile_estimate(model, io._FastState()) == pytest.approx(3.0)
    assert io.compile_estimate(model.to(torch.float64), io._FastState()) == pytest.approx(by_layers)  # another dtype
    model.to(torch.float32)
    (cache / "fxgraph").rmdir()  # the cache emptied: cold again
    assert io.compile_estimate(model, io._FastState()) == pytest.approx(by_layers)
    (cache / "fxgraph").mkdir()
    (cache / io.COMPILE_TIMES_FILE).write_text("{not json")
    assert io.recorded_compile_seconds(model) == {}


def test_auto_measures_its_calls_and_compiles_when_the_plan_pays(tiny_arch_dir, tiny_tokenizer, prompts, monkeypatch):
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    params = io.SamplingParams(max_new_tokens=6, seed=1)
    monkeypatch.setattr(io, "compile_estimate", lambda model, state: 1e-9)  # compiling is (said to be) free
    compiled = []
    monkeypatch.setattr(io, "_compiled_step",
                        lambda state, device: lambda *args: compiled.append(1) or io._decode_step(*args))
    io.generate(model, prompts, params, pad_token_id=pad, expected_calls=5)
    state = io._FAST_STATE[model]
    (key,) = state.uncompiled_cost
    seconds, calls, tokens = state.uncompiled_cost[key]
    assert calls == 1 and seconds > 0 and tokens == len(prompts) * 6 and not compiled  # the first call is timed
    io.generate(model, prompts, params, pad_token_id=pad, expected_calls=4)
    assert compiled and key in state.compile_seconds  # then it pays: compiled


def test_compile_failure_falls_back_to_the_same_step_uncompiled(tiny_arch_dir, tiny_tokenizer, prompts, monkeypatch):
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    params = io.SamplingParams(max_new_tokens=9, n=2, seed=4)
    want = io.generate(model, prompts, params, pad_token_id=pad, engine="static")

    def broken(*args):
        for layer in args[4].layers:  # a failure after the cache already advanced
            layer.cumulative_length.add_(1)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(io, "_compiled_step", lambda state, device: broken)
    got = io.generate(model, prompts, params, pad_token_id=pad, engine="compiled")
    assert got.token_ids == want.token_ids and "no compiler" in io._FAST_STATE[model].compile_failed
    assert io._choose_engine(model, "compiled", params, 8, 64)[0] == "static"


def test_a_compiled_step_that_disagrees_with_the_uncompiled_one_is_not_trusted(tiny_arch_dir, tiny_tokenizer,
                                                                                prompts, monkeypatch):
    """A miscompiled graph (torch.compile on CPU with ATen pinned to AVX2 gave NaN log-probs for one shape) is caught
    on its first call against the uncompiled step on the same inputs: that call and the rest decode uncompiled, and
    the shape is never compiled again in this process."""
    model = _model(tiny_arch_dir, "llama")
    pad = tiny_tokenizer.pad_token_id
    params = io.SamplingParams(max_new_tokens=9, n=2, seed=4, temperature=1.0)
    want = io.generate(model, prompts, params, pad_token_id=pad, engine="static")
    calls = []

    def miscompiled(*args):
        calls.append(1)
        token, logprob, done, position = io._decode_step(*args)
        return token, torch.full_like(logprob, float("nan")), done, position

    monkeypatch.setattr(io, "_compiled_step", lambda state, device: miscompiled)
    got = io.generate(model, prompts, params, pad_token_id=pad, engine="compiled")
    assert got.token_ids == want.token_ids and len(calls) == 1
    key = (8, 32, False, 0, 1.0, 0)
    assert "non-finite" in io._FAST_STATE[model].miscompiled[key]
    assert io._choose_engine(model, "compiled", params, 8, 32)[0] == "static"
    assert io._choose_engine(model, "auto", params, 8, 32)[0] == "static"


def test_disagreement_by_hand():
    tokens, logprobs = torch.tensor([1, 2, 3, 4]), torch.tensor([-0.5, -1.0, -2.0, -0.1])
    done = torch.zeros(4, dtype=torch.bool)
    assert io._disagreement((tokens, logprobs + 1e-5, done), (tokens, logprobs, done)) == ""
    assert io._disagreement((tokens, logprobs + 0.01, done), (tokens, logprobs, done)) == "log-probs differ by 0.01"
    assert io._disagreement((torch.tensor([1, 2, 3, 9]), logprobs, done), (tokens, logprobs, done)) \
        == "1 of 4 tokens differ"
    nan = logprobs.clone()
    nan[0] = float("nan")
    assert io._disagreement((tokens, nan, done), (tokens, logprobs, done)) == "1 non-finite log-probs against 0"


def test_compiled_step_matches_static_and_survives_weight_updates(tiny_arch_dir, tiny_tokenizer, prompts,
                                                                    monkeypatch):
    """One compilation (the slow part of this file): the compiled fused step samples the same tokens as
    the uncompiled one from the same seed; then, as in online RL, the weights change in place and the
    prompts change width within the cache-length bucket: no recompilation, the new weights are used. The
    first call of the process compiles (an empty cache-keyword memo, which a guard once caught)."""
    monkeypatch.setattr(io, "_CACHE_KEYWORDS", {})
    model = _model(tiny_arch_dir, "llama")
    pad, eos = tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id
    params = io.SamplingParams(max_new_tokens=10, n=2, temperature=1.0, seed=5)
    graphs = []  # dynamo's compiled graphs after each compiled call
    for batch in (prompts, [p[1:] for p in prompts]):
        compiled = io.generate(model, batch, params, pad_token_id=pad, eos_token_id=eos, engine="compiled")
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        static = io.generate(model, batch, params, pad_token_id=pad, eos_token_id=eos, engine="static")
        assert compiled.token_ids == static.token_ids and compiled.finish_reasons == static.finish_reasons
        for got, want in zip(compiled.logprobs, static.logprobs):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)  # a sharper policy: different samples next round
    assert list(io.compile_seconds(model)) == [(8, 32, False, 0, 1.0, 0)]  # compiled once, reused
    assert graphs[1] == graphs[0]  # the second call's guards held: no graph compiled again
    assert not io._FAST_STATE[model].compile_failed


@pytest.mark.parametrize("engine", ["static", "eager"])
def test_generation_under_bf16_autocast(engine, tiny_arch_dir, tiny_tokenizer, prompts):
    """A model prepared for bf16 mixed precision (accelerate wraps its forward in autocast) returns RoPE'd keys in
    float32 and values in bfloat16: the static cache must hold each in its own dtype (it used to fail with
    'index_copy_(): self and source expected to have the same dtype'), and both loops agree."""
    model = _model(tiny_arch_dir, "llama")
    params = io.SamplingParams(max_new_tokens=10, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = io.generate(model, prompts, params, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=None,
                          engine=engine)
        reference = io.generate(model, prompts, params, pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=None,
                                engine="eager")
    assert out.token_ids == reference.token_ids and all(len(t) == 10 for t in out.token_ids)


def test_cache_argument_names_the_keyword_the_forward_takes():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; a model whose forward knows only the old
    name (older releases, custom models) gets the old one, and a PEFT-style wrapper defers to what it wraps."""
    import inspect

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    class NewStyle(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return input_ids

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    marker = object()
    assert io.cache_argument(OldStyle(), marker) == {"past_key_values": marker}
    assert io.cache_argument(NewStyle(), marker) == {"cache": marker}
    assert io.cache_argument(Wrapper(OldStyle()), marker) == {"past_key_values": marker}
    from transformers import LlamaForCausalLM

    expected = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    assert io.cache_argument(LlamaForCausalLM.__new__(LlamaForCausalLM), marker) == {expected: marker}

    class Output:
        cache = None
        past_key_values = marker

    assert io.returned_cache(Output()) is marker
