"""A real pretrained model, side by side with TRL: SFT, DPO and GRPO with TRL's trainers and ours on the same data,
settings and number of steps; seconds per step, peak memory and held-out accuracy at the end.

    python scripts/fetch_real_models.py smollm2           # once: ~/.cache/rlhf/models/SmolLM2-135M-Instruct
    python bench/bench_real_learning.py                   # SFT 50, DPO 50, GRPO 20 steps (2 warm-up), 2 threads
    python bench/bench_real_learning.py --stages grpo --sft-model outputs/demo/sft --json /tmp/real.json
    python bench/bench_real_learning.py --model PATH      # any Hugging Face causal-LM folder with a chat template

What runs. ``--model`` (default: the SmolLM2-135M-Instruct folder that ``scripts/fetch_real_models.py smollm2`` makes)
is fine-tuned by both implementations, stage by stage, on the demo task of data/demo (data/demo/README.md):

* SFT on the first ``--sft-records`` (400) records of ``demo_sft`` (sft.jsonl: prompt / response), from ``--model``;
* DPO on the first ``--dpo-records`` (400) pairs of ``demo_preference`` (preference.jsonl: prompt / chosen / rejected);
* GRPO on the first ``--grpo-records`` (all 800) prompts of ``demo_rl`` (rl_prompts.jsonl: prompt / answer), rewarded
  by ``rlhf.exact_answer_reward`` (1 when the number after the last ``Answer:`` equals the record's answer).

DPO and GRPO start from one shared SFT checkpoint: ``--sft-model`` if given, else one trained by our SFT with the SFT
row's settings and kept in ``--workdir`` (when the SFT stage runs, the SFT row's first ours run is that training, so
nothing is trained twice; otherwise it is trained first), reused by later runs with the same model and settings. The
output says which checkpoint they started from. Every prompt is one user turn rendered with the model's own chat
template (SmolLM2's adds its default system prompt): TRL gets conversational records (``[{"role": "user", ...}]``,
answers as ``{"role": "assistant", ...}``) and applies ``tokenizer.apply_chat_template``; ours reads the same files by
their dataset names (``dataset_dir=data/demo``, ``max_samples`` = the first N records, ``template: auto`` = the
tokenizer's template). Both train on the answer turn only (response, ``<|im_end|>`` and the newline after it).

Held equal, stage by stage (TRL 1.16 field names on the right where they differ from ours):

* both: full fine-tuning, fp32 weights (ours ``model_dtype=float32``; TRL ``model_init_kwargs={"dtype": float32}``),
  ``attn_implementation=sdpa``, no gradient checkpointing (TRL's default is on: ``gradient_checkpointing=False``), the
  fused ``torch.optim.AdamW`` (``optim=adamw_torch_fused`` in both) with the stage's learning rate, betas (0.9, 0.999),
  eps 1e-8, no weight decay, a constant learning rate without warm-up (``lr_scheduler_type=constant``,
  ``warmup_steps=0``), gradient clipping at 1.0, seed 0, ``per_device_train_batch_size`` the same and
  ``gradient_accumulation_steps=1``, ``max_steps`` the same, logging every step (``logging_steps=1``), no evaluation
  and no checkpoints during training (ours ``save_steps=0``: only the final one, weights only; TRL
  ``save_strategy=no``), the final model saved to a folder (ours by the trainer, TRL by ``trainer.save_model``), on
  the CPU (workers hide any GPU; TRL ``use_cpu=True``) with ``--threads`` torch threads and ``OMP_NUM_THREADS``, and
  the same CPU kernels (every worker calls ``inference_optimizations.pin_cpu_kernels()`` first, as rlhf's CLI does).
  Dropout is off in both (ours ``disable_dropout``, its default; TRL ``disable_dropout=True`` for DPO and GRPO; TRL's
  SFTConfig has no such switch, and the models here have no dropout anyway).
* SFT: ``--sft-batch`` (8) sequences per step, ``--sft-lr`` (5e-5), ``cutoff_len`` / ``max_length`` ``--seq-len``
  (128; every demo record fits, so nothing is truncated), no packing (``packing=False``, ``padding_free=False``), loss
  on the answer tokens only (ours: its default; TRL ``completion_only_loss=True``), summed cross-entropy over the
  step's target tokens (both).
* DPO: ``--dpo-batch`` (8) pairs per step, ``--dpo-lr`` (5e-6), the sigmoid loss with beta ``--beta`` (0.1) against a
  reference model (the starting checkpoint), ``cutoff_len`` / ``max_length`` ``--seq-len``. Ours keeps
  ``precompute_ref_log_probs`` as our default (``auto``) decides for the run: on only when the steps pass over the
  pairs more than once (there is no held-out set), so a short run keeps the reference live on every batch; both get
  that value explicitly and the run line prints it.
* GRPO: ``--grpo-batch`` (32) completions per step = ``--grpo-batch`` / G prompts, all sampled in that step (TRL
  ``steps_per_generation=1``, so ``generation_batch_size`` = the batch; ours: one rollout per step), G =
  ``--num-generations`` (8), at most ``--completion-len`` (48) new tokens, temperature 1.0, no top-k / top-p, beta 0
  (no KL term, no reference model in either), ``num_iterations=1``, ``loss_type=grpo``, ``scale_rewards=group``, clip
  epsilon 0.2, ``mask_truncated_completions=False``, no vLLM (TRL samples with ``model.generate``; ours with its own
  engine, ``generation_engine`` ``--engine``, default auto), ``--grpo-lr`` (1e-5); prompts are not truncated (ours
  ``cutoff_len`` 512 for the prompt; TRL has no prompt limit). Ours keeps its default ``skip_zero_gradient_rows``: with
  beta 0 it skips the forward and backward of completions whose advantage is 0 (their group scored alike), which
  add exactly nothing to the update; TRL computes them. The share it skipped is printed.

Both record every step's training loss; for SFT and DPO the verdict line prints the largest difference between the
two (on the embedded tiny model: below 1e-6 in both, so the two trainers drew the same batches in the same order and
computed the same loss). What differs and cannot be matched: GRPO's samples (different random streams and sampling
code, so the completions, the rewards and the tokens generated per step differ: the completion tokens per step of
both are printed, like bench/bench_grpo.py; GRPO prompts are drawn by each trainer's own seeded sampler), and each
trainer's own work around the step (TRL's SFT computes entropy and token accuracy for its logs; ours packs DPO pairs
and shares GRPO prompts: that is what is being compared).

How it measures. Every (stage, implementation) run is its own subprocess (``--worker ours|trl``, one JSON line on
stdout), run one at a time, so its peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``: Python, libraries,
model, reference, optimizer state, activations, the final save) is its own; "base MiB" is the resident memory after
the imports. A child's ``ru_maxrss`` starts from its parent's peak (fork carries it over exec), so the driver imports
neither torch nor rlhf (it reads our DPO default from rlhf.py's source) and stays near 20 MiB; each run also records
its VmHWM (the high-water mark since exec) as a check. TRL's GRPO worker imports rlhf for the reward function (about
40 MiB of its peak), as bench/bench_grpo.py's does.

Seconds per step: SFT and DPO, ours from the start to the end of ``BaseTrainer._optimizer_step`` (forward and backward
of the micro-batch, the live reference's forward, clipping, the optimizer step), TRL from ``on_step_begin`` to
``on_step_end`` of a ``TrainerCallback`` (the same work: in both the batch is fetched before and logging comes after);
GRPO, both from the end of one optimizer step to the end of the next (ours: ``_optimizer_step`` wrapped; TRL:
``on_step_end``), since the rollout, generation and scoring, belongs to the step and runs before ``_optimizer_step`` in
ours. The "cycle" column is end-to-end for every stage. The first ``--warmup`` steps are dropped; "s/step median" is
the median of the timed steps (with ``--repeats``, the best median over the repeats; the order of the
implementations alternates), "s/step min" the fastest timed step of all repeats. Model loading, tokenisation and the
final save are not timed. On 2 cores another busy process slows a run many times over: the CPU the rest of the machine
used during each run is measured ("bg cores") and the verdicts say when it passed ``--max-background``.

Held-out accuracy comes from an evaluator written here with plain transformers, which shares nothing with either
trainer: it loads the saved folder with ``AutoModelForCausalLM`` / ``AutoTokenizer``, renders each of the first
``--eval-prompts`` (300) prompts of ``demo_eval`` (eval.jsonl) with ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)``, decodes greedily with ``model.generate`` (``--eval-max-new-tokens`` 64, batches of
``--eval-batch`` left-padded prompts, stopping at the tokenizer's EOS and the generation config's EOS ids), takes the
number after the last ``Answer:`` of the decoded text with its own regular expression and counts exact matches
(string equality) with the record's answer. It runs after the training runs in an evaluation subprocess of its own
(``--worker eval``; so its memory is in no training run's peak), which evaluates, one after the other and with the
same function, the base model and the SFT checkpoint (the "before" rows) and every implementation's output of the
first repeat (kept under ``--workdir``/bench-runs until then). "answer line" is the share of completions with an
``Answer: N`` line at all.

The limit (``bench/limits.py``): the peak fp32 matmul FLOP/s at ``--threads`` threads (the workers' CPU kernels
pinned the same way) and the memory bandwidth are measured before the first training run and after the last (the best
of each is kept, printed above the table), each time in a subprocess of its own (this driver keeps torch out of its
own process, and the buffers count in no run's memory); it also counts ``--model``'s parameters (``model_params``: all
of them, the tied embedding once). Every worker counts the tokens of each optimizer step: SFT and DPO the non-padding
tokens of the step's batch (attention-mask sum; DPO: prompt + chosen and prompt + rejected; ours in
``_optimizer_step``, TRL in ``training_step``), GRPO the prompt + completion tokens of the rows trained (ours: the rows
``_rows_that_train`` keeps; TRL: its ``compute_loss`` masks) and the completion tokens sampled. "trained tokens per
step" is their mean over the timed steps. A step's FLOPs: SFT 6 x parameters x tokens; DPO 6 x parameters x tokens +
2 x parameters x tokens while the reference runs live (``precompute_ref_log_probs`` off); GRPO 2 x parameters x
completion tokens sampled + 6 x parameters x tokens trained (+ 2 x parameters x tokens of forwards without backward:
none here, beta 0, one step per rollout); attention's own FLOPs ignored. "GFLOP/s" = a step's FLOPs / its seconds
(SFT, DPO: mean FLOPs per timed step / the median s/step; GRPO: the median over the timed steps); "% of peak" = that /
the peak: the headroom each trainer leaves on this machine. The evaluation is not timed against a limit.

Targets (PASS / FAIL lines): GRPO ours <= 0.5x TRL's median seconds per step with held-out accuracy >= TRL's; SFT
and DPO ours <= 0.8x TRL's median seconds per step. The exit status is 0 whatever the figures (1 only if a run broke).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

# bench/ (the script's folder) is on sys.path; neither module has side effects on import
from bench_dpo import batch_tokens, count_trl_tokens, peak_rss_mib, rss_mib, run_measured, step_times, trl_step_timer
from bench_grpo import count_ours_grpo_tokens, count_trl_grpo_tokens, per_step, step_flop_rates, timed_steps
from limits import Limits, forward_flops, fraction, giga, limits_epilog, training_flops
from tables import print_table

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data" / "demo"
MARK = "BENCH_REAL_LEARNING_RESULT "
DEFAULT_MODEL = "~/.cache/rlhf/models/SmolLM2-135M-Instruct"
STAGES = ("sft", "dpo", "grpo")
IMPLS = ("ours", "trl")
LABELS = {"ours": "ours (rlhf)", "trl": "TRL"}
DATASETS = {"sft": "demo_sft", "dpo": "demo_preference", "grpo": "demo_rl", "eval": "demo_eval"}
TIME_TARGETS = {"sft": 0.8, "dpo": 0.8, "grpo": 0.5}
ATTN = "sdpa"
GRPO_PROMPT_CUTOFF = 512  # ours' cutoff_len for GRPO prompts (TRL has none); the demo prompts are far shorter
STAMP = "bench-real-learning.json"  # in the SFT checkpoint's folder: the model and settings it was trained with
ADAM = dict(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
# the evaluator's own pattern: the number after "Answer:" (the last one in the text counts)
ANSWER_LINE = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
# the flags every worker gets from the driver (hyperparameters and evaluation settings)
PASSED = ("threads", "warmup", "sft_steps", "dpo_steps", "grpo_steps", "sft_lr", "dpo_lr", "grpo_lr", "sft_records",
          "dpo_records", "grpo_records", "eval_prompts", "sft_batch", "dpo_batch", "grpo_batch", "num_generations",
          "completion_len", "seq_len", "beta", "eval_batch", "eval_max_new_tokens", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=limits_epilog(
                                         "GFLOP/s = SFT 6 x parameters x tokens, DPO + 2 x parameters x tokens with a"
                                         " live reference, GRPO 2 x parameters x sampled + 6 x parameters x trained "
                                         "tokens, per step / its seconds; % of peak = that / the peak matmul FLOP/s"))
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="Hugging Face model folder SFT starts from (default: SmolLM2-135M-Instruct, made by "
                             "`python scripts/fetch_real_models.py smollm2`)")
    parser.add_argument("--sft-model", default=None,
                        help="the SFT checkpoint DPO and GRPO start from (default: trained here once with our SFT and "
                             "the SFT row's settings, kept in --workdir)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the SFT checkpoint is kept and the runs' outputs go (default: "
                             "$RLHF_CACHE/bench-real-learning, RLHF_CACHE defaulting to ~/.cache/rlhf)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated: sft, dpo, grpo")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated: ours, trl")
    parser.add_argument("--repeats", type=int, default=1,
                        help="training runs per stage and implementation (the order alternates; accuracy is the "
                             "first repeat's)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads and OMP_NUM_THREADS in workers")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of every run left out of the timing")
    parser.add_argument("--sft-steps", type=int, default=50)
    parser.add_argument("--dpo-steps", type=int, default=50)
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--sft-lr", type=float, default=5e-5)
    parser.add_argument("--dpo-lr", type=float, default=5e-6)
    parser.add_argument("--grpo-lr", type=float, default=1e-5)
    parser.add_argument("--sft-records", type=int, default=400, help="first N records of demo_sft")
    parser.add_argument("--dpo-records", type=int, default=400, help="first N pairs of demo_preference")
    parser.add_argument("--grpo-records", type=int, default=800, help="first N prompts of demo_rl (800: all)")
    parser.add_argument("--eval-prompts", type=int, default=300, help="first N prompts of demo_eval (held out)")
    parser.add_argument("--sft-batch", type=int, default=8, help="SFT sequences per optimizer step")
    parser.add_argument("--dpo-batch", type=int, default=8, help="DPO pairs per optimizer step")
    parser.add_argument("--grpo-batch", type=int, default=32, help="GRPO completions per optimizer step")
    parser.add_argument("--num-generations", type=int, default=8, help="GRPO group size G (divides --grpo-batch)")
    parser.add_argument("--completion-len", type=int, default=48, help="GRPO max_completion_length")
    parser.add_argument("--seq-len", type=int, default=128, help="SFT / DPO cutoff_len and max_length")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (sigmoid loss)")
    parser.add_argument("--eval-batch", type=int, default=32, help="prompts per greedy generate call when evaluating")
    parser.add_argument("--eval-max-new-tokens", type=int, default=64)
    parser.add_argument("--engine", default="auto", choices=("auto", "compiled", "static", "eager"),
                        help="our GRPO rollout decoding (GRPOConfig.generation_engine; its default is auto)")
    parser.add_argument("--max-background", type=float, default=0.25,
                        help="flag the verdicts when other processes used more CPU cores than this during a run")
    parser.add_argument("--keep-outputs", action="store_true",
                        help="keep every run's trained model under --workdir/bench-runs (default: deleted once "
                             "evaluated)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's raw results to this file")
    # internal: one measurement (or one evaluation) in this process
    parser.add_argument("--worker", choices=(*IMPLS, "eval"), help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--eval-dirs", help=argparse.SUPPRESS)
    parser.add_argument("--dpo-precompute", type=int, choices=(0, 1), default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = ("repeats", "threads", "warmup", "sft_records", "dpo_records", "grpo_records", "eval_prompts", "sft_batch",
              "dpo_batch", "grpo_batch", "completion_len", "seq_len", "eval_batch", "eval_max_new_tokens")
    if min(getattr(args, name) for name in counts) < 1:
        parser.error("--" + ", --".join(n.replace("_", "-") for n in counts) + " must be >= 1")
    if min(args.sft_steps, args.dpo_steps, args.grpo_steps) <= args.warmup:
        parser.error("--sft-steps, --dpo-steps and --grpo-steps must be larger than --warmup")
    if args.num_generations < 2 or args.grpo_batch % args.num_generations:
        parser.error("--num-generations must be >= 2 and divide --grpo-batch (each step trains on whole groups)")
    args.stages = sorted(_choices(parser, args.stages, STAGES, "--stages"), key=STAGES.index)  # SFT first
    args.impls = _choices(parser, args.impls, IMPLS, "--impls")
    return args


def _choices(parser: argparse.ArgumentParser, value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    picked = [v.strip() for v in value.split(",") if v.strip()]
    if not picked or any(v not in allowed for v in picked):
        parser.error(f"{flag}: comma-separated values from {', '.join(allowed)}")
    return list(dict.fromkeys(picked))


def stage_settings(args: argparse.Namespace, stage: str) -> dict:
    """Steps, learning rate, batch and records of one stage."""
    return {"steps": getattr(args, f"{stage}_steps"), "lr": getattr(args, f"{stage}_lr"),
            "batch": getattr(args, f"{stage}_batch"), "records": getattr(args, f"{stage}_records")}


def read_demo(name: str, count: int) -> list[dict]:
    """The first ``count`` records of a demo dataset, read straight from its file (dataset_info.json names it)."""
    info = json.loads((DATA_DIR / "dataset_info.json").read_text())
    records = []
    with open(DATA_DIR / info[name]["file_name"]) as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
            if len(records) == count:
                break
    return records


# -- worker side: one training run, or the evaluations, in this process -----------------------------------------------


def _pin_kernels() -> None:
    """CPU only, and the CPU kernels rlhf's CLI pins, before this process runs any torch operation."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import inference_optimizations

    inference_optimizations.pin_cpu_kernels()


def hwm_mib() -> float:
    """This process's resident high-water mark since its exec (VmHWM), beside ``ru_maxrss``, which starts from the
    parent's peak: the two agree when the driver is small."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def run_ours(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import rlhf

    base = rss_mib()
    stage, s = args.stage, stage_settings(args, args.stage)
    begins: list[float] = []
    ends: list[float] = []
    tokens: list[int] = []
    events: list[tuple[float, str, int]] = []
    generations: list[dict] = []
    stop_ids: list[int] = []
    inner_step = rlhf.BaseTrainer._optimizer_step

    def timed_step(self, group, window):  # forward(s), backward, clipping and the optimizer step of one step
        tokens.append(sum(batch_tokens(batch) for batch in group))
        begins.append(time.perf_counter())
        try:
            return inner_step(self, group, window)
        finally:
            ends.append(time.perf_counter())

    rlhf.BaseTrainer._optimizer_step = timed_step
    if stage == "grpo":
        inner_sample = rlhf.GRPOTrainer._sample

        def timed_sample(self, prompts, n):
            started = time.perf_counter()
            output = inner_sample(self, prompts, n)
            ended = time.perf_counter()
            lengths = [len(c) for c in output.token_ids]  # stop token included
            generations.append({"start": started, "end": ended, "tokens": sum(lengths), "completions": len(lengths),
                                "truncated": sum(reason == "length" for reason in output.finish_reasons)})
            stop_ids[:] = sorted(self.formatter.stop_token_ids)
            return output

        rlhf.GRPOTrainer._sample = timed_sample
        count_ours_grpo_tokens(rlhf.GRPOTrainer, events)

    common = dict(
        model_name_or_path=args.start, dataset=DATASETS[stage], dataset_dir=str(DATA_DIR), template="auto",
        max_samples=s["records"], finetuning_type="full", model_dtype="float32", attn_implementation=ATTN,
        gradient_checkpointing=False, disable_dropout=True, optim="adamw_torch_fused", learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, warmup_ratio=0.0, weight_decay=0.0, **ADAM, max_grad_norm=1.0,
        per_device_train_batch_size=s["batch"], gradient_accumulation_steps=1, max_steps=s["steps"], seed=0,
        logging_steps=1, save_steps=0, save_only_model=True, disable_progress_bar=True, report_to="none",
        resume_from_checkpoint="none", output_dir=args.out)
    started = time.perf_counter()
    if stage == "sft":
        config = rlhf.SFTConfig(**common, cutoff_len=args.seq_len, packing=False)
        result = rlhf.train_sft(config)
    elif stage == "dpo":
        config = rlhf.DPOConfig(**common, cutoff_len=args.seq_len, pref_beta=args.beta, pref_loss="sigmoid",
                                precompute_ref_log_probs=bool(args.dpo_precompute))
        result = rlhf.train_dpo(config)
    else:
        config = rlhf.GRPOConfig(
            **common, cutoff_len=GRPO_PROMPT_CUTOFF, reward_funcs=["exact_answer"], beta=0.0,
            num_generations=args.num_generations, max_completion_length=args.completion_len, temperature=1.0,
            top_p=1.0, top_k=0, num_iterations=1, epsilon_low=0.2, loss_type="grpo", scale_rewards="group",
            mask_truncated_completions=False, use_vllm=False, generation_engine=args.engine)
        result = rlhf.train_grpo(config)
    wall = time.perf_counter() - started
    if len(ends) != s["steps"]:
        raise RuntimeError(f"ours ran {len(ends)} optimizer steps, expected {s['steps']}")
    history = sorted((row for row in result.history if "step" in row), key=lambda row: row["step"])
    losses = [float(row["loss"]) for row in history if "loss" in row]
    out = {"wall": wall, "rss_base": base, "version": "rlhf", "mean_loss": _mean(losses), "losses": losses,
           "data": {k: v for k, v in result.metrics.items() if k.startswith("data/")}}
    if stage == "grpo":
        timed = timed_steps(ends, per_step(generations, ends), s["steps"], args.warmup, events=events)
        skipped = [float(row["skipped_rows_frac"]) for row in history
                   if row["step"] > args.warmup and "skipped_rows_frac" in row]
        out.update(timed, step=timed["cycle"], step_timer="end of one _optimizer_step to the end of the next",
                   mean_reward=_mean([float(row["reward"]) for row in history if "reward" in row]),
                   skipped=_mean(skipped) or 0.0, stop_ids=stop_ids)
    else:
        out.update(step_times(begins, ends, args.warmup), step_timer="_optimizer_step begin -> end",
                   step_tokens=tokens[args.warmup:])
    if stage == "dpo":
        out["precompute_ref_log_probs"] = config.precompute_ref_log_probs == "true"
    return out


def run_trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    stage, s = args.stage, stage_settings(args, args.stage)
    rlhf = None
    if stage == "grpo":  # the reward function is ours, the same as our trainer's
        import rlhf
    base = rss_mib()

    generations: list[dict] = []
    if stage == "grpo":
        inner = trl.GRPOTrainer._generate_single_turn  # the model.generate call (no vLLM)

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
    if stage == "grpo":
        count_trl_grpo_tokens(trl.GRPOTrainer, events)

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    def assistant(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    records = read_demo(DATASETS[stage], s["records"])
    if stage == "sft":
        rows = [{"prompt": user(r["prompt"]), "completion": assistant(r["response"])} for r in records]
    elif stage == "dpo":
        rows = [{"prompt": user(r["prompt"]), "chosen": assistant(r["chosen"]), "rejected": assistant(r["rejected"])}
                for r in records]
    else:
        rows = [{"prompt": user(r["prompt"]), "answer": r["answer"]} for r in records]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.start)
    common = dict(
        output_dir=args.out, seed=0, use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": ATTN}, gradient_checkpointing=False,
        optim="adamw_torch_fused", learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, **ADAM, max_grad_norm=1.0, per_device_train_batch_size=s["batch"],
        gradient_accumulation_steps=1, max_steps=s["steps"], logging_steps=1, report_to=[], save_strategy="no",
        eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False)
    kwargs = {}
    if stage == "sft":
        config = trl.SFTConfig(**common, max_length=args.seq_len, packing=False, padding_free=False,
                               completion_only_loss=True, assistant_only_loss=False)
        trainer_class = trl.SFTTrainer
    elif stage == "dpo":
        config = trl.DPOConfig(**common, max_length=args.seq_len, beta=args.beta, loss_type=["sigmoid"],
                               precompute_ref_log_probs=bool(args.dpo_precompute), disable_dropout=True)
        trainer_class = trl.DPOTrainer
    else:
        def exact_answer(prompts, completions, answer, **kw):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational
            return rlhf.exact_answer_reward(prompts, texts, answer).tolist()

        config = trl.GRPOConfig(
            **common, steps_per_generation=1, num_generations=args.num_generations,
            max_completion_length=args.completion_len, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group", mask_truncated_completions=False,
            use_vllm=False, disable_dropout=True, log_completions=False)
        trainer_class = trl.GRPOTrainer
        kwargs["reward_funcs"] = exact_answer
    timer = trl_step_timer()
    trainer = trainer_class(model=args.start, args=config, train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[timer], **kwargs)
    tokens: list[int] = []
    if stage != "grpo":
        count_trl_tokens(trainer, tokens)
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    if output.global_step != s["steps"] or len(timer.ends) != s["steps"]:
        raise RuntimeError(f"TRL ran {output.global_step} steps ({len(timer.ends)} timed), expected {s['steps']}")
    trainer.save_model(args.out)
    out = {"wall": wall, "rss_base": base, "version": f"trl {trl.__version__}", "mean_loss": output.training_loss,
           "losses": [float(row["loss"]) for row in trainer.state.log_history if "loss" in row]}
    if stage == "grpo":
        timed = timed_steps(timer.ends, generations, s["steps"], args.warmup, timer.begins, events)
        rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
        out.update(timed, step=timed["cycle"], step_timer="on_step_end to the next on_step_end",
                   mean_reward=_mean(rewards), stop_ids=sorted(trainer.eos_token_ids))
    else:
        out.update(step_times(timer.begins, timer.ends, args.warmup), step_timer="on_step_begin -> on_step_end",
                   step_tokens=tokens[args.warmup:])
    if stage == "dpo":
        out["precompute_ref_log_probs"] = config.precompute_ref_log_probs
        out["reference_in_memory"] = trainer.ref_model is not None
    return out


def last_answer(text: str) -> str | None:
    """The number after the last ``Answer:`` in a completion (None without one): what the evaluator compares, as a
    string, with the record's answer."""
    found = ANSWER_LINE.findall(text)
    return found[-1] if found else None


def evaluate_folder(directory: str, records: list[dict], batch_size: int, max_new_tokens: int) -> dict:
    """Held-out exact-match accuracy of a saved model folder with plain transformers: the model's chat template,
    greedy decoding, batches of left-padded prompts, the number after the last ``Answer:``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=ATTN)
    model.eval()
    stops: set[int] = set()
    for ids in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        stops.update([ids] if isinstance(ids, int) else list(ids or []))
    if not stops:
        raise RuntimeError(f"{directory}: neither the tokenizer nor the generation config names an EOS token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stops),
                                  pad_token_id=pad)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in records]
    completions, lengths, stopped = [], [], 0
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False)
        with torch.inference_mode():
            output = model.generate(**encoded, generation_config=generation)
        for row in output[:, encoded["input_ids"].shape[1]:].tolist():
            end = next((i for i, token in enumerate(row) if token in stops), None)
            stopped += end is not None
            row = row if end is None else row[:end]
            lengths.append(len(row))
            completions.append(tokenizer.decode(row, skip_special_tokens=True))
    found = [last_answer(text) for text in completions]
    correct = [f is not None and f == str(r["answer"]).strip() for f, r in zip(found, records)]
    return {"accuracy": sum(correct) / len(records), "correct": sum(correct), "prompts": len(records),
            "answer_line": sum(f is not None for f in found) / len(records),
            "mean_new_tokens": statistics.fmean(lengths),
            "stopped": stopped / len(records), "seconds": time.perf_counter() - started, "stop_ids": sorted(stops),
            "correct_flags": correct,
            "examples": [{"prompt": r["prompt"], "answer": r["answer"], "completion": c}
                         for r, c in zip(records[:3], completions[:3])]}


def run_eval(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    records = read_demo(DATASETS["eval"], args.eval_prompts)
    evals = {}
    for key, folder in json.loads(args.eval_dirs).items():
        try:
            evals[key] = evaluate_folder(folder, records, args.eval_batch, args.eval_max_new_tokens)
        except Exception as error:  # one model that cannot be evaluated leaves the others' figures
            evals[key] = {"error": f"{type(error).__name__}: {error}"}
    return {"evals": evals}


def worker(args: argparse.Namespace) -> int:
    if args.worker == "eval":
        if not args.eval_dirs:
            raise SystemExit("--worker eval needs --eval-dirs")
    elif not (args.stage and args.start and args.out):
        raise SystemExit("--worker ours|trl needs --stage, --start and --out")
    _pin_kernels()
    run = {"ours": run_ours, "trl": run_trl, "eval": run_eval}[args.worker]
    result = run(args)
    result.update(impl=args.worker, stage=args.stage, peak_rss=peak_rss_mib(), peak_hwm=hwm_mib())
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)
    return 0


# -- driver side: the SFT checkpoint, the runs one by one, the evaluations, the table ---------------------------------


def _worker_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in PASSED:
        value = getattr(args, name)
        flags += [f"--{name.replace('_', '-')}", repr(value) if isinstance(value, float) else str(value)]
    return flags


def run_worker(args: argparse.Namespace, role: str, *, stage: str | None = None, start: str | None = None,
               out: Path | None = None, eval_dirs: dict[str, str] | None = None) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", role, *_worker_flags(args),
               "--dpo-precompute", str(int(args.dpo_precompute))]
    if role == "eval":
        command += ["--eval-dirs", json.dumps(eval_dirs)]
    else:
        command += ["--stage", stage, "--start", str(start), "--out", str(out)]
    result = run_measured(command, args.threads, MARK)
    if "error" not in result and role != "eval" and not (out / "config.json").is_file():
        result = {"error": f"the run saved no model in {out}"}
    if role != "eval":
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # our final checkpoint: a second copy of the weights
    return result


def our_default(config: str, field: str) -> object:
    """The default of a field of one of rlhf's config classes, read from rlhf.py without importing it: the driver
    stays small, since a worker's ``ru_maxrss`` starts from the driver's peak (fork carries it over exec)."""
    import ast

    for node in ast.parse((REPO / "rlhf.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == config:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field:
                    value = item.value  # _opt(default, help)
                    value = value.args[0] if isinstance(value, ast.Call) else value
                    return ast.literal_eval(value)
    raise SystemExit(f"error: rlhf.py has no {config}.{field}")


def default_workdir() -> Path:
    return Path(os.environ.get("RLHF_CACHE") or Path.home() / ".cache" / "rlhf").expanduser() / "bench-real-learning"


def sft_start_folder(args: argparse.Namespace, model: Path, workdir: Path) -> tuple[Path, dict, bool]:
    """Where the SFT checkpoint DPO and GRPO start from is kept, its stamp (the model and the SFT row's settings), and
    whether a checkpoint with that stamp is already there (then it is reused)."""
    stamp = {"model": str(model), **stage_settings(args, "sft"), "seq_len": args.seq_len, "threads": args.threads,
             "dataset": DATASETS["sft"]}
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    folder = workdir / f"sft-start-{model.name}-{key}"
    stamp_file = folder / STAMP
    cached = (folder / "config.json").is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp
    return folder, stamp, cached


def flop_rate(run: dict, stage: str, params: int | None) -> float | None:
    """A run's FLOP/s (see the module docstring): SFT and DPO, the mean FLOPs of a timed step / the median seconds per
    step; GRPO, the median over the timed steps of a step's FLOPs / its seconds. None without the token counts."""
    if not params:
        return None
    if stage == "grpo":
        rates = step_flop_rates(run, params)
        return statistics.median(rates) if rates else None
    if not run.get("step_tokens"):
        return None
    tokens = statistics.fmean(run["step_tokens"])
    live_reference = stage == "dpo" and not run.get("precompute_ref_log_probs")
    flops = training_flops(params, tokens) + (forward_flops(params, tokens) if live_reference else 0.0)
    return flops / statistics.median(run["step"])


def summarise(runs: list[dict], stage: str | None = None, params: int | None = None) -> dict:
    """One row from the repeats of one (stage, implementation): the best median, the fastest step, the highest
    peak memory, the FLOP/s of the repeat with the best median (with ``params``); loss, reward and GRPO token counts
    of the first repeat that ran."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    first = ok[0]
    fastest = min(ok, key=lambda r: statistics.median(r["step"]))
    trained = fastest.get("trained_tokens") or fastest.get("step_tokens")
    row = {"step": min(statistics.median(r["step"]) for r in ok), "min": min(min(r["step"]) for r in ok),
           "cycle": min(statistics.median(r["cycle"]) for r in ok), "peak": max(r["peak_rss"] for r in ok),
           "base": max(r["rss_base"] for r in ok), "background": max(r["background"] for r in ok),
           "timed": len(first["step"]), "runs": len(ok), "mean_loss": first.get("mean_loss"),
           "mean_reward": first.get("mean_reward"), "skipped": first.get("skipped"),
           "trained": statistics.fmean(trained) if trained else None,
           "flops_per_s": flop_rate(fastest, stage, params)}
    if "tokens" in first:
        row.update(gen=statistics.median(first["gen"]), tokens=statistics.fmean(first["tokens"]),
                   length=sum(first["tokens"]) / max(sum(first["completions"]), 1),
                   truncated=sum(first["truncated"]) / max(sum(first["completions"]), 1))
    return row


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


HEADERS = ["stage", "impl.", "starts from", "timed steps", "s/step median", "s/step min", "cycle s median",
           "gen s median", "compl. tokens per step", "trained tokens per step", "GFLOP/s", "% of peak", "peak MiB",
           "base MiB", "mean loss", "mean reward", "held-out accuracy", "answer line", "time ours/TRL", "bg cores"]
SHORT = {"ours": "ours", "trl": "TRL"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    model = Path(args.model).expanduser().resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"error: --model {args.model}: no config.json there; run `python scripts/fetch_real_models.py "
                         "smollm2` for the default, or pass a Hugging Face model folder")
    # what our default (precompute_ref_log_probs=auto) decides for this run, given to both explicitly: with no
    # held-out set, precompute when the steps pass over the pairs more than once
    if our_default("DPOConfig", "precompute_ref_log_probs") != "auto":
        raise SystemExit("error: rlhf.DPOConfig's precompute_ref_log_probs default is no longer auto; update the bench")
    args.dpo_precompute = args.dpo_steps * args.dpo_batch > args.dpo_records
    workdir = (args.workdir or default_workdir()).expanduser().resolve()
    runs_dir = workdir / "bench-runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir(parents=True)
    try:
        from importlib.metadata import version

        versions = f"torch {version('torch')}, transformers {version('transformers')}, trl {version('trl')}"
    except Exception:  # only for the header line
        versions = "trl not installed"
    print(f"model {model}: full fine-tuning, fp32, {ATTN}, CPU, {args.threads} threads; {versions}")
    for stage in args.stages:
        s = stage_settings(args, stage)
        print(f"  {stage}: first {s['records']} records of {DATASETS[stage]}, batch {s['batch']}, lr {s['lr']:g} "
              f"constant, {s['steps']} steps (first {args.warmup} untimed)"
              + {"sft": f", cutoff {args.seq_len}",
                 "dpo": f", cutoff {args.seq_len}, sigmoid beta {args.beta:g}, precompute_ref_log_probs "
                        f"{args.dpo_precompute} (what our default, auto, decides here; both)",
                 "grpo": f" ({args.grpo_batch // args.num_generations} prompts x G {args.num_generations}), at most "
                         f"{args.completion_len} new tokens, temperature 1.0, beta 0, loss grpo"}[stage])
    print(f"  held-out: first {args.eval_prompts} prompts of {DATASETS['eval']}, greedy, at most "
          f"{args.eval_max_new_tokens} new tokens")

    starts = {"sft": (str(model), "base model")}
    evals_wanted = {"base model": str(model)}
    pending: tuple[Path, dict] | None = None  # the SFT checkpoint, when the SFT row's first ours run trains it
    start_error = ""
    if {"dpo", "grpo"} & set(args.stages):
        if args.sft_model:
            sft_start = Path(args.sft_model).expanduser().resolve()
            if not (sft_start / "config.json").is_file():
                raise SystemExit(f"error: --sft-model {args.sft_model}: no config.json there")
            how = "given by --sft-model"
        else:
            sft_start, stamp, cached = sft_start_folder(args, model, workdir)
            if cached:
                how = "trained by our SFT with the SFT row's settings in an earlier run, reused"
            elif "sft" in args.stages and "ours" in args.impls:
                pending = (sft_start, stamp)
                how = "trained by our SFT with the SFT row's settings: the SFT row's first ours run below trains it"
            else:
                shutil.rmtree(sft_start, ignore_errors=True)
                started = time.perf_counter()
                result = run_worker(args, "ours", stage="sft", start=str(model), out=sft_start)
                if "error" in result:
                    raise SystemExit(f"error: training the SFT checkpoint for DPO and GRPO failed:\n{result['error']}")
                (sft_start / STAMP).write_text(json.dumps(stamp, sort_keys=True))
                how = f"trained now by our SFT with the SFT row's settings, {time.perf_counter() - started:.0f}s"
        print(f"DPO and GRPO start from the SFT checkpoint {sft_start} ({how})")
        starts["dpo"] = starts["grpo"] = (str(sft_start), "SFT checkpoint")
        evals_wanted["SFT checkpoint"] = str(sft_start)

    evals: dict[str, dict] = {}
    failures = 0

    def evaluate(folders: dict[str, str]) -> None:
        nonlocal failures
        unique: dict[str, str] = {}
        for key, folder in folders.items():  # a folder named twice (the SFT checkpoint) is evaluated once
            if (Path(folder) / "config.json").is_file():
                unique.setdefault(folder, key)
            else:
                evals[key] = {"error": f"no model in {folder}"}
        if not unique:
            return
        result = run_worker(args, "eval", eval_dirs={key: folder for folder, key in unique.items()})
        if "error" in result:
            failures += 1
            print("evaluation FAILED:\n  " + result["error"].replace("\n", "\n  "))
            evals.update({key: {"error": result["error"]} for key, folder in folders.items() if folder in unique})
            return
        for key, folder in folders.items():
            if folder not in unique:
                continue
            value = evals[key] = result["evals"][unique[folder]]
            if "error" in value:
                failures += 1
                print(f"evaluation of {key} FAILED: {value['error']}")
                continue
            print(f"held-out accuracy of {key}: {value['accuracy']:.1%} ({value['correct']}/{value['prompts']}), "
                  f"answer line {value['answer_line']:.0%}, {value['mean_new_tokens']:.1f} new tokens on average, "
                  f"{value['seconds']:.0f}s")

    # the limits in a process of their own: this driver imports no torch (its peak memory every run's ru_maxrss
    # starts from), and its buffers count in no run's memory; kernels pinned as the workers pin them
    limits = Limits("float32")
    params = limits.measure_in_subprocess(args.threads, model=model, pin_kernels=True)["params"]
    runs: dict[str, list[dict]] = {}
    for stage in args.stages:
        start, _ = starts[stage]
        for repeat in range(args.repeats):
            for impl in (args.impls if repeat % 2 == 0 else args.impls[::-1]):
                if start_error and stage != "sft":
                    runs.setdefault(f"{stage}/{impl}", []).append({"error": start_error})
                    print(f"{stage} / {LABELS[impl]} (repeat {repeat + 1}) not run: {start_error}")
                    continue
                out = runs_dir / f"{stage}-{impl}-r{repeat + 1}"
                trains_start = pending is not None and stage == "sft" and impl == "ours" and repeat == 0
                if trains_start:  # the same run as the SFT row's: its output is the checkpoint DPO and GRPO start from
                    out = pending[0]
                    shutil.rmtree(out, ignore_errors=True)
                result = run_worker(args, impl, stage=stage, start=start, out=out)
                runs.setdefault(f"{stage}/{impl}", []).append(result)
                if trains_start:
                    if "error" in result:
                        start_error = "no SFT checkpoint to start from: the SFT run that trains it broke"
                    else:
                        (out / STAMP).write_text(json.dumps(pending[1], sort_keys=True))
                if "error" in result:
                    failures += 1
                    print(f"{stage} / {LABELS[impl]} (repeat {repeat + 1}) FAILED:\n  "
                          + result["error"].replace("\n", "\n  "))
                    continue
                extra = ""
                if stage == "grpo":
                    extra = (f", generation {statistics.median(result['gen']):.3f}s, "
                             f"{statistics.fmean(result['tokens']):.0f} completion tokens/step, stop ids "
                             f"{result['stop_ids']}, mean reward {_fmt(result['mean_reward'])}"
                             + (f", rows skipped {result['skipped']:.0%}" if impl == "ours" else ""))
                if stage == "dpo":
                    extra = f", precompute_ref_log_probs {result['precompute_ref_log_probs']}"
                print(f"{stage} / {LABELS[impl]} (repeat {repeat + 1}): median step "
                      f"{statistics.median(result['step']):.3f}s ({result['step_timer']}), fastest "
                      f"{min(result['step']):.3f}s, peak {result['peak_rss']:.0f} MiB "
                      f"(VmHWM {result['peak_hwm']:.0f}), "
                      f"mean loss {_fmt(result['mean_loss'], '.4f')}{extra}, process {result['process']:.0f}s, "
                      f"background load {result['background']:.2f} cores")
                if repeat == 0:
                    evals_wanted[f"{stage}/{impl}"] = str(out)
                elif not args.keep_outputs:
                    shutil.rmtree(out, ignore_errors=True)
        if pending is not None and stage == "sft":
            pending = None
    limits.measure_in_subprocess(args.threads, pin_kernels=True)  # after the training runs
    evaluate(evals_wanted)  # one evaluation process after the training runs: the same function for every model

    summary = {key: summarise(value, key.split("/")[0], params) for key, value in runs.items()}
    rows = []
    for key, label in [("base model", "base model"), ("SFT checkpoint", "SFT checkpoint")]:
        if key in evals_wanted:
            e = evals.get(key, {})
            rows.append(["before", label, "-"] + ["-"] * 13
                        + [_fmt(e.get("accuracy"), ".1%"), _fmt(e.get("answer_line"), ".0%"), "-", "-"])
    verdicts = []
    for stage in args.stages:
        ours, theirs = summary.get(f"{stage}/ours"), summary.get(f"{stage}/trl")
        both = ours and theirs and "error" not in ours and "error" not in theirs
        for impl in args.impls:
            s, e = summary[f"{stage}/{impl}"], evals.get(f"{stage}/{impl}", {})
            if "error" in s:
                rows.append([stage, SHORT[impl], starts[stage][1], "failed"] + ["-"] * (len(HEADERS) - 4))
                continue
            ratio = f"{s['step'] / theirs['step']:.2f}x" if both and impl == "ours" else "-"
            rows.append([stage, SHORT[impl], starts[stage][1], f"{s['timed']}x{s['runs']}", _fmt(s["step"]),
                         _fmt(s["min"]), _fmt(s["cycle"]), _fmt(s.get("gen")), _fmt(s.get("tokens"), ".0f"),
                         _fmt(s["trained"], ".0f"), giga(s["flops_per_s"]), fraction(s["flops_per_s"], limits.peak),
                         _fmt(s["peak"], ".0f"), _fmt(s["base"], ".0f"), _fmt(s["mean_loss"], ".4f"),
                         _fmt(s["mean_reward"]), _fmt(e.get("accuracy"), ".1%"), _fmt(e.get("answer_line"), ".0%"),
                         ratio, f"{s['background']:.2f}"])
        if not both:
            verdicts.append(f"n/a {stage}: no ratio, " + ("a run broke" if len(args.impls) == 2
                                                           else "--impls needs both ours and trl"))
            continue
        t, target = ours["step"] / theirs["step"], TIME_TARGETS[stage]
        ok = t <= target
        line = (f"{stage}: time {t:.2f}x TRL per step (target <= {target:g}x, {'met' if ok else 'missed'}); fastest "
                f"step {ours['min'] / theirs['min']:.2f}x, cycle {ours['cycle'] / theirs['cycle']:.2f}x, peak memory "
                f"{ours['peak'] / theirs['peak']:.2f}x")
        mine, theirs_losses = runs[f"{stage}/ours"][0].get("losses"), runs[f"{stage}/trl"][0].get("losses")
        if stage != "grpo" and mine and theirs_losses and len(mine) == len(theirs_losses):
            line += (f"; per-step training loss ours vs TRL (first repeat): largest difference "
                     f"{max(abs(a - b) for a, b in zip(mine, theirs_losses)):.2g}")
        if stage == "grpo":
            a, b = evals.get("grpo/ours", {}).get("accuracy"), evals.get("grpo/trl", {}).get("accuracy")
            acc_ok = a is not None and b is not None and a >= b
            ok = ok and acc_ok
            line += (f"; held-out accuracy {_fmt(a, '.1%')} vs TRL {_fmt(b, '.1%')} (target >= TRL's, "
                     f"{'met' if acc_ok else 'missed'}); completion tokens per step {ours['tokens']:.0f} vs "
                     f"{theirs['tokens']:.0f} (mean length {ours['length']:.1f} vs {theirs['length']:.1f}, at the "
                     f"limit {ours['truncated']:.0%} vs {theirs['truncated']:.0%}); rows skipped by ours "
                     f"{ours['skipped'] or 0:.0%} (skip_zero_gradient_rows, our default)")
        if max(ours["background"], theirs["background"]) > args.max_background:
            line += "; MACHINE BUSY, times unreliable"
        verdicts.append(f"{'PASS' if ok else 'FAIL'} {line}")

    print(limits.describe("measured before and after the training runs"))
    print_table(HEADERS, rows, f"{model.name}: SFT, DPO and GRPO, ours beside TRL ({args.threads} threads, fp32 CPU; "
                f"s/step: SFT/DPO step begin -> end, GRPO end of one step to the end of the next, generation included; "
                f"peak = max RSS of the run's process; accuracy: greedy on {args.eval_prompts} held-out prompts)",
                label_columns=3, wrap_values=True, min_width=240)
    print(f"GFLOP/s: SFT 6 x {params / 1e6:.1f}M parameters x trained tokens, DPO the same + 2 x parameters x tokens "
          "while the reference runs live, GRPO 2 x parameters x sampled + 6 x parameters x trained tokens, per step / "
          "its seconds (attention FLOPs ignored); % of peak = that / the peak matmul FLOP/s above")
    for line in verdicts:
        print(line)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if k not in ("worker", "stage", "start", "out", "eval_dirs", "json")}
        args.json.write_text(json.dumps({"settings": settings, "model": str(model),
                                         "starts": {k: v[0] for k, v in starts.items()}, "runs": runs,
                                         "summary": summary, "evals": evals, "verdicts": verdicts,
                                         "limits": {**limits.to_json(), "params": params}}, indent=1))
    if not args.keep_outputs:
        shutil.rmtree(runs_dir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
