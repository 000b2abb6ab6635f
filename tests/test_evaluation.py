"""Section 8, evaluation: the KL estimators against hand values and the exact KL of a categorical,
distinct-n / self-similarity / win-rate by hand, and RLHFEvaluator on a tiny model (KL of a model to
itself is 0, to a perturbed copy positive and consistent between estimators; reward accuracy, win
rate, diversity and task accuracy against what the callables imply)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_kl_estimates_by_hand():
    policy = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    reference = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # sequence 1: log r = -0.5, +1.0 -> k1 = 0.5 - 1.0 = -0.5; k3 = (e^-0.5 - 1 + 0.5) + (e^1 - 1 - 1)
    k3_first = (math.exp(-0.5) - 0.5) + (math.e - 2.0)
    got = rlhf.kl_estimates(policy, reference, mask)
    assert got["kl/k1"] == pytest.approx(-0.25)  # mean of -0.5 and 0
    assert got["kl/k3"] == pytest.approx(k3_first / 2)


def test_kl_estimators_are_unbiased_for_a_categorical():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = float((p * (p / q).log()).sum())
    draws = torch.multinomial(p, 200_000, replacement=True, generator=generator)
    lp, lq = p.log()[draws][:, None], q.log()[draws][:, None]  # one token per "sequence"
    got = rlhf.kl_estimates(lp, lq, torch.ones_like(lp))
    assert got["kl/k1"] == pytest.approx(exact, abs=0.01) and got["kl/k3"] == pytest.approx(exact, abs=0.01)


def test_distinct_self_similarity_and_win_rate_by_hand():
    texts = ["a b a b", "a c"]
    # unigrams a b a b a c: 3 distinct of 6; bigrams ab ba ab ac: 3 distinct of 4
    assert rlhf.distinct_n(texts, 1) == 0.5 and rlhf.distinct_n(texts, 2) == 0.75
    assert rlhf.distinct_n([""], 2) == 0.0
    # bigram sets {ab, ba}, {ab, bc}, {xy}: Jaccard 1/3, 0, 0 -> mean 1/9
    assert rlhf.self_similarity(["a b a", "a b c", "x y"]) == pytest.approx(1 / 9)
    assert rlhf.self_similarity(["same words", "same words"]) == 1.0 and rlhf.self_similarity(["one"]) == 0.0
    result = rlhf.win_rate([3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 5.0, -1.0])
    assert result == {"win_rate": 0.625, "wins": 2, "ties": 1, "losses": 1}
    with pytest.raises(ValueError):
        rlhf.win_rate([1.0], [1.0, 2.0])


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))


def test_kl_of_a_model_to_itself_is_zero_and_to_a_perturbed_copy_positive(policy):
    prompts = ["What is 37 + 8?", "Compute 12 + 7 - 5."]
    same = rlhf.RLHFEvaluator(policy, copy.deepcopy(policy), max_new_tokens=12).kl_to_reference(prompts, 3)
    assert same["kl/k1"] == pytest.approx(0.0, abs=1e-5) and same["kl/k3"] == pytest.approx(0.0, abs=1e-5)
    other = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    shifted = rlhf.RLHFEvaluator(policy, other, max_new_tokens=12).kl_to_reference(prompts, 8)
    assert shifted["kl/k3"] > 0.05 and shifted["kl/k1"] > 0.0
    assert shifted["kl/k1"] == pytest.approx(shifted["kl/k3"], rel=0.5)  # two unbiased estimates of one KL
    with pytest.raises(rlhf.RLHFInputError, match="reference"):
        rlhf.RLHFEvaluator(policy).kl_to_reference(prompts)


def test_reward_accuracy_win_rate_diversity_and_task_accuracy(policy):
    def longer_is_better(prompts, responses):
        return torch.tensor([float(len(r)) for r in responses])

    pairs = [{"prompt": "p", "chosen": "long answer", "rejected": "short"},
             {"prompt": "p", "chosen": "x", "rejected": "much longer"}]
    assert rlhf.RLHFEvaluator.reward_accuracy(pairs, longer_is_better)["reward/accuracy"] == 0.5
    evaluator = rlhf.RLHFEvaluator(policy, copy.deepcopy(policy), max_new_tokens=10)
    prompts = ["What is 37 + 8?", "hi"]
    tie = evaluator.win_rate(prompts, reward_fn=longer_is_better)  # same model, same greedy responses
    assert tie["win/win_rate"] == 0.5 and tie["win/ties"] == 2
    judged = evaluator.win_rate(prompts, judge=lambda prompt, ours, theirs: 1.0)
    assert judged["win/win_rate"] == 1.0 and judged["win/wins"] == 2
    diversity = evaluator.diversity(prompts, samples_per_prompt=4)
    assert 0 < diversity["diversity/distinct_1"] <= 1 and 0 <= diversity["diversity/self_similarity"] <= 1
    records = [{"prompt": "What is 37 + 8?", "answer": "45"}, {"prompt": "hi", "answer": "1"}]
    greedy = [policy.decode(c) for c in evaluator.complete(policy, evaluator.as_records(records), sample=False)]
    expected = sum(rlhf.extract_answer(t) == r["answer"] for t, r in zip(greedy, records)) / 2
    assert evaluator.task_accuracy(records)["task/accuracy"] == expected
    assert evaluator.task_accuracy(records, verifier=lambda response, record: record["answer"] == "45") \
        == {"task/accuracy": 0.5}
    everything = evaluator.evaluate(records, pairs=pairs, reward_fn=longer_is_better, samples_per_prompt=2)
    assert {"diversity/distinct_2", "task/accuracy", "kl/k1", "kl/k3", "win/win_rate",
            "reward/accuracy"} <= set(everything)


def test_generation_stops_at_every_stop_token_of_the_generation_config(tiny_model_dir):
    """A model whose generation_config lists an end-of-turn token besides EOS (Llama 3.1, Gemma 3) stops there in
    rollouts and evaluation: the evaluator's stop set carries it."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    turn_end = policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert turn_end != policy.tokenizer.eos_token_id
    records = rlhf.RLHFEvaluator.as_records(["What is 3 + 4?"])
    prompt = rlhf.RLHFEvaluator(policy).formatter.prompt_ids(records[0])
    head = policy.model.get_output_embeddings()
    seen = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append(args[0][0, -1].detach()))
    with torch.no_grad():
        policy.model(torch.tensor([prompt]))
        handle.remove()
        head.weight.zero_()
        head.weight[turn_end] = seen[0]  # the first token it generates is the end-of-turn token, logit |h|^2 > 0
    plain = rlhf.RLHFEvaluator(policy, max_new_tokens=8)
    assert turn_end not in plain.formatter.stop_token_ids
    assert len(plain.complete(policy, records, sample=False)[0]) > 1  # runs past it
    policy.model.generation_config.eos_token_id = [policy.tokenizer.eos_token_id, turn_end]
    evaluator = rlhf.RLHFEvaluator(policy, max_new_tokens=8)
    assert turn_end in evaluator.formatter.stop_token_ids
    assert evaluator.complete(policy, records, sample=False)[0] == [turn_end]
