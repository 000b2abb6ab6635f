"""How far a low-precision rollout copy's policy is from the model's: KL(model || copy) in nats per token.

    python experiments/quantized_rollout_kl.py --model ~/.cache/rlhf/models/SmolLM2-135M-Instruct

Builds the copies ``rollout_dtype`` samples from (``inference_optimizations.QuantizedEngine``: fp16 and int8), and
int8 copies that quantise only some kinds of linear layer (by the last part of their names, e.g. ``down_proj``), then
compares each copy's next-token distributions with the model's over the demo's first ``--prompts`` RL prompts in the
model's own chat template (one forward each, every prompt position). docs/experiments/low-precision-rollouts.md
holds the figures.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_generation import copy_kl, demo_prompts  # noqa: E402

import inference_optimizations as io  # noqa: E402

LAYER_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def int8_only(model: torch.nn.Module, keep: callable) -> torch.nn.Module:
    """A copy of ``model`` whose linear layers named by ``keep`` are int8 (as QuantizedEngine's), the rest fp32."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    quantized = copy.deepcopy(model)
    spec = {name: per_channel_dynamic_qconfig for name, module in quantized.named_modules()
            if isinstance(module, torch.nn.Linear) and keep(name)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(quantized, spec, dtype=torch.qint8, inplace=True)
    return quantized


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder (or .gguf file)")
    parser.add_argument("--prompts", type=int, default=16, help="demo RL prompts to compare on")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import rlhf

    policy = rlhf.PolicyModel.from_pretrained(args.model)
    model, tokenizer = policy.model.float().eval(), policy.tokenizer
    prompts, pad = demo_prompts(tokenizer, args.prompts), tokenizer.pad_token_id
    rows = [(f"{fmt} copy (rollout_dtype: {fmt})",
             copy_kl(model, io.QuantizedEngine(model, dtype=fmt, pad_token_id=pad).model, prompts, pad))
            for fmt in io.QUANTIZED_ROLLOUT_DTYPES]
    rows.append(("int8, all but down_proj", copy_kl(model, int8_only(model, lambda n: not n.endswith("down_proj")),
                                                     prompts, pad)))
    for kind in LAYER_KINDS:
        if any(name.endswith(kind) for name, _ in model.named_modules()):
            rows.append((f"int8, only {kind}", copy_kl(model, int8_only(model, lambda n, k=kind: n.endswith(k)),
                                                        prompts, pad)))
    print(f"KL(model || copy), nats per prompt token, {len(prompts)} demo prompts, {Path(args.model).name}")
    for label, kl in rows:
        print(f"  {label:<36} {kl:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
