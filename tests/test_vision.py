"""Vision-language models: tiny-vl and tiny random-weight Qwen2-VL / Qwen2.5-VL / LLaVA models built from their real
config classes, LLaMA-Factory's multimodal records, the VL chat templates against the models' own processor
templates, and SFT / DPO / KTO with images.

The processor templates below are the models' published chat templates (Qwen2-VL-7B-Instruct and llava-1.5-7b-hf
whole; Qwen3-VL's reduced to the branches these conversations take: string or typed content, no tools)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

import rlhf

REPO = Path(__file__).resolve().parents[1]
DEMO_VL = REPO / "data" / "demo_vl"

QWEN2_VL_TEMPLATE = (  # Qwen/Qwen2-VL-7B-Instruct chat_template.json
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == "
    "'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
_QWEN3_VL_CONTENT = (
    "{%- set image_count = namespace(value=0) %}{%- macro render_content(content, do_vision_count) %}"
    "{%- if content is string %}{{- content }}{%- else %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}{%- if do_vision_count %}"
    "{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + render_content(messages[0].content, false) "
    "+ '<|im_end|>\\n' }}{%- endif %}")
QWEN3_VL_THINKING_TEMPLATE = (  # Qwen/Qwen3-VL-*-Thinking chat_template.json (no tools)
    _QWEN3_VL_CONTENT +
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set content = render_content(message.content, false) %}"
    "{%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = render_content(message.content, True) %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
QWEN3_VL_INSTRUCT_TEMPLATE = (  # Qwen/Qwen3-VL-*-Instruct chat_template.json (no tools)
    _QWEN3_VL_CONTENT +
    "{%- for message in messages %}{%- set content = render_content(message.content, True) %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}")
LLAVA_TEMPLATE = (  # llava-hf/llava-1.5-7b-hf chat_template.json
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


# ------------------------------------------------------------------ models


@pytest.fixture(scope="session")
def tiny_vl_dir() -> Path:
    return rlhf.build_tiny_vl_model()


def _tiny_family(name: str, tiny_vl: Path, directory: Path) -> Path:
    """A random-weight Qwen2-VL / Qwen2.5-VL / LLaVA with tiny-vl's tokenizer (LLaVA's <image> token added), saved with
    its image processor as a user's model directory is."""
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        AutoTokenizer,
        CLIPImageProcessorPil,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    if name == "llava":
        tokenizer.add_tokens(["<image>"], special_tokens=True)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    mrope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    if name == "qwen2_vl":
        config = AutoConfig.for_model("qwen2_vl", text_config={**text, "rope_parameters": mrope},
                                      tie_word_embeddings=True,
                                      vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2,
                                                         mlp_ratio=2, patch_size=8, spatial_merge_size=2,
                                                         temporal_patch_size=2),
                                      **ids)
    elif name == "qwen2_5_vl":
        config = AutoConfig.for_model("qwen2_5_vl", text_config={**text, "rope_parameters": mrope},
                                      tie_word_embeddings=True,
                                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                         out_hidden_size=64, patch_size=8, spatial_merge_size=2,
                                                         temporal_patch_size=2, window_size=32,
                                                         fullatt_block_indexes=[0]),
                                      **ids)
    else:
        config = AutoConfig.for_model("llava", image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-1, vision_feature_select_strategy="default",
                                      tie_word_embeddings=True, text_config={"model_type": "llama", **text},
                                      vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                                         intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=32, patch_size=8,
                                                         projection_dim=32))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    if name == "llava":
        processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                             max_pixels=64 * 64)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def family_dirs(tiny_vl_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl-families")
    dirs = {name: _tiny_family(name, tiny_vl_dir, root / name) for name in ("qwen2_vl", "qwen2_5_vl", "llava")}
    return {"qwen3_vl": tiny_vl_dir, **dirs}


def _picture(path: Path, colour=(220, 40, 40), size=(64, 64)) -> str:
    Image.new("RGB", size, colour).save(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "qwen2_5_vl", "llava"])
def test_log_probs_with_images_equal_a_plain_forward(family, family_dirs, tmp_path):
    """PolicyModel's per-token log-probs of a batch with images (one image in row 0, two in row 1) are the model's own
    forward with the processor's pixel inputs, log-softmaxed by hand."""
    policy = rlhf.PolicyModel.from_pretrained(str(family_dirs[family]))
    assert policy.vision is not None and policy.vision.family == ("llava" if family == "llava" else "qwen")
    red, blue = _picture(tmp_path / "red.png"), _picture(tmp_path / "blue.png", (40, 80, 220), (48, 80))
    formatter = rlhf.ChatFormatter(policy.tokenizer, "llava" if family == "llava" else "chatml", vision=policy.vision)
    records = [{"system": "", "messages": [{"role": "user", "content": "<image>How many?"}], "response": "Answer: 1",
                "images": [red]},
               {"system": "", "messages": [{"role": "user", "content": "<image> and <image>: same?"}],
                "response": "Answer: 0", "images": [red, blue]}]
    items = [dict(zip(("input_ids", "labels"), formatter.conversation(r)), images=r["images"]) for r in records]
    batch = rlhf.SFTCollator(policy.tokenizer.pad_token_id, vision=policy.vision)(items)
    assert int((batch["input_ids"] == policy.vision.image_token_id).sum()) == sum(
        policy.vision.expected_tokens(r) for r in records)
    got = policy.compute_log_probs(batch["input_ids"], batch["attention_mask"], batch["labels"],
                                   **rlhf.vision_kwargs(batch))
    with torch.no_grad():
        logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              **rlhf.vision_kwargs(batch)).logits
        want = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        text_only = policy.compute_log_probs(batch["input_ids"], batch["attention_mask"], batch["labels"]).summed
    mask = batch["labels"][:, 1:] != rlhf.IGNORE_INDEX
    torch.testing.assert_close(got.per_token, want * mask, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got.summed, text_only)  # the pixels reach the answer's log-probs


def test_vision_tower_frozen_by_default_lora_leaves_it_alone(tiny_vl_dir):
    def prepared(**fields):
        config = rlhf.SFTConfig(model_name_or_path=str(tiny_vl_dir), **fields)
        return rlhf.PolicyModel.from_pretrained(str(tiny_vl_dir)).prepare_for_training(config).model

    full = prepared(finetuning_type="full")
    trainable = {n for n, p in full.named_parameters() if p.requires_grad}
    assert trainable and not any("visual" in n for n in trainable)
    assert all(("language_model" in n or "lm_head" in n) for n in trainable)
    both = prepared(finetuning_type="full", freeze_vision_tower=False, freeze_multi_modal_projector=False)
    assert any("visual.blocks" in n for n, p in both.named_parameters() if p.requires_grad)
    assert any("visual.merger" in n for n, p in both.named_parameters() if p.requires_grad)
    vision_only = prepared(finetuning_type="full", freeze_vision_tower=False, freeze_language_model=True)
    assert {n for n, p in vision_only.named_parameters() if p.requires_grad} <= {
        n for n, _ in vision_only.named_parameters() if "visual" in n and "merger" not in n}
    lora = prepared(finetuning_type="lora", lora_target="all")
    adapted = {n for n, _ in lora.named_modules() if n.endswith("lora_A")}
    assert adapted and not any("visual" in n for n in adapted)
    unfrozen = prepared(finetuning_type="lora", lora_target="all", freeze_vision_tower=False)
    adapted = {n for n, _ in unfrozen.named_modules() if n.endswith("lora_A")}
    assert any("visual.blocks" in n for n in adapted) and not any("patch_embed" in n for n in adapted)


# ------------------------------------------------------------------ templates


def _typed(messages: list[dict]) -> list[dict]:
    """Our string records ('<image>' placeholders) as the typed content parts a processor template reads."""
    out = []
    for m in messages:
        parts, text = [], m["content"]
        while "<image>" in text:
            before, text = text.split("<image>", 1)
            parts += ([{"type": "text", "text": before}] if before else []) + [{"type": "image"}]
        parts += [{"type": "text", "text": text}] if text else []
        out.append({"role": m["role"], "content": parts})
    return out


def _ours(tokenizer, name: str, messages: list[dict], token: str, generation_prompt: bool) -> str:
    """Our template's text with each placeholder as the processor template writes an unexpanded image."""
    source = rlhf.CHAT_TEMPLATES[name]
    plain = [{**m, "content": m["content"].replace("<image>", token)} for m in messages]
    return tokenizer.apply_chat_template(plain, chat_template=source, tokenize=False,
                                         add_generation_prompt=generation_prompt)


CONVERSATIONS = [
    [{"role": "user", "content": "<image>How many circles are there?"}],
    [{"role": "system", "content": "Count carefully."}, {"role": "user", "content": "<image>How many shapes?"},
     {"role": "assistant", "content": "Answer: 3"}, {"role": "user", "content": "And in the left half?<image>"}],
]


@pytest.mark.parametrize(("name", "processor_template"), [("qwen2_vl", QWEN2_VL_TEMPLATE),
                                                          ("qwen3_vl_nothink", QWEN3_VL_INSTRUCT_TEMPLATE),
                                                          ("qwen3_vl", QWEN3_VL_THINKING_TEMPLATE)])
def test_qwen_vl_templates_render_what_the_processor_templates_render(name, processor_template, tiny_vl_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    for messages in CONVERSATIONS:
        for finished in (False, True):
            turns = [*messages, {"role": "assistant", "content": "Answer: 2"}] if finished else messages
            want = tokenizer.apply_chat_template(_typed(turns), chat_template=processor_template, tokenize=False,
                                                 add_generation_prompt=not finished)
            assert _ours(tokenizer, name, turns, image, not finished) == want


def test_llava_template_renders_the_processor_template_with_an_end_of_answer_token(family_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dirs["llava"])
    eos = tokenizer.eos_token
    for messages in CONVERSATIONS:
        prompt = tokenizer.apply_chat_template(_typed(messages), chat_template=LLAVA_TEMPLATE, tokenize=False,
                                               add_generation_prompt=True)
        # the processor's template ends each answer with ' '; ours with the end-of-sequence token (and ' ' before the
        # next turn), so that a trained model stops
        assert _ours(tokenizer, "llava", _images_first(messages), "<image>\n", True) == prompt.replace(
            "Answer: 3 ", f"Answer: 3{eos} ")
        turns = [*messages, {"role": "assistant", "content": "Answer: 2"}]
        whole = tokenizer.apply_chat_template(_typed(turns), chat_template=LLAVA_TEMPLATE, tokenize=False)
        assert _ours(tokenizer, "llava", _images_first(turns), "<image>\n", False) == whole.replace(
            "Answer: 3 ", f"Answer: 3{eos} ")[:-1] + eos


def _images_first(messages: list[dict]) -> list[dict]:
    """VisionInputs.expand_record's order for LLaVA: a turn's images before its text, as LLaVA's template
    writes them."""
    return [{**m, "content": "<image>" * m["content"].count("<image>") + m["content"].replace("<image>", "")}
            for m in messages]


# ------------------------------------------------------------------ data and bad input


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def _mllm_dir(tmp_path: Path, records: list[dict], kind: str = "sft") -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    _picture(data / "red.png")
    (data / "notes.png").write_text("not a picture")
    _write(data / "vl.json", records)
    columns = {"messages": "messages", "images": "images"} if kind == "sft" else {
        "messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"}
    info = {"vl": {"file_name": "vl.json", "formatting": "sharegpt", "ranking": kind != "sft", "columns": columns,
                   **({"tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                "assistant_tag": "assistant"}} if kind == "sft" else {})}}
    _write(data / "dataset_info.json", info)  # type: ignore[arg-type]
    return data


def _sft_record(content: str, images: list[str]) -> dict:
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Answer: 1"}],
            "images": images}


@pytest.mark.parametrize(("record", "expected"), [
    (_sft_record("<image>How many?", ["missing.png"]), "image '"),
    (_sft_record("<image>How many?", ["notes.png"]), "is not a readable image"),
    (_sft_record("<image>How many? <image>", ["red.png"]), "2 <image> placeholder(s) but the record has 1 image(s)"),
    (_sft_record("How many?", ["red.png"]), "0 <image> placeholder(s) but the record has 1 image(s)"),
])
def test_bad_image_records_are_one_line_naming_file_and_line(record, expected, tmp_path, capsys):
    data = _mllm_dir(tmp_path, [_sft_record("<image>How many?", ["red.png"]), record])
    code = rlhf.main(["sft", "model_name_or_path=tiny-vl", "dataset=vl", f"dataset_dir={data}",
                      f"output_dir={tmp_path / 'out'}", "max_steps=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{data / 'vl.json'}:" in err and expected in " ".join(err.split()), err


def test_images_given_to_a_text_model_and_videos_are_one_line_errors(tmp_path, capsys):
    data = _mllm_dir(tmp_path, [_sft_record("<image>How many?", ["red.png"])])
    code = rlhf.main(["sft", "model_name_or_path=tiny", "dataset=vl", f"dataset_dir={data}",
                      f"output_dir={tmp_path / 'out'}", "max_steps=1"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "the record has images, but the model is a text-only model" in err and "vl.json:" in err
    _write(data / "vl.json", [{**_sft_record("<image>How many?", ["red.png"]), "videos": ["clip.mp4"]}])
    code = rlhf.main(["sft", "model_name_or_path=tiny-vl", "dataset=vl", f"dataset_dir={data}",
                      f"output_dir={tmp_path / 'out2'}", "max_steps=1"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "videos are not supported" in err and "vl.json:" in err


def test_packing_with_a_vision_language_model_is_refused(tmp_path):
    config = _vl_config(rlhf.SFTConfig, tmp_path, dataset="demo_vl_sft", max_samples=4, max_steps=1, packing=True)
    with pytest.raises(rlhf.RLHFInputError, match="config field 'packing'"):
        rlhf.train_sft(config)


def test_truncation_drops_a_record_rather_than_cut_an_image(tiny_vl_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_vl_dir))
    formatter = rlhf.ChatFormatter(policy.tokenizer, "qwen3_vl_nothink", vision=policy.vision)
    red = _picture(tmp_path / "red.png")
    long_question = "Look closely. " * 12 + "<image>How many?"
    record = {"system": "", "messages": [{"role": "user", "content": long_question}], "chosen": "Answer: 1",
              "rejected": "Answer: 2", "images": [red], "location": "pairs.json:1"}
    kept = rlhf.PreferenceDataset([record], policy.tokenizer, formatter, cutoff_len=256)
    assert kept.items[0]["images"] == [red]
    assert policy.vision.count_image_tokens(kept.items[0]["prompt_ids"]) == 16
    with pytest.raises(rlhf.RLHFInputError, match="cutoff_len"):  # 30 tokens cannot hold the image's 18
        rlhf.PreferenceDataset([record], policy.tokenizer, formatter, cutoff_len=30)


# ------------------------------------------------------------------ trainers


def _lf_dpo_yaml(tmp_path: Path) -> Path:
    """Seed 001's multimodal DPO block as a user writes it, with tiny-vl and fp32 (bf16 off on CPU)."""
    config = {"model_name_or_path": "tiny-vl", "trust_remote_code": True, "stage": "dpo", "do_train": True,
              "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "freeze_vision_tower": True,
              "pref_beta": 0.1, "pref_loss": "sigmoid", "dataset": "mllm_dpo_demo", "template": "qwen3_vl_nothink",
              "image_max_pixels": 262144, "video_max_pixels": 16384, "cutoff_len": 2048, "max_samples": 1000,
              "output_dir": str(tmp_path / "saves" / "dpo"), "per_device_train_batch_size": 1,
              "gradient_accumulation_steps": 8, "learning_rate": 5.0e-6, "num_train_epochs": 1.0,
              "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": False, "logging_steps": 1,
              "report_to": "none", "overwrite_output_dir": True, "save_only_model": False, "plot_loss": True}
    path = tmp_path / "qwen3vl_lora_dpo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_llamafactory_multimodal_dpo_yaml_runs_and_its_output_loads_and_generates(tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    monkeypatch.chdir(REPO)
    assert rlhf.main(["train", str(_lf_dpo_yaml(tmp_path)), "disable_progress_bar=true"]) == 0
    out = tmp_path / "saves" / "dpo"
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][-1]["global_step"] == 3  # 24 pairs, 8 per optimizer step
    tokenizer = AutoTokenizer.from_pretrained(out)
    processor = AutoImageProcessor.from_pretrained(out, backend="pil")
    base = AutoModelForImageTextToText.from_pretrained(
        json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"])
    model = PeftModel.from_pretrained(base, out).eval()
    image = Image.open(REPO / "data" / json.loads((REPO / "data" / "mllm_dpo_demo.json").read_text())[0]["images"][0])
    pixels = processor(images=[image.convert("RGB")], return_tensors="pt")
    tokens = int(pixels["image_grid_thw"].prod()) // processor.merge_size ** 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<|vision_start|>" + "<|image_pad|>" * tokens
                                           + "<|vision_end|>How many shapes are in the picture?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    image_id = base.config.image_token_id
    out_ids = model.generate(**ids, **pixels, mm_token_type_ids=(ids["input_ids"] == image_id).long(), max_new_tokens=4,
                             do_sample=False)
    assert out_ids.shape[1] > ids["input_ids"].shape[1]


def _vl_config(cls, tmp_path: Path, **fields):
    defaults = dict(model_name_or_path="tiny-vl", dataset_dir=str(DEMO_VL), template="qwen3_vl_nothink",
                    finetuning_type="full", output_dir=str(tmp_path / "out"), report_to="none", save_steps=0,
                    logging_steps=1, eval_dataset="", disable_progress_bar=True, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4)
    return cls(**{**defaults, **fields})


def test_dpo_reference_sees_the_same_pixels_live_and_precomputed(tmp_path):
    config = _vl_config(rlhf.DPOConfig, tmp_path, dataset="demo_vl_preference", max_samples=8)
    policy = rlhf.PolicyModel.from_pretrained("tiny-vl")
    formatter = rlhf.chat_formatter(policy.tokenizer, config, policy)
    dataset = rlhf.PreferenceDataset(rlhf.load_records(config.dataset, config.dataset_dir, "preference", max_samples=8),
                                     policy.tokenizer, formatter, cutoff_len=512)
    reference = rlhf.create_reference_model(config, policy)
    collator = rlhf.PreferenceCollator(policy.tokenizer.pad_token_id, vision=policy.vision)
    rlhf.precompute_ref_log_probs(reference, dataset, collator, batch_size=3, device="cpu")
    batch = collator([dataset[i] for i in range(8)])
    live = rlhf._reference_logps(reference, batch)
    torch.testing.assert_close(torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]), live,
                               rtol=1e-5, atol=1e-4)
    blind = {k: v for k, v in batch.items() if k not in rlhf.VISION_KEYS}
    blind["input_ids"] = blind["input_ids"].masked_fill(blind["input_ids"] == policy.vision.image_token_id,
                                                        policy.tokenizer.pad_token_id)
    assert not torch.allclose(rlhf._reference_logps(reference, blind), live)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_preference_stages_learn_on_images(stage, tmp_path):
    """DPO and KTO on the visual demo's pairs: the implicit reward margin (DPO) or the chosen reward (KTO) rises."""
    if stage == "dpo":
        config = _vl_config(rlhf.DPOConfig, tmp_path, dataset="demo_vl_preference", max_samples=48, max_steps=12,
                            learning_rate=2e-3, pref_beta=0.5)
        result = rlhf.train_dpo(config)
        key = "rewards/margins"
    else:
        config = _vl_config(rlhf.KTOConfig, tmp_path, dataset="demo_vl_kto", max_samples=48, max_steps=12,
                            learning_rate=2e-3)
        result = rlhf.train_kto(config)
        key = "rewards/chosen"
    rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    values = [row[key] for row in rows if key in row]
    assert len(values) >= 10 and sum(values[-3:]) / 3 > sum(values[:3]) / 3, values
    assert result.global_step == 12


def test_sft_trains_the_language_model_and_leaves_the_frozen_tower_unchanged(tmp_path):
    from safetensors.torch import load_file

    config = _vl_config(rlhf.SFTConfig, tmp_path, dataset="demo_vl_sft", max_samples=64, max_steps=10,
                        learning_rate=2e-3)
    rlhf.train_sft(config)
    start = load_file(str(Path(rlhf.build_tiny_vl_model()) / "model.safetensors"))
    trained = load_file(str(Path(config.output_dir) / "model.safetensors"))
    vision = [k for k in start if ".visual." in k]
    assert vision and all(torch.equal(start[k], trained[k]) for k in vision)
    assert any(not torch.equal(start[k], trained[k]) for k in start if "language_model" in k)
    rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses[-1] < losses[0]
    assert ((Path(config.output_dir) / "processor_config.json").exists()
            or (Path(config.output_dir) / "preprocessor_config.json").exists())
    shutil.rmtree(config.output_dir)


def test_llamafactory_multimodal_sft_yaml_mixes_image_and_text_records(tmp_path, monkeypatch):
    """LLaMA-Factory's qwen3vl_lora_sft.yaml: mllm_demo (multi-turn, two images) with text-only datasets."""
    monkeypatch.chdir(REPO)
    config = yaml.safe_load(_lf_dpo_yaml(tmp_path).read_text())
    config.update(stage="sft", dataset="mllm_demo,identity,alpaca_en_demo", max_samples=4,
                  output_dir=str(tmp_path / "saves" / "sft"), learning_rate=1.0e-4)
    for key in ("pref_beta", "pref_loss", "freeze_vision_tower"):
        config.pop(key)
    path = tmp_path / "qwen3vl_lora_sft.yaml"
    path.write_text(yaml.safe_dump(config))
    assert rlhf.main(["train", str(path), "disable_progress_bar=true"]) == 0
    assert json.loads((tmp_path / "saves" / "sft" / "report.json").read_text())["stages"][-1]["global_step"] >= 1


def test_grpo_samples_from_images_and_a_checkpoint_inside_a_rollout_keeps_them(tmp_path):
    """GRPO on image prompts: completions come from image + text and the exact-answer reward scores them; a
    checkpoint taken inside a rollout (num_iterations 2: step 1 of 2) stores the rows' image paths, and a run resumed
    from it finishes."""
    from safetensors import safe_open

    fields = dict(dataset="demo_vl_rl", max_samples=8, max_steps=2, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=6, reward_funcs=["exact_answer"], beta=0.04, num_iterations=2,
                  learning_rate=1e-4, save_steps=1)
    config = _vl_config(rlhf.GRPOConfig, tmp_path, **fields)
    result = rlhf.train_grpo(config)
    rows = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert (result.global_step == 2 and any("reward" in row for row in rows)
            and all("kl" in row for row in rows if "loss" in row))
    saved = Path(config.output_dir) / "checkpoints" / "checkpoint-1" / "rollout.safetensors"
    with safe_open(str(saved), framework="pt") as handle:
        images = json.loads(handle.metadata()["images"])
    assert len(images) == 8 and all(len(row) == 1 and Path(row[0]).is_file() for row in images)
    resumed = _vl_config(rlhf.GRPOConfig, tmp_path, **fields, resume_from_checkpoint=str(saved.parent))
    resumed.output_dir = str(tmp_path / "resumed")
    shutil.copytree(Path(config.output_dir) / "checkpoints", tmp_path / "resumed" / "checkpoints")
    resumed.resume_from_checkpoint = str(tmp_path / "resumed" / "checkpoints" / "checkpoint-1")
    assert rlhf.train_grpo(resumed).global_step == 2


def test_image_prompts_in_stages_without_them_are_refused(tmp_path):
    config = _vl_config(rlhf.GRPOConfig, tmp_path, dataset="demo_vl_rl", max_samples=4, max_steps=1, num_generations=2,
                        per_device_train_batch_size=4, reward_funcs=["exact_answer"])
    config.use_vllm = True  # past the config's own check (vLLM is not installed in the test environment)
    with pytest.raises(rlhf.RLHFInputError, match="passing their pixels to vLLM is not supported yet"):
        rlhf.train_grpo(config)
    ppo = _vl_config(rlhf.PPOConfig, tmp_path, dataset="demo_vl_rl", max_samples=4, max_steps=1,
                     reward_funcs=["exact_answer"])
    with pytest.raises(rlhf.RLHFInputError, match="does not train on image prompts"):
        rlhf.train_ppo(ppo)


def _sharpened(policy: rlhf.PolicyModel) -> rlhf.PolicyModel:
    """A random model's next-token distributions are nearly flat, so a wrong position or a missing image would barely
    move them: scaling the language model's weights makes every input matter."""
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "visual" not in name and "vision_tower" not in name:
                parameter.mul_(3.0)
    return policy.eval()


def _image_prompts(policy: rlhf.PolicyModel, family: str, tmp_path: Path) -> tuple[list[list[int]], list[list[str]]]:
    """Prompts of different widths with no, one and two images (so rows are left-padded and M-RoPE offsets differ)."""
    red, blue = _picture(tmp_path / "red.png"), _picture(tmp_path / "blue.png", (40, 80, 220), (48, 80))
    formatter = rlhf.ChatFormatter(policy.tokenizer, "llava" if family == "llava" else "chatml", vision=policy.vision)
    records = [{"system": "", "messages": [{"role": "user", "content": "<image>How many?"}], "images": [red]},
               {"system": "", "messages": [{"role": "user", "content": "<image> and <image>: same colour, or not?"}],
                "images": [red, blue]},
               {"system": "", "messages": [{"role": "user", "content": "No picture here."}], "images": []}]
    return [formatter.prompt_ids(r) for r in records], [r["images"] for r in records]


@pytest.mark.parametrize("engine", ["eager", "static", "paged"])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "qwen2_5_vl", "llava"])
def test_our_engine_samples_from_images_with_the_trainers_log_probs(family, engine, family_dirs, tmp_path):
    """Our engine generates from image + text: its sampled tokens' log-probs equal the trainer's forward of each row
    alone with its pictures (so the images and, for the Qwen families, the M-RoPE positions after them, reached every
    decoding step), the n samples share one prefill, and no completion holds an image token."""
    from inference_optimizations import SamplingParams, generate

    policy = _sharpened(rlhf.PolicyModel.from_pretrained(str(family_dirs[family])))
    prompts, images = _image_prompts(policy, family, tmp_path)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3, suppress_token_ids=policy.suppressed_tokens)
    out = generate(policy.model, prompts, params, pad_token_id=policy.tokenizer.pad_token_id, engine=engine,
                   vision=policy.vision_for(images))
    assert len(out.token_ids) == 6 and not any(t in policy.suppressed_tokens for row in out.token_ids for t in row)
    for row, (tokens, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        prompt, pictures = prompts[row // 2], images[row // 2]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            alone = policy.compute_log_probs(ids, torch.ones_like(ids), None, **policy.vision.batch([pictures], ids))
        torch.testing.assert_close(alone.per_token[0, -len(tokens):], torch.tensor(logprobs), rtol=0, atol=1e-4)


def test_a_lora_policy_samples_from_images_with_its_own_positions(tiny_vl_dir, tmp_path):
    """A LoRA policy is a PeftModel around the vision-language model: the engine finds the M-RoPE positions through
    the wrapper, so the sampled log-probs are still the trainer's."""
    from peft import LoraConfig, get_peft_model

    from inference_optimizations import SamplingParams, generate

    policy = _sharpened(rlhf.PolicyModel.from_pretrained(str(tiny_vl_dir)))
    wrapped = get_peft_model(policy.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    policy = rlhf.PolicyModel(wrapped, policy.tokenizer, vision=policy.vision)
    prompts, images = _image_prompts(policy, "qwen3_vl", tmp_path)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3, suppress_token_ids=policy.suppressed_tokens)
    out = generate(wrapped, prompts, params, pad_token_id=policy.tokenizer.pad_token_id,
                   vision=policy.vision_for(images))
    for row, (tokens, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        ids = torch.tensor([prompts[row // 2] + tokens])
        with torch.no_grad():
            alone = policy.compute_log_probs(ids, torch.ones_like(ids), None,
                                             **policy.vision.batch([images[row // 2]], ids))
        torch.testing.assert_close(alone.per_token[0, -len(tokens):], torch.tensor(logprobs), rtol=0, atol=1e-4)


def test_held_out_accuracy_generates_from_the_images(tiny_vl_dir):
    """Greedy answers with images (PolicyModel.generate, our engine, prompts of several widths together) equal Hugging
    Face generate on the same inputs, one prompt at a time."""
    policy = _sharpened(rlhf.PolicyModel.from_pretrained(str(tiny_vl_dir)))
    formatter = rlhf.ChatFormatter(policy.tokenizer, "qwen3_vl_nothink", vision=policy.vision)
    records = rlhf.load_records("demo_vl_eval", DEMO_VL, "prompt", max_samples=4)
    prompts = [formatter.prompt_ids(r) for r in records]
    assert len({len(p) for p in prompts}) > 1  # left padding
    together = policy.generate(prompts, images=[r["images"] for r in records], max_new_tokens=6,
                               stop_token_ids=formatter.stop_token_ids)
    assert len({tuple(c) for c in together}) > 1  # the answers differ with the pictures
    for prompt, record, completion in zip(prompts, records, together):
        ids = torch.tensor([prompt])
        alone = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      **policy.vision.batch([record["images"]], ids), max_new_tokens=6,
                                      do_sample=False, eos_token_id=formatter.stop_token_ids,
                                      suppress_tokens=policy.vision.vision_token_ids,
                                      pad_token_id=policy.tokenizer.pad_token_id)[0, len(prompt):].tolist()
        assert completion == alone[:len(completion)]


def test_plan_counts_the_vision_tower(tiny_vl_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    arch = rlhf.model_architecture(str(tiny_vl_dir))
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert arch["vision_parameters"] == vision
    assert abs(rlhf.count_parameters(arch) - model.num_parameters()) < 0.01 * model.num_parameters()


def test_grpo_rollout_log_probs_are_each_rows_own_forward_with_its_image(tmp_path):
    """The rollout's micro-batches carry each row's own pixel inputs: the trainer's log-probs of a rollout of several
    pictures equal each row's forward alone with its picture."""
    config = _vl_config(rlhf.GRPOConfig, tmp_path, dataset="demo_vl_rl", max_samples=3, num_generations=2,
                        per_device_train_batch_size=4, reward_funcs=["exact_answer"], beta=0.0, max_completion_length=4)
    policy = rlhf.PolicyModel.from_pretrained("tiny-vl")
    formatter = rlhf.chat_formatter(policy.tokenizer, config, policy)
    records = rlhf.load_records("demo_vl_rl", DEMO_VL, "prompt", max_samples=3)
    dataset = rlhf.GRPODataset(records, policy.tokenizer, formatter, cutoff_len=256)
    trainer = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=lambda p, c, a: torch.zeros(len(c)),
                               formatter=formatter)
    items = [dataset[i] for i in range(3) for _ in range(2)]
    completions = [[policy.tokenizer.encode("Answer: ")[0]] * (1 + i % 3) for i in range(len(items))]
    rollout = trainer._rows(items, completions)
    batches = rollout.micro_batches(4, vision=policy.vision)
    with torch.no_grad():
        got = torch.cat([trainer._policy_logps(b) for b in batches])
        for row, (item, completion) in enumerate(zip(items, completions)):
            ids = torch.tensor([item["prompt_ids"] + completion])
            alone = policy.compute_log_probs(ids, torch.ones_like(ids), None,
                                             **policy.vision.batch([item["images"]], ids))
            n = len(completion)
            width = ids.shape[1] - 1
            torch.testing.assert_close(got[row, width - n:width], alone.per_token[0, -n:], rtol=1e-5, atol=1e-5)


def test_chosen_and_rejected_share_one_image_encoding(tmp_path):
    """A preference batch gives each pair's pixels once. With the vision side frozen, PolicyModel encodes each image
    once (no graph) for both rows; with it training, every row is encoded. Both equal a batch that lists each row's
    images in full, and gradients reach a training tower."""
    policy = rlhf.PolicyModel.from_pretrained("tiny-vl")
    formatter = rlhf.ChatFormatter(policy.tokenizer, "qwen3_vl_nothink", vision=policy.vision)
    records = rlhf.load_records("demo_vl_preference", DEMO_VL, "preference", max_samples=3)
    dataset = rlhf.PreferenceDataset(records, policy.tokenizer, formatter, cutoff_len=256)
    items = [dataset[i] for i in range(3)]
    shared = rlhf.PreferenceCollator(policy.tokenizer.pad_token_id, vision=policy.vision)(items)
    assert int(shared["image_repeats"]) == 2 and shared["image_grid_thw"].shape[0] == 6
    assert shared["pixel_values"].shape[0] == 3 * 64  # three 64x64 pictures of 8x8 patches, given once
    full = {k: v for k, v in shared.items() if k not in rlhf.VISION_KEYS}
    full.update(policy.vision.batch([i["images"] for i in items] * 2, shared["input_ids"]))

    def logps(batch):
        return rlhf._completion_forward(policy, batch).summed

    want = logps(full).detach()
    policy.model.requires_grad_(False)
    for name, parameter in policy.model.named_parameters():
        parameter.requires_grad_("language_model" in name)
    torch.testing.assert_close(logps(shared).detach(), want, rtol=1e-5, atol=1e-4)  # encoded once
    policy.model.requires_grad_(True)
    out = logps(shared)
    torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-4)  # encoded per row
    out.sum().backward()
    assert policy.model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_a_saved_llava_loads_with_autoprocessor_which_tokenizes_as_training_did(family_dirs, tmp_path):
    """LLaVA's processor needs no torchvision: the saved output loads with AutoProcessor, and its expansion of the
    prompt and image gives the ids and pixels training used."""
    from transformers import AutoProcessor

    policy = rlhf.PolicyModel.from_pretrained(str(family_dirs["llava"]))
    policy.tokenizer.chat_template = rlhf.CHAT_TEMPLATES["llava"]
    policy.save_pretrained(tmp_path / "out")
    processor = AutoProcessor.from_pretrained(tmp_path / "out")
    assert type(processor).__name__ == "LlavaProcessor"
    red = _picture(tmp_path / "red.png")
    record = {"system": "", "messages": [{"role": "user", "content": "<image>How many?"}], "images": [red]}
    formatter = rlhf.ChatFormatter(policy.tokenizer, "llava", vision=policy.vision)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nHow many?"}],
                                                   tokenize=False, add_generation_prompt=True)
    theirs = processor(text=text, images=Image.open(red), return_tensors="pt")
    assert theirs["input_ids"][0].tolist() == formatter.prompt_ids(record)
    torch.testing.assert_close(theirs["pixel_values"], policy.vision.encode(red)[0])


def test_streaming_sft_reads_image_records(tmp_path):
    """streaming: true reads image records too: the streamed items carry their images' paths (resolved against
    dataset_dir) and their image tokens, and a streaming run trains on them."""
    config = _vl_config(rlhf.SFTConfig, tmp_path, dataset="demo_vl_sft", max_samples=8, max_steps=2,
                        per_device_train_batch_size=4, learning_rate=1e-3, streaming=True)
    policy = rlhf.PolicyModel.from_pretrained("tiny-vl")
    formatter = rlhf.chat_formatter(policy.tokenizer, config, policy)
    spec = rlhf.resolve_dataset("demo_vl_sft", DEMO_VL)
    spec.media_dir = DEMO_VL
    item = next(iter(rlhf.StreamingSFTDataset(spec, policy.tokenizer, formatter, cutoff_len=256, max_samples=1)))
    assert item["images"] and Path(item["images"][0]).is_file()
    assert policy.vision.count_image_tokens(item["input_ids"]) == 16
    assert rlhf.train_sft(config).global_step == 2
