"""The research tools in experiments/: their shared paired tests (stats.py), careless_breakdown.py's pooled row,
combine_seeds.py's pooling of inference_demo runs, inference_demo.py's allocation rules, make_onpolicy_pairs.py's
prompt loading and mixing, rm_probe.py's flaw split; and the careless-teacher configs in experiments/configs/.
The tools are scripts, loaded with conftest.load_script."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

import rlhf

pytestmark = pytest.mark.usefixtures("keeps_torch_threads")  # the tools' main() set the thread count

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stats():
    return load_script("experiments/stats.py")


@pytest.fixture(scope="module")
def breakdown():
    return load_script("experiments/careless_breakdown.py")


@pytest.fixture(scope="module")
def combine_seeds():
    return load_script("experiments/combine_seeds.py")


@pytest.fixture(scope="module")
def demo():
    return load_script("experiments/inference_demo.py")


@pytest.fixture(scope="module")
def script():
    return load_script("experiments/make_onpolicy_pairs.py")


@pytest.fixture(scope="module")
def probe():
    return load_script("experiments/rm_probe.py")


# -- stats.py: the exact McNemar test every demo study uses to call a difference shown or not ----------------------


def test_mcnemar_counts_discordant_prompts_and_gives_the_exact_binomial_p(stats):
    a = [True, True, True, False, False, True]
    b = [True, False, False, False, True, True]
    # discordant: a alone right at 1 and 2, b alone right at 4 -> 2 vs 1;
    # two-sided exact p = 2 * P(X <= 1), X ~ Bin(3, 1/2)
    assert stats.mcnemar(a, b) == (2, 1, 1.0)  # 2 * (1 + 3) / 8 = 1.0, capped at 1
    five_to_none = [True] * 5 + [False] * 3
    assert stats.mcnemar(five_to_none, [False] * 8) == (5, 0, 2 / 32)
    # 20 better, 11 worse (the README's round-2 PPO row): 2 * sum_{i<=11} C(31, i) / 2^31
    a = [True] * 20 + [False] * 11 + [True] * 50
    b = [False] * 20 + [True] * 11 + [True] * 50
    wins, losses, p = stats.mcnemar(a, b)
    assert (wins, losses) == (20, 11)
    assert abs(p - 0.1496) < 5e-4


def test_mcnemar_without_discordant_prompts_is_p_one(stats):
    assert stats.mcnemar([True, False], [True, False]) == (0, 0, 1.0)


# -- careless_breakdown.py: seeds of one recipe pooled and tested against the first policy -------------------------


def test_pooled_row_by_hand(breakdown):
    classes = ["1-step", "1-step", "1-step borrow", "multi", "multi borrow", "1-step borrow"]
    baseline = [True, True, False, True, False, False]
    run_a = [True, False, True, True, False, True]   # +2 prompts, -1
    run_b = [True, True, True, True, True, False]    # +2 prompts
    row = breakdown.pooled_row([baseline, run_a, run_b], classes, [9, 3, 2], columns=7, resamples=20000, seed=0)
    assert row[:7] == ["mean of 2 runs", "75.0%", "75.0%", "75.0%", "100.0%", "50.0%", "2.5"]
    # per prompt: 0, -0.5, +1, 0, +0.5, +0.5 -> +1.5 over 6 prompts = +25 points
    assert row[7].startswith("+25.0 pts, sign-flip p=")
    differences = [0.5, 1.0, 0.5, 0.5]  # the non-zero ones, up to sign
    observed = abs(-0.5 + 1.0 + 0.5 + 0.5)
    exact = sum(abs(sum(s * d for s, d in zip(signs, differences))) >= observed - 1e-12
                for signs in itertools.product((1, -1), repeat=4)) / 16
    assert float(row[7].split("p=")[1]) == pytest.approx(exact, abs=0.02)


def test_pooled_row_pads_the_sampled_columns(breakdown):
    row = breakdown.pooled_row([[True, False], [True, False]], ["1-step", "multi"], [0, 0], columns=9, resamples=100,
                               seed=0)
    assert len(row) == 10 and row[7:9] == ["", ""] and row[3] == "-"  # no borrow problems here
    assert row[9] == "+0.0 pts, sign-flip p=1"


def test_pool_end_to_end_and_its_errors(breakdown, sft_model, monkeypatch, capsys):
    policy = str(sft_model)
    monkeypatch.setattr(sys, "argv", ["careless_breakdown.py", "--pool", "--threads", "1",
                                      "--policies", ",".join([policy] * 3)])
    assert breakdown.main() == 0
    out = capsys.readouterr().out
    assert "mean of 2 runs" in out and "+0.0 pts, sign-flip p=1" in out  # the same policy thrice: nothing ahead
    monkeypatch.setattr(sys, "argv", ["careless_breakdown.py", "--pool", "--policies", policy])
    with pytest.raises(SystemExit) as error:
        breakdown.main()
    assert error.value.code == 2
    assert "--pool needs the baseline policy and at least one run" in capsys.readouterr().err


# -- combine_seeds.py: several inference_demo runs pooled per prompt, and the sign-flip test -----------------------


def test_sign_flip_p_matches_the_exact_value(stats):
    # five prompts all +1: of the 2^5 sign patterns only all-plus and all-minus are as extreme -> 2/32
    assert stats.sign_flip_p([1.0] * 5, 20000, 0) == pytest.approx(2 / 32, abs=0.006)
    # differences of 0 carry no information. +0.5, -0.5 and +1 (observed |sum| 1), over the 8 sign patterns:
    # the two halves cancel in 4 patterns (sum +-1, both as extreme), add to +-1 in the other 4 (sum 2 or 0,
    # -2 or 0: 2 of them as extreme) -> 6/8
    assert stats.sign_flip_p([0.0, 0.5, -0.5, 1.0], 20000, 0) == pytest.approx(0.75, abs=0.02)
    assert stats.sign_flip_p([0.0, 0.0], 100, 0) == 1.0


def test_per_prompt_mean_averages_each_prompt_over_the_runs(stats):
    assert stats.per_prompt_mean([[True, False, True], [True, True, False]]) == [1.0, 0.5, 0.5]


def seed_run(seed: int, greedy: list[bool], method: list[bool], n: int = 8) -> dict:
    settings = {"seed": seed, "output": f"s{seed}.json", "n": n, "policy": "p"}
    rows = [{"method": "Greedy", "prompts": "eval (4)", "accuracy": 100 * sum(greedy) / 4, "correct": greedy},
            {"method": "MCTS + PRM value", "prompts": "eval (4)", "accuracy": 100 * sum(method) / 4,
             "correct": method, "claim": 2, "versus": 0}]
    return {"settings": settings, "rows": rows}


def test_combine_reports_the_mean_over_runs_against_the_claims_baseline(combine_seeds):
    greedy = [True, False, False, False]
    runs = [seed_run(0, greedy, [True, True, False, False]), seed_run(1, greedy, [True, True, True, False])]
    (row,) = combine_seeds.combine(runs, 2000, 0)
    assert row[:6] == ["2", "MCTS + PRM value", "eval (4)", "Greedy", "25.0%", "62.5%"]
    assert row[6] == "50.0 / 75.0"
    assert row[7].startswith("+37.5 pts")  # per prompt: 0, +1, +0.5, 0


def test_runs_that_differ_in_more_than_the_seed_are_refused(combine_seeds, tmp_path):
    greedy = [True, False, False, False]
    a, b = seed_run(0, greedy, greedy), seed_run(1, greedy, greedy)
    b["settings"]["policy"] = "other"
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    with pytest.raises(SystemExit, match=r"b.json: settings differ from .*a.json in policy"):
        combine_seeds.load_runs(paths)
    del b["rows"][0]["correct"]
    b["settings"]["policy"] = "p"
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="no per-prompt flags"):
        combine_seeds.load_runs(paths)


def test_stopping_at_equal_accuracy_holds_with_three_runs(combine_seeds):
    """Claim 4 compares counts: with 3 runs per-prompt means like 1/3 are inexact floats, and equal accuracy must
    still read as 'no lower'."""
    base = [True, False, True, False, True]
    runs = []
    for seed, flags in enumerate([[False, True, True, False, True], [True, False, True, False, True],
                                  [True, False, False, True, True]]):
        data = seed_run(seed, base, flags)
        data["rows"][1].update(claim=4, method="Confidence stopping + majority", mean_samples=3.0)
        runs.append(data)
    (row,) = combine_seeds.combine(runs, 200, 0)
    assert row[7].startswith("+0.0 pts") and row[7].endswith("62% fewer samples") and row[8] == "holds"


def test_a_seed_twice_or_another_row_layout_is_refused(combine_seeds, tmp_path):
    greedy = [True, False, False, False]
    a, b = seed_run(0, greedy, greedy), seed_run(0, greedy, greedy)
    paths = []
    for name, data in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    with pytest.raises(SystemExit, match="a seed given twice"):
        combine_seeds.load_runs(paths)
    b = seed_run(1, greedy, greedy)
    b["rows"][1]["method"] = "Something else"
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="its rows are not those of"):
        combine_seeds.load_runs(paths)
    (tmp_path / "b.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not an inference_demo --output file"):
        combine_seeds.load_runs(paths)


# -- inference_demo.py: allocation under reward-model reranking, on cases worked out by hand -----------------------


def test_adaptive_reranked_spends_the_budget_where_the_pilot_scores_low(demo):
    """4 prompts, 2 samples each (8 in all), a 1-sample pilot. The best pilot scores are 5, 4, 1, 2; their
    median (the upper middle, 4) leaves shortfalls 0, 0, 3, 2, so the 4 further samples go to the last two
    prompts 3:2: 2.4 and 1.6 give 2 and 1, and the one left over is shared again 3:2 and goes to the larger
    remainder (AdaptiveComputeAllocator). Each prompt answers with its highest-scored sample."""
    scores = [[5, 0, 0, 0], [4, 0, 0, 0], [1, 2, 3, 0], [2, 1, 0, 3]]
    ok = [[True, False, False, False], [True, False, False, False], [False, False, True, False],
          [False, False, False, True]]
    args = argparse.Namespace(budget_per_prompt=2, pilot=1, max_per_prompt=4)
    result = demo.adaptive_vs_uniform_reranked(scores, ok, args)
    assert result["shares"] == [1, 1, 4, 2] and result["total"] == 8 and result["hard"] == 2
    assert result["adaptive"] == [True, True, True, False]  # prompt 3's right sample is its 4th, not reached
    assert result["uniform"] == [True, True, False, False]  # the best of the first 2 samples


def test_lowest_share_gives_the_extra_samples_evenly_to_the_lowest_scored_prompts(demo):
    """The same 4 prompts with the lowest-scored half flagged: best pilot scores 5, 4, 1, 2 flag prompts 2
    and 3, which share the 4 further samples evenly (2 each, 3 samples apiece); with a cap of 2 per prompt
    the flagged are full after 1 each and the 2 left over go evenly to the others."""
    scores = [[5, 0, 0, 0], [4, 0, 0, 0], [1, 2, 3, 0], [2, 1, 0, 3]]
    ok = [[True, False, False, False], [True, False, False, False], [False, False, True, False],
          [False, False, False, True]]
    assert demo.lowest_share_difficulty(scores, 0.5, pilot=1) == [0.0, 0.0, 1.0, 1.0]
    assert demo.lowest_share_difficulty(scores, 0.25, pilot=1) == [0.0, 0.0, 1.0, 0.0]
    # with a 2-sample pilot the best pilot scores are 5, 4, 2, 2: a tie is broken by prompt order
    assert demo.lowest_share_difficulty(scores, 0.25, pilot=2) == [0.0, 0.0, 1.0, 0.0]
    args = argparse.Namespace(budget_per_prompt=2, pilot=1, max_per_prompt=4)
    flags, shares = demo.reranked_allocation(scores, ok, [0.0, 0.0, 1.0, 1.0], args, max_per_prompt=4)
    assert shares == [1, 1, 3, 3] and flags == [True, True, True, False]
    flags, shares = demo.reranked_allocation(scores, ok, [0.0, 0.0, 1.0, 1.0], args, max_per_prompt=2)
    assert shares == [2, 2, 2, 2] and flags == [True, True, False, False]


# -- make_onpolicy_pairs.py: answers for prompts without one, duplicates once, skipped prompts out -----------------


@pytest.mark.parametrize(("prompt", "answer"), [("What is 52 - 7?", "45"), ("What is 95 + 5?", "100"),
                                                ("Compute 12 + 7 - 5.", "14"), ("Compute 90 - 7 + 4 - 30.", "57"),
                                                ("Say hello.", None)])
def test_demo_answer(script, prompt, answer):
    assert script.demo_answer(prompt) == answer


def test_demo_answer_agrees_with_every_demo_file_that_has_answers(script):
    for name in ("eval.jsonl", "rl_prompts.jsonl", "multistep.jsonl"):
        for line in (REPO / "data/demo" / name).read_text().splitlines():
            record = json.loads(line)
            assert script.demo_answer(record["prompt"]) == str(record["answer"]), (name, record)


def test_load_prompts_skips_dedupes_and_fills_answers(script, tmp_path):
    first = tmp_path / "rl.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is 52 - 7?", "answer": "45"}, {"prompt": "What is 10 + 3?", "answer": "13"}]))
    second = tmp_path / "sft.jsonl"
    second.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is 61 - 2?", "response": "61 - 2 = 59"}, {"prompt": "What is 52 - 7?", "response": "x"},
        {"prompt": "What is 10 + 3?", "response": "y"}, {"prompt": "Compute 1 + 2 + 3.", "response": "z"}]))
    records = script.load_prompts([str(first), str(second)], skip=1)
    # 52 - 7 is skipped in the first file and so kept out of the second; 61 - 2 is the second file's skipped line
    assert records == [{"prompt": "What is 10 + 3?", "answer": "13"}, {"prompt": "Compute 1 + 2 + 3.", "answer": "6"}]


def test_load_prompts_names_the_line_without_an_answer(script, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: no 'answer'"):
        script.load_prompts([str(path)], skip=0)


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "What is 1 + 2?"}\nnot json\n', r"bad.jsonl:2: not JSON"),
    ('{"prompt": "What is 1 + 2?"}\n\n{"question": "What is 1 + 2?"}\n', r"bad.jsonl:3: no 'prompt' string"),
    ('["What is 1 + 2?"]\n', r"bad.jsonl:1: no 'prompt' string"),
])
def test_load_prompts_names_the_bad_line(script, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        script.load_prompts([str(path)], skip=0)


def test_a_missing_prompt_file_is_one_line_from_the_command(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    (tmp_path / "config.json").write_text("{}")  # the prompts are read before the policy loads
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "make_onpolicy_pairs.py"), "--policy",
                           str(tmp_path), "--prompts", str(missing)], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"{missing}: cannot read it (No such file or directory); give JSONL files with a " \
                                  "'prompt' per line"


def test_a_directory_without_a_model_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "make_onpolicy_pairs.py"), "--policy",
                           str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"--policy {tmp_path}: no model there (no config.json); "
                                                         "give a directory saved by rlhf.py")


def test_mix_writes_the_given_pairs_and_the_new_ones_shuffled(script, tiny_model_dir, tmp_path):
    """End to end on the tiny model: mixed.jsonl holds every line of the --mix files and every new pair, in
    an order fixed by --seed, and dataset_info.json registers both files."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(20, 24)))
    extra = tmp_path / "extra.jsonl"
    given = [{"prompt": f"What is {a} - 7?", "chosen": f"{a} - 7 = {a - 7}\nAnswer: {a - 7}",
              "rejected": f"{a} - 7 = {a + 3}\nAnswer: {a + 3}"} for a in range(50, 62)]
    extra.write_text("".join(json.dumps(p) + "\n" for p in given))
    outs = []
    for name in ("a", "b"):
        args = ["--policy", str(tiny_model_dir), "--prompts", str(prompts), "--samples", "4", "--temperature", "1.0",
                "--mix", str(extra), "--out", str(tmp_path / name)]
        assert script.main(args) == 0
        outs.append(tmp_path / name)
    new = (outs[0] / "pairs.jsonl").read_text().splitlines()
    mixed = (outs[0] / "mixed.jsonl").read_text().splitlines()
    assert sorted(mixed) == sorted([json.dumps(p) for p in given] + new)
    assert mixed != [json.dumps(p) for p in given] + new  # shuffled
    assert (outs[1] / "mixed.jsonl").read_text() == (outs[0] / "mixed.jsonl").read_text()
    info = json.loads((outs[0] / "dataset_info.json").read_text())
    assert info["onpolicy_mixed"]["file_name"] == "mixed.jsonl" and info["onpolicy_pairs"]["file_name"] == "pairs.jsonl"


def test_a_mix_record_that_is_not_a_pair_names_its_line(script, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?", "chosen": "Answer: 2", "rejected": "Answer: 3"}) + "\n"
                    + json.dumps({"prompt": "What is 1 + 2?", "response": "Answer: 3"}) + "\n")
    with pytest.raises(SystemExit, match=r"sft.jsonl:2: no 'chosen' string"):
        script.read_pair_lines(str(path))


# -- rm_probe.py: each held-out pair in the row of the digit its rejected answer gets wrong ------------------------


@pytest.mark.parametrize(
    ("chosen", "rejected", "kind", "digit"),
    [
        ("66 + 3 = 69\nAnswer: 69", "66 + 3 = 59\nAnswer: 59", "arithmetic", "tens"),
        ("66 + 3 = 69\nAnswer: 69", "66 + 3 = 70\nAnswer: 70", "arithmetic", "units"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48\nAnswer: 58", "format", "tens"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48\nAnswer: 46", "format", "units"),
        ("52 - 4 = 48\nAnswer: 48", "52 - 4 = 48", "format", None),
        # the careless teacher's forgotten borrow, carried into the next step
        ("Step 1: 52 - 7 = 45\nStep 2: 45 + 3 = 48\nAnswer: 48",
         "Step 1: 52 - 7 = 55\nStep 2: 55 + 3 = 58\nAnswer: 58", "arithmetic", "tens"),
        ("Step 1: 95 + 5 = 100\nStep 2: 100 - 1 = 99\nAnswer: 99",
         "Step 1: 95 + 5 = 90\nStep 2: 90 - 1 = 89\nAnswer: 89", "arithmetic", "tens"),
    ],
)
def test_flaw_kind_and_wrong_digit(probe, chosen, rejected, kind, digit):
    assert probe.flaw_kind(rejected) == kind
    assert probe.wrong_digit(chosen, rejected) == digit


def test_flaw_rows_partition_the_demo_pairs(probe):
    """Each kind's rows split it without overlap, and the digit rows agree with the slip the generator made
    (its FLAW_DELTAS: 1 or 2 is the units digit, 10 the tens)."""
    pairs = [json.loads(line) for line in (REPO / "data/demo/preference.jsonl").read_text().splitlines()]
    rows = dict(probe.flaw_rows(pairs))
    assert sorted(rows["all"]) == list(range(len(pairs)))
    assert sorted(rows["format"] + rows["arithmetic"]) == rows["all"]
    assert sorted(rows["  no Answer line"] + rows["  Answer disagrees in the units digit"]
                  + rows["  Answer disagrees in the tens digit"]) == rows["format"]
    assert sorted(rows["  wrong units digit"] + rows["  wrong tens digit"]) == rows["arithmetic"]
    assert all(len(indices) > 20 for indices in rows.values())
    for i in rows["  wrong tens digit"] + rows["  Answer disagrees in the tens digit"]:
        assert "Answer:" in pairs[i]["rejected"]
        last_right = int(pairs[i]["chosen"].rsplit(" ", 1)[1])
        assert abs(int(pairs[i]["rejected"].rsplit(" ", 1)[1]) - last_right) == 10


def test_main_prints_a_training_pair_column_per_reward_model(probe, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """End to end on the tiny model: two reward models and --train-pairs give two training-pair columns;
    --policy-pairs a row for a make_onpolicy_pairs directory, counting its pairs."""
    import rlhf

    for seed in (1, 2):
        rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=seed).save_pretrained(tmp_path / f"rm-{seed}")
    models = f"{tmp_path / 'rm-1'},{tmp_path / 'rm-2'}"
    pairs_dir = tmp_path / "pairs"
    pairs_dir.mkdir()
    pair = {"prompt": "What is 52 - 7?", "chosen": "52 - 7 = 45\nAnswer: 45", "rejected": "52 - 7 = 55\nAnswer: 55"}
    (pairs_dir / "pairs.jsonl").write_text((json.dumps(pair) + "\n") * 3)
    (pairs_dir / "dataset_info.json").write_text(json.dumps({"onpolicy_pairs": {
        "file_name": "pairs.jsonl", "ranking": True,
        "columns": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}}}))
    monkeypatch.setenv("COLUMNS", "1000")  # wide enough that no header is cut
    monkeypatch.setattr(sys, "argv", ["rm_probe.py", "--policy", str(tiny_model_dir), "--reward-models", models,
                                      "--train-pairs", "6", "--val-size", "20", "--threads", "1",
                                      "--policy-pairs", str(pairs_dir)])
    assert probe.main() == 0
    out = capsys.readouterr().out
    assert out.count("on 6 training pairs") == 2, out
    row = next(line for line in out.splitlines() if f"policy samples, {pairs_dir}" in line)
    assert " 3 " in row


def test_policy_pairs_without_a_pairs_directory_is_one_line(probe, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rm_probe.py", "--policy", str(tiny_model_dir), "--reward-models",
                                      str(tiny_model_dir), "--policy-pairs", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--policy-pairs .*no dataset_info.json there"):
        probe.main()


def test_tens_digit_pairs_are_the_habit_and_an_invented_borrow(probe):
    """Every eval single-step subtraction lands in exactly one probe: a borrow problem against the habit
    (10 too high), a problem without one against a borrow taken anyway (10 too low); the chosen answer is
    the eval file's own."""
    eval_path = REPO / "data/demo/eval.jsonl"
    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"] for line in eval_path.read_text().splitlines()}
    pairs = probe.tens_digit_pairs(eval_path)
    habit, invented = pairs["borrow, vs the habit (+10)"], pairs["no borrow, vs a borrow (-10)"]
    assert len(habit) > 30 and len(invented) > 30
    assert not {p["messages"][0]["content"] for p in habit} & {p["messages"][0]["content"] for p in invented}
    for pair, delta in [(p, 10) for p in habit] + [(p, -10) for p in invented]:
        prompt = pair["messages"][0]["content"]
        right = int(pair["chosen"].rsplit(" ", 1)[1])
        assert str(right) == answers[prompt] and " - " in prompt
        assert int(pair["rejected"].rsplit(" ", 1)[1]) == right + delta
    def needs_borrow(pair: dict) -> bool:  # "What is 52 - 7?": 2 units cannot give 7
        words = pair["messages"][0]["content"].split()
        return int(words[2]) % 10 < int(words[4].rstrip("?"))

    assert all(needs_borrow(p) for p in habit) and not any(needs_borrow(p) for p in invented)


# -- experiments/configs/: the careless-teacher studies load and differ from each other only where they say --------


def test_careless_demo_config_loads(repo):
    """The careless-teacher demo trains on the careless files and scores the same held-out prompts."""
    pipeline = rlhf.PipelineConfig.load(repo / "experiments" / "configs" / "demo_careless.yaml")
    assert pipeline.stages == ["sft", "dpo", "grpo"]
    sft, dpo, grpo = (pipeline.stage_config(name) for name in pipeline.stages)
    assert sft.dataset == "demo_sft_careless" and dpo.dataset == "demo_preference_careless"
    assert grpo.dataset == "demo_rl" and grpo.reward_names() == ["exact_answer"]
    assert {sft.eval_dataset, dpo.eval_dataset, grpo.eval_dataset} == {"demo_eval"}
    assert sft.output_dir == str(rlhf.Path("outputs/demo_careless/sft"))
    info = json.loads((repo / "data" / "demo" / "dataset_info.json").read_text())
    assert {sft.dataset, dpo.dataset} <= set(info)


def test_careless_reward_and_ppo_configs_load(repo):
    """experiments/configs/rm_careless.yaml trains the careless demo's boosted reward models on the pairs that reject
    the habit; experiments/configs/ppo_careless.yaml runs PPO on the learned reward alone, from the careless SFT
    model."""
    rm = rlhf.load_config(rlhf.RewardModelConfig, repo / "experiments" / "configs" / "rm_careless.yaml")
    assert rm.dataset == "demo_rm_careless" and rm.ensemble_size == 4 and rm.ensemble_strategy == "boosting"
    assert rm.output_dir == "outputs/demo_careless/rm" and rm.val_split_by_prompt
    ppo = rlhf.load_config(rlhf.PPOConfig, repo / "experiments" / "configs" / "ppo_careless.yaml")
    assert ppo.model_name_or_path == "outputs/demo_careless/sft" and ppo.reward_funcs == []
    assert (ppo.reward_model == "outputs/demo_careless/rm_combined"
            and ppo.value_model.startswith("outputs/demo_careless/rm"))
    info = json.loads((repo / "data" / "demo" / "dataset_info.json").read_text())
    assert rm.dataset in info and info[rm.dataset]["ranking"] is True


def test_careless_verifier_config_is_rm_careless_from_the_clean_sft_model_on_the_mixed_pairs(repo):
    """experiments/configs/rm_careless_verifier.yaml differs from rm_careless.yaml only in its start (the clean demo's
    SFT model), its data (make_onpolicy_pairs' onpolicy_mixed) and where it writes."""
    base = rlhf.load_config(rlhf.RewardModelConfig, repo / "experiments" / "configs" / "rm_careless.yaml")
    verifier = rlhf.load_config(rlhf.RewardModelConfig, repo / "experiments" / "configs" / "rm_careless_verifier.yaml")
    differ = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(verifier, f.name)}
    assert differ == {"model_name_or_path", "dataset", "dataset_dir", "output_dir"}
    assert verifier.model_name_or_path == "outputs/demo_ensemble/sft" and verifier.dataset == "onpolicy_mixed"


def test_careless_online_ppo_config_is_ppo_careless_at_grpos_budget_of_samples(repo):
    """experiments/configs/ppo_careless_online.yaml is ppo_careless.yaml with GRPO's budget of samples (64 prompts per
    rollout, each answer trained on once, 300 steps: 19,200 samples), the online loop's round-3 verifier and a
    fixed KL coefficient."""
    base = rlhf.load_config(rlhf.PPOConfig, repo / "experiments" / "configs" / "ppo_careless.yaml")
    online = rlhf.load_config(rlhf.PPOConfig, repo / "experiments" / "configs" / "ppo_careless_online.yaml")
    differ = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(online, f.name)}
    assert differ == {"reward_model", "value_model", "per_device_train_batch_size", "ppo_epochs", "learning_rate",
                      "max_steps", "eval_steps", "save_steps", "output_dir", "adap_kl_ctrl", "init_kl_coef"}
    assert not online.adap_kl_ctrl and online.init_kl_coef == 0.2
    rollouts = online.max_steps // (online.ppo_epochs * online.ppo_buffer_size)
    assert rollouts * online.per_device_train_batch_size * online.ppo_buffer_size == 19_200
    assert online.reward_model == "outputs/demo_careless/rm_round3"
    assert online.value_model == "outputs/demo_careless/rm_round3/member-0"


# -- online_rl_family.py and the tool-use demo -----------------------------------------------------------------------


def test_every_online_rl_family_command_is_a_valid_config(tmp_path):
    """Each method's command line builds its stage's config (nothing runs): one budget, each method's own knobs."""
    family = load_script("experiments/online_rl_family.py")
    args = argparse.Namespace(sft="outputs/demo_careless/sft", teacher="outputs/demo_tools/sft", steps=150, set=[],
                              suffix="", output_root=str(tmp_path))
    configs = {}
    for method in family.METHODS:
        argv = family.command(method, args, seed=0)
        stage = argv[2]
        configs[method] = rlhf.load_config(rlhf.STAGE_CONFIGS[stage], overrides=argv[3:])
        assert configs[method].max_steps == 150 and configs[method].model_name_or_path == args.sft
    assert (configs["rloo"].advantage_estimator == "rloo"
            and configs["reinforce_pp"].advantage_estimator == "reinforce_pp")
    assert configs["gspo"].importance_sampling_level == "sequence" and configs["cispo"].loss_type == "cispo"
    assert configs["dapo"].dynamic_sampling and configs["dapo"].overlong_buffer_len == 16
    assert configs["distill"].teacher_model == args.teacher
    group = [configs[m] for m in ("grpo", "rloo", "reinforce_pp", "gspo", "cispo", "dapo")]
    assert {c.per_device_train_batch_size * c.gradient_accumulation_steps for c in group} == {64}
    assert configs["online_dpo"].per_device_train_batch_size * 2 == 64  # the same 64 samples a step


def test_tool_use_demo_config_matches_its_data(repo, tiny_tokenizer):
    """experiments/configs/demo_tools.yaml: SFT on the demo and the tool demonstrations, then GRPO with the
    calculator, whose tags read the demonstrations' calls and write what they show as the tool's answer."""
    pipeline = rlhf.PipelineConfig.load(repo / "experiments" / "configs" / "demo_tools.yaml")
    sft, grpo = (pipeline.stage_config(name) for name in pipeline.stages)
    assert sft.dataset == "demo_sft,demo_tool_sft" and grpo.dataset == "demo_tool_rl"
    assert grpo.environment == "calculator" and grpo.eval_dataset == "demo_tool_multistep"
    demonstration = json.loads((repo / "data" / "demo" / "tool_sft.jsonl").read_text().splitlines()[1])["response"]
    first_step = demonstration.split("\n")[0]  # Step 1: <<88 + 8>> = 96
    call_text = first_step[:first_step.index(grpo.tool_tags[1]) + len(grpo.tool_tags[1])]
    environment = rlhf.environment_factory(grpo)()
    environment.reset({})
    observation, _, done = environment.step(call_text)
    assert call_text + observation == first_step and not done
    longest = max(len(tiny_tokenizer(json.loads(line)["response"])["input_ids"])
                  for line in (repo / "data/demo/tool_sft.jsonl").open())
    assert longest + 1 <= grpo.max_completion_length  # the longest demonstration and its end-of-turn token fit
