"""MCTSGenerator (inference_optimizations.py): PUCT by hand, the tree's visit/value bookkeeping after
real searches on a tiny model, each budget (nodes, simulations, time, confidence) stopping the search
with its reason, and the search finding responses its evaluator prefers more often than sampling."""

from __future__ import annotations

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_puct_by_hand():
    child = io.MCTSNode([1], prior=0.5, visits=3, value_sum=1.5)
    # Q = 1.5 / 3 = 0.5; U = 2 * 0.5 * sqrt(16) / (1 + 3) = 1.0
    assert io.puct_score(16, child, c_puct=2.0) == pytest.approx(1.5)
    fresh = io.MCTSNode([2], prior=0.25)
    assert io.puct_score(9, fresh, c_puct=1.0) == pytest.approx(0.75)  # Q = 0, U = 0.25 * 3 / 1


@pytest.fixture(scope="module")
def model(tiny_arch_dir):
    loaded, _ = rlhf.load_causal_lm(str(tiny_arch_dir("llama")))
    return loaded.eval()


def _digit_share(prompts: list[str], responses: list[str]) -> torch.Tensor:
    """A stand-in process reward: the share of digits in the response so far (the tiny random model
    emits a mix of everything, so this is a preference the search can act on)."""
    return torch.tensor([sum(ch.isdigit() for ch in r) / max(len(r), 1) for r in responses])


def _walk(node):
    yield node
    for child in node.children:
        yield from _walk(child)


def test_tree_bookkeeping_after_a_search(model, tiny_tokenizer):
    search = io.MCTSGenerator(model, tiny_tokenizer, _digit_share, expansions=3, max_nodes=20, max_depth=3,
                              max_step_tokens=4, max_new_tokens=16, seed=0)
    result = search.search("What is 37 + 8?")
    root = result.root
    assert result.stopped_by in ("nodes", "exhausted") and 20 <= result.nodes <= 20 + 2
    assert result.nodes == sum(1 for _ in _walk(root))
    assert result.policy_calls >= 1 and result.evaluations >= result.nodes - 1
    assert root.visits == sum(c.visits for c in root.children)
    for node in _walk(root):
        if node is root:
            continue
        assert node.value is not None and 0 <= node.value <= 1 and node.depth <= 3
        if node.children:  # one visit of its own evaluation plus everything backed up through it
            assert node.visits >= 1 + sum(c.visits for c in node.children)
            assert sum(c.prior for c in node.children) == pytest.approx(1.0)
        for child in node.children:  # a child extends its parent's tokens by one step
            assert child.token_ids[:len(node.token_ids)] == node.token_ids and child.depth == node.depth + 1
    assert result.max_depth == max(n.depth for n in _walk(root))
    if result.complete:  # the answer is the best finished solution in the tree
        finished = [n for n in _walk(root) if n.finished]
        assert result.value == max(n.value for n in finished) and result.solutions == len(finished)
        assert result.response in {tiny_tokenizer.decode(n.token_ids, skip_special_tokens=True) for n in finished}


def test_budgets_stop_the_search_with_their_reason(model, tiny_tokenizer):
    common = dict(expansions=2, max_depth=6, max_step_tokens=3, max_new_tokens=18, seed=1)
    by_simulations = io.MCTSGenerator(model, tiny_tokenizer, _digit_share, max_nodes=500, max_simulations=3,
                                      **common).search("hi")
    assert by_simulations.stopped_by == "simulations" and by_simulations.simulations == 3
    by_time = io.MCTSGenerator(model, tiny_tokenizer, _digit_share, max_nodes=500, time_budget=0.0,
                               **common).search("hi")
    assert by_time.stopped_by == "time" and by_time.nodes == 1 and by_time.policy_calls == 1  # greedy completion only
    assert by_time.response  # still an answer
    with pytest.raises(ValueError, match="answer_fn"):
        io.MCTSGenerator(model, tiny_tokenizer, _digit_share, stopping=io.ConfidenceBasedStopping())


def test_confidence_stops_once_finished_solutions_agree(model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    # every step ends the turn at once (the end token is the only one allowed past the first), so each
    # expansion yields finished solutions; all answers agree ("same"), so one round is enough
    with torch.no_grad():
        bias = torch.full((model.config.vocab_size,), -1e4)
        bias[eos] = 1e4
        saved = model.lm_head.weight.clone()
        model.lm_head.weight.zero_()
        handle = model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    try:
        stop = io.ConfidenceBasedStopping(agreement=1.0, min_samples=1)
        result = io.MCTSGenerator(model, tiny_tokenizer, _digit_share, expansions=2, max_nodes=50, stopping=stop,
                                  answer_fn=lambda text: "same", seed=0).search("hi")
    finally:
        handle.remove()
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    assert result.stopped_by == "confident" and result.simulations == 1 and result.complete and result.solutions == 1


def test_search_finds_what_its_evaluator_prefers(model, tiny_tokenizer):
    """Over a few prompts, the searched response scores higher under the evaluator than a plain sample
    of the same length budget does."""
    prompts = ["What is 37 + 8?", "Compute 12 + 7 - 5.", "What is 90 - 9?", "hi"]
    search = io.MCTSGenerator(model, tiny_tokenizer, _digit_share, expansions=4, max_nodes=40, max_depth=4,
                              max_step_tokens=4, max_new_tokens=16, seed=0)
    searched = [r.value for r in search(prompts)]
    ids = [io.chat_prompt_ids(tiny_tokenizer, p) for p in prompts]
    sampled = io.generate(model, ids, io.SamplingParams(max_new_tokens=16, seed=0, n=4),
                          pad_token_id=tiny_tokenizer.pad_token_id)
    texts = [tiny_tokenizer.decode(t, skip_special_tokens=True) for t in sampled.token_ids]
    plain = _digit_share([""] * len(texts), texts).view(len(prompts), 4).mean(-1)
    assert sum(searched) / len(searched) > float(plain.mean()) + 0.1
