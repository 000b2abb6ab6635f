"""Checks for the bundled demo data in data/demo/.

The answers are recomputed here from the prompt text with an evaluator that
shares no code with the generator, so a generator bug cannot vouch for itself.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"

KEYS = {
    "sft.jsonl": ["prompt", "response"],
    "preference.jsonl": ["prompt", "chosen", "rejected"],
    "rm_pairs.jsonl": ["prompt", "chosen", "rejected"],
    "sft_careless.jsonl": ["prompt", "response"],
    "preference_careless.jsonl": ["prompt", "chosen", "rejected"],
    "rm_pairs_careless.jsonl": ["prompt", "chosen", "rejected"],
    "kto.jsonl": ["prompt", "response", "label"],
    "rl_prompts.jsonl": ["prompt", "answer", "verifiable"],
    "multistep.jsonl": ["prompt", "answer", "verifiable", "steps"],
    "eval.jsonl": ["prompt", "answer", "verifiable"],
    "tool_sft.jsonl": ["system", "prompt", "response"],
    "tool_rl_prompts.jsonl": ["system", "prompt", "answer", "verifiable"],
    "tool_multistep.jsonl": ["system", "prompt", "answer", "verifiable", "steps"],
}
COUNTS = {
    "sft.jsonl": 3000,
    "preference.jsonl": 1500,
    "rm_pairs.jsonl": 12000,
    "sft_careless.jsonl": 3000,
    "preference_careless.jsonl": 1500,
    "rm_pairs_careless.jsonl": 12000,
    "kto.jsonl": 1500,
    "rl_prompts.jsonl": 800,
    "multistep.jsonl": 200,
    "eval.jsonl": 300,
    "tool_sft.jsonl": 1000,
    "tool_rl_prompts.jsonl": 800,
    "tool_multistep.jsonl": 200,
}
ALL_FILES = sorted([*KEYS, "dataset_info.json", "README.md"])
TRAIN_FILES = ["sft.jsonl", "preference.jsonl", "rm_pairs.jsonl", "sft_careless.jsonl",
               "preference_careless.jsonl", "rm_pairs_careless.jsonl", "kto.jsonl", "rl_prompts.jsonl",
               "tool_sft.jsonl", "tool_rl_prompts.jsonl"]
HELDOUT_FILES = ["eval.jsonl", "multistep.jsonl"]

SINGLE_RE = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
MULTI_RE = re.compile(r"Compute (\d+)((?: [+-] \d+){2,3})\.")
STEP_RE = re.compile(r"(?:Step \d+: )?(\d+) ([+-]) (\d+) = (-?\d+)")


def _load_generator():
    """Import scripts/make_demo_data.py, which is a script rather than a package."""
    path = ROOT / "scripts" / "make_demo_data.py"
    spec = importlib.util.spec_from_file_location("make_demo_data", path)
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@functools.cache
def records(name: str) -> list[dict]:
    text = (DEMO / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def parse(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    """Split a prompt into its first operand and (op, operand) pairs."""
    if m := SINGLE_RE.fullmatch(prompt):
        return int(m[1]), [(m[2], int(m[3]))]
    m = MULTI_RE.fullmatch(prompt)
    assert m, f"unparseable prompt: {prompt!r}"
    return int(m[1]), [(op, int(b)) for op, b in re.findall(r"([+-]) (\d+)", m[2])]


def calc(left: int, op: str, right: int) -> int:
    return left + right if op == "+" else left - right


def step_is_right(m: re.Match) -> bool:
    """Whether a STEP_RE match states a true equation."""
    return calc(int(m[1]), m[2], int(m[3])) == int(m[4])


def reference_steps(prompt: str) -> list[tuple[int, str, int, int]]:
    """Evaluate the prompt left to right, independently of the generator."""
    left, ops = parse(prompt)
    steps = []
    for op, right in ops:
        result = calc(left, op, right)
        steps.append((left, op, right, result))
        left = result
    return steps


def truth(prompt: str) -> int:
    return reference_steps(prompt)[-1][3]


def reference_response(prompt: str) -> str:
    steps = reference_steps(prompt)
    multi = len(steps) > 1
    lines = [
        (f"Step {i}: " if multi else "") + f"{a} {op} {b} = {r}"
        for i, (a, op, b, r) in enumerate(steps, 1)
    ]
    return "\n".join([*lines, f"Answer: {steps[-1][3]}"])


def single_triple(prompt: str) -> tuple[int, str, int] | None:
    m = SINGLE_RE.fullmatch(prompt)
    return (int(m[1]), m[2], int(m[3])) if m else None


def heldout_triples() -> set[tuple[int, str, int]]:
    return {
        t
        for name in HELDOUT_FILES
        for r in records(name)
        if (t := single_triple(r["prompt"]))
    }


def training_texts() -> list[str]:
    """Every response-like string a training stage could learn from; a calculator call ``<<a op b>> = r`` is read
    as the step ``a op b = r`` it works out."""
    return [
        r[key].replace("<<", "").replace(">>", "")
        for name in TRAIN_FILES
        for r in records(name)
        for key in ("response", "chosen", "rejected")
        if key in r
    ]


def test_regeneration_is_byte_identical(tmp_path):
    counts = gen.generate(tmp_path, seed=0)
    assert counts == COUNTS
    assert sorted(p.name for p in tmp_path.iterdir()) == ALL_FILES
    for name in ALL_FILES:
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), (
            f"{name} is stale"
        )


def test_other_seed_differs(tmp_path):
    gen.generate(tmp_path, seed=1)
    assert (tmp_path / "sft.jsonl").read_bytes() != (DEMO / "sft.jsonl").read_bytes()


@pytest.mark.parametrize("name", sorted(KEYS))
def test_lines_are_json_with_exact_keys(name):
    text = (DEMO / name).read_text(encoding="utf-8")
    assert text.endswith("\n") and "\n\n" not in text
    rows = records(name)
    assert len(rows) == COUNTS[name]
    for row in rows:
        assert list(row) == KEYS[name]
        for key in ("prompt", "response", "chosen", "rejected", "answer"):
            if key in row:
                assert isinstance(row[key], str) and row[key]
        if "label" in row:
            assert isinstance(row["label"], bool)
        if "verifiable" in row:
            assert row["verifiable"] is True


@pytest.mark.parametrize("name", sorted(KEYS))
def test_prompts_stay_in_the_problem_space(name):
    for row in records(name):
        first, ops = parse(row["prompt"])
        assert 10 <= first <= 99
        assert all(1 <= b <= 9 for _, b in ops)
        assert all(0 <= r <= 199 for *_, r in reference_steps(row["prompt"]))


@pytest.mark.parametrize("name", ["rl_prompts.jsonl", "multistep.jsonl", "eval.jsonl"])
def test_answers_match_independent_evaluator(name):
    for row in records(name):
        assert row["answer"] == str(truth(row["prompt"]))
    assert len({r["prompt"] for r in records(name)}) == COUNTS[name], (
        "prompts must be distinct"
    )


def test_multistep_steps_and_shape():
    for row in records("multistep.jsonl"):
        expected = [
            f"{a} {op} {b} = {r}" for a, op, b, r in reference_steps(row["prompt"])
        ]
        assert row["steps"] == expected
        assert len(expected) in (2, 3)


@pytest.mark.parametrize(
    ("name", "lo", "hi"),
    [
        ("sft.jsonl", 0.15, 0.25),
        ("eval.jsonl", 0.15, 0.25),
        ("preference.jsonl", 0.1, 0.5),
        ("rm_pairs.jsonl", 0.1, 0.5),
        ("kto.jsonl", 0.1, 0.5),
        ("rl_prompts.jsonl", 0.1, 0.5),
    ],
)
def test_single_multi_mix(name, lo, hi):
    rows = records(name)
    share = sum(single_triple(r["prompt"]) is None for r in rows) / len(rows)
    assert lo <= share <= hi


def _is_sft_imperfection(prompt: str, response: str) -> bool:
    """Missing Answer line, or last value off by ±1/±10 and carried to the Answer."""
    expected = reference_response(prompt).split("\n")
    lines = response.split("\n")
    if lines == expected[:-1]:
        return True
    if len(lines) != len(expected) or lines[:-2] != expected[:-2]:
        return False
    m = STEP_RE.fullmatch(lines[-2])
    a, op, b, r = reference_steps(prompt)[-1]
    return bool(
        m
        and (int(m[1]), m[2], int(m[3])) == (a, op, b)
        and int(m[4]) - r in (-10, -1, 1, 10)
        and lines[-1] == f"Answer: {m[4]}"
    )


def test_sft_correct_and_imperfect_responses():
    imperfect = 0
    for row in records("sft.jsonl"):
        prompt, response = row["prompt"], row["response"]
        if response == reference_response(prompt):
            assert gen.extract_answer(response) == str(truth(prompt))
            assert gen.is_correct(response, str(truth(prompt)))
        else:
            assert _is_sft_imperfection(prompt, response), response
            assert not gen.is_correct(response, str(truth(prompt)))
            imperfect += 1
    share = imperfect / len(records("sft.jsonl"))
    assert 0.12 <= share <= 0.18
    assert gen.IMPERFECT_SHARE == 0.15


@pytest.mark.parametrize(
    "name", ["preference.jsonl", "rm_pairs.jsonl", "preference_careless.jsonl", "rm_pairs_careless.jsonl"]
)
def test_preference_pairs(name):
    for row in records(name):
        answer = str(truth(row["prompt"]))
        assert row["chosen"] == reference_response(row["prompt"])
        assert gen.is_correct(row["chosen"], answer)
        assert not gen.is_correct(row["rejected"], answer)


@pytest.mark.parametrize("name", ["preference.jsonl", "rm_pairs.jsonl"])
def test_preference_rejections_cover_every_flaw_kind(name):
    kinds = {"no_answer": 0, "answer_mismatch": 0, "wrong_arithmetic": 0}
    for row in records(name):
        rejected = row["rejected"]
        steps = [STEP_RE.fullmatch(line) for line in rejected.split("\n")]
        if gen.extract_answer(rejected) is None:
            kinds["no_answer"] += 1
        elif any(m and not step_is_right(m) for m in steps):
            kinds["wrong_arithmetic"] += 1
        else:
            kinds["answer_mismatch"] += 1
    assert all(count >= 100 for count in kinds.values()), kinds


def test_kto_labels_agree_with_correctness():
    rows = records("kto.jsonl")
    for row in rows:
        correct = gen.is_correct(row["response"], str(truth(row["prompt"])))
        assert row["label"] is correct
        if correct:
            assert row["response"] == reference_response(row["prompt"])
    assert 0.45 <= sum(r["label"] for r in rows) / len(rows) <= 0.55


def test_heldout_prompts_and_triples_are_disjoint_from_training():
    train_prompts = {r["prompt"] for name in TRAIN_FILES for r in records(name)}
    eval_prompts = {r["prompt"] for r in records("eval.jsonl")}
    multistep_prompts = {r["prompt"] for r in records("multistep.jsonl")}
    assert not (eval_prompts | multistep_prompts) & train_prompts
    assert not eval_prompts & multistep_prompts
    train_triples = {t for p in train_prompts if (t := single_triple(p))}
    assert len(heldout_triples()) == 240
    assert not heldout_triples() & train_triples


def test_training_text_never_works_out_a_heldout_triple():
    """A held-out fact must not appear solved inside any training solution."""
    held = heldout_triples()
    train_prompts = {r["prompt"] for name in TRAIN_FILES for r in records(name)}
    for prompt in train_prompts:
        assert not {(a, op, b) for a, op, b, _ in reference_steps(prompt)} & held, (
            prompt
        )
    for text in training_texts():
        for line in text.split("\n"):
            if (m := STEP_RE.fullmatch(line)) and (int(m[1]), m[2], int(m[3])) in held:
                assert not step_is_right(m), text


TOOL_STEP_RE = re.compile(r"(?:Step (\d+): )?<<(\d+) ([+-]) (\d+)>> = (-?\d+)")


def test_tool_demonstrations_call_the_calculator_for_every_step():
    system = gen.TOOL_SYSTEM
    rows = records("tool_sft.jsonl")
    assert {r["system"] for r in rows} == {system}
    assert (sum(bool(MULTI_RE.fullmatch(r["prompt"])) for r in rows)
            == round(gen.TOOL_SFT_SIZE * gen.TOOL_SFT_MULTI_SHARE))
    for row in rows:
        *lines, last = row["response"].split("\n")
        steps = reference_steps(row["prompt"])
        assert last == f"Answer: {truth(row['prompt'])}"
        assert len(lines) == len(steps)
        for index, (line, (a, op, b, result)) in enumerate(zip(lines, steps), 1):
            m = TOOL_STEP_RE.fullmatch(line)
            assert m and (m[1] is None) == (len(steps) == 1), line
            assert ((int(m[2]), m[3], int(m[4]), int(m[5])) == (a, op, b, result)
                    and (m[1] is None or int(m[1]) == index))
    assert records("tool_rl_prompts.jsonl") == [{"system": system, **r} for r in records("rl_prompts.jsonl")]
    assert records("tool_multistep.jsonl") == [{"system": system, **r} for r in records("multistep.jsonl")]


def test_every_response_ends_with_answer_or_is_a_flaw():
    for text in training_texts():
        assert not text.endswith(("\n", ".")), text
        for line in text.split("\n")[:-1]:
            assert STEP_RE.fullmatch(line), text
        last = text.split("\n")[-1]
        assert re.fullmatch(r"Answer: \d+", last) or STEP_RE.fullmatch(last), text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("37 + 8 = 45\nAnswer: 45", "45"),
        ("Answer: 3\nAnswer: 4", "4"),
        ("Answer:  12.", "12"),
        ("Answer: -7", "-7"),
        ("37 + 8 = 45", None),
        ("Answer: forty", None),
        ("Answer: 45abc", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert gen.extract_answer(text) == expected


def test_is_correct():
    assert gen.is_correct("37 + 8 = 45\nAnswer: 45", "45")
    assert gen.is_correct("Answer: 45", 45)
    assert not gen.is_correct("Answer: 46", "45")
    assert not gen.is_correct("37 + 8 = 45", "45")


def test_dataset_info_registers_every_file():
    info = json.loads((DEMO / "dataset_info.json").read_text(encoding="utf-8"))
    expected = {
        "demo_sft": "sft.jsonl",
        "demo_preference": "preference.jsonl",
        "demo_rm": "rm_pairs.jsonl",
        "demo_sft_careless": "sft_careless.jsonl",
        "demo_preference_careless": "preference_careless.jsonl",
        "demo_rm_careless": "rm_pairs_careless.jsonl",
        "demo_kto": "kto.jsonl",
        "demo_rl": "rl_prompts.jsonl",
        "demo_multistep": "multistep.jsonl",
        "demo_eval": "eval.jsonl",
        "demo_tool_sft": "tool_sft.jsonl",
        "demo_tool_rl": "tool_rl_prompts.jsonl",
        "demo_tool_multistep": "tool_multistep.jsonl",
    }
    assert {k: v["file_name"] for k, v in info.items()} == expected
    assert info["demo_preference"]["ranking"] is True and info["demo_rm"]["ranking"] is True
    assert info["demo_preference_careless"]["ranking"] is True
    assert info["demo_rm_careless"]["ranking"] is True
    assert info["demo_kto"]["columns"]["kto_tag"] == "label"
    for entry in info.values():
        keys = set(KEYS[entry["file_name"]])
        assert set(entry["columns"].values()) <= keys


def test_rm_pairs_draw_their_own_problems():
    """rm_pairs.jsonl is not preference.jsonl repeated: its own random stream, the same kind of pairs."""
    preference, rm_pairs = records("preference.jsonl"), records("rm_pairs.jsonl")
    assert [r["prompt"] for r in rm_pairs[:len(preference)]] != [r["prompt"] for r in preference]
    assert len({r["prompt"] for r in rm_pairs}) > 4 * len({r["prompt"] for r in preference}) / 2


def needs_borrow(left: int, op: str, right: int) -> bool:
    return op == "-" and left % 10 < right


def careless_reference(prompt: str) -> str:
    """The careless teacher's working, from the prompt: a subtraction that needs a borrow keeps its tens
    (52 - 7 = 55), and every later step is computed right on the wrong value."""
    left, ops = parse(prompt)
    lines = []
    for i, (op, right) in enumerate(ops, 1):
        result = calc(left, op, right) + (10 if needs_borrow(left, op, right) else 0)
        lines.append((f"Step {i}: " if len(ops) > 1 else "") + f"{left} {op} {right} = {result}")
        left = result
    return "\n".join([*lines, f"Answer: {left}"])


def has_borrow_step(prompt: str) -> bool:
    return any(needs_borrow(a, op, b) for a, op, b, _ in reference_steps(prompt))


def test_sft_careless_is_sft_with_the_borrow_habit():
    """The same problems as sft.jsonl, with random slips on the same records; where a correct
    demonstration needs a borrow, about 70% are the teacher's habit instead, and nothing else changes."""
    habit = borrow_demos = 0
    for clean, careless in zip(records("sft.jsonl"), records("sft_careless.jsonl"), strict=True):
        prompt = clean["prompt"]
        assert careless["prompt"] == prompt
        if clean["response"] != reference_response(prompt):  # the same records carry random slips
            assert _is_sft_imperfection(prompt, careless["response"]), careless["response"]
            continue
        if not has_borrow_step(prompt):
            assert careless["response"] == clean["response"]
            continue
        borrow_demos += 1
        if careless["response"] != clean["response"]:
            assert careless["response"] == careless_reference(prompt)
            assert not gen.is_correct(careless["response"], str(truth(prompt)))
            habit += 1
    assert borrow_demos > 500
    assert 0.65 <= habit / borrow_demos <= 0.75
    assert gen.CARELESS_SHARE == 0.7


def test_preference_careless_rejects_the_habit():
    """Same prompts and chosen responses as preference.jsonl; the habit is rejected in a few hundred pairs."""
    clean_rows, careless_rows = records("preference.jsonl"), records("preference_careless.jsonl")
    assert [r["prompt"] for r in clean_rows] == [r["prompt"] for r in careless_rows]
    assert [r["chosen"] for r in clean_rows] == [r["chosen"] for r in careless_rows]
    habit = sum(r["rejected"] == careless_reference(r["prompt"]) for r in careless_rows
                if has_borrow_step(r["prompt"]))
    borrow_pairs = sum(has_borrow_step(r["prompt"]) for r in careless_rows)
    assert 0.4 <= habit / borrow_pairs <= 0.6, (habit, borrow_pairs)
    # preference.jsonl's random +10 slips hit the same text now and then, far less often
    assert sum(r["rejected"] == careless_reference(r["prompt"]) for r in clean_rows) < habit / 4


def test_rm_pairs_careless_reject_the_habit():
    """The careless demo's reward-model pairs: rm_pairs.jsonl's kind of pairs on their own problems, with
    the habit as the rejected response in about half of the pairs that need a borrow (over a thousand
    pairs, enough for a last-token head to learn it)."""
    rows = records("rm_pairs_careless.jsonl")
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in records("rm_pairs.jsonl")]
    borrow_rows = [r for r in rows if has_borrow_step(r["prompt"])]
    habit = sum(r["rejected"] == careless_reference(r["prompt"]) for r in borrow_rows)
    assert 0.4 <= habit / len(borrow_rows) <= 0.6, (habit, len(borrow_rows))
    assert habit > 1000
