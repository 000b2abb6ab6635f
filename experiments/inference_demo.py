"""Inference-time compute on the demo task: Best-of-N, MCTS, adaptive allocation, confidence stopping.

    python experiments/inference_demo.py --output inference_demo.json   # everything: about 2 min on 2 cores
    python experiments/inference_demo.py --limit 50 --mcts-limit 10     # a quick run
    python experiments/inference_demo.py --threads 1 ...                # on a busy machine (see --threads)

The acceptance claims of the inference-time-compute issue, measured as hypotheses on held-out prompts:

  1. Best-of-8 reranked by the trained reward model beats greedy accuracy (data/demo/eval.jsonl);
  2. MCTS with the process reward model as value function beats greedy on the multi-step problems
     (data/demo/multistep.jsonl);
  3. adaptive allocation beats uniform allocation at the same total number of samples (eval), with the
     answer picked by majority vote or by the reward model;
  4. confidence-based stopping saves samples at equal accuracy (eval).

A response is correct when its last ``Answer: N`` equals the record's answer. Everything is decided
before the held-out sets are touched, on a validation slice of data/demo/rl_prompts.jsonl (training
prompts with answers, not held out): the sampling temperature of Best-of-N (best Best-of-8 + RM
accuracy), the temperature of the voting methods (best majority-of-8 accuracy), the confidence-stopping
setting (fewest mean samples at a validation accuracy no lower than the fixed 8-sample vote), the share
of prompts that the "lowest-scored share" reranking rule gives its extra samples (``--flag-shares``) and,
optionally (``--mcts-temperatures`` with several values), the MCTS temperature on the slice's
multi-step prompts. Fixed settings can be given instead (``--temperature``, ``--vote-temperature``,
``--stop-agreement``/``--stop-min-samples``, one MCTS temperature): no sweep then. Confidence stopping
is also measured with Adaptive-Consistency's Beta rule at a threshold fixed in advance (``--stop-beta``,
default 0.95, the paper's), which nothing is tuned for.

How samples are shared (common random numbers): for each held-out prompt a pool of ``--pool`` i.i.d.
samples is drawn once (one batched ``generate`` call per group of prompts, ``BestOfNSampler.candidates``).
Best-of-8, the oracle and the majority vote use its first 8; uniform allocation takes the first k
of a prompt's pool, adaptive allocation the pilot plus as many further pool samples as it is given
(difficulty: the pilot's disagreement or reward-score spread under the vote, the best pilot score's
shortfall below the median under reward-model reranking, which samples the Best-of-N pool);
confidence stopping reads the pool one sample at a time and stops when ``ConfidenceBasedStopping``
says so. Reading i.i.d. samples in order is the same in distribution as drawing them one by one,
and it makes every comparison paired (the same samples on both sides), so differences come from the
method, not from sampling luck. Each "delta" note gives a paired bootstrap interval over prompts
(95%), the discordant prompts (method right and baseline wrong / the reverse) and the exact McNemar
p-value. A "beats" claim holds when the method is ahead with p < 0.05; ahead with p >= 0.05 is
reported as not shown. Confidence stopping holds when it uses fewer samples at an accuracy no lower
than the fixed vote. Rows marked "(context)" are not claims: the first sample, the majority vote and
the oracle of the same 8 samples, and Best-of-8 reranked by the demo's rule-based arithmetic step
checker (``rlhf.arithmetic_step_labels``) in place of the learned reward model, which shows what a
reward model that could check the arithmetic would buy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from stats import mcnemar  # experiments/stats.py (the script's folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # inference_optimizations, bench/tables.py

from tables import print_table  # noqa: E402

import inference_optimizations as io  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x.strip()]

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x.strip()]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="outputs/demo_ensemble/sft", help="policy model directory")
    parser.add_argument("--reward", default="outputs/demo_ensemble/rm",
                        help="outcome reward model saved by rlhf's rm stage")
    parser.add_argument("--prm", default="outputs/prm", help="process reward model saved by rlhf's prm stage")
    parser.add_argument("--eval", default="data/demo/eval.jsonl", help="held-out prompts with answers")
    parser.add_argument("--multistep", default="data/demo/multistep.jsonl", help="held-out multi-step problems")
    parser.add_argument("--validation", default="data/demo/rl_prompts.jsonl",
                        help="prompts with answers (not held out) on which settings are chosen")
    parser.add_argument("--validation-limit", type=int, default=200, help="first N validation prompts (default 200)")
    parser.add_argument("--limit", type=int, help="first N prompts of each held-out set (quick runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch intra-op threads (default 2; on a machine busy with other jobs 1 thread can "
                        "be many times faster, as spinning threads contend)")
    parser.add_argument("--engine", default="auto", choices=io.GENERATION_ENGINES)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    # Best-of-N and the shared sample pool
    parser.add_argument("-n", type=int, default=8,
                        help="Best-of-N / majority / oracle / fixed-vote samples (default 8)")
    parser.add_argument("--pool", type=int, default=16, help="i.i.d. samples drawn per held-out prompt (default 16)")
    parser.add_argument("--temperatures", type=floats, default=[0.3, 0.5, 0.7, 1.0],
                        help="validation sweep of the sampling temperature (default 0.3,0.5,0.7,1.0)")
    parser.add_argument("--temperature", type=float, help="Best-of-N temperature (skips its sweep)")
    parser.add_argument("--vote-temperature", type=float, help="temperature of the voting methods (skips its sweep)")
    # adaptive allocation
    parser.add_argument("--pilot", type=int, default=2, help="pilot samples per prompt (default 2)")
    parser.add_argument("--budget-per-prompt", type=int, default=4,
                        help="total samples per prompt on average, pilot included, in both arms (default 4)")
    parser.add_argument("--max-per-prompt", type=int, default=16, help="adaptive cap per prompt, pilot included")
    parser.add_argument("--flag-shares", type=floats, default=[0.1, 0.2, 0.33, 0.5],
                        help="for the 'lowest-scored share' reranking rule: shares of the prompts (those whose best "
                             "pilot score is lowest) that receive the extra samples, swept on validation "
                             "(one value: fixed)")
    # confidence stopping
    parser.add_argument("--stop-agreement", type=floats, default=[0.6, 0.7, 0.8, 1.0],
                        help="agreement values to sweep on validation (one value: fixed)")
    parser.add_argument("--stop-min-samples", type=ints, default=[2, 3, 4],
                        help="min_samples values to sweep on validation (one value: fixed)")
    parser.add_argument("--stop-beta", type=float, default=0.95,
                        help="also run Adaptive-Consistency's Beta rule at this fixed threshold, untuned "
                        "(default 0.95, the paper's; 0: skip)")
    # MCTS
    parser.add_argument("--mcts-limit", type=int, help="first N multi-step problems for MCTS and its greedy baseline")
    parser.add_argument("--mcts-expansions", type=int, default=4)
    parser.add_argument("--mcts-max-nodes", type=int, default=32)
    parser.add_argument("--mcts-c-puct", type=float, default=1.0)
    parser.add_argument("--mcts-temperatures", type=floats, default=[0.3, 0.7, 1.0],
                        help="MCTS temperature; several values are swept on validation multi-step prompts")
    parser.add_argument("--mcts-validation", type=int, default=30, help="validation multi-step prompts for the sweep")
    parser.add_argument("--mcts-max-depth", type=int, default=8)
    parser.add_argument("--mcts-max-step-tokens", type=int, default=24)
    parser.add_argument("--skip-mcts", action="store_true")
    parser.add_argument("--output", help="write the table rows (and the settings and sweeps) as JSON here")
    args = parser.parse_args(argv)
    if args.n > args.pool or args.pilot > args.budget_per_prompt or args.max_per_prompt > args.pool:
        parser.error("need -n <= --pool, --pilot <= --budget-per-prompt and --max-per-prompt <= --pool")
    if args.budget_per_prompt > args.pool or min(args.n, args.pilot, args.max_new_tokens) < 1:
        parser.error("need --budget-per-prompt <= --pool and -n, --pilot, --max-new-tokens >= 1")
    if args.stop_beta and not 0.5 < args.stop_beta < 1:
        parser.error(f"--stop-beta {args.stop_beta}: give a threshold between 0.5 and 1 (0 skips the Beta rule)")
    return args


# -- helpers --------------------------------------------------------------------------------------------------

def read_records(path: str, limit: int | None) -> list[dict]:
    records = [json.loads(line) for line in (REPO / path).read_text().splitlines() if line.strip()]
    return records[:limit] if limit else records


def correct(text: str, answer) -> bool:
    return io._last_answer(text) == str(answer).strip()


def vote(answers: list) -> object:
    """Majority vote (ties: the answer seen first)."""
    return io.answer_agreement(answers)[0]


def bootstrap_delta(a: list[bool], b: list[bool], seed: int, resamples: int = 2000) -> tuple[float, float, float]:
    """Paired bootstrap of mean(a) - mean(b) over prompts: (delta, low, high) in points, 95%."""
    rng = random.Random(seed)
    n = len(a)
    diff = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    stats = sorted(sum(diff[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return 100 * sum(diff) / n, 100 * stats[int(0.025 * resamples)], 100 * stats[int(0.975 * resamples) - 1]


def delta_note(a: list[bool], b: list[bool], seed: int, versus: str) -> str:
    d, lo, hi = bootstrap_delta(a, b, seed)
    wins, losses, p = mcnemar(a, b)
    return f"{d:+.1f} pts vs {versus} [{lo:+.1f}, {hi:+.1f}], {wins}/{losses} discordant, p={p:.2g}"


def verdict(a: list[bool], b: list[bool]) -> str:
    """'a beats b': holds when a is ahead and McNemar's p < 0.05; ahead but p >= 0.05 is not shown."""
    ahead = pct(a) - pct(b)
    p = mcnemar(a, b)[2]
    if ahead <= 0:
        return f"does NOT hold ({ahead:+.1f} pts)"
    return (f"holds ({ahead:+.1f} pts, p={p:.2g})" if p < 0.05
            else f"not shown: {ahead:+.1f} pts is within noise (p={p:.2g})")


def verifier_score(text: str) -> float:
    """The demo's rule-based step checker (rlhf.arithmetic_response_labels: each 'a op b = c' holds, the
    Answer equals the last result, and a response that ends without an Answer fails its last step):
    share of checked steps that pass; context, not a trained model."""
    import rlhf

    labels = [x for x in rlhf.arithmetic_response_labels(rlhf.split_steps(text, "\n")) if x is not None]
    return sum(labels) / len(labels) if labels else 0.0


def pct(flags: list[bool]) -> float:
    return 100 * sum(flags) / max(len(flags), 1)


class Policy:
    def __init__(self, directory: str, engine: str, max_new_tokens: int, batch_size: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModelForCausalLM.from_pretrained(directory).eval()
        self.engine, self.max_new_tokens, self.batch_size = engine, max_new_tokens, batch_size
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def greedy(self, prompts: list[str]) -> list[str]:
        params = io.SamplingParams(max_new_tokens=self.max_new_tokens, do_sample=False,
                                   stop_token_ids=io.stop_token_ids(self.tokenizer))
        texts = []
        for start in range(0, len(prompts), self.batch_size):
            ids = [io.chat_prompt_ids(self.tokenizer, p) for p in prompts[start:start + self.batch_size]]
            out = io.generate(self.model, ids, params, pad_token_id=self.pad, tokenizer=self.tokenizer,
                              engine=self.engine)
            texts += [self.tokenizer.decode(t, skip_special_tokens=True) for t in out.token_ids]
        return texts

    def samples(self, prompts: list[str], n: int, temperature: float, seed: int, reward_fn=None) -> list[list[str]]:
        params = io.SamplingParams(max_new_tokens=self.max_new_tokens, temperature=temperature, seed=seed)
        sampler = io.BestOfNSampler(self.model, self.tokenizer, reward_fn, n=n, params=params, engine=self.engine,
                                    prompts_per_batch=max(1, self.batch_size * 8 // n))
        return sampler.candidates(prompts)


def score_pool(scorer, prompts: list[str], pool: list[list[str]]) -> list[list[float]]:
    flat = scorer([p for p, row in zip(prompts, pool) for _ in row], [c for row in pool for c in row]).tolist()
    out, at = [], 0
    for row in pool:
        out.append(flat[at:at + len(row)])
        at += len(row)
    return out


def best_by_score(row_scores: list[float], row_ok: list[bool], k: int) -> bool:
    """Whether the highest-scored of a prompt's first k samples is right (the first one on a tie)."""
    return row_ok[max(range(k), key=lambda i: row_scores[i])]


def pool_stats(records: list[dict], pool: list[list[str]], scores: list[list[float]], n: int) -> dict:
    """Accuracy of the first sample, Best-of-n by score, majority of n and oracle of n, plus how well
    the scores rank correct above wrong candidates (pairwise, within prompts that have both)."""
    first, best, major, oracle = [], [], [], []
    wins = pairs = 0
    for record, row, row_scores in zip(records, pool, scores):
        row, row_scores = row[:n], row_scores[:n]
        ok = [correct(c, record["answer"]) for c in row]
        first.append(ok[0])
        best.append(best_by_score(row_scores, ok, n))
        major.append(vote([io._last_answer(c) for c in row]) == str(record["answer"]).strip())
        oracle.append(any(ok))
        right = [s for s, o in zip(row_scores, ok) if o]
        wrong = [s for s, o in zip(row_scores, ok) if not o]
        wins += sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
        pairs += len(right) * len(wrong)
    return {"first": first, "best": best, "majority": major, "oracle": oracle,
            "pairwise": wins / pairs if pairs else float("nan"), "sample_accuracy":
            100 * sum(correct(c, r["answer"]) for r, row in zip(records, pool) for c in row[:n]) / (n * len(records))}


def confidence_stop(answers_per_prompt: list[list], truth: list[str], agreement: float, min_samples: int,
                    cap: int, beta_threshold: float | None = None) -> tuple[list[bool], list[int]]:
    stopper = io.ConfidenceBasedStopping(agreement=agreement, min_samples=min_samples, beta_threshold=beta_threshold)
    flags, used = [], []
    for answers, answer in zip(answers_per_prompt, truth):
        taken = cap
        for k in range(1, cap + 1):  # one sample per round
            if stopper.should_stop(answers[:k]):
                taken = k
                break
        used.append(taken)
        flags.append(vote(answers[:taken]) == answer)
    return flags, used


def stopping_verdict(flags: list[bool], fixed: list[bool], mean_used: float, n: int) -> str:
    """Claim 4 holds when stopping uses fewer samples than the fixed vote at no lower accuracy."""
    if mean_used < n and pct(flags) >= pct(fixed):
        return (f"holds: {100 * (1 - mean_used / n):.0f}% fewer samples, accuracy {pct(flags) - pct(fixed):+.1f} pts "
                f"(p={mcnemar(flags, fixed)[2]:.2g})")
    return f"does NOT hold: {mean_used:.2f} samples, accuracy {pct(flags) - pct(fixed):+.1f} pts"


def allocate(difficulty: list[float], args, max_per_prompt: int | None = None) -> tuple[list[int], int]:
    """Each prompt's samples under adaptive allocation: the pilot, plus its share of the rest of the
    uniform budget (budget_per_prompt per prompt) by difficulty, capped at max_per_prompt (default
    ``--max-per-prompt``); and the total."""
    total = args.budget_per_prompt * len(difficulty)
    cap = max_per_prompt or args.max_per_prompt
    extra = io.AdaptiveComputeAllocator(total - args.pilot * len(difficulty), min_per_prompt=0,
                                        max_per_prompt=cap - args.pilot).allocate(difficulty)
    shares = [args.pilot + e for e in extra]
    assert sum(shares) == total
    return shares, total


def adaptive_vs_uniform(answers: list[list], scores: list[list[float]], truth: list[str], args,
                        difficulty_kind: str) -> dict:
    pilot = [a[:args.pilot] for a in answers]
    if difficulty_kind == "disagreement":
        difficulty = [1.0 - io.answer_agreement(p)[1] for p in pilot]
    else:  # reward-model score spread over the pilot samples
        difficulty = [float(torch.tensor(s[:args.pilot]).std(unbiased=False)) for s in scores]
    shares, total = allocate(difficulty, args)
    adaptive = [vote(a[:k]) == t for a, k, t in zip(answers, shares, truth)]
    uniform = [vote(a[:args.budget_per_prompt]) == t for a, t in zip(answers, truth)]
    return {"adaptive": adaptive, "uniform": uniform, "shares": shares, "total": total,
            "hard": sum(d > 0 for d in difficulty)}


def lowest_share_difficulty(scores: list[list[float]], share: float, pilot: int) -> list[float]:
    """1.0 for the ``share`` of prompts whose best pilot score is lowest (ties by order), else 0.0: the extra
    samples go, evenly, only where the reward model likes no pilot answer (compute-optimal allocation by a
    verifier's difficulty estimate, Snell et al. 2024). Uses no labels."""
    best_pilot = [max(row[:pilot]) for row in scores]
    flagged = sorted(range(len(scores)), key=lambda i: best_pilot[i])[:round(share * len(scores))]
    difficulty = [0.0] * len(scores)
    for i in flagged:
        difficulty[i] = 1.0
    return difficulty


def reranked_allocation(scores: list[list[float]], ok: list[list[bool]], difficulty: list[float], args,
                        max_per_prompt: int) -> tuple[list[bool], list[int]]:
    """Best-of-N by score under adaptive allocation with this difficulty: each prompt's flags and shares."""
    shares, _ = allocate(difficulty, args, max_per_prompt)
    return [best_by_score(s, o, k) for s, o, k in zip(scores, ok, shares)], shares


def adaptive_vs_uniform_reranked(scores: list[list[float]], ok: list[list[bool]], args) -> dict:
    """Allocation for Best-of-N: each prompt's answer is its highest-scored sample. Difficulty is the reward
    model's doubt about the pilot: how far the best pilot score falls below the median best pilot score over
    the prompts (0 above it), so the samples go where no pilot answer looks right. Uses no labels."""
    best_pilot = [max(row[:args.pilot]) for row in scores]
    middle = sorted(best_pilot)[len(scores) // 2]
    difficulty = [max(0.0, middle - b) for b in best_pilot]
    adaptive, shares = reranked_allocation(scores, ok, difficulty, args, args.max_per_prompt)
    uniform = [best_by_score(s, o, args.budget_per_prompt) for s, o in zip(scores, ok)]
    return {"adaptive": adaptive, "uniform": uniform, "shares": shares, "total": sum(shares),
            "hard": sum(d > 0 for d in difficulty)}


def build_value_fn(prm_dir: str):
    import rlhf

    prm = rlhf.ProcessRewardModel.from_pretrained(prm_dir, is_trainable=False)
    reward = rlhf.ProcessReward(prm)

    def value_fn(prompts: list[str], responses: list[str]) -> torch.Tensor:
        return reward(prompts, responses, [None] * len(prompts))

    return value_fn


def run_mcts(policy: Policy, value_fn, records: list[dict], temperature: float, args) -> dict:
    mcts = io.MCTSGenerator(policy.model, policy.tokenizer, value_fn, expansions=args.mcts_expansions,
                            step_delimiter="\n", c_puct=args.mcts_c_puct, max_nodes=args.mcts_max_nodes,
                            max_depth=args.mcts_max_depth, max_step_tokens=args.mcts_max_step_tokens,
                            max_new_tokens=args.max_new_tokens, temperature=temperature, engine=args.engine,
                            seed=args.seed)
    started = time.perf_counter()
    results = mcts([r["prompt"] for r in records])
    seconds = time.perf_counter() - started
    flags = [correct(res.response, r["answer"]) for res, r in zip(results, records)]
    count = len(records)
    return {"correct": flags, "seconds": seconds, "nodes": sum(r.nodes for r in results) / count,
            "policy_calls": sum(r.policy_calls for r in results) / count,
            "evaluations": sum(r.evaluations for r in results) / count,
            "complete": sum(r.complete for r in results) / count,
            "stopped_by": {k: sum(r.stopped_by == k for r in results) for k in {r.stopped_by for r in results}}}


# -- main -----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output = Path(args.output).resolve() if args.output else None
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)  # before minutes of sampling, not after
    os.chdir(REPO)
    io.pin_cpu_kernels()  # the same figures on any x86-64 CPU (see README, 'The run is deterministic')
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    wall = time.perf_counter()
    for directory in (args.policy, args.reward) + (() if args.skip_mcts else (args.prm,)):
        if not any((Path(directory) / name).exists() for name in ("config.json", io.RewardModelScorer.ENSEMBLE_FILE)):
            raise SystemExit(f"error: {directory} holds no model (no config.json or ensemble.json); train it first")

    policy = Policy(args.policy, args.engine, args.max_new_tokens, args.batch_size)
    scorer = io.RewardModelScorer(args.reward, batch_size=256)
    validation = read_records(args.validation, args.validation_limit)
    eval_records = read_records(args.eval, args.limit)
    multistep = read_records(args.multistep, args.mcts_limit or args.limit)
    log = []  # (what, seconds)
    sweeps: dict = {}

    def timed(what: str, fn, *a, **k):
        start = time.perf_counter()
        out = fn(*a, **k)
        log.append((what, time.perf_counter() - start))
        print(f"  {what}: {log[-1][1]:.1f} s", file=sys.stderr, flush=True)
        return out

    # -- 0. choose settings on the validation slice (not held out) -----------------------------------------------
    val_prompts = [r["prompt"] for r in validation]
    val_truth = [str(r["answer"]).strip() for r in validation]
    val_greedy = [correct(t, r["answer"]) for t, r in zip(timed("greedy (validation)", policy.greedy, val_prompts),
                                                          validation)]
    temps = sorted({*([args.temperature] if args.temperature is not None else args.temperatures),
                    *([args.vote_temperature] if args.vote_temperature is not None else args.temperatures)})
    val_pools, val_scores, val_stats = {}, {}, {}
    for temperature in temps:
        pool = timed(f"{args.n} samples at T {temperature} (validation)", policy.samples, val_prompts, args.n,
                     temperature, args.seed + 1)
        val_pools[temperature], val_scores[temperature] = pool, score_pool(scorer, val_prompts, pool)
        val_stats[temperature] = pool_stats(validation, pool, val_scores[temperature], args.n)
    sweeps["validation"] = {"prompts": len(validation), "file": args.validation, "greedy": pct(val_greedy),
                            "by_temperature": {str(t): {"first_sample": pct(s["first"]), "best_of_n_rm": pct(s["best"]),
                                                        "majority": pct(s["majority"]), "oracle": pct(s["oracle"]),
                                                        "rm_pairwise": s["pairwise"]}
                                               for t, s in val_stats.items()}}
    bon_t = args.temperature if args.temperature is not None else \
        max(temps, key=lambda t: (pct(val_stats[t]["best"]), -t))
    vote_t = args.vote_temperature if args.vote_temperature is not None else \
        max(temps, key=lambda t: (pct(val_stats[t]["majority"]), -t))
    val_answers = [[io._last_answer(c) for c in row] for row in val_pools[vote_t]]
    fixed_val = pct([vote(a[:args.n]) == t for a, t in zip(val_answers, val_truth)])
    grid = []
    for agreement in args.stop_agreement:
        for min_samples in args.stop_min_samples:
            flags, used = confidence_stop(val_answers, val_truth, agreement, min_samples, args.n)
            grid.append({"agreement": agreement, "min_samples": min_samples, "accuracy": pct(flags),
                         "mean_samples": sum(used) / len(used)})
    eligible = [g for g in grid if g["accuracy"] >= fixed_val - 1e-9] or [max(grid, key=lambda g: g["accuracy"])]
    stop = min(eligible, key=lambda g: (g["mean_samples"], -g["accuracy"]))
    sweeps["confidence_stopping"] = {"temperature": vote_t, "fixed_vote_accuracy": fixed_val, "grid": grid,
                                     "chosen": stop}
    val_ok = [[correct(c, r["answer"]) for c in row] for r, row in zip(validation, val_pools[bon_t])]
    share_accuracy = {str(share): pct(reranked_allocation(val_scores[bon_t], val_ok, lowest_share_difficulty(
        val_scores[bon_t], share, args.pilot), args, min(args.max_per_prompt, args.n))[0])
        for share in args.flag_shares}
    flag_share = max(args.flag_shares, key=lambda s: (share_accuracy[str(s)], s))  # ties: spread wider
    sweeps["adaptive_rerank"] = {"temperature": bon_t, "pool": args.n, "accuracy_by_share": share_accuracy,
                                 "chosen": flag_share}
    print(f"validation ({len(validation)} prompts of {args.validation}): greedy {pct(val_greedy):.1f}%; "
          + "; ".join(f"T {t}: BoN-RM {pct(s['best']):.1f}% maj {pct(s['majority']):.1f}% oracle "
                      f"{pct(s['oracle']):.1f}% first {pct(s['first']):.1f}%" for t, s in val_stats.items())
          + f"\n  chosen: Best-of-N T {bon_t}, voting T {vote_t}, stopping agreement {stop['agreement']} "
          f"min_samples {stop['min_samples']}", file=sys.stderr, flush=True)

    # -- 1. Best-of-8 with the reward model on eval -----------------------------------------------------------------
    prompts = [r["prompt"] for r in eval_records]
    truth = [str(r["answer"]).strip() for r in eval_records]
    greedy = [correct(t, r["answer"]) for t, r in zip(timed("greedy (eval)", policy.greedy, prompts), eval_records)]
    pools = {}
    for temperature in sorted({bon_t, vote_t}):
        pool = timed(f"{args.pool} samples at T {temperature} (eval)", policy.samples, prompts, args.pool,
                     temperature, args.seed + 2)
        pools[temperature] = (pool, timed(f"RM scores at T {temperature} (eval)", score_pool, scorer, prompts, pool))
    bon_pool, bon_scores = pools[bon_t]
    bon = pool_stats(eval_records, bon_pool, bon_scores, args.n)
    rows: list[dict] = []

    def add(method: str, dataset: str, budget: str, flags: list[bool], notes: str, **extra) -> int:
        """A table row; the per-prompt flags go to --output, so experiments/combine_seeds.py can pool runs. A claim row
        names its baseline row (``versus``, an index into the rows)."""
        rows.append({"method": method, "prompts": dataset, "budget": budget, "accuracy": pct(flags),
                     "n_prompts": len(flags), "notes": notes, **extra, "correct": [bool(f) for f in flags]})
        return len(rows) - 1

    eval_name = f"eval ({len(eval_records)})"
    greedy_row = add("Greedy", eval_name, "1 sample", greedy, "baseline")
    add(f"Best-of-{args.n} + RM", eval_name, f"{args.n} samples", bon["best"],
        f"T {bon_t}; {delta_note(bon['best'], greedy, args.seed, 'greedy')}; RM ranks correct > wrong "
        f"{100 * bon['pairwise']:.1f}% of pairs", claim=1, versus=greedy_row, verdict=verdict(bon["best"], greedy),
        temperature=bon_t, rm_pairwise=bon["pairwise"])
    add("  first sample (context)", eval_name, "1 sample", bon["first"],
        f"T {bon_t}; per-sample accuracy {bon['sample_accuracy']:.1f}%")
    add(f"  majority of {args.n} (context)", eval_name, f"{args.n} samples", bon["majority"],
        f"T {bon_t}; {delta_note(bon['majority'], greedy, args.seed, 'greedy')}")
    add(f"  oracle: any of {args.n} (context)", eval_name, f"{args.n} samples", bon["oracle"],
        f"T {bon_t}; ceiling of any reranker")
    checked = pool_stats(eval_records, bon_pool, [[verifier_score(c) for c in row] for row in bon_pool], args.n)
    add(f"  Best-of-{args.n} + step checker (context)", eval_name, f"{args.n} samples", checked["best"],
        f"T {bon_t}; rule-based arithmetic checker instead of the RM (ranks correct > wrong "
        f"{100 * checked['pairwise']:.1f}%); {delta_note(checked['best'], greedy, args.seed, 'greedy')}")

    # -- 2. MCTS with the PRM on the multi-step problems -------------------------------------------------------------
    if not args.skip_mcts:
        value_fn = build_value_fn(args.prm)
        ms_prompts = [r["prompt"] for r in multistep]
        ms_greedy = [correct(t, r["answer"]) for t, r in
                     zip(timed("greedy (multistep)", policy.greedy, ms_prompts), multistep)]
        mcts_t = args.mcts_temperatures[0]
        if len(args.mcts_temperatures) > 1:
            val_ms = [r for r in read_records(args.validation, None) if r["prompt"].startswith("Compute")]
            val_ms = val_ms[:args.mcts_validation]
            sweep = {str(t): pct(timed(f"MCTS T {t} (validation multi-step)", run_mcts, policy, value_fn, val_ms, t,
                                       args)["correct"]) for t in args.mcts_temperatures}
            mcts_t = max(args.mcts_temperatures, key=lambda t: (sweep[str(t)], -t))
            sweeps["mcts"] = {"prompts": len(val_ms), "accuracy_by_temperature": sweep, "chosen": mcts_t}
        mcts = timed("MCTS (multistep)", run_mcts, policy, value_fn, multistep, mcts_t, args)
        ms_name = f"multistep ({len(multistep)})"
        ms_greedy_row = add("Greedy", ms_name, "1 sample", ms_greedy, "baseline")
        add("MCTS + PRM value", ms_name, f"{mcts['policy_calls']:.1f} policy calls",
            mcts["correct"], f"T {mcts_t}, {args.mcts_expansions} expansions, max {args.mcts_max_nodes} nodes, c_puct "
            f"{args.mcts_c_puct}; {mcts['nodes']:.1f} nodes, {mcts['seconds'] / len(multistep):.2f} s/problem; "
            f"{delta_note(mcts['correct'], ms_greedy, args.seed, 'greedy')}", claim=2, versus=ms_greedy_row,
            verdict=verdict(mcts["correct"], ms_greedy), temperature=mcts_t,
            **{k: v for k, v in mcts.items() if k != "correct"})
        ms_pool = timed(f"{args.n} samples at T {mcts_t} (multistep)", policy.samples, ms_prompts, args.n, mcts_t,
                        args.seed + 3)
        ms_prm = pool_stats(multistep, ms_pool, timed("PRM scores (multistep)", score_pool, value_fn, ms_prompts,
                                                      ms_pool), args.n)
        add(f"  Best-of-{args.n} + PRM (context)", ms_name, f"{args.n} samples", ms_prm["best"],
            f"T {mcts_t}; PRM ranks correct > wrong {100 * ms_prm['pairwise']:.1f}% of pairs; oracle "
            f"{pct(ms_prm['oracle']):.1f}%, majority {pct(ms_prm['majority']):.1f}%", prm_pairwise=ms_prm["pairwise"])
        checked = pool_stats(multistep, ms_pool, [[verifier_score(c) for c in row] for row in ms_pool], args.n)
        add(f"  Best-of-{args.n} + step checker (context)", ms_name, f"{args.n} samples", checked["best"],
            f"T {mcts_t}; rule-based arithmetic checker instead of the PRM (ranks correct > wrong "
            f"{100 * checked['pairwise']:.1f}%); {delta_note(checked['best'], ms_greedy, args.seed, 'greedy')}")

    # -- 3. adaptive vs uniform allocation at the same total samples -------------------------------------------------
    vote_pool, vote_scores = pools[vote_t]
    answers = [[io._last_answer(c) for c in row] for row in vote_pool]
    k = args.budget_per_prompt
    for kind in ("disagreement", "rm_std"):
        result = adaptive_vs_uniform(answers, vote_scores, truth, args, kind)
        if kind == "disagreement":
            uniform_vote_row = add(f"Uniform {k} + majority", eval_name, f"{k} samples ({result['total']} total)",
                result["uniform"], f"T {vote_t}; ties: first sample's answer")
        label = "pilot disagreement" if kind == "disagreement" else "RM score std of pilot (variant)"
        add("Adaptive + majority", eval_name, f"{k} samples ({result['total']} total)", result["adaptive"],
            f"T {vote_t}; pilot {args.pilot}, difficulty = {label}; {result['hard']} prompts with difficulty > 0, "
            f"max {max(result['shares'])}/prompt; "
            f"{delta_note(result['adaptive'], result['uniform'], args.seed, 'uniform')}",
            claim=3 if kind == "disagreement" else None, versus=uniform_vote_row,
            verdict=verdict(result["adaptive"], result["uniform"]), difficulty=kind, total_samples=result["total"])

    bon_ok = [[correct(c, r["answer"]) for c in row] for r, row in zip(eval_records, bon_pool)]
    result = adaptive_vs_uniform_reranked(bon_scores, bon_ok, args)
    uniform_rerank_row = add(f"Uniform {k} + RM rerank", eval_name, f"{k} samples ({result['total']} total)",
                             result["uniform"], f"T {bon_t}; the highest-scored of the first {k}")
    add("Adaptive + RM rerank", eval_name, f"{k} samples ({result['total']} total)", result["adaptive"],
        f"T {bon_t}; pilot {args.pilot}, difficulty = the best pilot score's shortfall below the median; "
        f"{result['hard']} prompts with difficulty > 0, max {max(result['shares'])}/prompt; "
        f"{delta_note(result['adaptive'], result['uniform'], args.seed, 'uniform')}", claim=3,
        versus=uniform_rerank_row, verdict=verdict(result["adaptive"], result["uniform"]), difficulty="rm_shortfall",
        total_samples=result["total"])
    flagged, shares = reranked_allocation(bon_scores, bon_ok,
                                          lowest_share_difficulty(bon_scores, flag_share, args.pilot),
                                          args, args.max_per_prompt)
    add("Adaptive + RM rerank (lowest-scored share)", eval_name, f"{k} samples ({result['total']} total)", flagged,
        f"T {bon_t}; pilot {args.pilot}, the extra samples evenly to the {flag_share:.0%} of prompts whose best pilot "
        f"score is lowest (share chosen on validation), max {max(shares)}/prompt; "
        f"{delta_note(flagged, result['uniform'], args.seed, 'uniform')}", claim=3, versus=uniform_rerank_row,
        verdict=verdict(flagged, result["uniform"]), difficulty="rm_lowest_share", total_samples=result["total"])

    # -- 4. confidence stopping vs a fixed vote ------------------------------------------------------------------
    fixed = [vote(a[:args.n]) == t for a, t in zip(answers, truth)]
    flags, used = confidence_stop(answers, truth, stop["agreement"], stop["min_samples"], args.n)
    mean_used = sum(used) / len(used)
    fixed_row = add(f"Fixed {args.n} + majority", eval_name, f"{args.n} samples", fixed, f"T {vote_t}")
    add("Confidence stopping + majority", eval_name, f"{mean_used:.2f} samples (mean)", flags,
        f"T {vote_t}; agreement {stop['agreement']}, min_samples {stop['min_samples']}, 1 sample/round, cap {args.n}; "
        f"saves {100 * (1 - mean_used / args.n):.0f}%; {delta_note(flags, fixed, args.seed, f'fixed {args.n}')}",
        claim=4, versus=fixed_row, verdict=stopping_verdict(flags, fixed, mean_used, args.n), mean_samples=mean_used)
    if args.stop_beta:  # a rule fixed in advance (nothing chosen on validation), reported beside the tuned one
        val_flags, val_used = confidence_stop(val_answers, val_truth, 1.0, 1, args.n, args.stop_beta)
        sweeps["confidence_stopping"]["beta_rule"] = {"threshold": args.stop_beta, "accuracy": pct(val_flags),
                                                      "mean_samples": sum(val_used) / len(val_used)}
        flags, used = confidence_stop(answers, truth, 1.0, 1, args.n, args.stop_beta)
        mean_used = sum(used) / len(used)
        add("  Beta-rule stopping + majority", eval_name, f"{mean_used:.2f} samples (mean)", flags,
            f"T {vote_t}; Adaptive-Consistency (Aggarwal et al. 2023): stop when P(leading answer likelier than "
            f"the runner-up) >= {args.stop_beta}, fixed in advance; validation {pct(val_flags):.1f}% at "
            f"{sum(val_used) / len(val_used):.2f} samples; saves {100 * (1 - mean_used / args.n):.0f}%; "
            f"{delta_note(flags, fixed, args.seed, f'fixed {args.n}')}", claim=4, versus=fixed_row,
            verdict=stopping_verdict(flags, fixed, mean_used, args.n), mean_samples=mean_used)

    seconds = time.perf_counter() - wall
    headers = ["method", "prompts", "samples / calls per prompt", "accuracy", "notes"]
    table = [[r["method"], r["prompts"], r["budget"], f"{r['accuracy']:.1f}%", r["notes"]] for r in rows]
    print_table(headers, table, f"Inference-time compute on the demo ({args.policy}; seed {args.seed}; "
                f"{seconds:.0f} s wall)", label_columns=3, wrap_values=True, min_width=160)
    claims = [r for r in rows if r.get("claim")]
    for r in claims:
        print(f"claim {r['claim']} ({r['method'].strip()}, {r['prompts']}): {r['verdict']}")
    if output:
        output.write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items()}, "chosen": {
                "best_of_n_temperature": bon_t, "vote_temperature": vote_t, "stopping": stop},
            "rows": rows, "sweeps": sweeps, "timings_s": dict(log), "wall_s": seconds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
