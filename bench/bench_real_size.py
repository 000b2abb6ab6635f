"""A real-sized model on this CPU: SFT and DPO steps of ours beside TRL's on a random-weight model shaped like
Qwen3-0.6B (its real config: 28 layers, hidden 1024, grouped-query attention, tied embeddings, a 151,936-token
vocabulary) with the real Qwen3 tokenizer and chat template (tests/real_models.py builds them offline).

    python bench/bench_real_size.py                        # SFT and DPO, 3 steps each (1 warm-up), sequences of 512
    python bench/bench_real_size.py --stages sft --steps 4

Both trainers get the same work: full fine-tuning in fp32, batch ``--batch-size`` (SFT sequences, DPO pairs), no
gradient accumulation, ``--seq-len`` tokens per sequence (prompt and answer each about half), the fused AdamW with a
constant learning rate, clipping at 1.0, no gradient checkpointing, the same attention implementation, a live
reference model for DPO (sigmoid loss, beta 0.1); TRL gets the records in its conversational prompt-completion
format, so it renders them with the same chat template and trains on the answers only, as ours does. The data are
the demo's arithmetic problems, several to a record, to reach the length.

Each run is a subprocess of its own (bench_dpo's ``run_measured``), so its peak resident memory (ru_maxrss: Python,
libraries, model, reference, optimizer state, activations) is its own. Seconds per step: ours, ``_optimizer_step``
(forward and backward of every micro-batch, clipping, the optimizer step); TRL, ``on_step_begin`` to ``on_step_end``;
the first ``--warmup`` steps are dropped. Where ours differs in memory it is mostly the output layer: ours never holds a
(batch, tokens, 151,936) logits tensor (rlhf.OutputHead), TRL does, with its gradient. The exit status is 0 whatever the
figures (non-zero only if a run breaks).

The limit (``bench/limits.py``): the peak fp32 matmul FLOP/s at ``--threads`` threads and the memory bandwidth are
measured before the first run and after the last (the best of each is kept, printed above the table), each time in a
subprocess of its own, so its buffers count in no run's peak memory; it also counts the model's parameters
(``model_params``: all of them, the tied embedding once: 596M, of which the 151,936 x 1024 embedding, as the output
head, is 156M). Every worker counts each step's non-padding tokens (the batch's attention-mask sum; DPO: prompt +
chosen and prompt + rejected; ours in ``_optimizer_step``, TRL in ``training_step``): "tokens per step" is their mean
over the timed steps. "GFLOP/s" = (6 x parameters x tokens, + 2 x parameters x tokens for DPO's live reference
forward) / the median s/step, attention FLOPs ignored; "% of peak" = that / the peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_dpo import (  # bench/ is on sys.path
    batch_tokens,
    count_trl_tokens,
    peak_rss_mib,
    rss_mib,
    run_measured,
    step_times,
    trl_step_timer,
)
from limits import Limits, forward_flops, fraction, giga, training_flops
from tables import print_table

REPO = Path(__file__).resolve().parents[1]
MARK = "BENCH_REAL_SIZE_RESULT "
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936)  # Qwen/Qwen3-0.6B config.json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="sft,dpo", help="comma-separated: sft, dpo")
    parser.add_argument("--impls", default="ours,trl",
                        help="comma-separated: ours, ours-compiled (torch_compile=true), trl")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--model-dir", default="", help="the random-weight model (default: built once, cached)")
    parser.add_argument("--worker", choices=("ours", "ours-compiled", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=("sft", "dpo"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--attn", default="sdpa", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- the model and the data ---------------------------------------------------------------------------------------


def build_model(directory: Path) -> Path:
    """Qwen3-0.6B's shape with random weights and the real Qwen3 tokenizer, saved once."""
    if (directory / "config.json").exists():
        return directory
    sys.path.insert(0, str(REPO / "tests"))
    import real_models
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = real_models.load_tokenizer("qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B, bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def records(tokenizer, seq_len: int, count: int) -> list[dict[str, str]]:
    """Preference records of about ``seq_len`` tokens (prompt and answer each about half): demo pairs, numbered,
    several to a record."""
    pairs = [json.loads(line) for line in (REPO / "data" / "demo" / "preference.jsonl").read_text().splitlines()
             if line]
    out, cursor = [], 0
    for _ in range(count):
        prompt, chosen, rejected = [], [], []
        while len(tokenizer("\n".join(prompt) + "\n".join(chosen))["input_ids"]) < seq_len * 0.8:
            pair = pairs[cursor % len(pairs)]
            cursor += 1
            number = len(prompt) + 1
            prompt.append(f"{number}. {pair['prompt']}")
            chosen.append(f"{number}. {pair['chosen']}")
            rejected.append(f"{number}. {pair['rejected']}")
        out.append({"prompt": "Solve each problem.\n" + "\n".join(prompt), "chosen": "\n".join(chosen),
                    "rejected": "\n".join(rejected)})
    return out


# -- workers ------------------------------------------------------------------------------------------------------


def run_ours(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    import rlhf

    base = rss_mib()
    begins: list[float] = []
    ends: list[float] = []
    tokens: list[int] = []
    inner_step = rlhf.BaseTrainer._optimizer_step

    def timed_step(self, group, window):  # forward, backward, clipping and the optimizer step of one step
        tokens.append(sum(batch_tokens(batch) for batch in group))
        begins.append(time.perf_counter())
        try:
            return inner_step(self, group, window)
        finally:
            ends.append(time.perf_counter())

    rlhf.BaseTrainer._optimizer_step = timed_step
    tokenizer = rlhf.load_tokenizer(args.model_dir)
    rows = records(tokenizer, args.seq_len, args.steps * args.batch_size)
    data = Path(args.workdir) / "data.jsonl"
    data.write_text("".join(json.dumps(r if args.stage == "dpo" else {"prompt": r["prompt"], "response": r["chosen"]})
                            + "\n" for r in rows))
    common = dict(model_name_or_path=args.model_dir, dataset=str(data), dataset_dir=str(data.parent),
                  cutoff_len=args.seq_len, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                  learning_rate=args.lr, lr_scheduler_type="constant",
                  optim="adamw_torch_fused", finetuning_type="full",
                  attn_implementation=args.attn, output_dir=str(Path(args.workdir) / "ours"), save_steps=0,
                  logging_steps=1, disable_progress_bar=True, report_to="none", seed=0, resume_from_checkpoint="none",
                  template="qwen3", torch_compile=args.worker == "ours-compiled")
    started = time.perf_counter()
    live_reference = False
    if args.stage == "sft":
        result = rlhf.train_sft(rlhf.SFTConfig(**common))
    else:
        config = rlhf.DPOConfig(**common, pref_beta=0.1, pref_loss="sigmoid")
        result = rlhf.train_dpo(config)
        live_reference = str(config.precompute_ref_log_probs).lower() != "true"  # as the run decided it
    wall = time.perf_counter() - started
    if len(ends) != args.steps:
        raise RuntimeError(f"ours ran {len(ends)} optimizer steps, expected {args.steps}")
    losses = [float(row["loss"]) for row in result.history if "loss" in row]
    return {**step_times(begins, ends, args.warmup), "wall": wall, "rss_base": base,
            "mean_loss": statistics.fmean(losses), "step_tokens": tokens[args.warmup:],
            "version": "rlhf, torch_compile" if args.worker == "ours-compiled" else "rlhf",
            "live_reference": live_reference,
            "chunked_head": rlhf.OutputHead.of(rlhf.PolicyModel.from_pretrained(args.model_dir).model).chunked}


def run_trl(args: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    base = rss_mib()

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = records(tokenizer, args.seq_len, args.steps * args.batch_size)
    user = [{"role": "user", "content": r["prompt"]} for r in rows]
    common = dict(output_dir=str(Path(args.workdir) / "trl"), seed=0, use_cpu=True, bf16=False, fp16=False,
                  model_init_kwargs={"dtype": torch.float32, "attn_implementation": args.attn},
                  max_length=args.seq_len, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
                  max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                  optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0, report_to=[], logging_strategy="no",
                  save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                  dataloader_pin_memory=False, gradient_checkpointing=False)
    if args.stage == "sft":
        dataset = datasets.Dataset.from_list([{"prompt": [u],
                                               "completion": [{"role": "assistant", "content": r["chosen"]}]}
                                              for u, r in zip(user, rows)])
        config = trl.SFTConfig(**common, packing=False, completion_only_loss=True)
        trainer_class = trl.SFTTrainer
    else:
        dataset = datasets.Dataset.from_list([{"prompt": [u], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                               "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                              for u, r in zip(user, rows)])
        config = trl.DPOConfig(**common, beta=0.1, loss_type=["sigmoid"])
        trainer_class = trl.DPOTrainer
    timer = trl_step_timer()
    trainer = trainer_class(model=args.model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[timer])
    tokens: list[int] = []
    count_trl_tokens(trainer, tokens)
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    if len(timer.ends) != args.steps:
        raise RuntimeError(f"TRL ran {len(timer.ends)} timed steps, expected {args.steps}")
    return {**step_times(timer.begins, timer.ends, args.warmup), "wall": wall, "rss_base": base,
            "mean_loss": output.training_loss, "version": f"trl {trl.__version__}", "chunked_head": False,
            "step_tokens": tokens[args.warmup:],
            "live_reference": args.stage == "dpo" and not config.precompute_ref_log_probs}


def worker(args: argparse.Namespace) -> int:
    result = (run_trl if args.worker == "trl" else run_ours)(args)
    result.update(impl=args.worker, stage=args.stage, peak_rss=peak_rss_mib())
    print(MARK + json.dumps(result), flush=True)
    return 0


# -- driver -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    model_dir = Path(args.model_dir) if args.model_dir else Path.home() / ".cache" / "rlhf" / "bench-qwen3-0.6b-random"
    build_model(model_dir)
    # the limits in a process of their own (not this one, whose peak memory every worker's ru_maxrss starts from)
    limits = Limits("float32")
    params = limits.measure_in_subprocess(args.threads, model=model_dir)["params"]
    rows, failures = [], 0
    for stage in [s.strip() for s in args.stages.split(",") if s.strip()]:
        results = {}
        for impl in [i.strip() for i in args.impls.split(",") if i.strip()]:
            with tempfile.TemporaryDirectory(prefix=f"bench-real-{impl}-{stage}-") as tmp:
                command = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--stage", stage,
                           "--model-dir", str(model_dir), "--workdir", tmp, "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                           "--seq-len", str(args.seq_len), "--threads", str(args.threads), "--lr", repr(args.lr)]
                results[impl] = run_measured(command, args.threads, MARK)
            if "error" in results[impl]:
                failures += 1
                print(f"{impl} {stage} failed:\n{results[impl]['error']}", file=sys.stderr)
        for impl, result in results.items():
            if "error" in result:
                continue
            seconds = statistics.median(result["step"])
            other = results.get("trl", {})
            ratio = (f"{seconds / statistics.median(other['step']):.2f}x / "
                     f"{result['peak_rss'] / other['peak_rss']:.2f}x") if impl != "trl" and "step" in other else ""
            tokens = statistics.fmean(result["step_tokens"]) if result.get("step_tokens") else None
            rate = None
            if tokens is not None:
                flops = training_flops(params, tokens) + (forward_flops(params, tokens)
                                                          if result.get("live_reference") else 0.0)
                rate = flops / seconds
            rows.append([stage, result["version"], f"{seconds:.1f}", "-" if tokens is None else f"{tokens:.0f}",
                         giga(rate, 1), fraction(rate, limits.peak), f"{result['peak_rss'] / 1024:.1f}",
                         "yes" if result.get("chunked_head") else "no", f"{result['mean_loss']:.3f}",
                         f"{result['background']:.2f}", ratio])
    limits.measure_in_subprocess(args.threads)
    print(limits.describe())
    print_table(["stage", "trainer", "s/step", "tokens per step", "GFLOP/s", "% of peak", "peak GiB", "chunked head",
                 "mean loss", "bg cores", "ours/TRL time / memory"], rows,
                "Qwen3-0.6B shape (random weights, vocabulary 151,936), fp32 full fine-tuning, "
                f"batch {args.batch_size}, {args.seq_len} tokens, {args.steps} steps ({args.warmup} warm-up), "
                f"{args.threads} threads", label_columns=2, min_width=150)
    print(f"GFLOP/s = (6 x {params / 1e6:.0f}M parameters x tokens per step, + 2 x parameters x tokens for DPO's live "
          "reference forward) / s/step, attention FLOPs ignored; % of peak = that / the peak matmul FLOP/s above")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
