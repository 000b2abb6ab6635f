#!/usr/bin/env python3
"""Real pretrained models learn: held-out accuracy of the base model, after SFT and after each RL stage, over seeds.

    python scripts/fetch_real_models.py                               # SmolLM2-135M-Instruct and Gemma 3 270M (once)
    python experiments/real_models.py --seeds 0,1,2                   # SmolLM2: SFT, then GRPO and online DPO from it
    python experiments/real_models.py --model gemma3 --stages sft     # Gemma 3 270M: SFT
    python experiments/real_models.py --table-only --seeds 0,1,2      # the table of runs already made

Each stage is one command, ``python rlhf.py train examples/real_models/<model>_<stage>.yaml seed=S
output_dir=...`` (printed before it starts, so any row can be rerun by hand): SFT from the base model on 400 of the
careless teacher's demonstrations, then GRPO (40 steps of 4 prompts x 8 answers) and online DPO (40 steps of 16
prompts x 2 answers), each from that seed's SFT model, rewarded by the exact-answer verifier on the demo's RL
prompts (no prompt of the held-out set). The files hold every setting; this script only changes the seed and the
output folder, and where each RL stage starts.

Held-out accuracy is measured twice, on the 300 prompts of ``demo_eval`` (greedy, 64 new tokens): by the trainer's
own evaluation (``eval/accuracy`` in the stage's report) and by an evaluator that shares nothing with the training
code (``bench/bench_real_learning.py``'s ``evaluate_folder``: plain transformers, the saved tokenizer's chat
template, ``generate``, its own ``Answer:`` regex). A base model without a chat template (Gemma 3 270M) is evaluated
with Gemma 3's own template (``tests/real_models.py``). The table shows both, the wall time of every stage
(evaluation included) and the whole chain's, and the mean gain over seeds with its sign-flip p-value per prompt.
Results go to ``--out/<model>/seed<S>/results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO, REPO / "bench", REPO / "experiments", REPO / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

MODELS = {"smollm2": "~/.cache/rlhf/models/SmolLM2-135M-Instruct", "gemma3": "~/.cache/rlhf/models/gemma-3-270m"}
STAGES = ("sft", "grpo", "online_dpo")
EVAL_PROMPTS = 300


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="which fetched model (default smollm2)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--stages", default="sft,grpo,online_dpo", help=f"subset of {','.join(STAGES)}, in order")
    parser.add_argument("--out", default="outputs/real_models", help="folder of the runs")
    parser.add_argument("--table-only", action="store_true", help="print the table of the runs already made")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override for every stage (repeatable)")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        parser.error(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(STAGES)}")
    return args


def config_file(model: str, stage: str) -> Path:
    return REPO / "examples" / "real_models" / f"{model}_{stage}.yaml"


def eval_records() -> list[dict]:
    import rlhf

    records = rlhf.load_records("demo_eval", REPO / "data" / "demo", "prompt", max_samples=EVAL_PROMPTS)
    return [{"prompt": r["messages"][-1]["content"], "answer": str(r["answer"])} for r in records]


def independent_accuracy(folder: Path, records: list[dict]) -> dict:
    """bench_real_learning's evaluator (plain transformers) on ``folder``; a tokenizer without a chat template gets
    the model family's own (Gemma 3's), written into a scratch copy of the folder's tokenizer files."""
    import shutil
    import tempfile

    from bench_real_learning import evaluate_folder
    from transformers import AutoTokenizer

    folder = Path(folder).expanduser().resolve()
    if AutoTokenizer.from_pretrained(str(folder)).chat_template:
        return evaluate_folder(str(folder), records, batch_size=64, max_new_tokens=64)
    import real_models

    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "model"
        copy.mkdir()
        for item in folder.iterdir():
            (copy / item.name).symlink_to(item)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        tokenizer.chat_template = real_models.GEMMA3_TEMPLATE
        for name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "special_tokens_map.json"):
            (copy / name).unlink(missing_ok=True)
        tokenizer.save_pretrained(copy)
        result = evaluate_folder(str(copy), records, batch_size=64, max_new_tokens=64)
        shutil.rmtree(copy, ignore_errors=True)
    return {**result, "template": "Gemma 3's (tests/real_models.py), the base model has none"}


def run_stage(args: argparse.Namespace, seed: int, stage: str, start: str, output: Path) -> dict:
    command = [sys.executable, "rlhf.py", "train", str(config_file(args.model, stage).relative_to(REPO)),
               f"seed={seed}", f"output_dir={output}", "overwrite_output_dir=true", "disable_progress_bar=true",
               *([] if stage == "sft" else [f"model_name_or_path={start}"]), *args.set]
    print("$ " + " ".join(command), flush=True)
    started = time.time()
    subprocess.run(command, cwd=REPO, check=True)
    seconds = time.time() - started
    entry = json.loads((output / "report.json").read_text())["stages"][-1]
    return {"seconds": seconds, "trainer_accuracy": entry["eval"].get("eval/accuracy"),
            "trainer_accuracy_before": (entry.get("eval_before") or {}).get("eval/accuracy"),
            "steps": entry["global_step"], "command": " ".join(command[1:])}


def run_seed(args: argparse.Namespace, seed: int, records: list[dict]) -> dict:
    folder = Path(args.out) / args.model / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"model": args.model, "seed": seed, "stages": {}}
    if "base" not in results:
        results["base"] = {"independent": independent_accuracy(Path(MODELS[args.model]), records)}
        path.write_text(json.dumps(results, indent=1))
    for stage in args.stages:
        start = folder / "sft"
        results["stages"][stage] = run_stage(args, seed, stage, MODELS[args.model] if stage == "sft" else str(start),
                                             folder / stage)
        results["stages"][stage]["independent"] = independent_accuracy(folder / stage, records)
        path.write_text(json.dumps(results, indent=1))
    return results


def table(args: argparse.Namespace) -> None:
    from stats import sign_flip_p
    from tables import print_table

    runs = []
    for seed in args.seeds:
        path = Path(args.out) / args.model / f"seed{seed}" / "results.json"
        if path.exists():
            runs.append(json.loads(path.read_text()))
    if not runs:
        print(f"no runs under {args.out}/{args.model}")
        return
    rows = []
    for run in runs:
        stages = run["stages"]
        chain = sum(stages[s]["seconds"] for s in ("sft", "grpo") if s in stages)
        row = [str(run["seed"]), f"{run['base']['independent']['accuracy']:.1%}"]
        for stage in STAGES:
            if stage in stages:
                ours, independent = stages[stage]["trainer_accuracy"], stages[stage]["independent"]["accuracy"]
                row.append(f"{independent:.1%} ({ours:.1%})" if ours is not None else f"{independent:.1%}")
                row.append(f"{stages[stage]['seconds'] / 60:.1f}")
            else:
                row += ["-", "-"]
        row.append(f"{chain / 60:.1f}")
        rows.append(row)
    headers = ["seed", "base", "SFT", "min", "GRPO", "min", "online DPO", "min", "SFT+GRPO min"]
    print_table(headers, rows, title=f"{args.model}: held-out exact match on {EVAL_PROMPTS} prompts, independent "
                                     f"evaluator (trainer's own in brackets)", label_columns=1)
    for stage, before in (("sft", None), ("grpo", "sft"), ("online_dpo", "sft")):
        pairs = [(r["stages"][stage]["independent"]["accuracy"],
                  r["base"]["independent"]["accuracy"] if before is None
                  else r["stages"][before]["independent"]["accuracy"])
                 for r in runs if stage in r["stages"] and (before is None or before in r["stages"])]
        if not pairs:
            continue
        gains = [a - b for a, b in pairs]
        line = (f"{stage}: mean gain {statistics.fmean(gains) * 100:+.1f} points over "
                f"{'the base' if before is None else before}"
                f" (per seed {', '.join(f'{g * 100:+.1f}' for g in gains)})")
        flags = [(r["stages"][stage]["independent"].get("correct_flags"),
                  (r["base"] if before is None else r["stages"][before])["independent"].get("correct_flags"))
                 for r in runs if stage in r["stages"] and (before is None or before in r["stages"])]
        if all(a and b for a, b in flags):
            per_prompt = [statistics.fmean(float(x) - float(y) for x, y in zip(a, b)) for a, b in
                          zip(zip(*[f[0] for f in flags]), zip(*[f[1] for f in flags]))]
            line += f", sign-flip p = {sign_flip_p(per_prompt, 10000, 0):.4f} over {len(per_prompt)} prompts"
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.table_only:
        records = eval_records()
        for seed in args.seeds:
            run_seed(args, seed, records)
    table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
