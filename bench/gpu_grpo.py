"""GRPO and SFT end to end on one GPU, as tokens/s and MFU beside prime-rl's published figure (Qwen3-0.6B RL on one
H100: 11.9k tokens/s at 11.1% MFU). The prepared script for a lent GPU (issue 45 part 6); on a CPU it runs at tiny
settings (tests/test_gpu_grpo_script.py), so it is known to work before device time is spent on it.

    python bench/gpu_grpo.py --tokenizer .gpu/qwen3-tokenizer                      # on the GPU machine
    python bench/gpu_grpo.py --device cpu --shape tiny --grpo-steps 2 --sft-steps 2 ...  # the CPU smoke run

The model: Qwen3-0.6B's shape (its config.json: 28 layers, hidden 1024, 151,936-token vocabulary, tied embeddings)
with random weights, built on the machine from ``--tokenizer`` (a saved Qwen3 tokenizer folder, 11 MB: carried, since
the GPU machine reaches no hub) or ``--shape tiny`` (4 layers, hidden 256, the same tokenizer). Random weights never
say "stop", so every completion runs to ``--completion-len``: the work per step is fixed, which is what a throughput
figure needs (rewards are near 0 and are not the point).

GRPO: ``--prompts-per-step`` prompts of the demo's arithmetic set x ``--num-generations`` completions per step, beta 0
(no reference forward), every row trained (``skip_zero_gradient_rows=false``: with random weights every reward is 0,
which our default would skip, as prime-rl and TRL do not), one optimizer step per rollout, our engine
(``generation_engine=auto``: the static-cache decode step compiled, a CUDA graph on CUDA), bf16 autocast with fp32
master weights. SFT: the demo's SFT set packed into ``--seq-len``-token rows, ``--sft-batch`` rows per step. The
first ``--warmup`` steps (compilation) are left out.

Figures per timed step (the median): seconds, whole (from the end of one optimizer step to the end of the next), and
of them the rollout's sampling and the forward, backward and update; sampled tokens/s (completion tokens); processed
tokens/s (prompt + completion tokens of every trained row, prime-rl's count as we read it: "tokens/s" over the whole
step); MFU = FLOPs / s / peak, with FLOPs = 2 x P x sampled + 6 x P x trained (GRPO; prompt prefill and attention
ignored) or 6 x P x tokens (SFT), P = the model's parameters (tied embedding once), and the peak the measured bf16
matmul FLOP/s (fp32 on a CPU) of an 8192^2 matmul (the H100's and H200's datasheet dense bf16: 989 TFLOP/s; both
figures are printed). Results go to ``--out`` as JSON too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_dpo import batch_tokens  # noqa: E402
from limits import forward_flops, giga, matmul_peak, model_params, training_flops  # noqa: E402
from tables import print_table  # noqa: E402

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)  # Qwen/Qwen3-0.6B's config.json, less the vocabulary
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
PRIME_RL = {"tokens_per_s": 11_900, "mfu": 0.111, "setting": "Qwen3-0.6B RL, one H100 (prime-rl's published figure)"}
H100_BF16_DENSE = 989e12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the point) or cpu (the smoke run)")
    parser.add_argument("--shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    parser.add_argument("--tokenizer", default="", help="a saved Qwen3 tokenizer folder (default: tests/real_models.py "
                                                        "builds one, where its sources are present)")
    parser.add_argument("--grpo-steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="GRPO rows per forward/backward (the step's rows are accumulated over micro-batches)")
    parser.add_argument("--sft-steps", type=int, default=8)
    parser.add_argument("--sft-batch", type=int, default=8, help="packed rows per SFT step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed SFT row")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (compilation)")
    parser.add_argument("--workdir", default="/tmp/gpu-grpo")
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    parser.add_argument("--stages", type=lambda text: text.split(","), default=["sft", "grpo"],
                        help="comma-separated: sft, grpo (default both)")
    parser.add_argument("--torch-compile", action="store_true", help="train with torch_compile: true")
    parser.add_argument("--profile", default="", help="a folder: profile both runs with torch.profiler and write "
                                                      "each one's operator table there (sft.txt, grpo.txt)")
    args = parser.parse_args(argv)
    if min(args.grpo_steps, args.sft_steps) <= args.warmup:
        parser.error("--grpo-steps and --sft-steps must be larger than --warmup")
    return args


def tokenizer_folder(args: argparse.Namespace) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    sys.path.insert(0, str(REPO / "tests"))
    import real_models

    return real_models.build_tokenizer("qwen3")


def build_model(args: argparse.Namespace, directory: Path) -> Path:
    """The random-weight model of ``--shape`` with the Qwen3 tokenizer, saved once into ``directory``."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder(args)))
    shape = QWEN3_0_6B if args.shape == "qwen3-0.6b" else TINY
    torch.manual_seed(0)
    config = Qwen3Config(**shape, vocab_size=len(tokenizer), bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    directory.mkdir(parents=True, exist_ok=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class StepClock:
    """Times every optimizer step of our trainers, whole: from the end of one optimizer step to the end of the next
    (data, the online trainers' rollout, forward, backward, update and logging), and apart from that the time inside
    ``BaseTrainer._optimizer_step`` (forward, backward and update alone); counts each step's trained tokens (the
    attention-mask sum of its micro-batches). The first step has no start and is not timed."""

    def __init__(self, rlhf) -> None:
        self.seconds: list[float] = []
        self.inside: list[float] = []
        self.tokens: list[int] = []
        self.last_end: float | None = None
        inner = rlhf.BaseTrainer._optimizer_step
        clock = self

        def timed(trainer, group, window):
            started = time.perf_counter()
            out = inner(trainer, group, window)
            if str(trainer.devices.device).startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            ended = time.perf_counter()
            if clock.last_end is not None:
                clock.seconds.append(ended - clock.last_end)
                clock.inside.append(ended - started)
                clock.tokens.append(sum(batch_tokens(batch) for batch in group))
            clock.last_end = ended
            return out

        rlhf.BaseTrainer._optimizer_step = timed

    def figures(self, warmup: int) -> dict:
        """Medians over the steps after the first ``warmup`` (the first step is never timed)."""
        timed = slice(max(warmup - 1, 0), None)
        return {"seconds": statistics.median(self.seconds[timed]), "inside": statistics.median(self.inside[timed]),
                "tokens": statistics.median(self.tokens[timed])}


@contextlib.contextmanager
def profiled(args: argparse.Namespace, name: str):
    """With ``--profile``: torch.profiler over the whole run, its operator tables (by device time, by CPU time)
    written to ``<profile>/<name>.txt``: where a step's time goes when the figures are far from the peak."""
    if not args.profile:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    table = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = "\n\n".join(f"sorted by {key}\n" + table.table(sort_by=key, row_limit=30, max_name_column_width=60)
                       for key in (device_key, "cpu_time_total"))
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    (Path(args.profile) / f"{name}.txt").write_text(text)


def run_sft(args: argparse.Namespace, rlhf, model: Path, common: dict) -> dict:
    clock = StepClock(rlhf)
    config = rlhf.SFTConfig(**common, dataset="demo_sft", packing=True, cutoff_len=args.seq_len,
                            per_device_train_batch_size=args.sft_batch, max_steps=args.sft_steps,
                            output_dir=str(Path(args.workdir) / "sft"))
    with profiled(args, "sft"):
        rlhf.train_sft(config)
    return clock.figures(args.warmup)


def run_grpo(args: argparse.Namespace, rlhf, model: Path, common: dict) -> dict:
    clock = StepClock(rlhf)
    rows = args.prompts_per_step * args.num_generations
    micro = min(args.micro_batch, rows)
    if rows % micro:
        raise SystemExit(f"error: --micro-batch {micro} must divide the step's {rows} rows")
    config = rlhf.GRPOConfig(**common, dataset="demo_rl", cutoff_len=256, per_device_train_batch_size=micro,
                             gradient_accumulation_steps=rows // micro,
                             num_generations=args.num_generations, max_completion_length=args.completion_len,
                             max_steps=args.grpo_steps, reward_funcs=["exact_answer"], beta=0.0, temperature=1.0,
                             skip_zero_gradient_rows=False,  # random weights earn no reward: train every row anyway
                             output_dir=str(Path(args.workdir) / "grpo"))
    with profiled(args, "grpo"):
        result = rlhf.train_grpo(config)
    history = sorted((row for row in result.history if "step" in row and "completions/mean_length" in row),
                     key=lambda row: row["step"])
    timed = slice(args.warmup, None)
    sampled = [row["completions/mean_length"] * rows for row in history][timed]
    generation = [row["perf/generation_s"] for row in history if "perf/generation_s" in row][timed]
    return {**clock.figures(args.warmup), "generation_s": statistics.median(generation) if generation else 0.0,
            "sampled": statistics.median(sampled) if sampled else float(rows * args.completion_len)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import rlhf

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no GPU; use --device cpu for the smoke run")
    model_dir = build_model(args, Path(args.workdir) / f"model-{args.shape}")
    params = model_params(rlhf.load_causal_lm(str(model_dir))[0])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the matrix products run in
    peak = max(matmul_peak(8192 if device.type == "cuda" else 512, device, dtype) for _ in range(2))
    common = dict(model_name_or_path=str(model_dir), dataset_dir=str(REPO / "data" / "demo"), template="qwen3",
                  finetuning_type="full", learning_rate=1e-6, lr_scheduler_type="constant", logging_steps=1,
                  save_steps=0, disable_progress_bar=True, report_to="none", seed=0, resume_from_checkpoint="none",
                  bf16=device.type == "cuda", eval_steps=0, torch_compile=args.torch_compile)
    figures = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "params": params,
               "peak_flops": peak, "peak_dtype": str(dtype), "shape": args.shape, "prime_rl": PRIME_RL,
               "torch_compile": args.torch_compile}
    rows = []
    if "sft" in args.stages:
        figures["sft"] = sft = run_sft(args, rlhf, model_dir, common)
        flops = training_flops(params, sft["tokens"]) / sft["seconds"]
        sft.update(flops=flops, mfu=flops / peak)
        rows.append(["SFT", f"{sft['seconds']:.3f}", "-", f"{sft['inside']:.3f}", "-",
                     f"{sft['tokens'] / sft['seconds']:,.0f}", giga(flops / 1e3, 1), f"{flops / peak:.1%}",
                     f"{flops / H100_BF16_DENSE:.1%}", "-"])
    if "grpo" in args.stages:
        figures["grpo"] = grpo = run_grpo(args, rlhf, model_dir, common)
        flops = (forward_flops(params, grpo["sampled"]) + training_flops(params, grpo["tokens"])) / grpo["seconds"]
        grpo.update(flops=flops, mfu=flops / peak)
        rows.append(["GRPO", f"{grpo['seconds']:.3f}", f"{grpo['generation_s']:.3f}", f"{grpo['inside']:.3f}",
                     f"{grpo['sampled'] / grpo['seconds']:,.0f}", f"{grpo['tokens'] / grpo['seconds']:,.0f}",
                     giga(flops / 1e3, 1), f"{flops / peak:.1%}", f"{flops / H100_BF16_DENSE:.1%}",
                     f"{PRIME_RL['tokens_per_s']:,} tokens/s, {PRIME_RL['mfu']:.1%} MFU"])
    print(f"{figures['device']}: {params / 1e6:.0f}M parameters ({args.shape}, random weights), measured {dtype} "
          f"matmul peak {peak / 1e12:.2f} TFLOP/s" + (", torch_compile" if args.torch_compile else ""))
    print_table(["stage", "s/step", "of which sampling", "of which forward, backward, update", "sampled tokens/s",
                 "processed tokens/s", "TFLOP/s", "MFU (measured peak)", "MFU (989 TFLOP/s)", "prime-rl (H100)"], rows,
                f"GRPO {args.prompts_per_step} prompts x {args.num_generations}, {args.completion_len} tokens; "
                f"SFT {args.sft_batch} x {args.seq_len} packed; median of steps after {args.warmup}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
