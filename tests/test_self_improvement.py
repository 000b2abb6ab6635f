"""Section 9, self-improvement and safety: repetition, degeneration rates, reward-hacking flags,
consistency and the validation score by hand; perturbations keep every number and operator; the
AdversarialValidator on tiny real models (one whose head is biased into a loop, one into stopping at
once, a real two-member reward ensemble for disagreement); the IterativeRefiner keeps its best by
reward (non-decreasing across rounds, scored against the original prompt) and its preference pairs
round-trip through load_records as a file and as a registered dataset."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [{"prompt": "What is 37 + 8?", "answer": "45"}, {"prompt": "Compute 12 + 7 - 5.", "answer": "14"}]


# -- pure functions by hand ----------------------------------------------------------------------------------------


def test_repetition_rate_by_hand():
    # bigrams ab ba ab ba ab: 2 distinct of 5 -> 3 repeats
    assert rlhf.repetition_rate("a b a b a b", 2) == pytest.approx(0.6)
    assert rlhf.repetition_rate("a a a a", 1) == pytest.approx(0.75)
    assert rlhf.repetition_rate("Step 1: 3 + 4 = 7", 3) == 0.0
    assert rlhf.repetition_rate("a b", 3) == 0.0 and rlhf.repetition_rate("", 1) == 0.0


def test_degeneration_rates_by_hand():
    completions = [[5, 6, 2], [7, 7, 7], [2], [9, 9]]
    texts = ["x y z", "= = = = =", " ", "ok then"]
    rates = rlhf.degeneration_rates(completions, texts, [2], n=3, threshold=0.5)
    # "= = = = =": trigrams 1 distinct of 3 -> 2/3 >= 0.5; " " is empty; [7, 7, 7] and [9, 9] have no stop token
    assert rates == {"degenerate/repetition": 0.25, "degenerate/empty": 0.25, "degenerate/truncated": 0.5}
    with pytest.raises(ValueError):
        rlhf.degeneration_rates([[1]], ["a", "b"], [2])


def test_reward_hacking_flags_by_hand():
    before = {"reward": 1.0, "accuracy": 0.6, "disagreement": 0.1}
    assert rlhf.reward_hacking_flags(before, {"reward": 1.5, "accuracy": 0.5, "disagreement": 0.3}) == [
        "reward_up_accuracy_down", "reward_up_disagreement_up"]
    assert rlhf.reward_hacking_flags(before, {"reward": 1.5, "accuracy": 0.7, "disagreement": 0.05}) == []
    worse = {"reward": 0.5, "accuracy": 0.1, "disagreement": 0.9}
    assert rlhf.reward_hacking_flags(before, worse) == []  # worse, but the reward fell too: not hacking
    assert rlhf.reward_hacking_flags(before, {"reward": 1.05, "accuracy": 0.0}, tolerance=0.1) == []  # within tolerance
    assert rlhf.reward_hacking_flags(before, {"reward": 2.0, "accuracy": 0.4}) == ["reward_up_accuracy_down"]
    assert rlhf.reward_hacking_flags({"reward": 0.0}, {"reward": 1.0, "disagreement": 5.0}) == []  # no baseline for it


def test_consistency_score_and_report_by_hand():
    # pairs: (1,1) (2,3) (None,None) | (1,1) (2,2) (None,4) -> 4 of 6 unchanged
    assert rlhf.answer_consistency(["1", "2", None], [["1", "3", None], ["1", "2", "4"]]) == pytest.approx(4 / 6)
    assert rlhf.validation_score(0.2, 0.0, 0.4, 0.6, 0) == pytest.approx((0.8 + 1.0 + 0.6 + 0.6) / 4)
    assert rlhf.validation_score(0.2, 0.0, 0.4, 0.6, 1) == pytest.approx(0.375)
    assert rlhf.validation_score(0.2, 0.0, 0.4, None, 0) == pytest.approx(0.8)
    thresholds = {"max_repetition": 0.1, "max_truncated": 0.5, "min_consistency": 0.5, "max_hacking_flags": 0}
    report = rlhf.ValidationReport(repetition=0.2, empty=0.0, truncated=0.4, consistency=0.6, thresholds=thresholds)
    assert report.score == pytest.approx(0.75)
    assert report.failures == ["repetition 0.2 > max_repetition 0.1"] and not report.passed
    report.repetition, report.hacking_flags = 0.0, ["reward_up_accuracy_down"]
    assert report.failures == ["hacking_flags 1 > max_hacking_flags 0"]
    report.hacking_flags = []
    assert report.passed and report.metrics()["validation/passed"] == 1.0
    assert "validation/accuracy" not in report.metrics()  # not measured, not logged


def _numbers_and_operators(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?|[-+*/=]", text)


def test_perturbations_keep_numbers_and_operators(demo_dir):
    prompts = [r["messages"][-1]["content"] for r in rlhf.load_records("demo_eval", demo_dir, "prompt", max_samples=20)]
    for name, perturb in rlhf.PERTURBATIONS.items():
        changed = 0
        for seed, text in enumerate(prompts):
            out = perturb(text, seed)
            assert _numbers_and_operators(out) == _numbers_and_operators(text), (name, text, out)
            assert out == perturb(text, seed)  # seeded: the same every time
            changed += out != text
        assert changed >= len(prompts) // 2, name
    text = "What is 37 + 8?"
    assert " ".join(rlhf.perturb_whitespace(text, 3).split()) == text
    assert rlhf.perturb_case(text, 1).lower() == text.lower()
    assert rlhf.perturb_prefix(text, 2).endswith(text) and rlhf.perturb_prefix(text, 2) != text


# -- AdversarialValidator on tiny real models ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))


def _biased_to(policy: rlhf.PolicyModel, token_id: int) -> rlhf.PolicyModel:
    """A copy whose output head prefers one token by a wide margin: greedy decoding then emits it forever."""
    biased = copy.deepcopy(policy)
    head = biased.model.get_output_embeddings()
    bias = torch.zeros(head.out_features)
    bias[token_id] = 100.0
    head.bias = nn.Parameter(bias)
    return biased


def test_validator_catches_a_looping_and_a_mute_policy(policy):
    validator = rlhf.AdversarialValidator(max_new_tokens=12, max_repetition=0.1, max_truncated=0.5)
    looping = _biased_to(policy, policy.tokenizer.convert_tokens_to_ids("Ġ="))  # " = = = ..." until the budget ends
    report = validator.validate(looping, PROMPTS)
    assert (report.repetition, report.empty, report.truncated) == (1.0, 0.0, 1.0)
    assert report.consistency == 1.0 and report.accuracy == 0.0 and report.perturbed_accuracy == 0.0
    assert report.score == pytest.approx(0.5) and not report.passed
    assert report.failures == ["repetition 1 > max_repetition 0.1", "truncated 1 > max_truncated 0.5"]
    mute = _biased_to(policy, policy.tokenizer.eos_token_id)  # stops at once: empty, never truncated
    mute_rates = {"degenerate/repetition": 0.0, "degenerate/empty": 1.0, "degenerate/truncated": 0.0}
    assert validator.degeneration(mute, PROMPTS) == mute_rates
    sampling = rlhf.AdversarialValidator(max_new_tokens=12, samples_per_prompt=3)  # temperature-1 samples
    assert sampling.degeneration(mute, PROMPTS) == mute_rates
    with pytest.raises(rlhf.RLHFInputError, match="max_empty=1.5"):
        rlhf.AdversarialValidator(max_empty=1.5)


def test_robustness_counts_answers_left_unchanged(policy):
    validator = rlhf.AdversarialValidator(max_new_tokens=8)
    always_45 = lambda response, record: record["answer"] == "45"  # noqa: E731 - verifier stub, the model is real
    metrics = validator.robustness(policy, PROMPTS, verifier=always_45)
    assert metrics["robustness/accuracy"] == metrics["robustness/perturbed_accuracy"] == 0.5
    assert 0.0 <= metrics["robustness/consistency"] <= 1.0
    assert rlhf.AdversarialValidator(perturbations=[]).robustness(policy, PROMPTS) == {}
    with pytest.raises(rlhf.RLHFInputError, match="unknown perturbations"):
        rlhf.AdversarialValidator(perturbations=["shuffle"])


def test_measure_reads_ensemble_disagreement(policy, llama_dir):
    members = [rlhf.RewardModel.from_pretrained(str(llama_dir), seed=s) for s in (0, 1)]
    learned = rlhf.LearnedReward(rlhf.RewardEnsemble(members))
    validator = rlhf.AdversarialValidator(max_new_tokens=8)
    measured = validator.measure(policy, PROMPTS, learned)
    records = rlhf.RLHFEvaluator.as_records(PROMPTS)
    greedy = rlhf.RLHFEvaluator(policy, max_new_tokens=8).complete(policy, records, sample=False)
    texts = [policy.decode(c) for c in greedy]
    expected = learned([p["prompt"] for p in PROMPTS], texts, ["45", "14"], records=records)
    assert measured["reward"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert measured["disagreement"] == pytest.approx(float(learned.last_uncertainty.mean()), abs=1e-5)
    assert measured["disagreement"] > 0 and measured["accuracy"] == 0.0


def test_validate_flags_reward_hacking_against_a_baseline(policy):
    def equals_signs(prompts, completions, answers):  # a proxy reward a loop of " =" exploits
        equals_signs.last_uncertainty = torch.tensor([c.count("=") / 10 for c in completions])
        return torch.tensor([float(c.count("=")) for c in completions])

    def no_loop(response, record):  # the "true" check: a looping response is wrong
        return rlhf.repetition_rate(response, 3) < 0.5

    validator = rlhf.AdversarialValidator(max_new_tokens=12, max_truncated=1.0, max_repetition=1.0,
                                          min_consistency=0.0)
    baseline = validator.measure(policy, PROMPTS, equals_signs, verifier=no_loop)
    looping = _biased_to(policy, policy.tokenizer.convert_tokens_to_ids("Ġ="))
    report = validator.validate(looping, PROMPTS, reward_fn=equals_signs, baseline=baseline, verifier=no_loop)
    assert baseline["accuracy"] == 1.0 and report.measurements["after"]["accuracy"] == 0.0
    assert report.measurements["after"]["reward"] == 12.0  # twelve " =" tokens
    assert report.hacking_flags == ["reward_up_accuracy_down", "reward_up_disagreement_up"]
    assert report.failures == ["hacking_flags 2 > max_hacking_flags 0"]
    with pytest.raises(rlhf.RLHFInputError, match="baseline needs the reward_fn"):
        validator.validate(policy, PROMPTS, baseline=baseline)


# -- IterativeRefiner --------------------------------------------------------------------------------------------------


def test_default_critique_by_hand():
    assert "no final 'Answer: <number>' line" in rlhf.default_critique("I think so", 0.0, None)
    wrong = "The previous answer 44 was judged wrong (reward 0); check each step."
    assert rlhf.default_critique("Answer: 44", 0.0, False) == wrong
    assert "judged correct" in rlhf.default_critique("Answer: 45", 1.0, True)
    assert "got a reward of 0.25" in rlhf.default_critique("Answer: 7", 0.25, None)


class DistinctCharacters:
    """A deterministic reward stub that sees the prompt records, to check what the refiner scores against."""

    wants_records = True

    def __init__(self) -> None:
        self.seen_prompts: set[str] = set()

    def __call__(self, prompts, completions, answers, records=None):
        self.seen_prompts.update(r["messages"][-1]["content"] for r in records)
        return torch.tensor([float(len(set(c))) for c in completions])


def test_refiner_keeps_the_best_by_reward_across_rounds(policy):
    reward, critiques = DistinctCharacters(), []

    def critic(prompt, response):
        critiques.append((prompt, response))
        return "Be more varied."

    refiner = rlhf.IterativeRefiner(policy, reward, critic=critic, rounds=3, num_candidates=2, max_new_tokens=10)
    results = refiner.refine(PROMPTS)
    assert reward.seen_prompts == {p["prompt"] for p in PROMPTS}  # candidates scored against the original prompt
    assert {p for p, _ in critiques} <= reward.seen_prompts and critiques
    for result in results:
        rounds = result.round_rewards
        assert 1 <= len(rounds) <= 4 and result.best_so_far == sorted(result.best_so_far)  # non-decreasing
        assert result.reward == result.best_so_far[-1] == max(rounds) >= rounds[0]
        assert rounds[result.best_round] == result.reward and result.reward == len(set(result.response))
        assert result.worst_reward <= result.reward
        if len(rounds) < 4:  # stopped early: the last round did not improve
            assert rounds[-1] <= max(rounds[:-1])
    assert [len(r.round_rewards) for r in rlhf.IterativeRefiner(policy, reward, rounds=0).refine(PROMPTS)] == [1, 1]
    with pytest.raises(rlhf.RLHFInputError, match="rounds"):
        rlhf.IterativeRefiner(policy, reward, rounds=-1)


def test_refiner_default_critique_uses_the_verifier(policy):
    refiner = rlhf.IterativeRefiner(policy, rlhf.exact_answer_reward)
    record = rlhf.RLHFEvaluator.as_records(PROMPTS)[0]
    result = rlhf.RefinementResult(record, "37 + 8 = 44\nAnswer: 44", 0.0, 0, [0.0], "", 0.0)
    assert refiner.critique(result) == "The previous answer 44 was judged wrong (reward 0); check each step."
    refined = refiner._refined(result)["messages"][-1]["content"]
    assert refined == rlhf.REFINE_TEMPLATE.format(prompt="What is 37 + 8?", response=result.response,
                                                  critique=refiner.critique(result))


def test_refinement_pairs_by_hand():
    def result(prompt, best, reward, worst, worst_reward, system="", history=()):
        turns = [({"role": "user", "content": q}, {"role": "assistant", "content": a}) for q, a in history]
        messages = [m for turn in turns for m in turn]
        record = {"system": system, "messages": messages + [{"role": "user", "content": prompt}]}
        return rlhf.RefinementResult(record, best, reward, 0, [reward], worst, worst_reward)

    results = [result("p1", "good", 2.0, "bad", 1.0), result("p2", "same", 1.0, "same", 1.0),
               result("p3", "good", 2.0, "  ", 0.0), result("p4", "a", 1.5, "b", 1.0, system="Be brief.",
                                                             history=[("hi", "hello")])]
    assert rlhf.refinement_pairs(results) == [
        {"prompt": "p1", "chosen": "good", "rejected": "bad", "chosen_reward": 2.0, "rejected_reward": 1.0},
        {"prompt": "p4", "system": "Be brief.", "history": [["hi", "hello"]], "chosen": "a", "rejected": "b",
         "chosen_reward": 1.5, "rejected_reward": 1.0}]
    assert [p["prompt"] for p in rlhf.refinement_pairs(results, min_margin=0.5)] == ["p1"]


def test_preference_pairs_round_trip_through_load_records(policy, tmp_path):
    reward = DistinctCharacters()
    refiner = rlhf.IterativeRefiner(policy, reward, rounds=2, num_candidates=3, max_new_tokens=10)
    prompts = PROMPTS + [{"prompt": "What is 5 + 5?", "system": "Show your steps."}]
    pairs = refiner.preference_pairs(prompts)
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    assert all(p["chosen_reward"] == len(set(p["chosen"])) for p in pairs)
    path = rlhf.write_preference_jsonl(pairs, tmp_path / "refined" / "pairs.jsonl", dataset_name="refined")
    by_path = rlhf.load_records(str(path), tmp_path, "preference")
    by_name = rlhf.load_records("refined", tmp_path / "refined", "preference")
    for loaded in (by_path, by_name):
        assert [(r["messages"][-1]["content"], r["system"], r["chosen"], r["rejected"]) for r in loaded] == [
            (p["prompt"], p.get("system", ""), p["chosen"], p["rejected"]) for p in pairs]
