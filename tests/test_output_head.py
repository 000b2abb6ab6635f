"""The chunked output head (rlhf.OutputHead) on a real-sized vocabulary: every loss path gives the values and
gradients of the model's own (B, T, V) logits, without making them: SFT, DPO (padded, shared-prompt and packed),
GRPO (grouped prompts), PPO, entropies and mean logits; Gemma's logit soft-capping; heads it cannot reproduce
keep the model's logits."""

from __future__ import annotations

import contextlib

import pytest
import torch

import rlhf

VOCAB = 40_000  # above CHUNKED_HEAD_MIN_VOCAB: a real vocabulary's size, a tiny model's width


def _model(kind: str = "llama", seed: int = 0):
    from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig

    torch.manual_seed(seed)
    if kind == "gemma2":  # final logit soft-capping, tied embeddings
        config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=5.0,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif kind == "gpt2":  # a Conv1D model with tied embeddings
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    else:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    rlhf.disable_dropout(model)
    with torch.no_grad():  # a spread of logits, so that differences would show
        model.get_output_embeddings().weight.mul_(20)
    return model


@contextlib.contextmanager
def plain_head(model):
    """The model's own logits for the length of the block."""
    inner = rlhf.innermost_model(model)
    chunked = rlhf.OutputHead.of(model)
    rlhf.OutputHead._cache[inner] = rlhf.OutputHead()
    try:
        yield
    finally:
        rlhf.OutputHead._cache[inner] = chunked


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _both(model, run):
    """``run()`` -> scalar, with the chunked head and with the model's own logits: values and gradients."""
    chunked_value = run()
    chunked_value.backward()
    chunked = _grads(model)
    with plain_head(model):
        plain_value = run()
        plain_value.backward()
        plain = _grads(model)
    return chunked_value, plain_value, chunked, plain


def _assert_same(chunked_value, plain_value, chunked, plain):
    torch.testing.assert_close(chunked_value, plain_value, rtol=1e-5, atol=1e-4)
    assert chunked.keys() == plain.keys()
    for name in plain:  # float sums in another order: agreement to 1e-5 of the gradient's scale
        scale = max(1.0, float(plain[name].abs().max()))
        torch.testing.assert_close(chunked[name], plain[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt2"])
def test_the_head_is_chunked_and_verified_on_real_sized_vocabularies(kind):
    model = _model(kind)
    head = rlhf.OutputHead.of(model)
    assert head.chunked and head.vocab == VOCAB
    assert head.softcap == (5.0 if kind == "gemma2" else None)
    ids = torch.randint(3, VOCAB, (2, 9))
    scores, out = head.scores(model, input_ids=ids)
    assert scores.shape == (2, 9, 32)  # hidden states, never (2, 9, V) logits
    assert out.logits.untyped_storage().nbytes() <= 4 and torch.isnan(out.logits[0, 0, 0])  # a placeholder
    want = model(input_ids=ids).logits.float()  # the model itself again: the swap was undone
    torch.testing.assert_close(head._logits(scores, model.get_output_embeddings().weight,
                                            model.get_output_embeddings().bias, 1.0), want, rtol=1e-4, atol=1e-4)


def test_small_vocabularies_keep_the_models_logits(tiny_model_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    assert not rlhf.OutputHead.of(policy.model).chunked


def test_a_head_it_cannot_reproduce_keeps_the_models_logits():
    model = _model("llama")
    original = model.forward  # logits scaled after the linear layer, as Cohere's are

    def scaled(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    assert not rlhf.OutputHead.of(model).chunked


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_sft_loss_and_gradients_equal_the_full_logits(kind):
    model = _model(kind)
    policy = rlhf.PolicyModel(model, tokenizer=None)
    ids = torch.randint(3, VOCAB, (3, 12))
    labels = ids.clone()
    labels[:, :5] = rlhf.IGNORE_INDEX  # the prompt

    def loss():
        head = rlhf.OutputHead.of(model)
        scores, _ = head.scores(policy, input_ids=ids, attention_mask=torch.ones_like(ids))
        total, count = rlhf.causal_lm_loss_with(head, scores, labels)
        assert count == 3 * 7  # targets 5..11 of each row
        return total

    _assert_same(*_both(model, loss))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_entropy_and_mean_logits_equal_the_full_logits(temperature):
    model = _model()
    policy = rlhf.PolicyModel(model, tokenizer=None)
    ids = torch.randint(3, VOCAB, (2, 10))
    mask = torch.ones_like(ids)

    def everything():
        out = policy.compute_log_probs(ids, mask, temperature=temperature)
        head = rlhf.OutputHead.of(model)
        scores, _ = head.scores(policy, input_ids=ids, attention_mask=mask)
        entropy = head.entropy(scores[:, :-1], temperature)
        mean = head.mean_logits(scores[:, :-1])
        return out.summed.sum() + entropy.sum() + 1e-3 * mean.sum()

    _assert_same(*_both(model, everything))


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_dpo_log_probs_equal_the_full_logits(layout, tiny_tokenizer):
    model = _model()
    policy = rlhf.PolicyModel(model, tokenizer=tiny_tokenizer)
    items = [{"prompt_ids": [5, 6, 7, 8], "chosen_ids": [9, 10, 11], "rejected_ids": [12, 13]},
             {"prompt_ids": [14, 15], "chosen_ids": [16, 17, 18, 19], "rejected_ids": [20, 21, 22]}]
    batch = rlhf.PreferenceCollator(0, share_prompt=layout != "padded", pack_pairs=layout == "packed")(items)
    assert ("packed_input_ids" in batch) == (layout == "packed")

    def summed():
        out = rlhf._completion_forward(policy, batch)
        return out.summed.sum() + 1e-3 * out.mean_logits.sum()

    _assert_same(*_both(model, summed))


@pytest.mark.parametrize("pack", [False, True])
def test_grouped_prompt_log_probs_equal_the_full_logits(pack):
    model = _model()
    ids = torch.tensor([[5, 6, 7, 30, 31, 0], [5, 6, 7, 32, 0, 0], [8, 9, 40, 41, 42, 43]])
    mask = (ids != 0).long()
    prompt_lengths = torch.tensor([3, 3, 2])

    def summed():
        head = rlhf.OutputHead.of(model)
        scores = rlhf.grouped_logits(model, ids, mask, prompt_lengths, pack=pack)
        completion = torch.arange(5)[None] >= (prompt_lengths[:, None] - 1)
        logps = head.log_probs(scores, ids[:, 1:], 0.9) * completion * mask[:, 1:]
        return logps.sum() + head.entropy(scores, 0.9).mul(completion).sum()

    _assert_same(*_both(model, summed))


def test_grouped_logits_takes_the_layout_the_processes_agree_on():
    """``agree`` receives this process's choice (packed or not) and its answer decides: the two layouts make different
    numbers of forwards through the model (so processes must take the same one), and give the same scores."""
    model = _model()
    ids = torch.tensor([[5, 6, 7, 30, 31, 0], [5, 6, 7, 32, 0, 0], [8, 9, 40, 41, 42, 43]])
    mask, prompt_lengths = (ids != 0).long(), torch.tensor([3, 3, 2])
    forwards, asked = [], []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        scores = {}
        for agreed in (True, False):
            forwards.clear()
            scores[agreed] = rlhf.grouped_logits(model, ids, mask, prompt_lengths, pack=True,
                                                 agree=lambda mine, agreed=agreed: asked.append(mine) or agreed)
            scores[f"{agreed}-forwards"] = len(forwards)
    finally:
        hook.remove()
    assert len(asked) == 2 and asked[0] == asked[1]  # this process's own choice, asked each time
    assert scores["False-forwards"] == 2 and scores["True-forwards"] != 2  # prompts then completions; packed rows
    completion = (torch.arange(5)[None] >= (prompt_lengths[:, None] - 1)) & mask[:, 1:].bool()
    assert torch.allclose(scores[True][completion], scores[False][completion], atol=1e-5)


def test_ppo_actor_critic_equals_the_full_logits():
    model = _model()
    critic = rlhf.ValueModel(model.config.hidden_size)
    actor_critic = rlhf.ActorCritic(model, critic)
    ids = torch.randint(3, VOCAB, (2, 8))

    def summed():
        scores, values = actor_critic(ids, torch.ones_like(ids))
        head = rlhf.OutputHead.of(model)
        return head.log_probs(scores[:, :-1], ids[:, 1:]).sum() + values.sum()

    _assert_same(*_both(model, summed))


# -- what a review found ------------------------------------------------------------------------------------------


def test_the_decision_cache_does_not_keep_a_model_alive():
    import gc
    import weakref

    model = _model()
    assert rlhf.OutputHead.of(model).chunked
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_model_whose_forward_reads_its_output_layer_keeps_its_logits():
    """Mamba reads lm_head.weight's dtype in its forward: the swapped layer has none, so the head falls back."""
    from transformers import AutoModelForCausalLM, MambaConfig

    model = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                                         num_hidden_layers=2, expand=2, conv_kernel=4))
    assert not rlhf.OutputHead.of(model).chunked
    ids = torch.randint(3, VOCAB, (1, 6))
    out = rlhf.PolicyModel(model, tokenizer=None).compute_log_probs(ids, torch.ones_like(ids))
    assert torch.isfinite(out.summed).all()
    assert type(model.get_output_embeddings()).__name__ == "Linear"  # put back


def test_a_detached_entropy_sends_no_gradient_into_the_output_layer():
    model = _model()
    head = rlhf.OutputHead.of(model)
    scores, _ = head.scores(model, input_ids=torch.randint(3, VOCAB, (1, 6)))
    entropy = head.entropy(scores.detach())
    assert not entropy.requires_grad
    assert model.get_output_embeddings().weight.grad is None


def test_a_compiled_model_keeps_its_own_logits():
    model = _model()
    compiled = torch.compile(model, backend="eager")
    try:
        assert not rlhf.OutputHead.of(rlhf.PolicyModel(compiled, tokenizer=None)).chunked
    finally:
        torch._dynamo.reset()
