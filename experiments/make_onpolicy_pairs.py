"""On-policy preference pairs for a verifier (Math-Shepherd-style automatic supervision).

    python experiments/make_onpolicy_pairs.py --policy outputs/demo_ensemble/sft --out outputs/onpolicy_pairs

Samples ``--samples`` responses per prompt of data/demo/rl_prompts.jsonl (not held out) from the
policy, keeps prompts where some samples are right and some wrong (by the final ``Answer:`` line),
and pairs a right one (chosen) with a wrong one (rejected), up to ``--pairs-per-prompt`` distinct
pairs. A reward model or process reward model trained on these sees the mistakes the policy itself
makes, which the demo's synthetic slips (preference.jsonl) do not cover; step labels come from the
arithmetic checker at training time (``prm_step_labeler: arithmetic``). Writes pairs.jsonl and a
dataset_info.json registering it as ``onpolicy_pairs``.

``--mix FILE ...`` also writes mixed.jsonl, registered as ``onpolicy_mixed``: the pairs of those files (say
data/demo/rm_pairs_careless.jsonl) and the new ones, shuffled with ``--seed``, for a reward model that
should learn both the synthetic flaws and the policy's own:

    python experiments/make_onpolicy_pairs.py --policy outputs/demo_careless/sft \
        --prompts data/demo/rl_prompts.jsonl data/demo/sft_careless.jsonl --skip 200 --samples 16 \
        --temperature 0.6 --pairs-per-prompt 4 --mix data/demo/rm_pairs_careless.jsonl --out outputs/onpolicy_sft
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # inference_optimizations, the demo generator

import make_demo_data as demo  # noqa: E402

import inference_optimizations as io  # noqa: E402


def demo_answer(prompt: str) -> str | None:
    """The answer of a demo prompt ('What is 52 - 7?', 'Compute 12 + 7 - 5.'), for files without one (sft.jsonl)."""
    problem = demo.Problem.from_prompt(prompt)
    return None if problem is None else str(problem.answer)


def read_records(path: str) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; a file that cannot be read, a line that is not JSON or
    a record without a prompt is one error line naming the file (and line)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise SystemExit(f"{path}: cannot read it ({err.strerror}); give JSONL files with a 'prompt' "
                         "per line") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}:{number}: not JSON ({err.msg}); one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise SystemExit(f"{path}:{number}: no 'prompt' string in this record")
        records.append((number, record))
    return records


def load_prompts(paths: list[str], skip: int) -> list[dict]:
    """Records with a prompt and an answer from every file, once each. The first ``skip`` lines of each file
    are left out, and so are their prompts wherever else they appear."""
    parsed = {path: read_records(path) for path in paths}
    seen = {record["prompt"] for path in paths for _, record in parsed[path][:skip]}
    records = []
    for path in paths:
        for number, record in parsed[path][skip:]:
            answer = record.get("answer", demo_answer(record["prompt"]))
            if answer is None:
                raise SystemExit(f"{path}:{number}: no 'answer' and no arithmetic in the prompt to compute it from")
            if record["prompt"] not in seen:
                seen.add(record["prompt"])
                records.append({"prompt": record["prompt"], "answer": str(answer)})
    return records


def read_pair_lines(path: str) -> list[str]:
    """The records of a pairs file as JSON lines (json.dumps, as the demo files are written), each checked to hold
    a prompt, a chosen and a rejected string."""
    lines = []
    for number, record in read_records(path):
        for key in ("chosen", "rejected"):
            if not isinstance(record.get(key), str):
                raise SystemExit(f"{path}:{number}: no '{key}' string in this record; --mix takes preference pairs")
        lines.append(json.dumps(record) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="outputs/demo_ensemble/sft", help="policy directory")
    parser.add_argument("--prompts", nargs="+", default=["data/demo/rl_prompts.jsonl"],
                        help="JSONL files with a prompt and an answer (a demo prompt without one, as in sft.jsonl, "
                             "gets the answer of its arithmetic); a prompt in several files is used once")
    parser.add_argument("--out", default="outputs/onpolicy_pairs", help="output directory")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first N prompts of each file, wherever they appear "
                             "(experiments/inference_demo.py chooses its settings on the "
                             "first 200 of rl_prompts.jsonl: pass --skip 200 to keep a reward model off them)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--pairs-per-prompt", type=int, default=2, help="at most this many pairs per prompt")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", nargs="+", default=[], metavar="FILE",
                        help="pairs files to mix with the new pairs into mixed.jsonl (dataset onpolicy_mixed), "
                             "shuffled")
    args = parser.parse_args(argv)
    if args.skip < 0:
        parser.error(f"--skip {args.skip}: give the number of leading prompts to leave out (0 or more)")
    if not (Path(args.policy) / "config.json").is_file():
        parser.error(f"--policy {args.policy}: no model there (no config.json); give a directory saved by rlhf.py")
    records = load_prompts(args.prompts, args.skip)  # bad input fails before the model loads
    mixed_in = [line for path in args.mix for line in read_pair_lines(path)]
    io.pin_cpu_kernels()  # the same pairs on any x86-64 CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    params = io.SamplingParams(max_new_tokens=64, temperature=args.temperature, n=args.samples, seed=args.seed,
                               stop_token_ids=io.stop_token_ids(tokenizer))
    pairs, contrasted = [], 0
    for start in range(0, len(records), args.batch_size):
        chunk = records[start:start + args.batch_size]
        out = io.generate(model, [io.chat_prompt_ids(tokenizer, r["prompt"]) for r in chunk], params,
                          pad_token_id=tokenizer.pad_token_id)
        texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.token_ids]
        for i, record in enumerate(chunk):
            samples = list(dict.fromkeys(texts[i * args.samples:(i + 1) * args.samples]))
            right = [s for s in samples if io._last_answer(s) == str(record["answer"])]
            wrong = [s for s in samples if io._last_answer(s) != str(record["answer"])]
            if not right or not wrong:
                continue
            contrasted += 1
            combos = [(c, r) for c in right for r in wrong]
            for chosen, rejected in rng.sample(combos, min(args.pairs_per_prompt, len(combos))):
                pairs.append({"prompt": record["prompt"], "chosen": chosen, "rejected": rejected})
        print(f"{min(start + args.batch_size, len(records))}/{len(records)} prompts, {len(pairs)} pairs", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    info = {"onpolicy_pairs": {"file_name": "pairs.jsonl", "ranking": True, "columns": columns}}
    if args.mix:
        lines = mixed_in + [json.dumps(p) + "\n" for p in pairs]
        random.Random(args.seed).shuffle(lines)  # a fresh generator: the mix does not depend on how pairs were drawn
        (out_dir / "mixed.jsonl").write_text("".join(lines))
        info["onpolicy_mixed"] = {"file_name": "mixed.jsonl", "ranking": True, "columns": columns}
    (out_dir / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"{len(pairs)} pairs from {contrasted} of {len(records)} prompts with both right and wrong samples "
          f"-> {out_dir}"
          + (f" (mixed.jsonl: with {len(mixed_in)} pairs of {', '.join(args.mix)})" if args.mix else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
