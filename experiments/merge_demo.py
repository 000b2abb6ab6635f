"""Model merging on the demo task: the demo pipeline's SFT, DPO and GRPO policies, their merges and ensembles,
each scored on the 300 held-out prompts.

    python rlhf.py pipeline --config configs/demo_ensemble.yaml   # once: writes outputs/demo_ensemble/{sft,dpo,grpo}
    python experiments/merge_demo.py                     # every merge in configs/merge_*.yaml + two ensembles
    python experiments/merge_demo.py --merges ties,dare_ties,slerp --no-ensembles --limit 100

Each merge runs from its example config (``configs/merge_<name>.yaml``: DPO and GRPO merged onto the SFT
model, or interpolated between themselves for slerp and linear) into ``outputs/merged/<name>`` with
``overwrite=true``; the settings are the configs' own, fixed before any held-out prompt was scored (no
tuning on the evaluation set). ``slerp-t0.5`` is the slerp config with a constant ``t=0.5`` instead of
its per-layer schedule. The ensembles need no merge: ``ensemble logprob`` decodes from the mean of DPO's and
GRPO's next-token log-probabilities (``EnsemblePolicy.generate``), ``majority vote`` lets SFT, DPO and
GRPO answer on their own and keeps the most frequent final answer (``EnsemblePolicy.majority_vote``; with
no majority, SFT's answer).

Scoring, as the pipeline's evaluation: greedy decoding, at most ``--max-new-tokens`` (64) tokens, the
prompt rendered with the tokenizer's chat template (``inference_optimizations.chat_prompt_ids``), stopped at
EOS or the end-of-turn marker; a response is correct when the number after its last ``Answer:`` equals the
record's ``answer``. With 300 prompts one standard error is about 2.7 points.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # the modules, bench/tables.py

from tables import print_table  # noqa: E402

import inference_optimizations as io  # noqa: E402
import model_merging as mm  # noqa: E402

INPUTS = ("sft", "dpo", "grpo")
MERGES = ("ties", "dare_ties", "slerp", "slerp-t0.5", "task_arithmetic", "linear", "model_stock", "dare_linear",
          "magnitude_prune")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-dir", default="outputs/demo_ensemble",
                        help="the demo pipeline's output (sft, dpo, grpo)")
    parser.add_argument("--eval", default="data/demo/eval.jsonl", help="held-out prompts with answers")
    parser.add_argument("--merges", default=",".join(MERGES), help=f"comma-separated from {', '.join(MERGES)}")
    parser.add_argument("--no-ensembles", action="store_true", help="skip the two ensemble rows")
    parser.add_argument("--limit", type=int, help="first N held-out prompts only (quick runs)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100, help="prompts per generate call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    args.merges = [m.strip() for m in args.merges.split(",") if m.strip()]
    unknown = [m for m in args.merges if m not in MERGES]
    if unknown:
        parser.error(f"--merges: unknown {', '.join(unknown)}; choose from {', '.join(MERGES)}")
    return args


def load(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def score(texts: list[str], records: list[dict]) -> tuple[float, float]:
    """(exact-match accuracy %, format rate %) of responses against the records' answers."""
    answers = [io._last_answer(t) for t in texts]
    correct = sum(a is not None and a == str(r["answer"]).strip() for a, r in zip(answers, records))
    return 100 * correct / len(records), 100 * sum(a is not None for a in answers) / len(records)


def batched(records: list[dict], size: int, fn: Callable[[list[dict]], list[str]]) -> list[str]:
    out: list[str] = []
    for start in range(0, len(records), size):
        out += fn(records[start:start + size])
    return out


def greedy_texts(model, tokenizer, records: list[dict], args: argparse.Namespace) -> list[str]:
    params = io.SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=False,
                               stop_token_ids=io.stop_token_ids(tokenizer))

    def run(chunk: list[dict]) -> list[str]:
        ids = [io.chat_prompt_ids(tokenizer, r["prompt"]) for r in chunk]
        out = io.generate(model, ids, params, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
        return [tokenizer.decode(t, skip_special_tokens=True) for t in out.token_ids]

    return batched(records, args.batch_size, run)


def run_merge(name: str) -> tuple[Path, float]:
    config_name = "slerp" if name == "slerp-t0.5" else name
    overrides = ["overwrite=true"] + (["t=0.5", "output_dir=outputs/merged/slerp-t0.5"] if name == "slerp-t0.5" else [])
    config = mm.MergeConfig.from_yaml(REPO / "configs" / f"merge_{config_name}.yaml", overrides)
    result = mm.ModelMerger(config).merge()
    return result.output_dir, result.seconds


def describe(name: str) -> str:
    if name == "slerp-t0.5":
        return "slerp dpo<->grpo, t 0.5"
    config = mm.MergeConfig.from_yaml(REPO / "configs" / f"merge_{name}.yaml")
    models = "+".join(Path(m.model).name for m in config.models)
    extra = {"ties": f"density {config.density}", "dare_ties": f"density {config.density}",
             "dare_linear": f"density {config.density}", "magnitude_prune": f"density {config.density}",
             "slerp": "t per layer (attn 0->1, mlp 1->0)"}.get(name, "")
    base = f" onto {Path(config.base_model).name}" if config.base_model else ""
    return f"{name} {models}{base}" + (f", {extra}" if extra else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    demo = Path(args.demo_dir)
    missing = [d for d in INPUTS if not (demo / d / "config.json").is_file()]
    if missing:
        print(f"error: {', '.join(str(demo / d) for d in missing)} missing; run python rlhf.py pipeline --config "
              "configs/demo_ensemble.yaml first", file=sys.stderr)
        return 2
    records = [json.loads(line) for line in Path(args.eval).read_text().splitlines() if line.strip()]
    records = records[:args.limit] if args.limit else records
    rows: list[dict] = []

    def add(row_name: str, kind: str, texts: list[str], seconds: float, merge_seconds: float | None = None) -> None:
        accuracy, fmt = score(texts, records)
        rows.append({"model": row_name, "kind": kind, "accuracy": accuracy, "format": fmt, "eval_s": seconds,
                     "merge_s": merge_seconds})
        print(f"{row_name}: {accuracy:.1f}% exact match, format {fmt:.0f}% ({seconds:.0f} s)", flush=True)

    models = {}
    for name in INPUTS:
        model, tokenizer = load(demo / name)
        models[name] = model
        started = time.perf_counter()
        add(name, "input", greedy_texts(model, tokenizer, records, args), time.perf_counter() - started)
    for name in args.merges:
        directory, merge_seconds = run_merge(name)
        model, tokenizer = load(directory)
        started = time.perf_counter()
        add(describe(name), "merge", greedy_texts(model, tokenizer, records, args), time.perf_counter() - started,
            merge_seconds)
    if not args.no_ensembles:
        stops = io.stop_token_ids(tokenizer)
        prompts = [io.chat_prompt_ids(tokenizer, r["prompt"]) for r in records]
        started = time.perf_counter()
        ensemble = mm.EnsemblePolicy([models["dpo"], models["grpo"]], tokenizer)
        ids = batched(list(range(len(prompts))), args.batch_size,
                      lambda rows_: [tokenizer.decode(c, skip_special_tokens=True) for c in ensemble.generate(
                          [prompts[i] for i in rows_], args.max_new_tokens, stop_token_ids=stops)])
        add("ensemble logprob dpo+grpo", "ensemble", ids, time.perf_counter() - started)
        started = time.perf_counter()
        voters = mm.EnsemblePolicy([models["sft"], models["dpo"], models["grpo"]], tokenizer)
        votes = batched(list(range(len(prompts))), args.batch_size, lambda rows_: [
            f"Answer: {v.answer}" if v.answer is not None else "" for v in voters.majority_vote(
                [prompts[i] for i in rows_], io._last_answer, max_new_tokens=args.max_new_tokens,
                stop_token_ids=stops)])
        add("majority vote sft+dpo+grpo", "ensemble", votes, time.perf_counter() - started)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print_table(["model", "kind", "exact match %", "format %", "merge s", "eval s"],
                [[r["model"], r["kind"], f"{r['accuracy']:.1f}", f"{r['format']:.0f}",
                  "-" if r["merge_s"] is None else f"{r['merge_s']:.1f}", f"{r['eval_s']:.0f}"] for r in rows],
                f"held-out exact match on {len(records)} prompts of {args.eval} (greedy, {args.max_new_tokens} tokens; "
                "one standard error is about 2.7 points at 300)", label_columns=2, wrap_values=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
