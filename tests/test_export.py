"""GGUF in and out, `rlhf export`, `rlhf eval` and `rlhf chat`.

The GGUF writer is checked against an independent reader: transformers' own GGUF loader
(``from_pretrained(folder, gguf_file=...)``), on random-weight models of the real Llama, Qwen2 and Gemma 3 config
classes with the real tokenizers of tests/real_models.py: the read-back model's logits equal the written model's
(f32 exactly; f16, bf16 and q8_0 within the tolerances below), its greedy answers are the same, and the read-back
tokenizer encodes text as the original does. SmolLM2's real weights are checked in tests/test_pretrained.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import real_models
import torch

import rlhf

TEXTS = ["What is 12 + 7?", "  two  spaces, 2026 digits and ünïcödé\nnew line", "Answer: 42<|im_end|>"]
# the largest |logit difference| allowed between the written model and transformers' read-back, per type (these
# random-weight models' logits are of order 1; q8_0 keeps a scale per block of 32 values, f16 a 10-bit mantissa)
TOLERANCE = {"f32": 0.0, "f16": 5e-3, "bf16": 5e-2, "q8_0": 5e-2}


@pytest.fixture(scope="module", autouse=True)
def sources():
    real_models.sources_or_skip()


pytestmark = pytest.mark.usefixtures("gguf_parsed_once")


def family_model(name: str, directory: Path, *, default_rope: bool = False) -> tuple[torch.nn.Module, object]:
    """A random-weight model of the family's real config class with its real tokenizer (Llama 3's rope scaling
    dropped when ``default_rope``: GGUF readers do not take it from the file, and the writer refuses it)."""
    from transformers import AutoModelForCausalLM

    family = real_models.FAMILIES[name]
    tokenizer = real_models.load_tokenizer(name)
    config = real_models.tiny_config(family, tokenizer)
    if default_rope:
        config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    if name == "gemma3":  # the head size of every Gemma 3 up to 12B, which GGUF readers assume
        config.head_dim = config.query_pre_attn_scalar = 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms, so that Gemma's 1 + weight shift is exercised
        for name_, parameter in model.named_parameters():
            if name_.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def read_back(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


@pytest.mark.parametrize("family", ["llama3", "llama2", "qwen2.5", "gemma3"])
def test_written_gguf_reads_back_with_the_same_logits_answers_and_tokens(family, tmp_path):
    """f32 with the real vocabularies: the same logits and greedy answers, and a tokenizer that encodes alike."""
    model, tokenizer = family_model(family, tmp_path / "model", default_rope=family == "llama3")
    ids = torch.tensor([tokenizer("The answer is 42, and then some more words").input_ids])
    path = rlhf.write_gguf(model, tokenizer, tmp_path / "m.gguf", "f32")
    loaded, loaded_tokenizer = read_back(path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
                           model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    for text in TEXTS:
        assert loaded_tokenizer(text).input_ids == tokenizer(text).input_ids, (family, text)
    assert loaded_tokenizer.chat_template == tokenizer.chat_template


def small_model(model_type: str, tokenizer, directory: Path) -> torch.nn.Module:
    """A random-weight model of a real config class over the tiny tokenizer (a small vocabulary reads back fast)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    extra = {"gemma3_text": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=16),
             "qwen3": dict(head_dim=128)}.get(model_type, {})  # every Qwen3's; transformers reads no head_dim
                                                               # from a qwen3 GGUF
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape, **extra)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_every_gguf_type_reads_back_within_its_tolerance(model_type, tiny_tokenizer, tmp_path):
    """f32, f16, bf16 and q8_0: the logits transformers reads back are within TOLERANCE of the written model's."""
    model = small_model(model_type, tiny_tokenizer, tmp_path / "model")
    ids = torch.tensor([tiny_tokenizer("What is 12 + 7? Answer: 19").input_ids])
    with torch.no_grad():
        expected = model(ids).logits
    for gguf_type, tolerance in TOLERANCE.items():
        path = rlhf.write_gguf(model, tiny_tokenizer, tmp_path / f"m-{gguf_type}.gguf", gguf_type)
        loaded, _ = read_back(path)
        with torch.no_grad():
            gap = (loaded(ids).logits - expected).abs().max().item()
        assert gap <= tolerance, (model_type, gguf_type, gap)
        assert gguf_type == "f32" or gap > 0  # the type was applied


def test_gguf_of_a_gemma_file_spells_whitespace_runs_as_llama_cpp_does(tmp_path):
    model, tokenizer = family_model("gemma3", tmp_path / "model")
    fields = rlhf.gguf_vocabulary(tokenizer, model.config.vocab_size, rlhf.GGUF_EXPORT_ARCHITECTURES["gemma3_text"])
    runs = [t for t in fields["tokens"] if t and not t.strip(" ")]
    assert runs and all(set(t) == {" "} for t in runs)  # "▁▁" is two spaces in a Gemma file
    assert fields["model"] == "llama"


def test_permute_for_gguf_is_undone_by_transformers_reader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = torch.randn(4 * 2 * 8, 16)  # 8 heads of 8 rows
    written = rlhf.permute_for_gguf(weight, 8).numpy()
    undone = LlamaTensorProcessor({"num_attention_heads": 8, "num_key_value_heads": 8}).process(
        written, "blk.0.attn_q.weight").weights
    assert torch.equal(torch.from_numpy(undone), weight)
    assert not torch.equal(torch.from_numpy(written), weight)


def test_gguf_export_refuses_what_it_cannot_carry(tmp_path):
    model, tokenizer = family_model("llama3", tmp_path / "model")  # llama3 rope scaling
    with pytest.raises(rlhf.RLHFInputError, match="rope scaling"):
        rlhf.write_gguf(model, tokenizer, tmp_path / "x.gguf")
    gpt2, gpt2_tokenizer = family_model("gpt2", tmp_path / "gpt2")
    with pytest.raises(rlhf.RLHFInputError, match="model type 'gpt2' cannot be written as GGUF"):
        rlhf.write_gguf(gpt2, gpt2_tokenizer, tmp_path / "y.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp*"))


# -- GGUF in ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_dir) -> Path:
    """The embedded tiny Llama written as an f32 GGUF file."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    return rlhf.write_gguf(policy.model, policy.tokenizer, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "f32")


def test_a_gguf_file_loads_as_a_hugging_face_folder_once(tiny_gguf, tiny_model_dir, tmp_path):
    folder = rlhf.gguf_to_hf(tiny_gguf, tmp_path)
    assert (folder / "model.safetensors").exists() and not (folder / "model.gguf").exists()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert json.loads((folder / "gguf_source.json").read_text())["sha256"]
    assert rlhf.gguf_to_hf(tiny_gguf, tmp_path) == folder  # cached by content
    original = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    loaded = rlhf.PolicyModel.from_pretrained(str(tiny_gguf), cache_dir=tmp_path)
    ids = torch.tensor([original.tokenizer("What is 3 + 4?").input_ids])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, original.model(ids).logits)
    assert loaded.tokenizer.chat_template == original.tokenizer.chat_template
    assert loaded.tokenizer("What is 12 + 7?").input_ids == original.tokenizer("What is 12 + 7?").input_ids


def test_gguf_file_key_joins_the_folder(tiny_gguf):
    config = rlhf.SFTConfig(model_name_or_path=str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert config.model_name_or_path == str(tiny_gguf) and config.gguf_file is None


def test_every_stage_trains_from_a_gguf_and_writes_a_hugging_face_folder(tiny_gguf, demo_dir, tmp_path, one_thread):
    out = tmp_path / "sft"
    assert rlhf.main(["sft", f"model_name_or_path={tiny_gguf}", "dataset=demo_sft", f"dataset_dir={demo_dir}",
                      "max_samples=16", "max_steps=2", "per_device_train_batch_size=4", "finetuning_type=full",
                      "save_steps=0", f"output_dir={out}", "disable_progress_bar=true"]) == 0
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert not list(out.glob("*.gguf"))
    # a reference, a reward model and a teacher may be GGUF files too: the same conversion serves every field
    reference = rlhf.create_reference_model(rlhf.DPOConfig(model_name_or_path=str(out), ref_model=str(tiny_gguf)),
                                            rlhf.PolicyModel.from_pretrained(str(out)))
    assert reference is not None


def test_a_gguf_of_an_unreadable_architecture_is_one_line_naming_it(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(rlhf.RLHFInputError, match="architecture 'rwkv7', which this transformers cannot read") as err:
        rlhf.gguf_to_hf(path, tmp_path / "cache")
    assert "\n" not in str(err.value)
    missing = tmp_path / "missing.gguf"
    with pytest.raises(rlhf.RLHFInputError, match="does not exist"):
        rlhf.resolve_model_path(str(missing), tmp_path)


# -- rlhf export -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_output(tmp_path_factory, tiny_model_dir, demo_dir) -> Path:
    """A LoRA SFT output of the tiny model (an adapter folder whose base is the tiny model)."""
    out = tmp_path_factory.mktemp("lora")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rlhf.train_sft(rlhf.SFTConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_sft",
                                      dataset_dir=str(demo_dir), max_samples=64, cutoff_len=64, finetuning_type="lora",
                                      lora_rank=4, learning_rate=5e-3, per_device_train_batch_size=8, max_steps=6,
                                      save_steps=0, disable_progress_bar=True, output_dir=str(out),
                                      resume_from_checkpoint="none"))
    finally:
        torch.set_num_threads(previous)
    return out


def _logits(policy: rlhf.PolicyModel, text: str = "What is 5 + 9?") -> torch.Tensor:
    ids = torch.tensor([policy.tokenizer(text).input_ids])
    with torch.no_grad():
        return policy.model(ids).logits


def test_export_merges_the_adapter_into_a_hugging_face_folder(lora_output, tmp_path):
    trained = rlhf.PolicyModel.from_pretrained(str(lora_output), is_trainable=False)
    assert trained.is_peft
    out = tmp_path / "export"
    assert rlhf.main(["export", f"model_name_or_path={lora_output}", f"export_dir={out}", "export_size=1"]) == 0
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    exported = rlhf.PolicyModel.from_pretrained(str(out))
    assert not exported.is_peft
    torch.testing.assert_close(_logits(exported), _logits(trained), atol=1e-5, rtol=1e-5)
    assert exported.tokenizer.chat_template == trained.tokenizer.chat_template
    # LLaMA-Factory's spelling: the base and the adapter apart, from a YAML file given without --config
    config = tmp_path / "export.yaml"
    base = json.loads((lora_output / "adapter_config.json").read_text())["base_model_name_or_path"]
    config.write_text(f"model_name_or_path: {base}\nadapter_name_or_path: {lora_output}\ntemplate: chatml\n"
                      f"finetuning_type: lora\nexport_dir: {tmp_path / 'export2'}\nexport_size: 2\n"
                      f"export_device: cpu\nexport_legacy_format: false\n")
    assert rlhf.main(["export", str(config)]) == 0
    torch.testing.assert_close(_logits(rlhf.PolicyModel.from_pretrained(str(tmp_path / "export2"))), _logits(trained),
                               atol=1e-5, rtol=1e-5)


def test_export_gguf_of_a_trained_adapter_answers_like_the_trained_model(lora_output, tmp_path):
    trained = rlhf.PolicyModel.from_pretrained(str(lora_output), is_trainable=False)
    assert rlhf.main(["export", f"model_name_or_path={lora_output}", f"export_dir={tmp_path}", "--format", "gguf",
                      "--gguf-type", "f32"]) == 0
    (path,) = tmp_path.glob("*.gguf")
    loaded, tokenizer = read_back(path)
    ids = torch.tensor([trained.tokenizer("What is 5 + 9?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained.model(ids).logits, atol=1e-4, rtol=1e-4)
    assert tokenizer.chat_template == trained.tokenizer.chat_template


@pytest.mark.parametrize("keys,message", [
    (["export_legacy_format=true"], "safetensors only"),
    (["export_quantization_bit=4"], "only 8, with export_format gguf"),
    (["export_hub_model_id=me/model"], "huggingface-cli upload"),
    (["gguf_type=q4_k", "export_format=gguf"], "valid: f32, f16, bf16, q8_0"),
    (["export_dir="], "export_dir"),
])
def test_export_refuses_keys_it_cannot_honour_in_one_line(keys, message, tmp_path, capsys):
    args = ["export", "model_name_or_path=tiny", f"export_dir={tmp_path / 'x'}", *keys]
    assert rlhf.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and err.count("\n") == 0


def test_export_quantization_bit_8_is_q8_0(tmp_path):
    config = rlhf.ExportConfig(model_name_or_path="tiny", export_dir=str(tmp_path), export_format="gguf",
                               export_quantization_bit=8)
    assert config.gguf_type == "q8_0"


# -- rlhf eval ---------------------------------------------------------------------------------------------------


def test_eval_writes_accuracy_format_kl_and_win_rate(sft_model, tiny_model_dir, demo_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "eval"
    assert rlhf.main(["eval", f"model_name_or_path={sft_model}", "dataset=demo_eval", f"dataset_dir={demo_dir}",
                      "max_samples=24", f"ref_model={tiny_model_dir}", f"compare_model={tiny_model_dir}",
                      "max_prompts=8", "samples_per_prompt=2", f"output_dir={out}"]) == 0
    report = json.loads((out / "eval.json").read_text())
    metrics = report["metrics"]
    assert report["prompts"] == 24 and report["answered"] == 24
    assert 0 <= metrics["eval/accuracy"] <= metrics["eval/format_rate"] <= 1
    assert metrics["eval/format_rate"] > 0.5  # the SFT model writes the Answer: line; the untrained one never does
    assert metrics["kl/k3"] > 0
    assert metrics["win/wins"] + metrics["win/ties"] + metrics["win/losses"] == 8
    assert metrics["win/losses"] == 0  # the untrained model answers nothing right
    # the same accuracy the trainer's evaluation measures
    policy = rlhf.PolicyModel.from_pretrained(str(sft_model))
    records = rlhf.load_records("demo_eval", demo_dir, "prompt", max_samples=24)
    expected = rlhf.evaluate_exact_match(policy, rlhf.ChatFormatter(policy.tokenizer), records)
    assert metrics["eval/accuracy"] == expected["eval/accuracy"]
    shown = capsys.readouterr().out
    assert "eval/accuracy" in shown and "eval.json" in shown


def test_eval_with_a_reward_model_scores_and_judges(sft_model, tiny_model_dir, demo_dir, tmp_path, one_thread):
    rm = tmp_path / "rm"
    rlhf.train_rm(rlhf.RewardModelConfig(model_name_or_path=str(tiny_model_dir), dataset="demo_preference",
                                         dataset_dir=str(demo_dir), max_samples=16, max_steps=1, save_steps=0,
                                         per_device_train_batch_size=8, finetuning_type="full",
                                         disable_progress_bar=True, output_dir=str(rm), resume_from_checkpoint="none"))
    report = rlhf.evaluate_model(rlhf.EvalConfig(model_name_or_path=str(sft_model), dataset="demo_eval",
                                                 dataset_dir=str(demo_dir), max_samples=6, reward_model=str(rm),
                                                 compare_model=str(tiny_model_dir), output_dir=str(tmp_path / "e")))
    assert {"reward/mean", "win/win_rate"} <= set(report["metrics"])


# -- rlhf chat ---------------------------------------------------------------------------------------------------


def test_chat_renders_the_whole_conversation_with_the_template_and_streams(sft_model, one_thread):
    policy = rlhf.PolicyModel.from_pretrained(str(sft_model))
    formatter = rlhf.ChatFormatter(policy.tokenizer)
    config = rlhf.ChatConfig(model_name_or_path=str(sft_model), temperature=0, max_new_tokens=24, system="Be brief.")
    session = rlhf.ChatSession(policy, formatter, config)
    pieces: list[str] = []
    first = session.reply("What is 12 + 7?", pieces.append)
    assert len(pieces) > 1 and "".join(pieces).strip() == first  # streamed in pieces that make up the reply
    second_prompt = session.prompt_ids("And 3 + 4?")
    record = {"system": "Be brief.", "messages": [{"role": "user", "content": "What is 12 + 7?"},
                                                  {"role": "assistant", "content": first},
                                                  {"role": "user", "content": "And 3 + 4?"}]}
    assert second_prompt == formatter.prompt_ids(record)
    assert second_prompt == policy.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *record["messages"]], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    # greedy: the reply is the one the generation engine gives for the same prompt
    expected = policy.generate([formatter.prompt_ids({"system": "Be brief.", "messages": record["messages"][:1]})],
                               max_new_tokens=24, stop_token_ids=formatter.stop_token_ids)[0]
    assert first == policy.decode(expected).strip()


def test_chat_command_keeps_history_and_takes_commands(sft_model, monkeypatch, capsys, one_thread):
    lines = iter(["What is 2 + 2?", "/system You add numbers.", "And 5 + 5?", "/reset", "/nope", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert rlhf.main(["chat", str(sft_model), "--temperature", "0", "--max-new-tokens", "16"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("model> ") == 2 and "(system prompt set)" in shown and "(conversation cleared)" in shown
    assert "unknown command /nope" in shown


def test_commands_are_in_help(capsys):
    for command in ("export", "eval", "chat"):
        with pytest.raises(SystemExit):
            rlhf.main([command, "--help"])
        shown = capsys.readouterr().out
        assert "options" in shown
    with pytest.raises(SystemExit):
        rlhf.main(["--help"])
    shown = capsys.readouterr().out
    assert all(command in shown for command in ("export", "eval", "chat"))
