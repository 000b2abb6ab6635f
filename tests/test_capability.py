"""CapabilityTester: the rollback decision against the threshold by hand, accuracy per task against
what the verifier says of the model's own greedy answers, loading tasks from config, and clear errors."""

from __future__ import annotations

import pytest

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compare_flags_drops_beyond_the_threshold():
    tester = rlhf.CapabilityTester({"a": [{"prompt": "p", "answer": "1"}]}, threshold=0.05)
    report = tester.compare({"math": 0.70, "format": 0.90, "code": 0.50}, {"math": 0.64, "format": 0.85, "code": 0.60})
    assert report.deltas == pytest.approx({"math": -0.06, "format": -0.05, "code": 0.10})
    assert report.regressions == ["math"] and report.rollback  # -0.05 is at the threshold, not beyond it
    assert not tester.compare({"math": 0.7}, {"math": 0.7}).rollback


def test_run_scores_each_task_with_its_verifier(tiny_model_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    records = [{"prompt": "What is 37 + 8?", "answer": "45"}, {"prompt": "hi", "answer": "1"}]
    tester = rlhf.CapabilityTester({"exact": records, "always": records, "first_only": records},
                                   verifiers={"always": lambda response, record: True,
                                              "first_only": lambda response, record: record["answer"] == "45"},
                                   max_new_tokens=8)
    scores = tester.run(policy)
    assert scores["always"] == 1.0 and scores["first_only"] == 0.5
    assert scores["exact"] == 0.0  # the untrained tiny model never writes "Answer: 45"


def test_from_config_reads_tasks_and_rejects_mistakes(demo_dir):
    tester = rlhf.CapabilityTester.from_config({"arithmetic": {"dataset": "demo_eval", "dataset_dir": str(demo_dir),
                                                               "max_samples": 5}}, threshold=0.1)
    assert len(tester.tasks["arithmetic"]) == 5 and tester.threshold == 0.1
    assert all(r["answer"] for r in tester.tasks["arithmetic"])
    with pytest.raises(rlhf.RLHFInputError, match="capability_tests.bad: needs 'dataset'"):
        rlhf.CapabilityTester.from_config({"bad": {"dataset_dir": str(demo_dir)}})
    with pytest.raises(rlhf.RLHFInputError, match="at least one"):
        rlhf.CapabilityTester({"empty": []})
