"""Pool several seeds of experiments/inference_demo.py: each claim's accuracy averaged over the runs, tested per prompt.

    for s in 0 1 2 3; do python experiments/inference_demo.py ... --seed $s --output runs/seed$s.json; done
    python experiments/combine_seeds.py runs/seed*.json

One run's verdict carries the luck of its seed: its samples, MCTS's expansions and the pools the allocation
rules draw from. Here every prompt's outcome is averaged over the runs first (a prompt MCTS solves in 3
of 4 seeds counts 0.75), and the difference from the claim's baseline row is tested over prompts, which
are the independent units: a paired sign-flip permutation test of the mean difference (two-sided,
``--resamples`` random flips, seeded). The runs must share the held-out prompts and every setting but
``--seed``, with the same rows; each claim row is compared with its own baseline row. Confidence-stopping rows also show
the samples saved, which is their claim (at no lower accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stats import per_prompt_mean, sign_flip_p  # experiments/stats.py (the script's folder is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tables import print_table  # noqa: E402  bench/tables.py


def load_runs(paths: list[str]) -> list[dict]:
    """The runs, each checked to be an inference_demo --output file with per-prompt flags; they must differ
    only in --seed (every other setting and the row layout the same) and not repeat a seed."""
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SystemExit(f"error: {path}: not an inference_demo --output file ({err})") from None
        if not isinstance(run, dict) or not isinstance(run.get("settings"), dict) or not run.get("rows"):
            raise SystemExit(f"error: {path}: not an inference_demo --output file (no settings or rows)")
        if not all(isinstance(row, dict) and "correct" in row for row in run["rows"]):
            raise SystemExit(f"error: {path}: its rows carry no per-prompt flags; rerun experiments/inference_demo.py "
                             "with this version to write them")
        runs.append(run)
    ignore = {"seed", "output"}
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:]):
        keys = (set(first["settings"]) | set(run["settings"])) - ignore
        differ = sorted(k for k in keys if first["settings"].get(k) != run["settings"].get(k))
        if differ:
            raise SystemExit(f"error: {path}: settings differ from {paths[0]} in {', '.join(differ)}; pool runs "
                             "that differ only in --seed")
        layout = [[(r["method"], r["prompts"], r.get("versus"), len(r["correct"])) for r in x["rows"]]
                  for x in (first, run)]
        if layout[0] != layout[1]:
            raise SystemExit(f"error: {path}: its rows are not those of {paths[0]} (method, prompts, baseline, "
                             "prompt count); pool runs of the same version of experiments/inference_demo.py")
    seeds = [run["settings"].get("seed") for run in runs]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"error: seeds {seeds}: a seed given twice would count its luck twice; give each run once")
    return runs


def combine(runs: list[dict], resamples: int, seed: int) -> list[list[str]]:
    """One table row per claim row: mean accuracy over the runs, each run's, and the test. Rows are matched by
    position (load_runs checks the layouts agree)."""
    table = []
    for index, row in enumerate(runs[0]["rows"]):
        if not row.get("claim"):
            continue
        matched = [run["rows"][index] for run in runs]
        base_rows = [run["rows"][row["versus"]] for run in runs]
        method = per_prompt_mean([m["correct"] for m in matched])
        base = per_prompt_mean([b["correct"] for b in base_rows])
        differences = [a - b for a, b in zip(method, base)]
        # the verdict compares integer counts: averages like k/3 are not exact in binary
        ahead = sum(sum(m["correct"]) for m in matched) - sum(sum(b["correct"]) for b in base_rows)
        mean = 100 * ahead / (len(runs) * len(method))
        p = sign_flip_p(differences, resamples, seed)
        note = f"{mean:+.1f} pts, p={p:.2g}"
        if row["claim"] == 4:  # stopping: fewer samples at no lower accuracy, as inference_demo's stopping_verdict
            saved = 1 - sum(m["mean_samples"] for m in matched) / len(matched) / runs[0]["settings"]["n"]
            note += f"; {100 * saved:.0f}% fewer samples"
            verdict = "holds" if saved > 0 and ahead >= 0 else "does not hold"
        else:
            verdict = "holds" if ahead > 0 and p < 0.05 else ("not shown" if ahead > 0 else "does not hold")
        table.append([f"{row['claim']}", row["method"].strip(), row["prompts"], base_rows[0]["method"].strip(),
                      f"{100 * sum(base) / len(base):.1f}%", f"{100 * sum(method) / len(method):.1f}%",
                      " / ".join(f"{m['accuracy']:.1f}" for m in matched), note, verdict])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="inference_demo.py --output files, one per seed")
    parser.add_argument("--resamples", type=int, default=20000, help="random sign flips (default 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sign flips")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs to pool")
    if args.resamples < 1:
        parser.error(f"--resamples {args.resamples}: give a number of random sign flips >= 1")
    runs = load_runs(args.runs)
    seeds = [run["settings"]["seed"] for run in runs]
    table = combine(runs, args.resamples, args.seed)
    print_table(["claim", "method", "prompts", "baseline", "baseline acc.", "mean acc.", "per seed", "vs baseline",
                 "verdict"], table, f"{len(runs)} runs pooled (seeds {', '.join(map(str, seeds))}); per-prompt "
                "outcomes averaged over the runs, paired sign-flip test over prompts", label_columns=3,
                min_width=220)
    return 0


if __name__ == "__main__":
    sys.exit(main())
