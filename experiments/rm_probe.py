"""Where the demo reward model's missing accuracy is: the same held-out pairs ranked by the SFT model's
own log-likelihood and by trained reward models, split by the kind of flaw in the rejected answer.

    python rlhf.py pipeline --config configs/demo_ensemble.yaml   # once: outputs/demo_ensemble/{sft,rm}
    python experiments/rm_probe.py                       # SFT log-likelihood and outputs/demo_ensemble/rm
    python experiments/rm_probe.py --reward-models outputs/demo_ensemble/rm,/tmp/rm_other

The held-out pairs are the rm stage's: ``val_size`` 200 of ``demo_rm`` held out by prompt
(``val_split_by_prompt``) with ``seed`` 0, as ``configs/demo_ensemble.yaml`` trains it, so no held-out prompt was
trained on. A pair counts as right when the chosen response scores higher. The
log-likelihood column scores a response by log p(response | prompt) summed over its tokens under the SFT
policy, the reward-model columns by the scalar head on the last token. Flaw kinds, read from the pair
itself: ``format`` (the rejected response has no ``Answer:`` line, or its answer disagrees with its own
last step) and ``arithmetic`` (a wrong result in a step, carried to the answer); the rows under each split
them by the digit the first wrong number gets wrong: the demo's flaws are off by 1 or 2 (the units digit)
or by 10 (the tens digit, e.g. ``66 + 3 = 59``, or the careless teacher's forgotten borrow).
``--train-pairs N`` adds a column per reward model for its first N training pairs: a flaw kind it ranks
no better there than on held-out pairs is one it did not learn, rather than one it learned and failed
to carry over.

A last row asks whether the reward model checks arithmetic it was never shown: one pair per held-out
eval prompt (data/demo/eval.jsonl, whose facts no training file works out), the correct solution against
a slip made the way the demo data makes them (one step off by one of ``FLAW_DELTAS``, carried through).
Two more rows probe the tens digit on the eval prompts' single-step subtractions: the correct answer
against the careless teacher's habit where a borrow is needed (``52 - 7 = 55``), and against a borrow
taken where none is needed (``83 - 3 = 70``). A reward model trained on pairs that reject the habit can
learn "the lower tens digit is better" instead of the arithmetic; the second row shows it, and it is the
answer RL on such a reward model drifts to (README, "The careless-teacher demo").

    python experiments/rm_probe.py --dataset demo_rm_careless \
        --reward-models outputs/demo_ensemble/rm,outputs/demo_careless/rm

``--policy-pairs DIR ...`` adds a row per directory written by ``experiments/make_onpolicy_pairs.py``: a policy's
own right answer against its own wrong one, on training prompts. These are the pairs RL meets: run it on
the policy an RL stage produced to see whether the reward model ranks the answers that policy drifted to.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "scripts")]  # rlhf, bench/tables.py, the demo generator

import make_demo_data as demo  # noqa: E402
from tables import print_table  # noqa: E402

import rlhf  # noqa: E402


def flaw_kind(rejected: str) -> str:
    answer = re.findall(r"Answer:\s*(-?\d+)", rejected)
    results = re.findall(r"=\s*(-?\d+)", rejected)
    if not answer or (results and answer[-1] != results[-1]):
        return "format"
    return "arithmetic"


def wrong_digit(chosen: str, rejected: str) -> str | None:
    """Which digit the rejected response's first wrong number gets wrong: "tens" when it is off by a
    multiple of 10, else "units"; None when every number it writes is right (a missing Answer line)."""
    for right, wrong in zip(re.findall(r"-?\d+", chosen), re.findall(r"-?\d+", rejected)):
        if right != wrong:
            return "tens" if (int(wrong) - int(right)) % 10 == 0 else "units"
    return None


def flaw_rows(pairs: list[dict]) -> list[tuple[str, list[int]]]:
    """(row label, indices of the pairs in that row): each flaw kind, then its split by wrong digit."""
    kinds = [flaw_kind(p["rejected"]) for p in pairs]
    digits = [wrong_digit(p["chosen"], p["rejected"]) for p in pairs]
    rows = []
    for kind in ("format", "arithmetic"):
        rows.append((kind, [i for i, k in enumerate(kinds) if k == kind]))
        if kind == "format":
            rows.append(("  no Answer line", [i for i, k in enumerate(kinds) if k == kind and digits[i] is None]))
        for digit in ("units", "tens"):
            what = "Answer disagrees in the" if kind == "format" else "wrong"
            rows.append((f"  {what} {digit} digit",
                         [i for i, k in enumerate(kinds) if k == kind and digits[i] == digit]))
    rows.append(("all", list(range(len(pairs)))))
    return rows


@torch.no_grad()
def log_likelihoods(policy: rlhf.PolicyModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log p(response | prompt) of every row of a PreferenceCollator batch. Shapes: -> (2B)."""
    logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    per_token = rlhf.token_log_probs(logits, labels.clamp(min=0))
    return (per_token * (labels != rlhf.IGNORE_INDEX)).sum(-1)


def eval_slip_pairs(path: Path, seed: int) -> list[dict]:
    """The correct solution of each eval prompt against a carried arithmetic slip (chat records)."""
    rng, records = random.Random(f"{seed}:eval-slips"), []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        item = json.loads(line)
        problem = demo.Problem.from_prompt(item["prompt"])
        if problem is None:
            raise SystemExit(f"error: {path}:{number}: '{item['prompt']}' is not a demo problem "
                             "('What is 52 - 7?' or 'Compute 12 + 7 - 5.')")
        if str(problem.answer) != item["answer"]:
            raise SystemExit(f"error: {path}:{number}: '{item['prompt']}' works out to {problem.answer}, not "
                             f"{item['answer']}; regenerate the demo data (python scripts/make_demo_data.py)")
        slips = [(step, d) for step in range(len(problem.ops)) for d in demo.FLAW_DELTAS]
        rng.shuffle(slips)
        steps = next(s for s in (demo.solve(problem, *slip) for slip in slips) if all(x[3] >= 0 for x in s))
        records.append({"system": None, "messages": [{"role": "user", "content": item["prompt"]}],
                        "chosen": demo.correct_response(problem),
                        "rejected": demo.render(problem, steps, steps[-1][3])})
    return records


HABIT_PROBE, INVENTED_BORROW_PROBE = "borrow, vs the habit (+10)", "no borrow, vs a borrow (-10)"


def tens_digit_pairs(path: Path) -> dict[str, list[dict]]:
    """Single-step subtractions of the eval prompts, the correct answer against one 10 too high where a borrow
    is needed (the careless teacher's habit) and one 10 too low where none is (a borrow taken that is not
    there: the answer a reward model that learned "reject the higher tens digit" prefers)."""
    pairs: dict[str, list[dict]] = {HABIT_PROBE: [], INVENTED_BORROW_PROBE: []}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        problem = demo.Problem.from_prompt(item["prompt"])
        if problem is None or problem.is_multi or problem.ops[0][0] != "-":
            continue
        if demo.borrows(problem.first, "-", problem.ops[0][1]):
            name, delta = HABIT_PROBE, 10
        elif problem.answer >= 10:
            name, delta = INVENTED_BORROW_PROBE, -10
        else:
            continue
        slip = demo.solve(problem, 0, delta)
        pairs[name].append({"system": None, "messages": [{"role": "user", "content": item["prompt"]}],
                            "chosen": demo.correct_response(problem),
                            "rejected": demo.render(problem, slip, slip[-1][3])})
    return pairs


def pairwise(scores: torch.Tensor) -> torch.Tensor:
    chosen, rejected = scores.chunk(2)
    return chosen > rejected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="outputs/demo_ensemble/sft",
                        help="the SFT policy (default outputs/demo_ensemble/sft)")
    parser.add_argument("--reward-models", default="outputs/demo_ensemble/rm",
                        help="comma-separated reward model directories")
    parser.add_argument("--dataset", default="demo_rm", help="the rm stage's dataset (default demo_rm)")
    parser.add_argument("--val-size", type=int, default=200, help="held-out pairs, as the rm stage's val_size")
    parser.add_argument("--split-by-record", action="store_true",
                        help="a record-level split (val_split_by_prompt: false) instead of whole prompts")
    parser.add_argument("--seed", type=int, default=0, help="the rm stage's seed (it draws the held-out pairs)")
    parser.add_argument("--train-pairs", type=int, default=0,
                        help="also rank the first N training pairs with each reward model (default 0: none)")
    parser.add_argument("--policy-pairs", nargs="+", default=[], metavar="DIR",
                        help="directories written by experiments/make_onpolicy_pairs.py: a row each for a policy's own "
                        "right-vs-wrong samples")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.train_pairs < 0:
        raise SystemExit(f"error: --train-pairs {args.train_pairs}: give a count of training pairs >= 0")
    rlhf.pin_cpu_kernels()  # the same figures on any x86-64 CPU (see README, 'The run is deterministic')
    torch.set_num_threads(args.threads)
    for path in [args.policy, *args.reward_models.split(",")]:
        if not Path(path).is_dir():
            raise SystemExit(f"error: {path} does not exist; run "
                             "`python rlhf.py pipeline --config configs/demo_ensemble.yaml` first")
    for path in args.policy_pairs:
        if not (Path(path) / "dataset_info.json").is_file():
            raise SystemExit(f"error: --policy-pairs {path}: no dataset_info.json there; write it with "
                             f"`python experiments/make_onpolicy_pairs.py --policy DIR --out {path}`")

    records = rlhf.load_records(args.dataset, REPO / "data/demo", "preference")
    train, held_out = rlhf._split_validation(records, args.val_size, args.seed, by_prompt=not args.split_by_record)
    train = train[:args.train_pairs]
    policy = rlhf.PolicyModel.from_pretrained(args.policy)
    policy.model.eval()
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    eval_slips = eval_slip_pairs(REPO / "data/demo/eval.jsonl", args.seed)
    collate = rlhf.PreferenceCollator(policy.tokenizer.pad_token_id)

    def batches(records: list[dict]) -> list[dict[str, torch.Tensor]]:
        pairs = rlhf.PreferenceDataset(records, policy.tokenizer, formatter, cutoff_len=128)
        return [collate([pairs[i] for i in range(s, min(s + 50, len(pairs)))]) for s in range(0, len(pairs), 50)]

    tens_digit = tens_digit_pairs(REPO / "data/demo/eval.jsonl")
    try:
        policy_pairs = {f"policy samples, {path}": rlhf.load_records("onpolicy_pairs", path, "preference")
                        for path in args.policy_pairs}
    except rlhf.RLHFInputError as error:  # a bad record in a pairs file: its file:line, in one line
        raise SystemExit(f"error: --policy-pairs: {error}") from None
    probes = {**{f"eval, {name}": pairs for name, pairs in tens_digit.items()}, **policy_pairs}  # a row each
    sets = {"held_out": batches(held_out), "eval_slips": batches(eval_slips),
            **{name: batches(pairs) for name, pairs in probes.items()}}
    columns = {"SFT log-likelihood": {name: torch.cat([pairwise(log_likelihoods(policy, b)) for b in bs])
                                      for name, bs in sets.items()}}
    train_columns = {}
    for path in args.reward_models.split(","):
        ensemble = rlhf.RewardEnsemble.from_pretrained(path).eval()  # a single reward model is an ensemble of one

        def right(batch: dict[str, torch.Tensor], ensemble: rlhf.RewardEnsemble = ensemble) -> torch.Tensor:
            return pairwise(ensemble(batch["input_ids"], batch["attention_mask"])[0])  # the members' mean score

        with torch.no_grad():
            columns[f"reward model {path}"] = {name: torch.cat([right(b) for b in bs]) for name, bs in sets.items()}
            if train:
                # one column per model, named by it
                train_columns[f"{path} on {len(train)} training pairs"] = torch.cat([right(b) for b in batches(train)])

    def share(right: torch.Tensor, indices: list[int]) -> str:
        return f"{float(right[indices].float().mean()):.1%}" if indices else "-"

    rows = []
    for (label, held), (_, trained) in zip(flaw_rows(held_out), flaw_rows(train) if train else flaw_rows(held_out)):
        rows.append([label, str(len(held))] + [share(right["held_out"], held) for right in columns.values()]
                    + [share(right, trained) for right in train_columns.values()])
    rows.append(["arithmetic, eval prompts (held-out facts)", str(len(eval_slips))]
                + [share(right["eval_slips"], list(range(len(eval_slips)))) for right in columns.values()]
                + ["-"] * len(train_columns))
    for name, pairs in probes.items():
        rows.append([name, str(len(pairs))]
                    + [share(right[name], list(range(len(pairs)))) for right in columns.values()]
                    + ["-"] * len(train_columns))
    print_table(["rejected flaw", "pairs", *columns, *train_columns], rows,
                f"Held-out demo pairs ranked right (chosen above rejected), {len(held_out)} pairs", label_columns=2,
                min_width=160)
    return 0


if __name__ == "__main__":
    sys.exit(main())
