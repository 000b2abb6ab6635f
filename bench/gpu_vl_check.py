"""Vision-language generation on a GPU (``bench/gpu_check.sh vision``), and what needs torchvision.

    python bench/gpu_vl_check.py                 # cuda when present, else cpu
    python bench/gpu_vl_check.py --device cpu

On the embedded tiny-vl (a 1.02M Qwen3-VL, weights of its language model scaled x3 so that every input moves the
next-token distribution): three prompts of different widths with one, two and no pictures, 2 samples each, 8 new
tokens, through every engine (static, compiled: a CUDA graph on a GPU, eager, paged), in float32 and bfloat16.
Each row's sampled tokens' log-probs are compared with the trainer's forward of that row alone with its pictures
(``PolicyModel.compute_log_probs``): the largest gap is printed, and must stay under 1e-3 in float32 (bf16 rows
are reported, not judged). Greedy answers are compared with Hugging Face ``generate`` one prompt at a time, and a
LoRA-wrapped policy's log-probs with its forward. Last, where torchvision imports (a GPU machine's torch usually
has it; the CPU wheels here do not), the saved output is loaded with ``AutoProcessor``, and the processor's image
tokens and pixels for a picture are compared with the ones training used.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import inference_optimizations as io  # noqa: E402
import rlhf  # noqa: E402


def sharpened(policy: rlhf.PolicyModel) -> rlhf.PolicyModel:
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "visual" not in name:
                parameter.mul_(3.0)
    return policy


def pictures(folder: Path) -> list[str]:
    paths = []
    for i, (colour, size) in enumerate([((220, 40, 40), (64, 64)), ((40, 80, 220), (48, 80)),
                                        ((30, 160, 60), (64, 48))]):
        path = folder / f"picture{i}.png"
        Image.new("RGB", size, colour).save(path)
        paths.append(str(path))
    return paths


def image_prompts(policy: rlhf.PolicyModel, paths: list[str]) -> tuple[list[list[int]], list[list[str]]]:
    formatter = rlhf.ChatFormatter(policy.tokenizer, "qwen3_vl_nothink", vision=policy.vision)
    records = [{"system": "", "messages": [{"role": "user", "content": "<image>How many?"}], "images": paths[:1]},
               {"system": "", "messages": [{"role": "user", "content": "<image> and <image>: the same colour?"}],
                "images": paths[1:]},
               {"system": "", "messages": [{"role": "user", "content": "No picture here."}], "images": []}]
    return [formatter.prompt_ids(r) for r in records], [r["images"] for r in records]


def trainer_gap(policy: rlhf.PolicyModel, prompts, images, out, n: int) -> float:
    device = next(policy.model.parameters()).device
    gap = 0.0
    for row, (tokens, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        ids = torch.tensor([prompts[row // n] + tokens], device=device)
        pixels = {k: v.to(device) for k, v in policy.vision.batch([images[row // n]], ids).items()}
        with torch.no_grad():
            alone = policy.compute_log_probs(ids, torch.ones_like(ids), None, **pixels)
        want = alone.per_token[0, -len(tokens):].float().cpu()
        gap = max(gap, float((want - torch.tensor(logprobs)).abs().max()))
    return gap


def check_engines(policy, prompts, images, device: str) -> list[tuple]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        policy.model.to(dtype)
        for engine in ("static", "compiled", "eager", "paged"):
            params = io.SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=3,
                                       suppress_token_ids=policy.suppressed_tokens)
            started = time.perf_counter()
            out = io.generate(policy.model, prompts, params, pad_token_id=policy.tokenizer.pad_token_id,
                              engine=engine, vision=policy.vision_for(images))
            seconds = time.perf_counter() - started
            gap = trainer_gap(policy, prompts, images, out, 2)
            judged = dtype == torch.float32
            rows.append((str(dtype).removeprefix("torch."), engine, f"{gap:.2e}", f"{seconds:.2f}",
                         ("PASS" if gap < 1e-3 else "FAIL") if judged else "-"))
    policy.model.to(torch.float32)
    return rows


def check_greedy(policy, prompts, images) -> str:
    device = next(policy.model.parameters()).device
    ours = policy.generate(prompts, images=images, max_new_tokens=8, stop_token_ids=[policy.tokenizer.eos_token_id])
    for prompt, pictures_of, answer in zip(prompts, images, ours):
        ids = torch.tensor([prompt], device=device)
        pixels = {k: v.to(device) for k, v in policy.vision.batch([pictures_of], ids).items()}
        with torch.no_grad():
            hf = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels, max_new_tokens=8,
                                       do_sample=False, eos_token_id=policy.tokenizer.eos_token_id,
                                       suppress_tokens=policy.suppressed_tokens,
                                       pad_token_id=policy.tokenizer.pad_token_id)[0, len(prompt):].tolist()
        if answer != hf[:len(answer)]:
            return f"FAIL: ours {answer}, HF generate {hf}"
    return "PASS"


def check_lora(policy, prompts, images) -> str:
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(policy.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    lora = rlhf.PolicyModel(wrapped, policy.tokenizer, vision=policy.vision)
    params = io.SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=3,
                               suppress_token_ids=lora.suppressed_tokens)
    out = io.generate(wrapped, prompts, params, pad_token_id=lora.tokenizer.pad_token_id,
                      vision=lora.vision_for(images))
    gap = trainer_gap(lora, prompts, images, out, 2)
    return f"{'PASS' if gap < 1e-3 else 'FAIL'} (gap {gap:.2e})"


def check_autoprocessor(policy, paths: list[str], folder: Path) -> str:
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure: the check cannot run here
        return f"skipped: torchvision does not import ({type(error).__name__}: {str(error)[:120]})"
    from transformers import AutoProcessor

    saved = folder / "saved"
    policy.save_pretrained(saved)
    try:
        processor = AutoProcessor.from_pretrained(saved)
    except Exception as error:  # noqa: BLE001 - the finding is the failure itself
        return f"FAIL: AutoProcessor.from_pretrained: {type(error).__name__}: {str(error)[:300]}"
    image = Image.open(paths[1]).convert("RGB")
    text = f"<|vision_start|>{policy.vision.image_token}<|vision_end|>How many?"
    theirs = processor(text=[text], images=[image], return_tensors="pt")
    ours_ids = policy.tokenizer(policy.vision.tokens_text(paths[1]) + "How many?",
                                add_special_tokens=False)["input_ids"]
    ours_pixels, ours_grid = policy.vision.encode(paths[1])
    same_ids = theirs["input_ids"][0].tolist() == ours_ids
    same_pixels = torch.allclose(theirs["pixel_values"], ours_pixels, atol=1e-5)
    same_grid = torch.equal(theirs["image_grid_thw"], ours_grid)
    verdict = "PASS" if same_ids and same_pixels and same_grid else "FAIL"
    return (f"{verdict}: {type(processor).__name__}; token ids equal {same_ids}, pixel_values equal {same_pixels}, "
            f"image_grid_thw equal {same_grid}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print("torch", torch.__version__, "cuda", torch.version.cuda, "device", args.device,
          torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "", flush=True)
    policy = sharpened(rlhf.PolicyModel.from_pretrained("tiny-vl"))
    policy.model.to(args.device).eval()
    with tempfile.TemporaryDirectory() as folder:
        paths = pictures(Path(folder))
        prompts, images = image_prompts(policy, paths)
        print(f"{'dtype':9} {'engine':9} {'max |gap|':>10} {'seconds':>8}  verdict", flush=True)
        for row in check_engines(policy, prompts, images, args.device):
            print(f"{row[0]:9} {row[1]:9} {row[2]:>10} {row[3]:>8}  {row[4]}", flush=True)
        print("greedy = HF generate:", check_greedy(policy, prompts, images), flush=True)
        print("AutoProcessor:", check_autoprocessor(policy, paths, Path(folder)), flush=True)
        print("LoRA policy:", check_lora(policy, prompts, images), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
