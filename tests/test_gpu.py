"""The CUDA paths: attention choice, the generation engine (eager, static, compiled, paged, speculative)
on the GPU in float32 and bfloat16, and bf16 mixed-precision training of SFT, DPO and GRPO on the GPU,
resume included. Skipped where no CUDA GPU is present (CI); run on a GPU machine with

    pytest tests/test_gpu.py -v

The CPU suite covers the same code on the CPU; these tests check what only a GPU exercises: tensors
created on the right device, Triton-compiled decode steps, CUDA RNG state in checkpoints, autocast to
bf16 and the fused CUDA optimizer."""

from __future__ import annotations

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["What is 37 + 8?", "Compute 12 + 7 - 5.", "What is 90 - 9?", "hi"]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    formatter = rlhf.ChatFormatter(tiny_tokenizer)
    return [formatter.prompt_ids({"system": "", "messages": [{"role": "user", "content": p}]}) for p in PROMPTS]


def _cuda_model(path, dtype: str = "float32", attn: str = "sdpa"):
    model, _ = rlhf.load_causal_lm(str(path), dtype=dtype, attn_implementation=attn, device="cuda")
    return model.to("cuda").eval()


def _hf_greedy(model, prompts, pad, max_new_tokens):
    out = []
    for prompt in prompts:  # one at a time: no padding, the plainest reference
        ids = torch.tensor([prompt], device="cuda")
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=pad,
                                   eos_token_id=None)
        out.append(generated[0, len(prompt):].tolist())
    return out


# -- attention ---------------------------------------------------------------------------------------------------------


def test_attention_choice_on_cuda_names_its_reason():
    implementation, reason = io.select_attention_implementation("auto", "cuda")
    flash, why_not = io.flash_attention_available("cuda")
    if flash:
        assert implementation == "flash_attention_2"
    else:
        assert implementation == "sdpa" and why_not in reason
    print(f"auto on cuda: {implementation} ({reason})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_backends_agree_on_cuda(dtype):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 9, 16, generator=generator) for _ in range(3))
    scores = (query.double() @ key.double().transpose(-1, -2)) / 4.0
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ value.double()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    backends = ["sdpa", "eager"] + (["flash_attention_2"] if io.flash_attention_available("cuda")[0] else [])
    for backend in backends:
        if backend == "flash_attention_2" and dtype == torch.float32:
            continue  # flash-attn runs half precision only
        attention = io.OptimizedAttention(backend, "cuda")
        got = attention(*(t.to("cuda", dtype) for t in (query, key, value)), is_causal=True)
        torch.testing.assert_close(got.double().cpu(), want, atol=tolerance, rtol=tolerance, msg=backend)


# -- the generation engine on the GPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["eager", "static", "compiled", "paged"])
def test_greedy_equals_hf_generate_on_cuda(engine, tiny_arch_dir, tiny_tokenizer, prompts):
    model = _cuda_model(tiny_arch_dir("llama"))
    pad = tiny_tokenizer.pad_token_id
    ours = io.generate(model, prompts, io.SamplingParams(max_new_tokens=20, do_sample=False), pad_token_id=pad,
                       eos_token_id=None, engine=engine,
                       **({"paged_cache": io.PagedKVCache(block_size=4, num_blocks=4)} if engine == "paged" else {}))
    assert ours.token_ids == _hf_greedy(model, prompts, pad, 20)
    assert ours.finish_reasons == ["length"] * len(prompts)


@pytest.mark.parametrize("engine", ["static", "compiled"])
def test_bf16_greedy_picks_the_models_argmax_and_logprobs_are_its_own(engine, tiny_model_dir, tiny_tokenizer,
                                                                        prompts):
    """In bf16 the engine's kernels and a teacher-forced forward round differently, so the check is not
    token equality with HF but what greedy means: every chosen token is within bf16 rounding of the
    best logit of the same model scoring the same sequence, and the reported log-probs are that
    forward's own."""
    model = _cuda_model(tiny_model_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    out = io.generate(model, prompts, io.SamplingParams(max_new_tokens=24, do_sample=False),
                      pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=None, engine=engine)
    for prompt, tokens, logprobs in zip(prompts, out.token_ids, out.logprobs, strict=True):
        assert len(tokens) == 24
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1]
        logits = logits.float()
        chosen = logits.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1)
        assert float((logits.max(-1).values - chosen).max()) < 0.1
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), want.cpu(), atol=0.1, rtol=0)


def test_sampling_on_cuda_reproduces_with_a_seed_and_shares_the_prefill(tiny_arch_dir, tiny_tokenizer, prompts):
    model = _cuda_model(tiny_arch_dir("llama"))
    params = io.SamplingParams(max_new_tokens=12, n=4, temperature=1.2, seed=11)
    first = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id, engine="compiled")
    again = io.generate(model, prompts[:2], params, pad_token_id=tiny_tokenizer.pad_token_id, engine="compiled")
    assert first.token_ids == again.token_ids and first.prompt_index == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({tuple(t) for t in first.token_ids[:4]}) > 1


def test_speculative_greedy_on_cuda_equals_target_greedy(tiny_arch_dir, tiny_model_dir, tiny_tokenizer, prompts):
    target, draft = _cuda_model(tiny_model_dir), _cuda_model(tiny_arch_dir("llama"))
    pad = tiny_tokenizer.pad_token_id
    for engine in ("eager", "compiled"):
        decoder = io.SpeculativeDecoder(target, draft, k=3, engine=engine)
        for prompt in prompts[:2]:
            assert decoder.generate(prompt, 24).token_ids == _hf_greedy(target, [prompt], pad, 24)[0], engine


def test_policy_model_generates_on_cuda(tiny_model_dir, tiny_tokenizer, prompts):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir), dtype="bfloat16", device="cuda").to("cuda")
    completions = policy.generate(prompts[:2], max_new_tokens=8)
    assert len(completions) == 2 and all(0 < len(c) <= 8 for c in completions)


# -- bf16 mixed-precision training on the GPU --------------------------------------------------------------------------


def _rows(result) -> list[dict]:
    return [row for row in result.history if "loss" in row]


def test_sft_bf16_learns_on_cuda(tmp_path, tiny_model_dir, demo_dir):
    config = rlhf.SFTConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_sft", dataset_dir=str(demo_dir),
                            max_samples=400, val_size=32, cutoff_len=96, finetuning_type="full", bf16=True,
                            per_device_train_batch_size=16, max_steps=40, learning_rate=3e-3,
                            lr_scheduler_type="cosine", warmup_steps=3, logging_steps=5, save_steps=0,
                            eval_before_training=True, disable_progress_bar=True, output_dir=str(tmp_path), seed=0)
    result = rlhf.train_sft(config)
    before, after = result.eval_before["eval/loss"], result.eval["eval/loss"]
    print(f"sft bf16 on cuda: eval/loss {before:.3f} -> {after:.3f}")
    assert after < before - 2.0
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())  # mixed precision keeps fp32 master weights


def test_dpo_bf16_learns_on_cuda(tmp_path, tiny_model_dir, demo_dir):
    config = rlhf.DPOConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_preference",
                            dataset_dir=str(demo_dir), max_samples=32, cutoff_len=96, finetuning_type="full",
                            bf16=True, per_device_train_batch_size=8, max_steps=20, learning_rate=1e-3,
                            lr_scheduler_type="constant", logging_steps=1, save_steps=0, disable_progress_bar=True,
                            output_dir=str(tmp_path), seed=0, resume_from_checkpoint="none")
    rows = _rows(rlhf.train_dpo(config))
    first = sum(r["rewards/accuracies"] for r in rows[:4]) / 4
    last = sum(r["rewards/accuracies"] for r in rows[-4:]) / 4
    print(f"dpo bf16 on cuda: rewards/accuracies {first:.3f} -> {last:.3f}")
    assert last >= first + 0.15 and last >= 0.7
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"] + 0.03


def test_grpo_on_cuda_learns_with_the_compiled_engine(tmp_path, tiny_model_dir, tiny_tokenizer, demo_dir):
    prompts = rlhf.GRPODataset(rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=64), tiny_tokenizer,
                               rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)

    def digit_share(prompts, completions, answers):
        return torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])

    config = rlhf.GRPOConfig(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path), finetuning_type="full",
                             num_generations=4, per_device_train_batch_size=8, max_completion_length=8, cutoff_len=64,
                             max_steps=30, beta=0.0, learning_rate=3e-3, lr_scheduler_type="constant", save_steps=0,
                             logging_steps=1, disable_progress_bar=True, report_to="none", reward_funcs=["format"],
                             seed=0, bf16=True, generation_engine="compiled", resume_from_checkpoint="none")
    rlhf.set_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    result = rlhf.GRPOTrainer(config, policy, prompts, reward_fn=digit_share).train()
    assert next(policy.parameters()).device.type == "cuda"
    rewards = [row["reward"] for row in result.history if "reward" in row]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"grpo on cuda: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.3


def test_resume_on_cuda_equals_an_uninterrupted_run(tmp_path, tiny_arch_dir, demo_dir, monkeypatch):
    from test_trainers import _interrupt_after, _Interrupted, _loss_rows, _weights

    common = dict(model_name_or_path=str(tiny_arch_dir("llama")), dataset="demo_sft", dataset_dir=str(demo_dir),
                  max_samples=48, cutoff_len=64, finetuning_type="full", per_device_train_batch_size=4, max_steps=6,
                  save_steps=3, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1,
                  disable_progress_bar=True, seed=0, bf16=True)
    rlhf.train_sft(rlhf.SFTConfig(output_dir=str(tmp_path / "A"), **common))
    config = rlhf.SFTConfig(output_dir=str(tmp_path / "B"), **common)
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Interrupted):
        rlhf.train_sft(config)
    monkeypatch.undo()
    assert rlhf.train_sft(config).global_step == 6
    straight, resumed = _weights(tmp_path / "A"), _weights(tmp_path / "B")
    worst = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
    print(f"resume on cuda: largest weight difference {worst:.2e}")
    assert worst < 1e-6
    losses = [[loss for _, loss, _ in _loss_rows(tmp_path / run)] for run in ("A", "B")]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def test_a_reference_built_on_the_cpu_follows_the_policy_to_the_gpu(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                    demo_dir):
    """Python-API users build the reference before the trainer, where the policy was loaded (the CPU); the
    trainer puts it on its device, for a live DPO reference and for GRPO's KL term alike."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    config = rlhf.DPOConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_preference",
                            dataset_dir=str(demo_dir), max_samples=16, cutoff_len=96, finetuning_type="full",
                            per_device_train_batch_size=8, max_steps=2, precompute_ref_log_probs=False, save_steps=0,
                            disable_progress_bar=True, output_dir=str(tmp_path / "dpo"), resume_from_checkpoint="none")
    formatter = rlhf.ChatFormatter(policy.tokenizer)
    records = rlhf.load_records("demo_preference", demo_dir, "preference", max_samples=16)
    pairs = rlhf.PreferenceDataset(records, policy.tokenizer, formatter, cutoff_len=96)
    reference = rlhf.create_reference_model(config, policy)
    assert reference.model.device.type == "cpu"
    assert rlhf.DPOTrainer(config, policy, pairs, reference=reference).train().global_step == 2
    assert reference.model.device.type == "cuda"

    prompts = rlhf.GRPODataset(rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=16), tiny_tokenizer,
                               rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)
    config = rlhf.GRPOConfig(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "grpo"),
                             finetuning_type="full", num_generations=4, per_device_train_batch_size=8,
                             max_completion_length=8, cutoff_len=64, max_steps=2, beta=0.1, save_steps=0,
                             disable_progress_bar=True, reward_funcs=["format"], resume_from_checkpoint="none")
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    reference = rlhf.create_reference_model(config, policy)
    result = rlhf.GRPOTrainer(config, policy, prompts, reward_fn=lambda p, c, a: torch.zeros(len(c)),
                              reference=reference).train()
    assert result.global_step == 2 and reference.model.device.type == "cuda"
