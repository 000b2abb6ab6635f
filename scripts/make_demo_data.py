#!/usr/bin/env python3
"""Generate the bundled demo task: verifiable two-digit arithmetic.

The task is small enough that a ~1-3M parameter Llama trained from scratch on
a laptop CPU partly learns it in a couple of minutes of SFT, yet every answer
can be checked exactly, so later preference and RL stages have a reward signal
and room to improve.

Usage::

    python scripts/make_demo_data.py [--out data/demo] [--seed 0]

Only the standard library is used and every random choice comes from
``random.Random`` streams derived from ``--seed``, so the output is
byte-identical on every run and platform.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

# --- Sizes and mixes (tune here) --------------------------------------------
SFT_SIZE = 3000
PREFERENCE_SIZE = 1500
# The reward model's pairs: a last-token reward head learns to check arithmetic only from many
# more pairs than DPO needs (on the demo model, 1,500 pairs teach it the format flaws alone)
RM_PAIRS_SIZE = 12000
KTO_SIZE = 1500
RL_SIZE = 800
TOOL_SFT_SIZE = 1000  # tool-use demonstrations, added to sft.jsonl for the tool-use demo
TOOL_SFT_MULTI_SHARE = 0.6  # 600 multi-step ones, as many as sft.jsonl has: with 150 the tiny model miscopies operands
TOOL_SYSTEM = "Use the calculator: <<expression>>."
MULTISTEP_SIZE = 200
EVAL_SIZE = 300

SFT_MULTI_SHARE = 0.2
PREFERENCE_MULTI_SHARE = 0.3
KTO_MULTI_SHARE = 0.3
RL_MULTI_SHARE = 0.3
EVAL_MULTI_SHARE = 0.2

# Share of SFT responses that are deliberately wrong or malformed, so that SFT
# alone cannot reach perfect accuracy and later stages have something to fix.
IMPERFECT_SHARE = 0.15
# Among imperfect SFT responses, the share that drop the "Answer:" line (the
# rest get a wrong last value propagated to the Answer line).
SFT_MISSING_ANSWER_SHARE = 1 / 3
# The "careless teacher" files (sft_careless.jsonl, preference_careless.jsonl): the teacher forgets to
# borrow in this share of its demonstrations that need a borrow. Random slips average out under SFT (the
# model's most likely answer stays right); a habit does not, so SFT learns it and only preference or
# verified-reward training can remove it.
CARELESS_SHARE = 0.7
# Among the careless preference pairs whose problem needs a borrow, the share whose rejected response is
# the teacher's habit (the rest are flawed as in preference.jsonl).
CARELESS_REJECTED_SHARE = 0.5
KTO_DESIRABLE_SHARE = 0.5

# --- Problem space -----------------------------------------------------------
OPS = ("+", "-")
FIRST_RANGE = (10, 99)  # first operand: two digits
OTHER_RANGE = (1, 9)  # every later operand: one digit
VALUE_RANGE = (0, 199)  # every intermediate result of a multi-step problem
MULTI_OP_COUNTS = (2, 3)

SFT_DELTAS = (-10, -1, 1, 10)
FLAW_DELTAS = (-10, -2, -1, 1, 2, 10)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "demo"

ANSWER_RE = re.compile(r"[ \t]*([+-]?\d+)\b")

Triple = tuple[int, str, int]
Step = tuple[int, str, int, int]  # left, op, right, written result


# --- Answer checking (shared with the reward code and the tests) ------------
def extract_answer(text: str) -> str | None:
    """Return the integer after the last ``Answer:`` in ``text``, or None.

    The last occurrence wins so that a model that restates or corrects itself
    is graded on its final claim.
    """
    index = text.rfind("Answer:")
    if index < 0:
        return None
    match = ANSWER_RE.match(text, index + len("Answer:"))
    return match.group(1).lstrip("+") if match else None


def is_correct(response: str, answer: str | int) -> bool:
    """True when the response's final ``Answer:`` equals ``answer`` as an integer."""
    found = extract_answer(response)
    return found is not None and int(found) == int(answer)


# --- Problems ----------------------------------------------------------------
def apply(left: int, op: str, right: int) -> int:
    """Evaluate one step; only ``+`` and ``-`` exist in this task."""
    return left + right if op == "+" else left - right


@dataclass(frozen=True)
class Problem:
    """A left-to-right chain ``first op1 b1 op2 b2 ...``; one op means single-step."""

    first: int
    ops: tuple[tuple[str, int], ...]

    @property
    def is_multi(self) -> bool:
        return len(self.ops) > 1

    @property
    def prompt(self) -> str:
        chain = " ".join([str(self.first)] + [f"{op} {b}" for op, b in self.ops])
        return f"Compute {chain}." if self.is_multi else f"What is {chain}?"

    @property
    def answer(self) -> int:
        return solve(self)[-1][3]

    @classmethod
    def from_prompt(cls, prompt: str) -> Problem | None:
        """The problem a demo prompt states (the inverse of ``prompt``), or None for any other text."""
        match = re.fullmatch(r"What is (.+)\?|Compute (.+)\.", prompt.strip())
        tokens = (match[1] or match[2]).split() if match else []
        if len(tokens) < 3 or len(tokens) % 2 == 0 or not all(t.isdigit() for t in tokens[::2]) \
                or not all(op in ("+", "-") for op in tokens[1::2]):
            return None
        return cls(int(tokens[0]), tuple((op, int(b)) for op, b in zip(tokens[1::2], tokens[2::2])))


def solve(
    problem: Problem, error_step: int | None = None, delta: int = 0
) -> list[Step]:
    """Work the chain step by step, optionally writing a wrong result at one step.

    A wrong result is carried into the following steps, as a real slip would be.
    """
    steps, left = [], problem.first
    for index, (op, right) in enumerate(problem.ops):
        result = apply(left, op, right) + (delta if index == error_step else 0)
        steps.append((left, op, right, result))
        left = result
    return steps


def format_step(step: Step) -> str:
    left, op, right, result = step
    return f"{left} {op} {right} = {result}"


def render(problem: Problem, steps: list[Step], answer: int | None) -> str:
    """Write the response text; ``answer=None`` omits the final Answer line."""
    if problem.is_multi:
        lines = [f"Step {i}: {format_step(s)}" for i, s in enumerate(steps, 1)]
    else:
        lines = [format_step(s) for s in steps]
    if answer is not None:
        lines.append(f"Answer: {answer}")
    return "\n".join(lines)


def correct_response(problem: Problem) -> str:
    steps = solve(problem)
    return render(problem, steps, steps[-1][3])


def all_triples() -> list[Triple]:
    """Every single-step problem in a fixed order (90 * 2 * 9 = 1620)."""
    return [
        (a, op, b)
        for a in range(FIRST_RANGE[0], FIRST_RANGE[1] + 1)
        for op in OPS
        for b in range(OTHER_RANGE[0], OTHER_RANGE[1] + 1)
    ]


def random_multi(rng: random.Random) -> Problem:
    """Draw a 2-3 op chain whose intermediate values all stay in VALUE_RANGE."""
    while True:
        problem = Problem(
            rng.randint(*FIRST_RANGE),
            tuple(
                (rng.choice(OPS), rng.randint(*OTHER_RANGE))
                for _ in range(rng.choice(MULTI_OP_COUNTS))
            ),
        )
        if all(VALUE_RANGE[0] <= s[3] <= VALUE_RANGE[1] for s in solve(problem)):
            return problem


class Split:
    """Held-out problems plus samplers that never touch them.

    Single-step held-out items are reserved by (a, op, b) triple.  Training
    text must also never show a held-out triple worked out correctly (e.g. as
    a step inside a multi-step solution), otherwise the eval answer leaks.
    """

    def __init__(self, seed: int, n_heldout_single: int, n_heldout_multi: int):
        rng = random.Random(f"{seed}:split")
        triples = all_triples()
        rng.shuffle(triples)
        self.heldout_triples = triples[:n_heldout_single]
        self.train_triples = triples[n_heldout_single:]
        self._heldout_set = set(self.heldout_triples)
        multis: dict[str, Problem] = {}
        while len(multis) < n_heldout_multi:
            problem = random_multi(rng)
            multis.setdefault(problem.prompt, problem)
        self.heldout_multi = list(multis.values())
        self._heldout_prompts = set(multis)

    def leaks(self, steps: list[Step]) -> bool:
        """True if any step correctly works out a held-out single-step triple."""
        return any(
            (left, op, right) in self._heldout_set and apply(left, op, right) == result
            for left, op, right, result in steps
        )

    def train_multi(self, rng: random.Random) -> Problem:
        while True:
            problem = random_multi(rng)
            if problem.prompt not in self._heldout_prompts and not self.leaks(
                solve(problem)
            ):
                return problem

    def train_single(self, rng: random.Random, count: int) -> list[Problem]:
        """Cycle through reshuffled training triples so coverage stays even."""
        out: list[Problem] = []
        while len(out) < count:
            batch = list(self.train_triples)
            rng.shuffle(batch)
            out.extend(Problem(a, ((op, b),)) for a, op, b in batch[: count - len(out)])
        return out

    def train_mix(
        self, rng: random.Random, count: int, multi_share: float
    ) -> list[Problem]:
        """A shuffled mix with exactly ``round(count * multi_share)`` multi-step items."""
        n_multi = round(count * multi_share)
        problems = self.train_single(rng, count - n_multi)
        problems += [self.train_multi(rng) for _ in range(n_multi)]
        rng.shuffle(problems)
        return problems


# --- Flawed responses ---------------------------------------------------------
def wrong_arithmetic(
    problem: Problem,
    split: Split,
    rng: random.Random,
    deltas: tuple[int, ...],
    last_only: bool,
) -> str | None:
    """Miscompute one step by a small delta and follow the mistake through.

    Returns None if every choice would go negative or leak a held-out fact.
    """
    n = len(problem.ops)
    candidates = [
        (step, d) for step in range(n) for d in deltas if not last_only or step == n - 1
    ]
    rng.shuffle(candidates)
    for error_step, delta in candidates:
        steps = solve(problem, error_step, delta)
        if all(s[3] >= 0 for s in steps) and not split.leaks(steps):
            return render(problem, steps, steps[-1][3])
    return None


def borrows(left: int, op: str, right: int) -> bool:
    """True if the subtraction needs a borrow from the tens (52 - 7: 2 < 7)."""
    return op == "-" and left % 10 < right % 10


def has_borrow(problem: Problem) -> bool:
    return any(borrows(left, op, right) for left, op, right, _ in solve(problem))


def careless_steps(problem: Problem) -> list[Step]:
    """The careless teacher's working: every subtraction that needs a borrow is written without it
    (52 - 7 = 55, the tens left as they were), and the wrong value is carried on."""
    steps, left = [], problem.first
    for op, right in problem.ops:
        result = apply(left, op, right) + (10 if borrows(left, op, right) else 0)
        steps.append((left, op, right, result))
        left = result
    return steps


def careless_response(problem: Problem, split: Split) -> str | None:
    """The teacher's habitual mistake written out, or None if it would work out a held-out fact."""
    steps = careless_steps(problem)
    if split.leaks(steps) or any(s[3] < 0 for s in steps):
        return None
    return render(problem, steps, steps[-1][3])


def missing_answer(problem: Problem) -> str:
    """Correct working but no final Answer line: a format failure."""
    return render(problem, solve(problem), None)


def mismatched_answer(problem: Problem, rng: random.Random) -> str:
    """Correct working whose Answer line disagrees with the last step."""
    truth = problem.answer
    delta = rng.choice([d for d in FLAW_DELTAS if truth + d >= 0])
    return render(problem, solve(problem), truth + delta)


def flawed_response(
    problem: Problem, split: Split, rng: random.Random, careless: bool = False
) -> str:
    """A rejected/undesirable response: wrong arithmetic (half) or a format flaw.

    With ``careless``, a problem that needs a borrow gets the careless teacher's mistake instead in
    CARELESS_REJECTED_SHARE of cases.
    """
    if careless and has_borrow(problem) and rng.random() < CARELESS_REJECTED_SHARE:
        text = careless_response(problem, split)
        if text is not None:
            return text
    if rng.random() < 0.5:
        text = wrong_arithmetic(problem, split, rng, FLAW_DELTAS, last_only=False)
        if text is not None:
            return text
    if rng.random() < 0.5:
        return missing_answer(problem)
    return mismatched_answer(problem, rng)


def imperfect_sft_response(problem: Problem, split: Split, rng: random.Random) -> str:
    """An SFT target that is wrong by ±1/±10 at the last value, or lacks an Answer."""
    if rng.random() >= SFT_MISSING_ANSWER_SHARE:
        text = wrong_arithmetic(problem, split, rng, SFT_DELTAS, last_only=True)
        if text is not None:
            return text
    return missing_answer(problem)


# --- Files --------------------------------------------------------------------
def make_sft(split: Split, seed: int, careless_share: float = 0.0) -> list[dict]:
    """Worked solutions; ``careless_share`` > 0 gives the careless teacher's version of the same
    problems (sft_careless.jsonl); the same records carry random imperfections."""
    rng = random.Random(f"{seed}:sft")
    problems = split.train_mix(rng, SFT_SIZE, SFT_MULTI_SHARE)
    imperfect = set(rng.sample(range(SFT_SIZE), round(SFT_SIZE * IMPERFECT_SHARE)))
    records = []
    for i, p in enumerate(problems):
        flawed = i in imperfect
        response = (
            imperfect_sft_response(p, split, rng) if flawed else correct_response(p)
        )
        if careless_share and not flawed and has_borrow(p) and rng.random() < careless_share:
            response = careless_response(p, split) or response
        records.append({"prompt": p.prompt, "response": response})
    return records


def _preference_pairs(
    split: Split, rng: random.Random, size: int, careless: bool = False
) -> list[dict]:
    """``size`` pairs on training problems: the correct response against a flawed one."""
    problems = split.train_mix(rng, size, PREFERENCE_MULTI_SHARE)
    return [
        {
            "prompt": p.prompt,
            "chosen": correct_response(p),
            "rejected": flawed_response(p, split, rng, careless),
        }
        for p in problems
    ]


def make_preference(split: Split, seed: int, careless: bool = False) -> list[dict]:
    """DPO's pairs; ``careless`` draws the same problems with the careless teacher's mistake among the
    rejected responses (preference_careless.jsonl)."""
    rng = random.Random(f"{seed}:preference")
    return _preference_pairs(split, rng, PREFERENCE_SIZE, careless)


def make_rm_pairs(split: Split, seed: int, careless: bool = False) -> list[dict]:
    """Pairs like ``make_preference``'s (same mix and flaws, its own random stream), 8x as many;
    ``careless`` rejects the careless teacher's habit as preference_careless.jsonl does
    (rm_pairs_careless.jsonl, the careless demo's reward model)."""
    stream = f"{seed}:rm_pairs_careless" if careless else f"{seed}:rm_pairs"
    return _preference_pairs(split, random.Random(stream), RM_PAIRS_SIZE, careless)


def make_kto(split: Split, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:kto")
    problems = split.train_mix(rng, KTO_SIZE, KTO_MULTI_SHARE)
    n_good = round(KTO_SIZE * KTO_DESIRABLE_SHARE)
    labels = [True] * n_good + [False] * (KTO_SIZE - n_good)
    rng.shuffle(labels)
    return [
        {
            "prompt": p.prompt,
            "response": correct_response(p) if good else flawed_response(p, split, rng),
            "label": good,
        }
        for p, good in zip(problems, labels)
    ]


def make_rl(split: Split, seed: int) -> list[dict]:
    """Distinct training prompts with their verifiable answers."""
    rng = random.Random(f"{seed}:rl")
    n_multi = round(RL_SIZE * RL_MULTI_SHARE)
    problems = split.train_single(rng, RL_SIZE - n_multi)  # distinct while <= pool size
    seen = {p.prompt for p in problems}
    while len(problems) < RL_SIZE:
        problem = split.train_multi(rng)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append(problem)
    rng.shuffle(problems)
    return [verifiable(p) for p in problems]


def verifiable(problem: Problem) -> dict:
    return {"prompt": problem.prompt, "answer": str(problem.answer), "verifiable": True}


def make_eval(split: Split, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:eval")
    problems = [Problem(a, ((op, b),)) for a, op, b in split.heldout_triples]
    problems += split.heldout_multi[MULTISTEP_SIZE:]
    rng.shuffle(problems)
    return [verifiable(p) for p in problems]


def make_multistep(split: Split) -> list[dict]:
    return [
        {**verifiable(p), "steps": [format_step(s) for s in solve(p)]}
        for p in split.heldout_multi[:MULTISTEP_SIZE]
    ]


# --- Tool use ------------------------------------------------------------------
def tool_response(problem: Problem) -> str:
    """A worked solution that calls the calculator for every step, in GSM8K's annotation style: the call is
    ``<<a op b>>`` and the tool's answer follows as `` = result`` (written by the environment during RL, so never
    trained on there; in these demonstrations it is part of the text). Short tags keep a 3-step answer near the
    plain one's length for the tiny model."""
    lines = [f"<<{left} {op} {right}>> = {result}" for left, op, right, result in solve(problem)]
    if problem.is_multi:
        lines = [f"Step {i}: {line}" for i, line in enumerate(lines, 1)]
    return "\n".join(lines + [f"Answer: {problem.answer}"])


def make_tool_sft(split: Split, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:tool_sft")
    problems = split.train_mix(rng, TOOL_SFT_SIZE, TOOL_SFT_MULTI_SHARE)
    return [{"system": TOOL_SYSTEM, "prompt": p.prompt, "response": tool_response(p)} for p in problems]


def with_tool_system(records: list[dict]) -> list[dict]:
    return [{"system": TOOL_SYSTEM, **record} for record in records]


def dataset_info() -> dict:
    """LLaMA-Factory ``dataset_info.json`` entries (alpaca-style column names)."""
    answer_columns = {"prompt": "prompt", "answer": "answer"}

    def sft(file_name: str) -> dict:
        return {"file_name": file_name, "columns": {"prompt": "prompt", "response": "response"}}

    def pairs(file_name: str) -> dict:
        columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
        return {"file_name": file_name, "ranking": True, "columns": columns}

    return {
        "demo_sft": sft("sft.jsonl"),
        "demo_preference": pairs("preference.jsonl"),
        "demo_rm": pairs("rm_pairs.jsonl"),
        "demo_sft_careless": sft("sft_careless.jsonl"),
        "demo_preference_careless": pairs("preference_careless.jsonl"),
        "demo_rm_careless": pairs("rm_pairs_careless.jsonl"),
        "demo_kto": {
            "file_name": "kto.jsonl",
            "columns": {"prompt": "prompt", "response": "response", "kto_tag": "label"},
        },
        "demo_rl": {"file_name": "rl_prompts.jsonl", "columns": dict(answer_columns)},
        "demo_multistep": {
            "file_name": "multistep.jsonl",
            "columns": dict(answer_columns),
        },
        "demo_eval": {"file_name": "eval.jsonl", "columns": dict(answer_columns)},
        "demo_tool_sft": {"file_name": "tool_sft.jsonl",
                          "columns": {"system": "system", "prompt": "prompt", "response": "response"}},
        "demo_tool_rl": {"file_name": "tool_rl_prompts.jsonl", "columns": {"system": "system", **answer_columns}},
        "demo_tool_multistep": {"file_name": "tool_multistep.jsonl",
                                "columns": {"system": "system", **answer_columns}},
    }


def readme(counts: dict[str, int], seed: int) -> str:
    return f"""# Demo task: verifiable arithmetic

Generated by `python scripts/make_demo_data.py --out data/demo --seed {seed}`
(standard library only, byte-identical on every run; do not edit by hand).
Prompts are `What is 37 + 8?` (two-digit op one-digit, `+`/`-`) or
`Compute 12 + 7 - 5.` (2-3 operations, intermediates in [0, 199]); every
correct response ends with the line `Answer: N`.

- `sft.jsonl` ({counts["sft.jsonl"]} records; `prompt`, `response`): worked
  solutions, ~{1 - SFT_MULTI_SHARE:.0%} single-step. {IMPERFECT_SHARE:.0%} are
  deliberately imperfect (last value off by ±1/±10, or no `Answer:` line) so
  that SFT alone stays below perfect.
- `preference.jsonl` ({counts["preference.jsonl"]} records; `prompt`, `chosen`,
  `rejected`): chosen is correct; rejected has an arithmetic slip (±1/±2/±10,
  carried forward), no `Answer:` line, or an `Answer:` that disagrees with the
  last step.
- `rm_pairs.jsonl` ({counts["rm_pairs.jsonl"]} records; as `preference.jsonl`):
  the reward model's pairs, drawn the same way. A last-token reward head needs
  many more pairs than DPO to learn to check the arithmetic. Not part of the
  tiny tokenizer's corpus.
- `sft_careless.jsonl` ({counts["sft_careless.jsonl"]} records; as `sft.jsonl`): the same
  problems from a careless teacher, who forgets to borrow (`52 - 7 = 55`) in {CARELESS_SHARE:.0%} of
  the demonstrations that need a borrow; the same records as in `sft.jsonl` carry random slips. Random slips average
  out under SFT; a habit does not, so the SFT model learns it and preference and RL stages can remove it.
- `preference_careless.jsonl` ({counts["preference_careless.jsonl"]} records; as
  `preference.jsonl`): the same problems; where a borrow is needed, the rejected response is the
  teacher's habit in {CARELESS_REJECTED_SHARE:.0%} of pairs.
- `rm_pairs_careless.jsonl` ({counts["rm_pairs_careless.jsonl"]} records; as `rm_pairs.jsonl`): the
  careless demo's reward-model pairs, with the habit among the rejected responses as in
  `preference_careless.jsonl`. No careless file is part of the tiny tokenizer's corpus.
- `kto.jsonl` ({counts["kto.jsonl"]} records; `prompt`, `response`, `label`):
  `label` is true for correct responses and false for flawed ones (~50/50).
- `rl_prompts.jsonl` ({counts["rl_prompts.jsonl"]} records; `prompt`, `answer`,
  `verifiable`): distinct prompts with the integer answer as a string, for
  reward-verified RL.
- `multistep.jsonl` ({counts["multistep.jsonl"]} records; as above plus
  `steps`): held-out multi-step problems with their reference steps.
- `eval.jsonl` ({counts["eval.jsonl"]} records; `prompt`, `answer`,
  `verifiable`): held-out mix, ~{1 - EVAL_MULTI_SHARE:.0%} single-step.
- `tool_sft.jsonl` ({counts["tool_sft.jsonl"]} records; `system`, `prompt`, `response`): tool-use
  demonstrations, {TOOL_SFT_MULTI_SHARE:.0%} multi-step. The system prompt is `{TOOL_SYSTEM}`; every step is a
  calculator call `<<12 + 7>>` followed by the tool's output ` = 19` (GRPO's `tool_tags: ["<<", ">>"]`,
  `tool_result_tags: [" = ", ""]`). Trained together with
  `sft.jsonl` in the tool-use demo (`experiments/configs/demo_tools.yaml`; GRPO with `environment: calculator`).
- `tool_rl_prompts.jsonl` and `tool_multistep.jsonl` ({counts["tool_rl_prompts.jsonl"]} and
  {counts["tool_multistep.jsonl"]} records): `rl_prompts.jsonl` and `multistep.jsonl` with that system prompt.
  No tool file is part of the tiny tokenizer's corpus.
- `dataset_info.json`: LLaMA-Factory registry (`demo_sft`, `demo_preference`, `demo_rm`,
  `demo_sft_careless`, `demo_preference_careless`, `demo_rm_careless`, `demo_kto`, `demo_rl`, `demo_multistep`, \
`demo_eval`,
  `demo_tool_sft`, `demo_tool_rl`, `demo_tool_multistep`).

Held-out discipline: `eval.jsonl` and `multistep.jsonl` share no prompt with
the training files, their single-step (a, op, b) triples never occur as
training problems, and no training text shows a held-out triple worked out
correctly.
"""


def write_jsonl(path: Path, records: list[dict]) -> None:
    lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
    path.write_text("".join(lines), encoding="utf-8")


def generate(out_dir: Path, seed: int = 0) -> dict[str, int]:
    """Write every demo file into ``out_dir`` and return record counts per JSONL file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_eval_multi = round(EVAL_SIZE * EVAL_MULTI_SHARE)
    split = Split(seed, EVAL_SIZE - n_eval_multi, MULTISTEP_SIZE + n_eval_multi)
    files = {
        "sft.jsonl": make_sft(split, seed),
        "preference.jsonl": make_preference(split, seed),
        "rm_pairs.jsonl": make_rm_pairs(split, seed),
        "sft_careless.jsonl": make_sft(split, seed, CARELESS_SHARE),
        "preference_careless.jsonl": make_preference(split, seed, careless=True),
        "rm_pairs_careless.jsonl": make_rm_pairs(split, seed, careless=True),
        "kto.jsonl": make_kto(split, seed),
        "rl_prompts.jsonl": make_rl(split, seed),
        "multistep.jsonl": make_multistep(split),
        "eval.jsonl": make_eval(split, seed),
        "tool_sft.jsonl": make_tool_sft(split, seed),
    }
    files["tool_rl_prompts.jsonl"] = with_tool_system(files["rl_prompts.jsonl"])
    files["tool_multistep.jsonl"] = with_tool_system(files["multistep.jsonl"])
    for name, records in files.items():
        write_jsonl(out_dir / name, records)
    counts = {name: len(records) for name, records in files.items()}
    info = json.dumps(dataset_info(), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "dataset_info.json").write_text(info, encoding="utf-8")
    (out_dir / "README.md").write_text(readme(counts, seed), encoding="utf-8")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output folder (default: data/demo)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, count in generate(args.out, args.seed).items():
        print(f"{args.out / name}: {count} records")


if __name__ == "__main__":
    main()
