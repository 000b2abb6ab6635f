"""ModelSoup (uniform and greedy, Wortsman et al. 2022) and EnsemblePolicy (log-prob averaging with a KV cache
per member, majority vote), checked against hand computations and Hugging Face ``generate``."""

from __future__ import annotations

import pytest
import torch

import model_merging as mm

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- soups


def scalar_model(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def weight_of(model: torch.nn.Module) -> float:
    return float(model.weight.detach())


def test_average_state_dicts_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor([3])}
    b = {"w": torch.tensor([3.0, -2.0]), "steps": torch.tensor([9])}
    got = mm.average_state_dicts([a, b])
    torch.testing.assert_close(got["w"], torch.tensor([2.0, 0.0]))
    assert torch.equal(got["steps"], torch.tensor([3]))  # integer buffers come from the first
    torch.testing.assert_close(mm.average_state_dicts([a, b], [3, 1])["w"], torch.tensor([1.5, 1.0]))
    with pytest.raises(mm.MergeError, match="ingredient 1: tensor w has shape"):
        mm.average_state_dicts([a, {"w": torch.zeros(3), "steps": torch.tensor([1])}])


def test_uniform_soup_of_hf_models(tiny_arch_dir):
    from transformers import AutoModelForCausalLM

    models = []
    for seed in range(3):
        model = AutoModelForCausalLM.from_pretrained(tiny_arch_dir("llama"))
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        models.append(model)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    soup = mm.ModelSoup(models).uniform()
    for name, value in soup.state_dict().items():
        torch.testing.assert_close(value, (before[0][name] + before[1][name] + before[2][name]) / 3)
    for model, state in zip(models, before):  # the ingredients are untouched
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_greedy_soup_by_hand():
    # eval = -(w - 2)^2 on held-out data whose best weight is 2
    models = [scalar_model(v) for v in (0.0, 1.0, 4.0, 10.0)]
    calls = []

    def eval_fn(model):
        calls.append(weight_of(model))
        return -((weight_of(model) - 2.0) ** 2)

    result = mm.ModelSoup(models).greedy(eval_fn)
    # alone: -4, -1, -4, -64 -> order 1 (w=1), 0 (w=0), 2 (w=4), 3 (w=10)
    assert result.individual_scores == [-4.0, -1.0, -4.0, -64.0]
    # soup {1}: -1; + 0 -> mean 0.5: -2.25 < -1 rejected; + 2 -> mean 2.5: -0.25 accepted; + 3 -> mean 5: -9 rejected
    assert [(t["ingredient"], t["accepted"]) for t in result.trace] == [(1, True), (0, False), (2, True), (3, False)]
    assert result.ingredients == [1, 2]
    assert result.score == pytest.approx(-0.25)
    assert weight_of(result.model) == pytest.approx(2.5)
    assert calls == pytest.approx([0.0, 1.0, 4.0, 10.0, 0.5, 2.5, 5.0])  # 2n - 1 evaluations
    assert [weight_of(m) for m in models] == [0.0, 1.0, 4.0, 10.0]


def test_greedy_soup_accepts_equal_scores():
    # a score that does not drop is enough (>=): with a constant score the greedy soup is the uniform soup
    models = [scalar_model(v) for v in (1.0, 2.0, 6.0)]
    result = mm.ModelSoup(models).greedy(lambda model: 0.5)
    assert result.ingredients == [0, 1, 2]
    assert weight_of(result.model) == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------- ensembles


def peaked_llama(tokenizer, seed: int):
    """A random tiny Llama with a sharpened head, so that argmax decisions are far from ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def members(tiny_tokenizer):
    return [peaked_llama(tiny_tokenizer, seed) for seed in (0, 1, 2)]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer(text)["input_ids"] for text in ("What is 12 + 7?", "Compute 3 - 1.")]


def test_ensemble_of_one_equals_hf_greedy(members, prompts, tiny_tokenizer):
    ensemble = mm.EnsemblePolicy([members[0]], tiny_tokenizer)
    # a batch: the prompts have different lengths
    got = ensemble.generate(prompts, max_new_tokens=10, stop_token_ids=[tiny_tokenizer.eos_token_id])
    for prompt, completion in zip(prompts, got):
        with torch.no_grad():
            reference = members[0].generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                            pad_token_id=tiny_tokenizer.pad_token_id,
                                            eos_token_id=tiny_tokenizer.eos_token_id)
        assert completion == reference[0, len(prompt):].tolist()


def test_next_token_logprobs_is_the_weighted_mean(members, prompts, tiny_tokenizer):
    ensemble = mm.EnsemblePolicy(members[:2], tiny_tokenizer, weights=[1.0, 3.0])
    got = ensemble.next_token_logprobs(prompts)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            first, second = (torch.log_softmax(m(torch.tensor([prompt])).logits[0, -1], -1) for m in members[:2])
        torch.testing.assert_close(got[row], 0.25 * first + 0.75 * second, rtol=1e-5, atol=1e-5)


def test_ensemble_generation_equals_recomputing_without_cache(members, prompts, tiny_tokenizer):
    ensemble = mm.EnsemblePolicy(members, tiny_tokenizer, weights=[0.5, 0.3, 0.2])
    got = ensemble.generate(prompts, max_new_tokens=8, stop_token_ids=[tiny_tokenizer.eos_token_id])
    for prompt, completion in zip(prompts, got):
        sequence = list(prompt)
        expected = []
        for _ in range(8):  # the whole sequence through every member at every step, no cache, no padding
            with torch.no_grad():
                scores = sum(w * torch.log_softmax(m(torch.tensor([sequence])).logits[0, -1], -1)
                             for w, m in zip((0.5, 0.3, 0.2), members))
            token = int(scores.argmax())
            expected.append(token)
            sequence.append(token)
            if token == tiny_tokenizer.eos_token_id:
                break
        assert completion == expected


def test_sampling_is_reproducible(members, prompts, tiny_tokenizer):
    ensemble = mm.EnsemblePolicy(members[:2], tiny_tokenizer)
    first = ensemble.generate(prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    again = ensemble.generate(prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert first == again and all(len(c) == 6 for c in first)


def test_majority_vote(members, prompts, tiny_tokenizer):
    # answer = the first generated token's text: members 0 and 0' (a copy) outvote member 1
    def first_token(text: str) -> str | None:
        return text[:3] or None

    alone = [mm.EnsemblePolicy([m], tiny_tokenizer).generate(prompts, 4) for m in members[:2]]
    decoded = [[tiny_tokenizer.decode(c, skip_special_tokens=True)[:3] for c in per_member] for per_member in alone]
    assert decoded[0] != decoded[1]  # the two members disagree, or the test shows nothing
    votes = mm.EnsemblePolicy([members[1], members[0], members[0]], tiny_tokenizer).majority_vote(
        prompts, first_token, max_new_tokens=4)
    for row, result in enumerate(votes):
        assert result.answer == decoded[0][row]
        assert result.answers == [decoded[1][row], decoded[0][row], decoded[0][row]]
        assert result.completions[1] == alone[0][row]
        if decoded[0][row] != decoded[1][row]:
            assert result.votes == pytest.approx({decoded[0][row]: 2 / 3, decoded[1][row]: 1 / 3})
    # a tie goes to the earliest member; weights break it otherwise
    tie = mm.EnsemblePolicy([members[1], members[0]], tiny_tokenizer).majority_vote(
        prompts, first_token, max_new_tokens=4)
    weighted = mm.EnsemblePolicy([members[1], members[0]], tiny_tokenizer, weights=[1, 2]).majority_vote(
        prompts, first_token, max_new_tokens=4)
    for row in range(len(prompts)):
        assert tie[row].answer == decoded[1][row]
        assert weighted[row].answer == decoded[0][row]


def test_ensemble_errors(members, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    other = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50))
    with pytest.raises(mm.MergeError, match="need the same tokenizer"):
        mm.EnsemblePolicy([members[0], other]).generate([[1, 2, 3]], 2)
    with pytest.raises(mm.MergeError, match="majority_vote decodes completions"):
        mm.EnsemblePolicy(members[:1]).majority_vote([[1, 2]], str)
    with pytest.raises(mm.MergeError, match="one non-negative number per model"):
        mm.EnsemblePolicy(members[:2], weights=[1.0])
