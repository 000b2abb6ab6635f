"""ContextCompressor (LLMLingua-style prompt compression by the policy's surprisal): token selection
by hand, surprisal against the model's own log-probs, the kept tokens in order at the requested ratio
with the question untouched, the most surprising token surviving, and the orchestrator's methods."""

from __future__ import annotations

import math

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_select_informative_tokens_by_hand():
    surprisal = torch.tensor([float("inf"), 0.5, 3.0, 0.5, 2.0, 0.1])
    # ratio 0.5 of 6 -> 3 kept: inf (first), 3.0, 2.0, in their original order
    assert rlhf.select_informative_tokens(surprisal, 0.5).tolist() == [True, False, True, False, True, False]
    # ratio 0.6 -> ceil(3.6) = 4: the tie at 0.5 goes to the earlier token
    assert rlhf.select_informative_tokens(surprisal, 0.6).tolist() == [True, True, True, False, True, False]
    assert rlhf.select_informative_tokens(surprisal, 1.0).all()
    with pytest.raises(rlhf.RLHFInputError, match="ratio"):
        rlhf.select_informative_tokens(surprisal, 0.0)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))


def test_surprisal_is_the_models_negative_log_prob(policy):
    ids = policy.tokenizer("Compute 12 + 7 - 5.", add_special_tokens=False)["input_ids"]
    got = rlhf.ContextCompressor(policy).surprisal(ids)
    with torch.no_grad():
        log_probs = torch.log_softmax(policy(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = -log_probs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert math.isinf(float(got[0]))
    torch.testing.assert_close(got[1:], want, atol=1e-5, rtol=1e-5)


def test_compression_keeps_the_ratio_the_order_and_the_question(policy):
    tokenizer = policy.tokenizer
    context = "Step 1: 12 + 7 = 19\nStep 2: 19 - 5 = 14\nAnswer: 14\n" * 3
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    question = tokenizer("What is 37 + 8?", add_special_tokens=False)["input_ids"]
    compressor = rlhf.ContextCompressor(policy, ratio=0.4)
    kept = compressor.compress_ids(ids, keep_ids=question)
    assert kept[-len(question):] == question
    body = kept[:-len(question)]
    assert len(body) == math.ceil(0.4 * len(ids))
    position = 0  # the kept tokens are a subsequence of the context
    for token in body:
        position = ids.index(token, position) + 1
    surprisal = compressor.surprisal(ids)
    threshold = sorted(surprisal.tolist(), reverse=True)[len(body) - 1]
    assert all(s >= threshold for s, k in zip(surprisal.tolist(), rlhf.select_informative_tokens(surprisal, 0.4)) if k)
    text = compressor.compress(context, "What is 37 + 8?", ratio=0.4)
    assert text.endswith("\nWhat is 37 + 8?") and len(text) < len(context)


def test_orchestrator_compresses_prompts_and_ids(tiny_model_dir, tmp_path):
    config = rlhf.PipelineConfig.from_dict({"stages": ["sft"], "model_name_or_path": str(tiny_model_dir),
                                            "output_dir": str(tmp_path)})
    orchestrator = rlhf.RLHFOrchestrator(config)
    compressed = orchestrator.compress_prompts(["a long context " * 5, {"context": "x y z " * 6, "question": "Q?"}],
                                               ratio=0.5)
    assert len(compressed) == 2 and compressed[1].endswith("\nQ?")
    ids = list(range(10, 30))
    out = orchestrator.compress_context_from_ids(ids, ratio=0.25, keep_ids=[5, 6])
    assert len(out) == 5 + 2 and out[-2:] == [5, 6] and out[:-2] == sorted(out[:-2])
