"""Process reward models: steps split at a delimiter, the demo's arithmetic step verifier, step end positions
in the token ids, min / product / last aggregation against plain formulas, step labels from records or a
labeler (with one-line errors), the collator, a short training run that learns and saves/loads, the PRM as an
online-RL reward function, and the CLI.

Models are the embedded ``tiny`` model; training runs are a handful of steps on 8 demo pairs.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread

PAIR = ("Step 1: 49 - 2 = 47\nStep 2: 47 - 2 = 45\nStep 3: 45 + 5 = 50\nAnswer: 50",
        "Step 1: 49 - 2 = 47\nStep 2: 47 - 2 = 45\nStep 3: 45 + 5 = 52\nAnswer: 52")


@pytest.fixture(scope="module")
def pref_records(demo_dir) -> list[dict]:
    return rlhf.load_records("demo_preference", demo_dir, "preference", max_samples=8)


@pytest.fixture(scope="module")
def formatter(tiny_tokenizer) -> rlhf.ChatFormatter:
    return rlhf.ChatFormatter(tiny_tokenizer, "auto")


def _record(prompt: str = "Compute 49 - 2 - 2 + 5.") -> dict:
    return {"system": "", "messages": [{"role": "user", "content": prompt}], "location": "test:1"}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _prm_config(tmp_path: Path, model_dir: Path, demo_dir: Path, **overrides) -> rlhf.ProcessRewardModelConfig:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "prm"), dataset="demo_preference",
                    dataset_dir=str(demo_dir), max_samples=8, finetuning_type="full", per_device_train_batch_size=8,
                    per_device_eval_batch_size=8, cutoff_len=96, max_steps=8, learning_rate=5e-3,
                    lr_scheduler_type="constant", logging_steps=1, save_steps=0, disable_progress_bar=True,
                    report_to="none", seed=0, resume_from_checkpoint="none", prm_step_labeler="arithmetic")
    settings.update(overrides)
    return rlhf.ProcessRewardModelConfig(**settings)


def _prm_trainer(config: rlhf.ProcessRewardModelConfig, records: list[dict], labeler: str = "arithmetic"):
    model = rlhf.ProcessRewardModel.from_pretrained(config.model_name_or_path, seed=config.seed,
                                                    step_delimiter=config.step_delimiter,
                                                    aggregation=config.prm_aggregation)
    data = rlhf.ProcessPreferenceDataset(records, model.tokenizer, rlhf.ChatFormatter(model.tokenizer, "auto"),
                                         cutoff_len=config.cutoff_len, delimiter=config.step_delimiter, labeler=labeler)
    return rlhf.ProcessRewardModelTrainer(config, model, data, eval_dataset=data), data


def _hand_step_accuracy(model: rlhf.ProcessRewardModel, data, collator) -> float:
    """Share of labelled steps whose logit has the label's sign, from the model's step logits directly."""
    device = next(model.parameters()).device  # the trainer put it on a GPU if there is one
    batch = {k: v.to(device) for k, v in collator([data[i] for i in range(len(data))]).items()}
    with torch.no_grad():
        logits = model.step_logits(batch["input_ids"], batch["attention_mask"], batch["step_positions"])
    right = total = 0
    for row in range(logits.shape[0]):
        for s in range(logits.shape[1]):
            label = float(batch["step_labels"][row, s])
            if batch["step_mask"][row, s] and label >= 0:
                total += 1
                right += int((float(logits[row, s]) > 0) == (label == 1.0))
    return right / total


# -- 8. steps and the arithmetic verifier -------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "delimiter", "steps"), [
    ("a\nb\nc", "\n", ["a\n", "b\n", "c"]),
    ("a\n\nb\n", "\n", ["a\n\n", "b\n"]),  # a blank piece joins the step before it
    ("a\n \n\nb", "\n", ["a\n \n\n", "b"]),
    ("one", "\n", ["one"]),
    ("", "\n", []),
    ("x = 1 ки y = 2 ки", " ки", ["x = 1 ки", " y = 2 ки"]),  # Math-Shepherd's step tag
])
def test_split_steps(response, delimiter, steps):
    assert rlhf.split_steps(response, delimiter) == steps
    assert "".join(rlhf.split_steps(response, delimiter)) == response


def test_split_steps_gives_every_response_back(pref_records):
    for record in pref_records:
        for side in ("chosen", "rejected"):
            steps = rlhf.split_steps(record[side])
            assert "".join(steps) == record[side] and all(s.strip() for s in steps)
            assert len(steps) == record[side].count("\n") + 1


def test_arithmetic_step_labels_hand_values():
    # wrong step, answer follows it
    assert rlhf.arithmetic_step_labels(rlhf.split_steps(PAIR[1])) == [True, True, False, True]
    assert rlhf.arithmetic_step_labels(rlhf.split_steps(PAIR[0])) == [True, True, True, True]
    assert rlhf.arithmetic_step_labels(["82 - 9 = 73\n", "Answer: 74"]) == [True, False]  # answer is not the last value
    assert rlhf.arithmetic_step_labels(["6 * 7 = 42\n", "so the result is\n", "Answer: 42"]) == [True, None, True]
    assert rlhf.arithmetic_step_labels(["Let me think.\n", "Hmm"]) == [None, None]  # no equation, no answer
    assert rlhf.arithmetic_step_labels(["Answer: 5"]) == [True]  # nothing computed to disagree with
    assert rlhf.arithmetic_step_labels(["3 - 5 = -2\n", "-2 + 1 = -1\n", "Answer: -1"]) == [True, True, True]
    assert rlhf.arithmetic_step_labels([]) == []


def test_arithmetic_labels_of_a_whole_response_mark_a_missing_answer_wrong():
    answerless = ["Step 1: 49 - 2 = 47\n", "Step 2: 47 - 2 = 45"]  # right working, no Answer line
    assert rlhf.arithmetic_step_labels(answerless) == [True, True]  # a partial solution (MCTS) is fine so far
    assert rlhf.arithmetic_step_labels(answerless, complete=True) == [True, False]  # a finished one failed to answer
    assert rlhf.arithmetic_response_labels(answerless) == [True, False]
    assert rlhf.arithmetic_step_labels(["Let me think.\n", "Hmm"], complete=True) == [None, False]
    assert rlhf.arithmetic_step_labels(["82 - 9 = 73\n", "Answer: 74"], complete=True) == [True, False]
    for steps in (rlhf.split_steps(PAIR[0]), rlhf.split_steps(PAIR[1]), ["Answer: 5"], []):  # answered: unchanged
        assert rlhf.arithmetic_step_labels(steps, complete=True) == rlhf.arithmetic_step_labels(steps)
    assert rlhf.STEP_LABELERS["arithmetic"] is rlhf.arithmetic_response_labels  # training pairs are whole responses


# -- 9. step positions in the token ids -------------------------------------------------------------------------


def test_encode_steps_ends_are_the_last_token_of_each_step(formatter, tiny_tokenizer, pref_records):
    cases = [(r, r[side], "\n") for r in pref_records for side in ("chosen", "rejected")]
    cases.append((_record(), "x = 1 ки y = 2 ки Answer: 3", " ки"))
    for record, response, delimiter in cases:
        ids, ends = rlhf.encode_steps(formatter, record, response, delimiter)
        assert ids == formatter.completion_ids(record, response)
        steps = rlhf.split_steps(response, delimiter)
        assert len(ends) == len(steps) and ends == sorted(set(ends))
        for k, end in enumerate(ends):
            prefix = tiny_tokenizer.decode(ids[:end + 1])
            assert prefix.strip() == "".join(steps[:k + 1]).strip()  # up to this step's end, nothing more
            assert prefix.rstrip().endswith(steps[k].strip())
        assert ends[-1] < len(ids) - 1  # the template's end marker comes after the last step


def test_encode_steps_with_a_template_that_trims_the_response(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "(message['content'] | trim)")
    formatter = rlhf.ChatFormatter(tokenizer, "auto")
    response = "Step 1: 1 + 1 = 2\nAnswer: 2\n"
    ids, ends = rlhf.encode_steps(formatter, _record("What is 1 + 1?"), response, "\n")
    assert len(ends) == len(rlhf.split_steps(response)) == 2


# -- 10. aggregation ------------------------------------------------------------------------------------------------


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_aggregate_step_scores_matches_plain_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 9.0], [-3.0, 4.0, 7.0, 1.0], [0.3, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    for how in rlhf.PRM_AGGREGATIONS:
        want = []
        for row, keep in zip(logits.tolist(), mask.tolist()):
            log_p = [_log_sigmoid(x) for x, k in zip(row, keep) if k]
            if not log_p:
                want.append(0.0)  # no steps: log 1
            else:
                want.append({"min": min(log_p), "product": sum(log_p), "last": log_p[-1]}[how])
        torch.testing.assert_close(rlhf.aggregate_step_scores(logits, mask, how), torch.tensor(want), msg=how)
    # min <= last and product <= min: the product needs every step right
    assert torch.all(rlhf.aggregate_step_scores(logits, mask, "product")
                     <= rlhf.aggregate_step_scores(logits, mask) + 1e-6)
    with pytest.raises(rlhf.RLHFInputError, match="unknown step aggregation 'mean'.*min, product, last"):
        rlhf.aggregate_step_scores(logits, mask, "mean")


# -- 11. datasets and the collator ---------------------------------------------------------------------------------


def test_step_labels_from_records_and_from_the_labeler(tmp_path, tiny_tokenizer, formatter):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "Compute 49 - 2 - 2 + 5.", "chosen": PAIR[0], "rejected": PAIR[1],
         "chosen_step_labels": [True, True, None, True], "rejected_step_labels": [1, 1, 0, None]},
        {"prompt": "What is 82 - 9?", "chosen": "82 - 9 = 73\nAnswer: 73", "rejected": "82 - 9 = 73\nAnswer: 74"},
        {"prompt": "What is 6 * 7?", "chosen": "6 * 7 = 42\nAnswer: 42", "rejected": "6 * 7 = 42"},
    ])
    records = rlhf.load_records(path.name, tmp_path, "preference")
    assert records[0]["rejected_step_labels"] == [True, True, False, None] and "chosen_step_labels" not in records[1]
    from_data = rlhf.ProcessPreferenceDataset(records, tiny_tokenizer, formatter, cutoff_len=128)
    assert from_data[0]["chosen_labels"] == [1.0, 1.0, -1.0, 1.0]
    assert from_data[0]["rejected_labels"] == [1.0, 1.0, 0.0, -1.0]
    assert from_data[1]["chosen_labels"] == [-1.0, -1.0] == from_data[1]["rejected_labels"]  # no labels, no labeler
    labelled = rlhf.ProcessPreferenceDataset(records, tiny_tokenizer, formatter, cutoff_len=128, labeler="arithmetic")
    assert labelled[0]["rejected_labels"] == [1.0, 1.0, 0.0, -1.0]  # the record's own labels win
    assert labelled[1]["chosen_labels"] == [1.0, 1.0] and labelled[1]["rejected_labels"] == [1.0, 0.0]
    assert labelled[2]["chosen_labels"] == [1.0, 1.0] and labelled[2]["rejected_labels"] == [0.0]  # stops unanswered
    for item, record in zip(labelled, records):
        for side in ("chosen", "rejected"):
            ids, ends = rlhf.encode_steps(formatter, record, record[side], "\n")
            assert item[f"{side}_ids"] == ids and item[f"{side}_steps"] == ends
        assert item["prompt_ids"] == formatter.prompt_ids(record)


def test_wrong_step_label_count_is_an_error_naming_the_record(tmp_path, tiny_tokenizer, formatter):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "What is 82 - 9?", "chosen": "82 - 9 = 73\nAnswer: 73", "rejected": "82 - 9 = 74\nAnswer: 74"},
        {"prompt": "What is 82 - 9?", "chosen": "82 - 9 = 73\nAnswer: 73", "rejected": "82 - 9 = 74\nAnswer: 74",
         "rejected_step_labels": [False]},
    ])
    records = rlhf.load_records(path.name, tmp_path, "preference")
    with pytest.raises(rlhf.RLHFInputError, match=r"pairs\.jsonl:2: 1 step labels for 2 'rejected' steps"):
        rlhf.ProcessPreferenceDataset(records, tiny_tokenizer, formatter, cutoff_len=128)
    _write_jsonl(path, [{"prompt": "p", "chosen": "a", "rejected": "b", "chosen_step_labels": "yes"}])
    with pytest.raises(rlhf.RLHFInputError, match=r"pairs\.jsonl:1: 'chosen_step_labels' must be a list"):
        rlhf.load_records(path.name, tmp_path, "preference")
    with pytest.raises(rlhf.RLHFInputError, match="prm_step_labeler"):
        rlhf.ProcessPreferenceDataset(records[:1], tiny_tokenizer, formatter, cutoff_len=128, labeler="math")


def test_truncation_drops_the_steps_cut_off(tiny_tokenizer, formatter):
    record = {**_record(), "chosen": PAIR[0], "rejected": PAIR[1]}
    full = rlhf.ProcessPreferenceDataset([record], tiny_tokenizer, formatter, cutoff_len=256, labeler="arithmetic")[0]
    cutoff = len(full["prompt_ids"]) + full["chosen_steps"][1] + 3  # the first two steps fit, a bit of the third
    data = rlhf.ProcessPreferenceDataset([record], tiny_tokenizer, formatter, cutoff_len=cutoff, labeler="arithmetic")
    assert data.stats["truncated"] == 1
    item = data[0]
    assert len(item["prompt_ids"]) + len(item["chosen_ids"]) <= cutoff
    for side in ("chosen", "rejected"):
        kept = len(item[f"{side}_steps"])
        assert 1 <= kept < 4 and all(end < len(item[f"{side}_ids"]) for end in item[f"{side}_steps"])
        assert item[f"{side}_steps"] == full[f"{side}_steps"][:kept]
        assert item[f"{side}_labels"] == full[f"{side}_labels"][:kept]


def test_collator_rows_steps_and_padding(tiny_tokenizer, formatter, pref_records):
    data = rlhf.ProcessPreferenceDataset(pref_records[:3], tiny_tokenizer, formatter, cutoff_len=128,
                                         labeler="arithmetic")
    items = [data[i] for i in range(3)]
    batch = rlhf.ProcessPreferenceCollator(tiny_tokenizer.pad_token_id)(items)
    rows = [(item, side) for side in ("chosen", "rejected") for item in items]  # chosen rows first
    width = max(len(item[f"{side}_steps"]) for item, side in rows)
    assert width > min(len(item[f"{side}_steps"]) for item, side in rows)  # some rows are padded
    for key in ("step_positions", "step_mask", "step_labels"):
        assert batch[key].shape == (6, width)
    assert batch["input_ids"].shape[0] == 6 and batch["step_mask"].dtype == torch.bool
    for r, (item, side) in enumerate(rows):
        n = len(item[f"{side}_steps"])
        ids = item["prompt_ids"] + item[f"{side}_ids"]
        assert batch["input_ids"][r, :len(ids)].tolist() == ids
        assert batch["step_mask"][r].tolist() == [True] * n + [False] * (width - n)
        assert batch["step_labels"][r].tolist() == item[f"{side}_labels"] + [-1.0] * (width - n)
        for s, end in enumerate(item[f"{side}_steps"]):
            position = int(batch["step_positions"][r, s])
            assert position == len(item["prompt_ids"]) + end
            assert int(batch["input_ids"][r, position]) == item[f"{side}_ids"][end]
        assert batch["step_positions"][r, n:].tolist() == [0] * (width - n)


# -- 12. training -----------------------------------------------------------------------------------------------------


def test_prm_training_learns_and_saves(tmp_path, tiny_model_dir, demo_dir, pref_records):
    config = _prm_config(tmp_path, tiny_model_dir, demo_dir, eval_before_training=True, prm_aggregation="min",
                         max_steps=16)
    trainer, data = _prm_trainer(config, pref_records)
    collator = rlhf.ProcessPreferenceCollator(data.formatter.tokenizer.pad_token_id)
    before = _hand_step_accuracy(trainer.policy, data, collator)
    result = trainer.train()
    print(f"prm: eval {result.eval_before} -> {result.eval}")
    assert result.eval_before["eval/step_accuracy"] == pytest.approx(before)
    assert result.eval["eval/step_accuracy"] == pytest.approx(_hand_step_accuracy(trainer.policy, data, collator))
    # measured: loss 1.87 -> 1.13, pairwise accuracy 0.5 -> 0.875, step accuracy 0.82 -> 0.84 (most steps are right)
    assert result.eval["eval/loss"] < result.eval_before["eval/loss"] - 0.4
    assert result.eval["eval/accuracy"] > result.eval_before["eval/accuracy"]
    assert result.eval["eval/step_accuracy"] >= result.eval_before["eval/step_accuracy"]
    assert any("steps/accuracy" in row for row in result.history)

    out = Path(config.output_dir)
    saved = json.loads((out / rlhf.ProcessRewardModel.CONFIG_FILE).read_text())
    assert saved["step_delimiter"] == "\n" and saved["aggregation"] == "min"
    assert (out / rlhf.RewardModel.HEAD_FILE).is_file()
    loaded = rlhf.ProcessRewardModel.from_pretrained(str(out))
    assert loaded.step_delimiter == "\n" and loaded.aggregation == "min"
    batch = collator([data[i] for i in range(4)])
    inputs = [batch[k] for k in ("input_ids", "attention_mask", "step_positions")]
    device = next(trainer.policy.parameters()).device  # the trainer put it on a GPU if there is one
    with torch.no_grad():
        want = trainer.policy.step_logits(*(t.to(device) for t in inputs)).cpu()
        got = loaded.step_logits(*inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    other = rlhf.ProcessRewardModel.from_pretrained(str(out), aggregation="product")  # an explicit choice wins
    assert other.aggregation == "product" and other.step_delimiter == "\n"


def test_step_accuracy_is_reported_without_the_step_loss(tmp_path, tiny_model_dir, demo_dir, pref_records):
    config = _prm_config(tmp_path, tiny_model_dir, demo_dir, step_label_weight=0.0)
    trainer, data = _prm_trainer(config, pref_records)
    collator = rlhf.ProcessPreferenceCollator(data.formatter.tokenizer.pad_token_id)
    want = _hand_step_accuracy(trainer.policy, data, collator)
    assert want > 0.5  # the untrained head says "right" for most steps, and most steps are right
    assert trainer.evaluate()["eval/step_accuracy"] == pytest.approx(want)


# -- 13. as a reward function -----------------------------------------------------------------------------------------


def test_process_reward_from_the_factory_scores_exp_of_the_model(tmp_path, tiny_model_dir, demo_dir):
    prm_dir = tmp_path / "prm-model"
    model = rlhf.ProcessRewardModel.from_pretrained(str(tiny_model_dir), seed=1, aggregation="product")
    model.save_pretrained(prm_dir)
    config = rlhf.GRPOConfig(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "grpo"),
                             process_reward_model=str(prm_dir), reward_funcs=["process_reward_model"],
                             num_generations=2, per_device_train_batch_size=2, per_device_eval_batch_size=2)
    reward = rlhf.RewardFunctionFactory(config).build()
    records = [_record("What is 82 - 9?"), _record("Compute 49 - 2 - 2 + 5."), _record("What is 82 - 9?")]
    completions = ["82 - 9 = 73\nAnswer: 73", PAIR[1], "no steps here"]
    scores = rlhf._call_reward(reward, [r["messages"][-1]["content"] for r in records], completions,
                               [None] * 3, records)
    assert scores.shape == (3,) and bool(((scores >= 0) & (scores <= 1)).all())
    formatter = rlhf.ChatFormatter(model.tokenizer, "auto")
    want = []
    with torch.no_grad():
        for record, completion in zip(records, completions):  # one row at a time, no padding, no collator
            prompt = formatter.prompt_ids(record)
            ids, ends = rlhf.encode_steps(formatter, record, completion, "\n")
            logits = model.step_logits(torch.tensor([prompt + ids]),
                                       torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
                                       torch.tensor([[len(prompt) + e for e in ends]]))[0]
            want.append(math.exp(sum(_log_sigmoid(float(x)) for x in logits)))  # product of step probabilities
    torch.testing.assert_close(scores, torch.tensor(want), atol=1e-5, rtol=1e-4)
    assert reward.last_components["process_reward_model"].shape == (3,)


# -- 14. CLI ---------------------------------------------------------------------------------------------------------


def test_cli_prm_run(tmp_path, tiny_model_dir, demo_dir, capsys):
    status = rlhf.main(["prm", f"model_name_or_path={tiny_model_dir}", "dataset=demo_preference",
                        f"dataset_dir={demo_dir}", "max_samples=8", "per_device_train_batch_size=4", "max_steps=2",
                        "cutoff_len=96", f"output_dir={tmp_path / 'cli'}", "save_steps=0", "logging_steps=1",
                        "disable_progress_bar=true", "report_to=none", "finetuning_type=full",
                        "prm_step_labeler=arithmetic", "prm_aggregation=last", "step_delimiter=\\n"])
    assert status == 0, capsys.readouterr().err
    out = tmp_path / "cli"
    saved = json.loads((out / rlhf.ProcessRewardModel.CONFIG_FILE).read_text())
    assert saved["aggregation"] == "last" and saved["step_delimiter"] == "\n"  # \n on the command line is a newline
    entry = json.loads((out / "report.json").read_text())["stages"][-1]
    assert entry["stage"] == "prm" and entry["global_step"] == 2


def test_cli_prm_bad_aggregation_is_one_line(tmp_path, capsys):
    assert rlhf.main(["prm", "prm_aggregation=mean", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "prm_aggregation" in err and "min, product, last" in err and "Traceback" not in err


def test_process_reward_cuts_to_cutoff_len_and_scores_only_the_kept_steps(tiny_model_dir):
    model = rlhf.ProcessRewardModel.from_pretrained(str(tiny_model_dir), seed=1, aggregation="product")
    record = _record()
    formatter = rlhf.ChatFormatter(model.tokenizer, "auto")
    prompt = formatter.prompt_ids(record)
    ids, ends = rlhf.encode_steps(formatter, record, PAIR[1], "\n")
    with torch.no_grad():
        logits = model.step_logits(torch.tensor([prompt + ids]),
                                   torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
                                   torch.tensor([[len(prompt) + e for e in ends]]))[0]
    cutoff = len(prompt) + ends[1] + 3  # the first two steps fit, a bit of the third (a short prompt is kept whole)
    cut = rlhf.ProcessReward(model, cutoff_len=cutoff)
    kept_prompt, kept_ids, kept_ends = cut.encode(record, PAIR[1])
    assert len(kept_prompt) + len(kept_ids) <= cutoff and kept_ends == ends[:2]
    score = float(cut([record["messages"][-1]["content"]], [PAIR[1]], [None], [record])[0])
    # causal attention: the kept steps' logits are the full sequence's
    assert score == pytest.approx(math.exp(sum(_log_sigmoid(float(x)) for x in logits[:2])), rel=1e-4)
    whole = float(rlhf.ProcessReward(model, cutoff_len=4096)([record["messages"][-1]["content"]], [PAIR[1]], [None],
                                                            [record])[0])
    assert whole == pytest.approx(math.exp(sum(_log_sigmoid(float(x)) for x in logits)), rel=1e-4)
