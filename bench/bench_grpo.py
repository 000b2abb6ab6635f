"""GRPO speed: ``rlhf.GRPOTrainer`` against TRL's ``GRPOTrainer`` (no vLLM) on the same work, seconds per step.

    python bench/bench_grpo.py                      # G 8, 64 completions per step, 64 tokens, 10 timed steps, 2 threads
    python bench/bench_grpo.py --steps 3 --warmup 1 --batch-size 16          # a quick check
    python bench/bench_grpo.py --repeats 3 --json /tmp/grpo.json
    python bench/bench_grpo.py --model outputs/demo/sft --engine compiled   # the demo's SFT policy: rewards vary
    python bench/bench_grpo.py --impls ours,rloo,reinforce_pp,gspo,cispo,dapo     # estimators and losses beside GRPO

A GRPO step is generation plus training: sample ``--num-generations`` completions for each of ``--batch-size`` /
``--num-generations`` prompts, score them, turn the rewards into group-relative advantages, then one forward and
backward pass over the completions and one optimizer step. Both trainers do all of that in every timed step.

Both trainers get the same work: the embedded tiny Llama (``rlhf.resolve_model_path("tiny")``, or ``--model``), full
fine-tuning, fp32, the attention implementation our trainer picks on CPU, no gradient checkpointing (TRL turns it on by
default; ours does not); the first ``--records`` prompts of ``data/demo/rl_prompts.jsonl`` (read once through
``rlhf.load_records``) rendered with the tokenizer's ChatML template (TRL gets them in its conversational format,
``[{"role": "user", "content": ...}]``, so it applies the same template; neither truncates a prompt); ``--batch-size``
completions per optimizer step = ``--batch-size`` / G prompts, all generated in that step (TRL:
``per_device_train_batch_size=B``, ``gradient_accumulation_steps=1``, ``steps_per_generation=1``, so
``generation_batch_size=B``; ours: ``per_device_train_batch_size=B``, ``gradient_accumulation_steps=1``); group size
G; sampling at temperature 1.0 without top-k / top-p, at most ``--completion-len`` new tokens, stopping at the
tokenizer's EOS ``<|im_end|>`` (the only stop token of both: TRL stops on the model's generation-config EOS plus the
tokenizer's, ours on the template's end marker plus the tokenizer's EOS); the same reward,
``rlhf.exact_answer_reward`` against each prompt's ``answer`` (TRL gets it as a reward function receiving the
``answer`` column); no KL term (beta 0, so neither trainer loads a reference model); ``num_iterations`` 1 (no stored
old log-probs: the ratio is 1 in both); the "grpo" loss (per-sequence token mean, then mean over the batch), rewards
scaled by the group's std, clip epsilon 0.2; the fused ``torch.optim.AdamW`` with the same lr / betas / eps (TRL:
``optim="adamw_torch_fused"``, its default), no weight decay, a constant learning rate without warm-up, gradient
clipping at 1.0; CPU, ``--threads`` torch threads and ``OMP_NUM_THREADS``, seed 0; both log every step
(``logging_steps=1``); no evaluation, no checkpoints. Sampling differs between the trainers (and runs), so the
completions, and with them the tokens generated per step, differ: the table shows the completion tokens per timed step
and the tokens per second, so a reader can see whether the work was comparable.

Ours runs twice. ``ours`` is the default trainer: with beta 0 it skips the forward and backward of completions whose
advantage is 0 (every completion of the group scored alike), which add exactly nothing to the update
(``GRPOConfig.skip_zero_gradient_rows``; TRL computes them). ``ours-dense`` turns that off and trains every row, the
same compute as TRL. How many rows are skipped depends on the policy: the embedded tiny model is untrained, so
nearly every ``exact_answer`` reward is 0 and nearly every row is skipped; ``--model outputs/demo/sft`` (the demo's
SFT policy) gives a realistic mix. The "rows skipped" column shows the share, and both ratios are printed.

The 2025-26 estimators and losses run as more rows of our trainer, each with one setting changed from ``ours``
(``VARIANTS``; "time / ours (GRPO)" is their cost beside GRPO's): ``rloo`` (leave-one-out baseline, unscaled),
``reinforce_pp`` (token returns with the KL in the reward, beta 0.01, so it loads and runs the reference model too),
``reinforce_pp_baseline`` (group mean first, no KL), ``gspo`` (sequence-level ratio), ``cispo`` (clipped
importance-weight loss) and ``dapo`` (clip-higher, token-mean loss, overlong shaping and dynamic sampling: groups
that all scored alike are dropped and more prompts sampled, up to 3 rounds a step, so its generation column adds
the rounds' times and "sampling rounds" shows how many a step took).

Every measurement runs in its own subprocess (``--worker ours|ours-dense|trl``, one JSON line on stdout), so the peak
resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``) belongs to that run alone. Workers run one at a time. Both
workers import rlhf (ours trains with it; TRL's worker takes the prompts and the reward function from it).

Time per step: the time from the end of one optimizer step to the end of the next, measured the same way for both,
so it includes generation, scoring, the training pass, the optimizer step, fetching the prompts and logging. Ours:
the instance's ``_optimizer_step`` is wrapped and its returns stamped (in our trainer the rollout, generation and
scoring, runs inside the batch iterator before ``_optimizer_step``, so only end-to-end covers a step). TRL: a
``TrainerCallback`` stamps ``on_step_end`` (and ``on_step_begin``: in transformers' loop ``on_step_begin`` comes
before ``training_step``, whose ``GRPOTrainer._prepare_inputs`` calls ``_generate_and_score_completions`` when
``_step % (steps_per_generation * num_iterations) == 0``, i.e. every step here, and ``on_step_end`` comes after the
optimizer step). The generation itself is timed on its own ("gen s": ours ``GRPOTrainer._sample``; TRL
``GRPOTrainer._generate_single_turn``, which runs ``model.generate``), and each run checks that exactly one
generation fell inside every step. The first ``--warmup`` steps (at least 1, since the first step has no previous
end) are dropped; model loading, tokenisation and the final save are not timed.

"s/step min" is the fastest timed step (over all repeats), the least disturbed by other processes; "tokens per s"
is the median over the timed steps of the step's completion tokens / its seconds. The verdict compares the median
seconds per step against ``--target`` (default: ours <= 0.5x TRL) and prints the fastest-step, generation and
tokens-per-second ratios too. With ``--repeats`` > 1 the order of the trainers alternates and each row shows the
repeat with the best median. On 2 cores another busy process slows a run many times over, so the driver
measures the CPU the rest of the machine used during each run ("bg cores": /proc/stat minus the worker's own CPU time)
and warns above ``--max-background``. The exit status is 0 whatever the timing (non-zero only if a run breaks).

The limit (``bench/limits.py``): the peak fp32 matmul FLOP/s at ``--threads`` threads and the memory bandwidth are
measured before the first worker and after the last (the best of each is kept, printed above the table), each time in
a subprocess of its own, so its buffers count in no worker's peak memory. A step's FLOPs = 2 x parameters x the
completion tokens it sampled (prompt prefill not counted) + 6 x parameters x the tokens it trained on (prompt +
completion of every row that ran forward and backward: ours counts the rows ``_rows_that_train`` keeps, so skipped
rows count nothing; TRL's are its ``compute_loss`` inputs' prompt and completion masks) + 2 x parameters x the tokens
of forwards without backward (ours: old log-probs and reference, ``_policy_logps`` / ``_reference_logps``, which only
the reinforce_pp row runs here; TRL runs none with beta 0 and one step per generation), all counted per step in the
workers. Parameters = the model's ``model_params`` (all of them, the tied embedding once); attention's own FLOPs
ignored. "GFLOP/s" is the median over the timed steps of a step's FLOPs / its seconds; "% of peak" = that / the peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/ (the script's folder) is on sys.path; bench_dpo has no side effects on import
from bench_dpo import batch_tokens, bench_setup, peak_rss_mib, rss_mib, run_measured, trl_step_timer
from limits import Limits, fraction, giga, limits_epilog, rl_step_flops
from tables import print_table

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data" / "demo"
DATASET = "demo_rl"  # data/demo/rl_prompts.jsonl (prompt, answer)
MARK = "BENCH_GRPO_RESULT "
# Our trainer with each advantage estimator and policy loss in place of GRPO's (one setting changed each; the stage
# defaults they would get from their own stage names otherwise). reinforce_pp keeps its KL in the reward (beta 0.01,
# the stage default), so it also loads and runs the reference model.
VARIANTS = {
    "rloo": {"advantage_estimator": "rloo", "scale_rewards": "none"},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "scale_rewards": "none", "beta": 0.01},
    "reinforce_pp_baseline": {"advantage_estimator": "reinforce_pp_baseline", "scale_rewards": "none"},
    "gspo": {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "cispo": {"loss_type": "cispo"},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28, "dynamic_sampling": True, "overlong_buffer_len": 16},
}
IMPLS = ("ours", "ours-dense", "trl", *VARIANTS)
LABELS = {"ours": "ours (rlhf)", "ours-dense": "ours, every row", "trl": "TRL",
          **{name: f"ours, {name}" for name in VARIANTS}}
PROMPT_CUTOFF = 512  # the tiny model's max_position_embeddings; the demo prompts are far shorter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GFLOP/s = median over steps of (2 x parameters x sampled + 6 x parameters x"
                                         " trained + 2 x parameters x no-grad forward tokens) / step s; % of peak = "
                                         "that / the peak matmul FLOP/s"))
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (at least 1)")
    parser.add_argument("--batch-size", type=int, default=64, help="completions per optimizer step (B)")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (the group G)")
    parser.add_argument("--completion-len", type=int, default=64, help="max_completion_length: new tokens at most")
    parser.add_argument("--records", type=int, default=256,
                        help="use the first N prompts of data/demo/rl_prompts.jsonl")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (constant, no warm-up)")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="comma-separated: ours (the default trainer, which skips the forward and backward of "
                             "completions with zero advantage), ours-dense (skip_zero_gradient_rows=False: every row, "
                             "the same compute as TRL), trl, and our trainer with another estimator or loss: "
                             + ", ".join(VARIANTS))
    parser.add_argument("--model", default="tiny",
                        help="the policy both trainers start from: tiny (the embedded, untrained demo model: nearly "
                             "every reward is 0, so our default trainer skips nearly every row) or a directory such "
                             "as outputs/demo/sft (the demo's SFT policy, where rewards vary within some groups)")
    parser.add_argument("--engine", default="auto", choices=("auto", "compiled", "static", "eager"),
                        help="our rollout decoding (GRPOConfig.generation_engine); compiled pays its compile time in "
                             "the untimed warm-up steps")
    parser.add_argument("--rollout-dtype", default="auto", choices=("auto", "fp16", "int8"),
                        help="what our engine samples from on a CPU (GRPOConfig.rollout_dtype): auto = the policy "
                             "itself, fp16 / int8 = a low-precision copy refreshed every step, its gap corrected")
    parser.add_argument("--repeats", type=int, default=1, help="runs per trainer (order alternates)")
    parser.add_argument("--target", type=float, default=0.5, help="target: ours / TRL seconds per step at most")
    parser.add_argument("--max-background", type=float, default=0.25,
                        help="warn when other processes used more CPU cores than this during a run")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's raw results to this file")
    # internal: one measurement in this process
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--attn", default="sdpa", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batch_size, args.completion_len, args.records, args.threads, args.repeats, args.warmup) < 1:
        parser.error("--batch-size, --completion-len, --records, --threads, --repeats and --warmup must be >= 1")
    if args.num_generations < 2 or args.batch_size % args.num_generations:
        parser.error("--num-generations must be >= 2 and divide --batch-size (each step trains on whole groups)")
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    if args.records < args.batch_size // args.num_generations:
        parser.error("--records must cover at least one step's prompts (--batch-size / --num-generations)")
    args.impls = [v.strip() for v in args.impls.split(",") if v.strip()]
    if not args.impls or any(v not in IMPLS for v in args.impls):
        parser.error(f"--impls: comma-separated values from {', '.join(IMPLS)}")
    return args


# -- worker side: one trainer in this process -------------------------------------------------------------------------


def load_prompt_records(n: int) -> list[dict]:
    sys.path.insert(0, str(REPO))
    import rlhf

    return rlhf.load_records(DATASET, DATA_DIR, "prompt", max_samples=n)


def count_ours_grpo_tokens(trainer_cls, events: list[tuple[float, str, int]]) -> None:
    """Record (time, kind, tokens) in ``events`` for every micro-batch our GRPO trainer trains on ("trained": the rows
    ``_rows_that_train`` keeps, which run forward and backward) and every forward without backward ("extra": old
    log-probs ``_policy_logps``, reference ``_reference_logps``). Wraps the class's methods; the real ones run."""
    inner_rows, inner_policy, inner_reference = (trainer_cls._rows_that_train, trainer_cls._policy_logps,
                                                 trainer_cls._reference_logps)

    def rows_that_train(self, batch):
        kept, share = inner_rows(self, batch)
        events.append((time.perf_counter(), "trained", batch_tokens(kept)))
        return kept, share

    def policy_logps(self, batch, *args, **kwargs):
        events.append((time.perf_counter(), "extra", batch_tokens(batch)))
        return inner_policy(self, batch, *args, **kwargs)

    def reference_logps(self, batch, *args, **kwargs):
        events.append((time.perf_counter(), "extra", batch_tokens(batch)))
        return inner_reference(self, batch, *args, **kwargs)

    trainer_cls._rows_that_train, trainer_cls._policy_logps = rows_that_train, policy_logps
    trainer_cls._reference_logps = reference_logps


def count_trl_grpo_tokens(trainer_cls, events: list[tuple[float, str, int]]) -> None:
    """Record (time, "trained", tokens) in ``events`` for every micro-batch TRL's GRPO ``compute_loss`` trains on: its
    prompt and completion masks' sums. Wraps the class's method; the real one runs."""
    inner = trainer_cls.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        events.append((time.perf_counter(), "trained", tokens))
        return inner(self, model, inputs, *args, **kwargs)

    trainer_cls.compute_loss = compute_loss


def tokens_by_step(events: list[tuple[float, str, int]], ends: list[float], kind: str) -> list[int]:
    """The ``kind`` tokens of each optimizer step: step k holds the events after ends[k - 1] up to ends[k]."""
    totals = [0] * len(ends)
    for stamp, what, tokens in events:
        if what == kind:
            step = next((k for k, end in enumerate(ends) if stamp <= end), None)
            if step is not None:
                totals[step] += tokens
    return totals


def timed_steps(ends: list[float], generations: list[dict], steps: int, warmup: int,
                begins: list[float] | None = None, events: list[tuple[float, str, int]] | None = None) -> dict:
    """Per-step numbers of the timed steps. Step k (k >= 1) runs from ends[k - 1] to ends[k]; its generation is the
    one call that started inside that window (checked)."""
    if len(ends) != steps or len(generations) != steps:
        raise RuntimeError(f"{len(ends)} optimizer steps and {len(generations)} generations, expected {steps} each")
    starts = begins if begins else [float("-inf")] + ends[:-1]  # TRL: inside on_step_begin -> on_step_end
    for k, gen in enumerate(generations):
        if not starts[k] <= gen["start"] < gen["end"] <= ends[k]:
            raise RuntimeError(f"generation {k} did not run inside step {k}: the step timer misses it")
    cycle = [b - a for a, b in zip(ends, ends[1:])]  # cycle[k - 1] is step k
    timed = range(warmup, steps)
    result = {"cycle": [cycle[k - 1] for k in timed],
              "gen": [generations[k].get("gen_seconds", generations[k]["end"] - generations[k]["start"])
                      for k in timed],
              "rounds": [generations[k].get("rounds", 1) for k in timed],
              "tokens": [generations[k]["tokens"] for k in timed],
              "completions": [generations[k]["completions"] for k in timed],
              "truncated": [generations[k]["truncated"] for k in timed]}
    if begins:  # TRL: its own begin -> end window, shown to confirm it holds the generation
        result["begin_end"] = [ends[k] - begins[k] for k in timed]
    if events is not None:  # tokens trained on (forward and backward) and forwarded without backward, per step
        for kind in ("trained", "extra"):
            counts = tokens_by_step(events, ends, kind)
            result[f"{kind}_tokens"] = [counts[k] for k in timed]
    return result


def per_step(generations: list[dict], ends: list[float]) -> list[dict]:
    """One generation record per optimizer step: DAPO's dynamic sampling may sample several rounds in one step, whose
    times and counts add up (one span from the first round's start to the last round's end)."""
    merged: list[dict] = []
    for end in ends:
        inside = [g for g in generations if g["end"] <= end and (not merged or g["start"] >= merged[-1]["end"])]
        if not inside:
            return generations  # timed_steps reports the mismatch
        merged.append({"start": inside[0]["start"], "end": inside[-1]["end"],
                       "rounds": len(inside), "gen_seconds": sum(g["end"] - g["start"] for g in inside),
                       **{key: sum(g[key] for g in inside) for key in ("tokens", "completions", "truncated")}})
    return merged


def run_trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    records = load_prompt_records(args.records)  # imports rlhf: its reward function scores TRL's completions too
    import rlhf

    base = rss_mib()

    generations: list[dict] = []
    inner = trl.GRPOTrainer._generate_single_turn  # the model.generate call (no vLLM, no continuous batching)

    def timed_generate(self, prompt_ids, *a, **kw):
        started = time.perf_counter()
        completion_ids, logprobs = inner(self, prompt_ids, *a, **kw)
        ended = time.perf_counter()
        lengths = [len(c) for c in completion_ids]  # up to and including the first EOS
        generations.append({"start": started, "end": ended, "tokens": sum(lengths), "completions": len(lengths),
                            "truncated": sum(n >= args.completion_len and c[-1] not in self.eos_token_ids
                                             for n, c in zip(lengths, completion_ids))})
        return completion_ids, logprobs

    trl.GRPOTrainer._generate_single_turn = timed_generate
    events: list[tuple[float, str, int]] = []
    count_trl_grpo_tokens(trl.GRPOTrainer, events)

    def exact_answer(prompts, completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational completions
        return rlhf.exact_answer_reward(prompts, texts, answer).tolist()

    rows = [{"prompt": ([{"role": "system", "content": r["system"]}] if r["system"] else []) + r["messages"],
             "answer": r["answer"]} for r in records]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    checkpointing = {"gradient_checkpointing": False}  # TRL's default is on, ours off
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(trl.GRPOConfig)}:
        checkpointing["activation_checkpointing"] = False
    config = trl.GRPOConfig(
        **checkpointing, output_dir=str(Path(args.workdir) / "trl"), seed=0, use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": args.attn},
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.num_generations, max_completion_length=args.completion_len, temperature=1.0, top_p=1.0,
        top_k=0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        mask_truncated_completions=False, use_vllm=False, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", eval_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, dataloader_pin_memory=False)
    timer = trl_step_timer()
    started = time.perf_counter()
    trainer = trl.GRPOTrainer(model=args.model_dir, reward_funcs=exact_answer, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
    setup = time.perf_counter() - started
    eos = sorted(trainer.eos_token_ids)
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    if output.global_step != args.steps:
        raise RuntimeError(f"TRL ran {output.global_step} steps, expected {args.steps}")
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {**timed_steps(timer.ends, generations, args.steps, args.warmup, timer.begins, events), "setup": setup,
            "wall": wall, "mean_loss": output.training_loss,
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            "stop_ids": eos, "reference_in_memory": trainer.ref_model is not None, "rss_base": base,
            "version": f"trl {trl.__version__}"}


def run_ours(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    records = load_prompt_records(args.records)
    import rlhf

    base = rss_mib()
    missing = [name for name in ("GRPOConfig", "GRPOTrainer", "GRPODataset") if not hasattr(rlhf, name)]
    if missing:
        raise SystemExit(f"rlhf has no {' / '.join(missing)}: our GRPO side cannot run (rlhf.py at {rlhf.__file__})")
    rlhf.set_seed(0)  # what rlhf.train_grpo does before it loads the model
    started = time.perf_counter()
    policy = rlhf.PolicyModel.from_pretrained(args.model_dir, dtype="float32", attn_implementation=args.attn)
    formatter = rlhf.ChatFormatter(policy.tokenizer, "auto")
    dataset = rlhf.GRPODataset(records, policy.tokenizer, formatter, cutoff_len=PROMPT_CUTOFF)
    settings = dict(
        model_name_or_path=args.model_dir, finetuning_type="full", model_dtype="float32", optim="adamw_torch_fused",
        attn_implementation=args.attn, gradient_checkpointing=False, reward_funcs=["exact_answer"], beta=0.0,
        num_generations=args.num_generations, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, max_completion_length=args.completion_len, temperature=1.0, top_p=1.0,
        top_k=0, num_iterations=1, epsilon_low=0.2, loss_type="grpo", scale_rewards="group",
        mask_truncated_completions=False, cutoff_len=PROMPT_CUTOFF, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, save_steps=0,
        output_dir=str(Path(args.workdir) / "ours"),
        disable_progress_bar=True, report_to=[], seed=0, resume_from_checkpoint="none", generation_engine=args.engine,
        rollout_dtype=args.rollout_dtype,
        skip_zero_gradient_rows=args.worker != "ours-dense")
    settings.update(VARIANTS.get(args.worker, {}))  # one estimator or loss in place of GRPO's
    config = rlhf.GRPOConfig(**settings)
    events: list[tuple[float, str, int]] = []
    count_ours_grpo_tokens(rlhf.GRPOTrainer, events)
    reference = rlhf.create_reference_model(config, policy) if config.beta > 0 else None  # reinforce_pp's KL reward
    trainer = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=rlhf.exact_answer_reward, reference=reference,
                               formatter=formatter)
    setup = time.perf_counter() - started

    # stamp the end of every optimizer step and time every generation; the real methods run
    ends: list[float] = []
    generations: list[dict] = []
    inner_step, inner_sample = trainer._optimizer_step, trainer._sample

    def timed_step(group, window):
        try:
            return inner_step(group, window)
        finally:
            ends.append(time.perf_counter())

    def timed_sample(prompts, n):
        started = time.perf_counter()
        output = inner_sample(prompts, n)
        ended = time.perf_counter()
        lengths = [len(c) for c in output.token_ids]  # stop token included
        generations.append({"start": started, "end": ended, "tokens": sum(lengths), "completions": len(lengths),
                            "truncated": sum(reason == "length" for reason in output.finish_reasons)})
        return output

    trainer._optimizer_step, trainer._sample = timed_step, timed_sample
    started = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - started
    generations = per_step(generations, ends)
    history = sorted((row for row in result.history if "step" in row), key=lambda row: row["step"])
    losses = [float(row["loss"]) for row in history if "loss" in row]
    rewards = [float(row["reward"]) for row in history if "reward" in row]
    timed = [row for row in history if row["step"] > args.warmup]
    skipped = [float(row["skipped_rows_frac"]) for row in timed if "skipped_rows_frac" in row]
    return {**timed_steps(ends, generations, args.steps, args.warmup, events=events), "setup": setup, "wall": wall,
            "skipped": statistics.fmean(skipped) if skipped else 0.0,
            "mean_loss": statistics.fmean(losses) if losses else None,
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            "stop_ids": sorted(formatter.stop_token_ids), "reference_in_memory": trainer.reference is not None,
            "rss_base": base, "version": "rlhf"}


def worker(args: argparse.Namespace) -> int:
    if not (args.model_dir and args.workdir):
        raise SystemExit("--worker needs --model-dir and --workdir")
    result = (run_trl if args.worker == "trl" else run_ours)(args)
    result.update(impl=args.worker, peak_rss=peak_rss_mib())
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)
    return 0


# -- driver side: run the workers one by one and print the table -----------------------------------------------------


def run_worker(args: argparse.Namespace, impl: str, model_dir: str, attn: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-grpo-{impl}-") as tmp:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--model-dir", model_dir,
                   "--attn", attn, "--workdir", tmp, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--batch-size", str(args.batch_size), "--num-generations", str(args.num_generations),
                   "--completion-len", str(args.completion_len), "--records", str(args.records),
                   "--threads", str(args.threads), "--lr", repr(args.lr), "--engine", args.engine,
                   "--rollout-dtype", args.rollout_dtype]
        result = run_measured(command, args.threads, MARK)
    return {"impl": impl, **result} if "error" in result else result


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def step_flop_rates(run: dict, params: int) -> list[float]:
    """FLOP/s of each timed step of a run (``limits.rl_step_flops`` / the step's seconds): sampling, training and
    forwards without backward, from the per-step token counts; empty when the run has none."""
    if "trained_tokens" not in run:
        return []
    return [rl_step_flops(params, generated, trained, extra) / seconds for generated, trained, extra, seconds
            in zip(run["tokens"], run["trained_tokens"], run["extra_tokens"], run["cycle"])]


def summarise(runs: list[dict], params: int | None = None) -> dict:
    """One row from the repeats of one trainer: the repeat with the best median step (its numbers), the fastest step
    of all repeats, the highest peak memory; with ``params``, the median FLOP/s of that repeat's steps."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    best = min(ok, key=lambda r: statistics.median(r["cycle"]))
    rest = [c - g for c, g in zip(best["cycle"], best["gen"])]
    rates = step_flop_rates(best, params) if params else []
    return {"step": statistics.median(best["cycle"]), "mean": statistics.fmean(best["cycle"]),
            "min": min(min(r["cycle"]) for r in ok),
            "gen": statistics.median(best["gen"]), "rest": statistics.median(rest),
            "tokens": statistics.fmean(best["tokens"]), "completions": statistics.fmean(best["completions"]),
            "truncated": sum(best["truncated"]) / max(sum(best["completions"]), 1),
            "tokens_per_s": statistics.median([t / c for t, c in zip(best["tokens"], best["cycle"])]),
            "peak": max(r["peak_rss"] for r in ok), "base": max(r["rss_base"] for r in ok),
            "skipped": best.get("skipped"), "rounds": statistics.fmean(best.get("rounds") or [1]),
            "background": max(r["background"] for r in ok), "timed": len(best["cycle"]), "runs": len(ok),
            "trained": statistics.fmean(best["trained_tokens"]) if best.get("trained_tokens") else None,
            "extra": statistics.fmean(best["extra_tokens"]) if best.get("extra_tokens") else None,
            "flops_per_s": statistics.median(rates) if rates else None}


HEADERS = ["trainer", "timed steps", "s/step median", "s/step mean", "s/step min", "gen s median", "rest s median",
           "compl. tokens per step", "mean compl. length", "hit max length", "rows skipped", "tokens per s",
           "trained tokens per step", "no-grad fwd tokens per step", "GFLOP/s", "% of peak", "base MiB", "peak MiB",
           "sampling rounds", "time / TRL", "time / ours (GRPO)", "bg cores"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    torch, model_dir, attn, trl_version = bench_setup()
    if args.model != "tiny":
        if not (Path(args.model) / "config.json").is_file():
            raise SystemExit(f"error: --model {args.model}: no config.json there; pass tiny or a model directory "
                             "(e.g. outputs/demo/sft after `python rlhf.py pipeline --config configs/demo.yaml`)")
        model_dir = str(Path(args.model).resolve())
    prompts = args.batch_size // args.num_generations
    print(f"model {Path(model_dir).name} ({attn}): full fine-tuning, fp32, CPU, threads {args.threads}; first "
          f"{args.records} prompts of {DATA_DIR.relative_to(REPO)}/rl_prompts.jsonl; per step {prompts} prompts x G "
          f"{args.num_generations} = {args.batch_size} completions of at most {args.completion_len} tokens, "
          f"temperature 1.0, beta 0, loss grpo, lr {args.lr:g} constant; {args.steps} steps, first {args.warmup} "
          f"untimed; torch {torch.__version__}, trl {trl_version}")

    # the limits in a process of their own (not this one, whose peak memory every worker's ru_maxrss starts from)
    limits = Limits("float32")
    params = limits.measure_in_subprocess(args.threads, model=model_dir)["params"]
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        order = args.impls if repeat % 2 == 0 else args.impls[::-1]
        for impl in order:
            result = run_worker(args, impl, model_dir, attn)
            runs.setdefault(impl, []).append(result)
            if "error" in result:
                print(f"{LABELS[impl]} (repeat {repeat + 1}) FAILED:\n  " + result["error"].replace("\n", "\n  "))
                continue
            extra = ""
            if "begin_end" in result:
                extra = f", on_step_begin->end {statistics.median(result['begin_end']):.3f}s"
            print(f"{LABELS[impl]} (repeat {repeat + 1}): median step {statistics.median(result['cycle']):.3f}s "
                  f"(generation {statistics.median(result['gen']):.3f}s{extra}), "
                  f"{statistics.fmean(result['tokens']):.0f} completion tokens/step, stop ids {result['stop_ids']}, "
                  f"reference loaded {result['reference_in_memory']}, peak {result['peak_rss']:.0f} MiB, mean loss "
                  f"{_fmt(result['mean_loss'])}, mean reward {_fmt(result['mean_reward'])}, process "
                  f"{result['process']:.1f}s, background load {result['background']:.2f} cores")
            if result["background"] > args.max_background:
                print(f"  warning: other processes used {result['background']:.2f} CPU cores during this run "
                      f"(> {args.max_background:g}); its times are not trustworthy, rerun on a quiet machine")
    limits.measure_in_subprocess(args.threads)
    if args.json:
        args.json.write_text(json.dumps({**runs, "limits": {**limits.to_json(), "params": params}}, indent=1))

    summary = {impl: summarise(value, params) for impl, value in runs.items()}
    ours, theirs, dense = summary.get("ours"), summary.get("trl"), summary.get("ours-dense")
    both = ours and theirs and "error" not in ours and "error" not in theirs
    rows = []
    for impl in args.impls:
        s = summary[impl]
        if "error" in s:
            rows.append([LABELS[impl], "failed"] + ["-"] * (len(HEADERS) - 2))
            continue
        ratio = f"{s['step'] / theirs['step']:.2f}x" if theirs and "error" not in theirs and impl != "trl" else "-"
        to_ours = f"{s['step'] / ours['step']:.2f}x" if ours and "error" not in ours and impl != "ours" else "-"
        rows.append([LABELS[impl], f"{s['timed']}x{s['runs']}", f"{s['step']:.3f}", f"{s['mean']:.3f}",
                     f"{s['min']:.3f}", f"{s['gen']:.3f}", f"{s['rest']:.3f}", f"{s['tokens']:.0f}",
                     f"{s['tokens'] / s['completions']:.1f}", f"{s['truncated']:.0%}",
                     "-" if s["skipped"] is None else f"{s['skipped']:.0%}", f"{s['tokens_per_s']:.0f}",
                     _fmt(s["trained"], ".0f"), _fmt(s["extra"], ".0f"), giga(s["flops_per_s"]),
                     fraction(s["flops_per_s"], limits.peak),
                     f"{s['base']:.0f}", f"{s['peak']:.0f}", f"{s['rounds']:.1f}", ratio, to_ours,
                     f"{s['background']:.2f}"])
    print(limits.describe())
    source = "the policy" if args.rollout_dtype == "auto" else f"an {args.rollout_dtype} copy"
    print_table(HEADERS, rows, f"GRPO: {args.batch_size} completions per step (G {args.num_generations}), at most "
                f"{args.completion_len} new tokens, threads {args.threads}, fp32 CPU, our rollouts from {source} "
                f"(seconds per step: end of one "
                f"optimizer step to the end of the next, generation included; gen = sampling alone; rest = step - "
                f"gen; tokens per s = median over steps; peak = max RSS of the run's process)", label_columns=1,
                wrap_values=True, min_width=230)
    print(f"GFLOP/s = median over the timed steps of (2 x {params / 1e6:.3f}M parameters x completion tokens sampled + "
          "6 x parameters x tokens trained (prompt + completion of the rows run forward and backward) + 2 x parameters "
          "x no-grad forward tokens (old log-probs, reference)) / the step's seconds, attention FLOPs ignored; "
          "% of peak = that / the peak matmul FLOP/s above")
    if both:
        t = ours["step"] / theirs["step"]
        busy = max(ours["background"], theirs["background"]) > args.max_background
        print(f"{'PASS' if t <= args.target else 'FAIL'}: time {t:.2f}x TRL per step (target <= {args.target:g}x, "
              f"{'met' if t <= args.target else 'missed'}); fastest step {ours['min'] / theirs['min']:.2f}x; "
              f"generation {ours['gen'] / theirs['gen']:.2f}x, rest "
              f"{ours['rest'] / theirs['rest']:.2f}x; completion tokens per step {ours['tokens']:.0f} vs "
              f"{theirs['tokens']:.0f}, tokens/s {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x TRL's"
              + (f"; rows skipped {ours['skipped']:.0%}" if ours.get("skipped") is not None else "")
              + ("; MACHINE BUSY, times unreliable" if busy else ""))
    elif not {"ours", "trl"} <= set(args.impls):
        print("n/a: no ratio of the default trainers: --impls needs both ours and trl")
    else:
        print("n/a: no ratio, a trainer's run broke")
    if dense and theirs and "error" not in dense and "error" not in theirs:
        t = dense["step"] / theirs["step"]
        print(f"every row (skip_zero_gradient_rows=False, the same compute as TRL): time {t:.2f}x TRL per step, "
              f"generation {dense['gen'] / theirs['gen']:.2f}x, rest {dense['rest'] / theirs['rest']:.2f}x")
    return 1 if any("error" in r for value in runs.values() for r in value) else 0


if __name__ == "__main__":
    sys.exit(main())
