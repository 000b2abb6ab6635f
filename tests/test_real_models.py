"""Every stage on every major model family, through the command line: tiny random-weight models of the real config
classes (grouped-query attention, tied embeddings, rope scaling, sliding windows, mixture of experts) with the real
tokenizers and chat templates of tests/real_models.py, trained a few steps on tests/data/real_models (system
prompts, multi-turn history). Each run must finish, log finite losses and save a model that loads with its own
auto class and carries the template it was trained with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import real_models

import rlhf

DATA = Path(__file__).parent / "data" / "real_models"
STAGES = {  # name -> (stage, arguments)
    "sft-full": ("sft", ["dataset=real_sft", "finetuning_type=full"]),
    "sft-lora": ("sft", ["dataset=real_sft", "finetuning_type=lora", "lora_rank=4"]),
    "rm": ("rm", ["dataset=real_preference", "finetuning_type=lora", "lora_rank=4"]),
    "dpo": ("dpo", ["dataset=real_preference", "finetuning_type=lora", "lora_rank=4"]),
    "kto": ("kto", ["dataset=real_kto", "finetuning_type=lora", "lora_rank=4"]),
    "grpo": ("grpo", ["dataset=real_prompts", "finetuning_type=lora", "lora_rank=4", "num_generations=2",
                      "max_completion_length=6", "reward_funcs=length"]),
    "ppo": ("ppo", ["dataset=real_prompts", "finetuning_type=lora", "lora_rank=4", "max_completion_length=6",
                    "reward_funcs=length", "ppo_epochs=1"]),
}



@pytest.fixture(scope="module", autouse=True)
def sources():
    real_models.sources_or_skip()

@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = real_models.build_model(name, tmp_path_factory.mktemp(name.replace(".", "_")))
        return built[name]

    return get


TOOL_FAMILIES = ("llama3", "qwen2.5", "qwen3", "qwen3-moe", "mistral-nemo")  # templates that write tool calls


@pytest.mark.parametrize("family,stage", [(f, s) for f in real_models.FAMILIES for s in STAGES]
                         + [(f, "sft-tools") for f in TOOL_FAMILIES])
def test_every_stage_runs_on_every_family(family, stage, family_models, tmp_path, monkeypatch, capsys):
    model = family_models(family)
    # tool rows: the template writes every tool's schema into the prompt (Qwen's ~300 tokens), so they need more room
    command, arguments = STAGES.get(stage) or ("sft", ["dataset=real_tools", "finetuning_type=lora", "lora_rank=4",
                                                       "cutoff_len=1024"])
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    template = real_models.FAMILIES[family].named_template  # its LLaMA-Factory name (auto: its own template)
    status = rlhf.main([command, f"model_name_or_path={model}", f"dataset_dir={DATA}", f"template={template}",
                        "cutoff_len=96", *arguments, "max_steps=2",
                        "per_device_train_batch_size=2", "logging_steps=1", "save_steps=0",
                        "report_to=none", "disable_progress_bar=true", "eval_dataset=", f"output_dir={out}"])
    assert status == 0, capsys.readouterr().err
    losses = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert losses and all(math.isfinite(loss) for loss in losses)
    own = (model / "chat_template.jinja").read_text() if (model / "chat_template.jinja").exists() else None
    trained = own if template == "auto" else rlhf.CHAT_TEMPLATES[template]
    assert (out / "chat_template.jinja").read_text() == (trained or rlhf.CHAT_TEMPLATES["default"])
    if stage == "sft-full":  # a full model saves its generation_config: every stop token, the model's own first
        from transformers import GenerationConfig

        saved = GenerationConfig.from_pretrained(out).eos_token_id
        saved = [saved] if isinstance(saved, int) else saved
        assert set(real_models.FAMILIES[family].eos_token_id) <= set(saved) and saved
