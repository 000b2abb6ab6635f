#!/usr/bin/env python3
"""The online-RL family on one budget: each method from the same SFT policy, held-out exact match before and after.

    python rlhf.py pipeline --config experiments/configs/demo_careless.yaml "stages=[sft]"   # the start (5 min)
    python experiments/online_rl_family.py                                  # every method, 150 steps each
    python experiments/online_rl_family.py --seeds 0,1,2                    # three runs each, gains averaged
    python experiments/online_rl_family.py --methods grpo,rloo --steps 300
    python experiments/online_rl_family.py --methods distill --teacher outputs/demo_tools/sft
    python experiments/online_rl_family.py --table-only --seeds 0,1,2       # the table of runs already made
    python experiments/online_rl_family.py --methods grpo --set use_vllm=true --suffix vllm   # vLLM rollouts

Every method runs as its own ``python rlhf.py STAGE key=value ...`` command (printed before it starts, so any row
can be rerun by hand) with the settings the methods share: the demo's RL prompts (``demo_rl``), the
``exact_answer`` reward, temperature 0.6, full fine-tuning, ``--steps`` optimizer steps of 64 sampled completions
(8 prompts x 8 for the group methods, 32 prompts x 2 for online DPO), learning rate 1e-4 after 10 warm-up steps
(5e-5 for online DPO, the demo DPO stage's rate: its loss is on a different scale) and no KL penalty except
REINFORCE++'s own (beta 0.01, its stage default). Each method keeps its paper's or TRL's defaults otherwise: a
fixed budget, nothing tuned per method. Held-out exact match is greedy on ``demo_eval`` (300 prompts, about
+-2.7 points of sampling error), before training and after the last step.

Methods (names are the rows):
  grpo          the baseline (group mean and std)
  rloo          stage rloo: leave-one-out baseline, unscaled (Ahmadian et al. 2024)
  reinforce_pp  stage reinforce_pp: token returns with the KL in the reward, whitened over the batch (Hu et al. 2025)
  gspo          importance_sampling_level: sequence, epsilon 3e-4 / 4e-4 (Zheng et al. 2025)
  grpo_mu2, gspo_mu2   the same two with num_iterations 2 (each rollout trains two optimizer steps)
  cispo         loss_type: cispo (MiniMax-M1)
  dapo          dynamic_sampling, overlong shaping (buffer 16, factor 1), clip-higher 0.28, dapo token mean
                (Yu et al. 2025)
  online_dpo    stage online_dpo, pairs ranked by the reward (Guo et al. 2024)
  distill       stage distill from --teacher on demo_sft_careless (GKD, lmbda 0.5, beta 0.5: TRL's defaults)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from tables import print_table  # noqa: E402

SHARED = {"dataset_dir": "data/demo", "eval_dataset": "demo_eval", "template": "auto", "cutoff_len": 128,
          "finetuning_type": "full", "max_completion_length": 64, "temperature": 0.6, "warmup_steps": 10,
          "logging_steps": 10, "save_steps": 100000, "per_device_eval_batch_size": 100, "eval_before_training": True,
          "report_to": "none", "plot_loss": False, "overwrite_output_dir": True}
GROUP = {"dataset": "demo_rl", "reward_funcs": "[exact_answer]", "num_generations": 8,
         "per_device_train_batch_size": 64, "beta": 0.0, "learning_rate": 1e-4}
METHODS = {
    "grpo": ("grpo", GROUP),
    "rloo": ("rloo", GROUP),
    "reinforce_pp": ("reinforce_pp", {**GROUP, "beta": 0.01}),
    "gspo": ("grpo", {**GROUP, "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4}),
    "cispo": ("grpo", {**GROUP, "loss_type": "cispo"}),
    "dapo": ("grpo", {**GROUP, "loss_type": "dapo", "epsilon_high": 0.28, "dynamic_sampling": True,
                      "overlong_buffer_len": 16, "overlong_penalty_factor": 1.0}),
    # two optimizer steps per rollout (mu 2): the second step is off-policy, so the ratio moves and the clip ranges
    # matter; on-policy (mu 1) GSPO's gradient equals GRPO's (a sequence ratio of exactly 1, the same token mean)
    "grpo_mu2": ("grpo", {**GROUP, "num_iterations": 2}),
    "gspo_mu2": ("grpo", {**GROUP, "num_iterations": 2, "importance_sampling_level": "sequence", "epsilon_low": 3e-4,
                          "epsilon_high": 4e-4}),
    "online_dpo": ("online_dpo", {"dataset": "demo_rl", "reward_funcs": "[exact_answer]",
                                  "per_device_train_batch_size": 32, "learning_rate": 5e-5, "pref_beta": 0.1}),
    "distill": ("distill", {"dataset": "demo_sft_careless", "per_device_train_batch_size": 32, "learning_rate": 1e-4,
                            "lmbda": 0.5, "beta": 0.5}),
}


def run_dir(args: argparse.Namespace, method: str, seed: int) -> Path:
    return Path(args.output_root) / f"{method}{'-' + args.suffix if args.suffix else ''}-seed{seed}"


def command(method: str, args: argparse.Namespace, seed: int = 0) -> list[str]:
    stage, settings = METHODS[method]
    settings = {**SHARED, **settings, "model_name_or_path": args.sft, "max_steps": args.steps, "seed": seed,
                "output_dir": str(run_dir(args, method, seed))}
    settings.update(dict(item.split("=", 1) for item in args.set))
    if method == "distill":
        settings["teacher_model"] = args.teacher
    return [sys.executable, str(REPO / "rlhf.py"), stage,
            *(f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in settings.items())]


def accuracies(output_dir: Path) -> tuple[float, float, float]:
    """Held-out exact match before and after training, and the stage's training seconds, from the run's report."""
    stage = json.loads((output_dir / "report.json").read_text())["stages"][-1]
    return stage["eval_before"]["eval/accuracy"], stage["eval"]["eval/accuracy"], stage["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="outputs/demo_careless/sft", help="the policy every method starts from")
    parser.add_argument("--teacher", default=None,
                        help="distill's teacher (a demo-trained model with the tiny tokenizer)")
    parser.add_argument("--methods", default="grpo,rloo,reinforce_pp,gspo,cispo,dapo,online_dpo",
                        help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per method")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each method runs once per seed (the "
                        "sampling and the prompt order change; the SFT start does not)")
    parser.add_argument("--output-root", default="outputs/online_rl_family",
                        help="each run goes in ROOT/METHOD-seedN")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more setting for every method (repeatable), e.g. use_vllm=true; give --suffix too")
    parser.add_argument("--suffix", default="", help="runs go in ROOT/METHOD-SUFFIX-seedN (keeps variants apart)")
    parser.add_argument("--table-only", action="store_true", help="run nothing: tabulate the runs already in ROOT")
    args = parser.parse_args()
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE, e.g. --set use_vllm=true")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if "distill" in methods and not args.teacher:
        parser.error("--methods distill needs --teacher DIR (a demo-trained model sharing the tiny tokenizer)")
    if not (Path(args.sft) / "config.json").is_file():
        parser.error(f"--sft: {args.sft} holds no saved model; run `python rlhf.py pipeline --config "
                     f"experiments/configs/demo_careless.yaml \"stages=[sft]\"` first")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of whole numbers")
    rows = []
    for method in methods:
        befores, afters, trainings = [], [], []
        for seed in seeds:
            if not args.table_only:
                argv = command(method, args, seed)
                print("$", " ".join(argv[1:]), flush=True)
                done = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
                    continue
            try:
                before, after, training = accuracies(run_dir(args, method, seed))
            except (OSError, KeyError, IndexError, ValueError):
                print(f"  {method} seed {seed}: no finished run in {run_dir(args, method, seed)}", flush=True)
                continue
            befores, afters, trainings = befores + [before], afters + [after], trainings + [training]
            print(f"  {method} seed {seed}: {before:.1%} -> {after:.1%}, {training:.0f} s of training", flush=True)
        if not afters:
            rows.append([method, "failed", "", "", ""])
            continue
        gains = [100 * (a - b) for a, b in zip(afters, befores)]
        rows.append([method, f"{befores[0]:.1%}", " / ".join(f"{a:.1%}" for a in afters),
                     f"{sum(gains) / len(gains):+.1f}", f"{sorted(trainings)[len(trainings) // 2]:.0f}"])
    print_table(["method", "held-out before", f"after {args.steps} steps (seed {', '.join(map(str, seeds))})",
                 "points (mean)", "training s (median)"], rows,
                f"Online RL from {args.sft}, {args.steps} steps each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
