"""Where the careless-teacher demo's accuracy goes: held-out exact match of each policy, split by whether
the problem needs a borrow, and how many greedy answers are the teacher's habit (the forgotten borrow).

    python rlhf.py pipeline --config experiments/configs/demo_careless.yaml # once: outputs/demo_careless/{sft,dpo,grpo}
    python experiments/careless_breakdown.py                                # those three policies
    python experiments/careless_breakdown.py --policies outputs/demo_careless/sft,outputs/grpo --sample-temperature 0.6

Greedy answers to data/demo/eval.jsonl (300 prompts whose facts no training file works out), through the
same generation path as the pipeline's evaluation. A problem "needs a borrow" when one of its subtractions
takes more units than the minuend has (52 - 7); the habit answer is the result of working every such step
without the borrow (52 - 7 = 55), as scripts/make_demo_data.py writes the careless demonstrations. With
``--sample-temperature``, each policy also draws ``--samples`` answers per borrow problem at that
temperature: the per-sample accuracy and the share of problems where any sample is right are what GRPO's
groups can learn from. The last column compares each policy's greedy answers with the first policy's,
prompt by prompt: how many it gets right that the first gets wrong, the reverse, and the exact McNemar p.

With ``--pool``, the policies after the first are runs of one recipe that differ only in their seed (say
four PPO runs): a last row averages each prompt's outcome over them and tests the difference from the
first policy over prompts with the paired sign-flip test (experiments/stats.py, as experiments/combine_seeds.py uses
it). One run's McNemar carries its seed's luck; the pooled row is what a claim about the recipe rests on.

    python experiments/careless_breakdown.py --pool --policies outputs/demo_careless/sft,runs/ppo_seed0,runs/ppo_seed1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from stats import mcnemar, per_prompt_mean, sign_flip_p  # experiments/stats.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "scripts")]  # rlhf, bench/tables.py, the demo generator

import make_demo_data as demo  # noqa: E402
from tables import print_table  # noqa: E402

import rlhf  # noqa: E402

CLASSES = ("1-step", "1-step borrow", "multi", "multi borrow")


def class_of(problem: demo.Problem) -> str:
    return ("multi" if problem.is_multi else "1-step") + (" borrow" if demo.has_borrow(problem) else "")


def answers(policy: rlhf.PolicyModel, formatter: rlhf.ChatFormatter, records: list[dict],
            **sampling) -> list[str | None]:
    completions = policy.generate([formatter.prompt_ids(r) for r in records], max_new_tokens=64,
                                  stop_token_ids=formatter.stop_token_ids, batch_size=100, **sampling)
    return [rlhf.extract_answer(policy.decode(ids)) for ids in completions]


def share(outcomes: list[float]) -> str:
    """The mean outcome as a percentage, or '-' for a kind of problem the prompts do not have."""
    return f"{sum(outcomes) / len(outcomes):.1%}" if outcomes else "-"


def pooled_row(outcomes: list[list[bool]], classes: list[str], habit_counts: list[int], *, columns: int,
               resamples: int, seed: int) -> list[str]:
    """The runs after the first, pooled: each prompt's outcome averaged over them, against the first policy."""
    runs = outcomes[1:]
    mean = per_prompt_mean(runs)
    row = [f"mean of {len(runs)} runs", f"{sum(mean) / len(mean):.1%}"]
    for name in CLASSES:
        row.append(share([m for m, c in zip(mean, classes) if c == name]))
    row.append(f"{sum(habit_counts[1:]) / len(runs):.1f}")
    row += [""] * (columns - len(row))  # the sampled columns, which a pooled row leaves empty
    # the points ahead from integer counts: averages like k/3 are not exact in binary
    ahead = 100 * (sum(map(sum, runs)) - len(runs) * sum(outcomes[0])) / (len(runs) * len(mean))
    p = sign_flip_p([m - b for m, b in zip(mean, outcomes[0])], resamples, seed)
    row.append(f"{ahead:+.1f} pts, sign-flip p={p:.2g}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="outputs/demo_careless/sft,outputs/demo_careless/dpo,"
                        "outputs/demo_careless/grpo", help="comma-separated policy directories")
    parser.add_argument("--eval", default=str(REPO / "data/demo/eval.jsonl"), help="held-out prompts with answers")
    parser.add_argument("--sample-temperature", type=float, default=0.0,
                        help="also sample the borrow problems at this temperature (default 0: greedy only)")
    parser.add_argument("--samples", type=int, default=8, help="samples per borrow problem (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pool", action="store_true",
                        help="the policies after the first are seeds of one recipe: add their pooled row, tested "
                             "against the first policy over prompts (paired sign-flip test)")
    parser.add_argument("--resamples", type=int, default=20000, help="sign flips for --pool's test")
    args = parser.parse_args()
    rlhf.pin_cpu_kernels()  # the same figures on any x86-64 CPU (see README, 'The run is deterministic')
    torch.set_num_threads(args.threads)
    paths = args.policies.split(",")
    for path in paths:
        if not (Path(path) / "config.json").is_file():
            parser.error(f"--policies: {path} holds no saved model; run "
                         f"`python rlhf.py pipeline --config experiments/configs/demo_careless.yaml` first")
    if args.sample_temperature < 0 or args.samples < 1:
        parser.error("--sample-temperature must be >= 0 and --samples >= 1")
    if args.pool and len(paths) < 2:
        parser.error("--pool needs the baseline policy and at least one run of the recipe in --policies")
    if args.resamples < 1:
        parser.error("--resamples must be >= 1")

    try:
        records = rlhf.load_records(args.eval, REPO / "data/demo", "prompt")
    except rlhf.RLHFInputError as error:  # a missing file or a bad record: its file:line, in one line
        parser.error(f"--eval: {error}")
    problems = [demo.Problem.from_prompt(r["messages"][0]["content"]) for r in records]
    classes = [class_of(p) for p in problems]
    habits = [str(demo.careless_steps(p)[-1][3]) if demo.has_borrow(p) else None for p in problems]
    borrow = [r for r, p in zip(records, problems) if demo.has_borrow(p)]
    headers = ["policy", "held-out", *(f"{c} ({classes.count(c)})" for c in CLASSES), "habit"]
    if args.sample_temperature:
        headers += [f"borrow T {args.sample_temperature}", f"any of {args.samples}"]
    rows, outcomes, habit_counts = [], [], []
    for path in paths:
        policy = rlhf.PolicyModel.from_pretrained(path)
        policy.model.eval()
        formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
        greedy = answers(policy, formatter, records)
        right = [a == r["answer"] for a, r in zip(greedy, records)]
        row = [path, f"{sum(right) / len(right):.1%}"]
        for name in CLASSES:
            row.append(share([ok for ok, c in zip(right, classes) if c == name]))
        habit_counts.append(sum(a is not None and a == h for a, h in zip(greedy, habits)))
        row.append(str(habit_counts[-1]))
        if args.sample_temperature:
            torch.manual_seed(args.seed)
            repeated = [r for r in borrow for _ in range(args.samples)]
            sampled = answers(policy, formatter, repeated, do_sample=True, temperature=args.sample_temperature)
            hits = [a == r["answer"] for a, r in zip(sampled, repeated)]
            groups = [hits[i:i + args.samples] for i in range(0, len(hits), args.samples)]
            row += [f"{sum(hits) / len(hits):.1%}", f"{sum(map(any, groups)) / len(groups):.1%}"]
        if outcomes:  # the first policy's greedy outcomes are the others' reference
            better, worse, p = mcnemar(right, outcomes[0])
            row.append(f"{better} / {worse}, p={p:.2g}")
        else:
            row.append("")
        outcomes.append(right)
        rows.append(row)
    if args.pool:
        rows.append(pooled_row(outcomes, classes, habit_counts, columns=len(headers), resamples=args.resamples,
                               seed=args.seed))
    headers.append(f"vs {Path(paths[0]).name}: better / worse, McNemar p")
    print_table(headers, rows, f"Held-out exact match by problem kind, {len(records)} prompts "
                f"({len(borrow)} need a borrow); "
                "habit: greedy answers that are the forgotten borrow; borrow T / any of: sampled answers to the "
                "borrow problems right, per sample / per problem", min_width=160)
    return 0


if __name__ == "__main__":
    sys.exit(main())
