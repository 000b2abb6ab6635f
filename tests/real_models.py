"""Real tokenizers and chat templates, built offline from two packages on PyPI, and tiny random-weight models of the
real config classes: the fixtures of the real-model tests (test_real_tokenizers.py, test_real_models.py).

Sources, fetched once with pip and cached (``$RLHF_REAL_MODELS_CACHE``, default ``~/.cache/rlhf/real-models``):
- llama-cpp-python's source distribution vendors llama.cpp's vocab-only GGUF files (the real vocabularies, merges
  and special tokens of Llama 2 and 3, Qwen2, Phi-3, GPT-2, GPT-NeoX and Gemma 4) and real chat templates
  (Llama 3.1, Qwen2.5, Qwen3, Phi-3.5, Gemma 2, Mistral-Nemo); transformers' GGUF converters turn them into
  Hugging Face tokenizers;
- mistral-common's wheel ships Mistral's own SentencePiece (v1, v3) and tekken tokenizers, and its reference
  encoder of chat requests, which the Mistral tests compare against.

What the packages lack is written here, each from the model's published files: the added tokens of Qwen2.5 and
Qwen3 (the GGUF lists them as padding), the Llama 2 / Llama 3.0 / Mistral v0.3 / Gemma 3 chat templates, and the
``generation_config.eos_token_id`` of each family. Gemma 2 and 3 tokenizers are on no registry; Gemma 4's vocabulary
has the same 262,144 pieces with Gemma 3's turn markers renamed (ids 105 and 106), so the Gemma fixture is Gemma 4's
vocabulary with Gemma 3's names back at those ids.

``python tests/real_models.py`` builds every tokenizer (about a minute the first time) and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"  # pinned: every machine builds the same fixtures
MISTRAL_COMMON = "1.13.1"
BUILD_VERSION = 1  # raise when a builder changes, so cached tokenizers are rebuilt
CACHE = Path(os.environ.get("RLHF_REAL_MODELS_CACHE", Path.home() / ".cache" / "rlhf" / "real-models"))

# -- chat templates the packages do not carry, as the models publish them (tokenizer_config.json)

LLAMA2_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
LLAMA3_TEMPLATE = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL_V03_TEMPLATE = (  # mistralai/Mistral-7B-Instruct-v0.3, without its tool branches
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] "
    "+ '[/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token}}{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional "
    "system message!') }}{%- endif %}{%- endfor %}")
GEMMA3_TEMPLATE = (  # google/gemma-3-1b-it, text turns
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")

# Qwen's added tokens (tokenizer_config.json of Qwen2.5-7B-Instruct and Qwen3-0.6B): id -> (token, special)
QWEN25_ADDED = {151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True),
                151648: ("<|box_start|>", True), 151649: ("<|box_end|>", True), 151650: ("<|quad_start|>", True),
                151651: ("<|quad_end|>", True), 151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True),
                151654: ("<|vision_pad|>", True), 151655: ("<|image_pad|>", True), 151656: ("<|video_pad|>", True),
                151657: ("<tool_call>", False), 151658: ("</tool_call>", False), 151659: ("<|fim_prefix|>", False),
                151660: ("<|fim_middle|>", False), 151661: ("<|fim_suffix|>", False), 151662: ("<|fim_pad|>", False),
                151663: ("<|repo_name|>", False), 151664: ("<|file_sep|>", False)}
QWEN3_ADDED = {**QWEN25_ADDED, 151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
               151667: ("<think>", False), 151668: ("</think>", False)}
GEMMA3_RENAMES = {105: "<start_of_turn>", 106: "<end_of_turn>"}


@dataclass
class Family:
    """A model family: how to build its tokenizer, its chat template, stop tokens and a tiny model config."""

    name: str
    source: str  # "gguf:<vocab name>" | "spm:<mistral-common file>" | "tekken:<mistral-common file>"
    template: str | None  # the family's own chat template (None: the tokenizer has none)
    template_file: str | None = None  # a template from llama.cpp's models/templates instead
    named_template: str = "auto"  # the LLaMA-Factory name that renders like the own template
    eos_token_id: list[int] = field(default_factory=list)  # the real generation_config's (empty: the tokenizer's eos)
    added: dict[int, tuple[str, bool]] = field(default_factory=dict)
    renames: dict[int, str] = field(default_factory=dict)
    config: str = "llama"  # key of CONFIGS: the real config class and its shape


FAMILIES = {f.name: f for f in [
    Family("llama3", "gguf:llama-bpe", None, "meta-llama-Llama-3.1-8B-Instruct.jinja", "auto",
           [128001, 128008, 128009], config="llama3"),
    Family("llama2", "gguf:llama-spm", LLAMA2_TEMPLATE, None, "llama2", config="llama2"),
    Family("qwen2.5", "gguf:qwen2", None, "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen", [151645, 151643],
           added=QWEN25_ADDED, config="qwen2"),
    Family("qwen3", "gguf:qwen2", None, "Qwen-Qwen3-0.6B.jinja", "qwen3", [151645, 151643], added=QWEN3_ADDED,
           config="qwen3"),
    Family("qwen3-moe", "gguf:qwen2", None, "Qwen-Qwen3-0.6B.jinja", "qwen3", [151645, 151643], added=QWEN3_ADDED,
           config="qwen3_moe"),
    Family("mistral-v0.3", "spm:mistral_instruct_tokenizer_240323.model.v3", MISTRAL_V03_TEMPLATE, None, "mistral",
           config="mistral"),
    Family("mistral-nemo", "tekken:tekken_240718.json", None, "mistralai-Mistral-Nemo-Instruct-2407.jinja", "auto",
           config="mistral_nemo"),
    Family("mixtral", "spm:mistral_instruct_tokenizer_240323.model.v3", MISTRAL_V03_TEMPLATE, None, "mistral",
           config="mixtral"),
    Family("gemma3", "gguf:gemma-4", GEMMA3_TEMPLATE, None, "gemma", [1, 106], renames=GEMMA3_RENAMES, config="gemma3"),
    Family("gemma2", "gguf:gemma-4", None, "google-gemma-2-2b-it.jinja", "gemma", [1, 106], renames=GEMMA3_RENAMES,
           config="gemma2"),
    Family("phi3.5", "gguf:phi-3", None, "microsoft-Phi-3.5-mini-instruct.jinja", "phi", [32007, 32001, 32000],
           config="phi3"),
    Family("gpt2", "gguf:gpt-2", None, None, "default", config="gpt2"),
    Family("gpt-neox", "gguf:gpt-neox", None, None, "default", config="gpt_neox"),
]}


def tiny_config(family: Family, tokenizer: Any) -> Any:
    """A few-layer random-weight config of the family's real class, shaped as the real models are: grouped-query
    attention, tied embeddings where the small models tie them, their rope scaling, sliding windows and experts."""
    import transformers as tf

    vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    ids = dict(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096)
    kind = family.config
    if kind == "llama3":  # Llama 3.2 1B: tied embeddings, llama3 rope scaling
        return tf.LlamaConfig(**small, **ids, tie_word_embeddings=True, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if kind == "llama2":
        return tf.LlamaConfig(**{**small, "num_key_value_heads": 4}, **ids)
    if kind == "qwen2":  # Qwen2.5 0.5B: tied, biases on q/k/v
        return tf.Qwen2Config(**small, **ids, tie_word_embeddings=True, rope_theta=1000000.0)
    if kind == "qwen3":  # Qwen3 0.6B: tied, q/k norms, explicit head_dim
        return tf.Qwen3Config(**small, **ids, head_dim=16, tie_word_embeddings=True)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**small, **ids, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True,
                                 router_aux_loss_coef=0.001)
    if kind == "mistral":  # Mistral 7B v0.1's sliding window
        return tf.MistralConfig(**small, **ids, sliding_window=16)
    if kind == "mistral_nemo":
        return tf.MistralConfig(**small, **ids, head_dim=32, sliding_window=None)
    if kind == "mixtral":
        return tf.MixtralConfig(**small, **ids, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    if kind == "gemma3":  # local sliding-window layers between global ones, tied, soft-capped
        return tf.Gemma3TextConfig(**small, **ids, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    if kind == "gemma2":
        return tf.Gemma2Config(**small, **ids, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    if kind == "phi3":  # Phi-3.5: longrope scaling over a 4k original context
        return tf.Phi3Config(**{**small, "max_position_embeddings": 8192}, **ids, original_max_position_embeddings=4096,
                             rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.5] * 8})
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **ids)
    if kind == "gpt_neox":
        return tf.GPTNeoXConfig(**{k: v for k, v in small.items() if k != "num_key_value_heads"}, **ids,
                                rotary_pct=0.25, use_parallel_residual=True)
    raise ValueError(kind)


# -- sources ------------------------------------------------------------------------------------------------------


def _download(spec: str, binary: bool) -> Path:
    """One distribution of ``spec`` (name==version) from PyPI into the cache, once."""
    folder = CACHE / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
    name, version = spec.split("==")
    stem = name.replace("-", "_") + "-" + version
    found = [p for p in folder.iterdir() if p.name.startswith(stem)]
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
                        *([] if binary else ["--no-binary", ":all:"]), spec, "-d", str(folder)], check=True)
        found = [p for p in folder.iterdir() if p.name.startswith(stem)]
    return found[0]


def _unpacked(kind: str) -> Path:
    """llama.cpp's models folder (``kind='llama.cpp'``) or mistral-common's data folder, unpacked once."""
    target = CACHE / "sources" / kind
    done = target / ".complete"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    if kind == "llama.cpp":
        with tarfile.open(_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", binary=False)) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/vendor/llama.cpp/models/")
                if len(parts) == 2 and member.isfile() and (parts[1].startswith(("ggml-vocab-", "templates/"))):
                    out = target / parts[1]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(archive.extractfile(member).read())
    else:
        with zipfile.ZipFile(_download(f"mistral-common=={MISTRAL_COMMON}", binary=True)) as archive:
            for name in archive.namelist():
                if name.startswith("mistral_common/data/"):
                    (target / Path(name).name).write_bytes(archive.read(name))
    done.touch()
    return target


def sources_or_skip() -> None:
    """Fetch both source packages now; where PyPI cannot be reached the real-model tests are skipped, with the
    reason, unless RLHF_REQUIRE_REAL_MODELS=1 (CI sets it) makes that a failure."""
    import pytest

    try:
        _unpacked("llama.cpp")
        _unpacked("mistral-common")
    except (subprocess.CalledProcessError, OSError) as err:
        message = (f"the real tokenizers need llama-cpp-python=={LLAMA_CPP_PYTHON} and "
                   f"mistral-common=={MISTRAL_COMMON} from PyPI once ({err})")
        if os.environ.get("RLHF_REQUIRE_REAL_MODELS") == "1":
            pytest.fail(message)
        pytest.skip(message)


def llama_cpp_template(file: str) -> str:
    return (_unpacked("llama.cpp") / "templates" / file).read_text(encoding="utf-8")


# -- tokenizers ---------------------------------------------------------------------------------------------------


def _gguf_tokenizer(vocab: str, family: Family) -> Any:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, settings = get_gguf_tokenizer(
        str(_unpacked("llama.cpp") / f"ggml-vocab-{vocab}.gguf"))
    tokens, types = (list(tokenizer_dict["tokens"]),
                     list(tokenizer_dict.get("token_type") or [1] * len(tokenizer_dict["tokens"])))
    for index, (token, special) in family.added.items():
        tokens[index], types[index] = token, 3 if special else 4  # CONTROL / USER_DEFINED, as llama.cpp marks them
    for index, token in family.renames.items():
        tokens[index] = token
    backend, _ = convert_gguf_tokenizer(architecture, {**tokenizer_dict, "tokens": tokens, "token_type": types})
    settings.pop("chat_template", None)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)


def _spm_tokenizer(file: str) -> Any:
    """Mistral's SentencePiece model as its Hugging Face repos load it (LlamaTokenizer, legacy=False: no space
    after a control token such as [INST])."""
    import shutil
    import tempfile

    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(_unpacked("mistral-common") / file, Path(folder) / "tokenizer.model")
        return LlamaTokenizer.from_pretrained(folder, legacy=False, add_bos_token=True, add_eos_token=False)


def _tekken_tokenizer(file: str) -> Any:
    from transformers.integrations.mistral import convert_tekken_tokenizer

    return convert_tekken_tokenizer(str(_unpacked("mistral-common") / file), chat_template="")


def build_tokenizer(name: str) -> Path:
    """The family's tokenizer in Hugging Face layout with its own chat template, built once into the cache."""
    family = FAMILIES[name]
    target = CACHE / "tokenizers" / f"{name}-v{BUILD_VERSION}"
    if (target / ".complete").exists():
        return target
    kind, file = family.source.split(":", 1)
    tokenizer = {"gguf": lambda: _gguf_tokenizer(file, family), "spm": lambda: _spm_tokenizer(file),
                 "tekken": lambda: _tekken_tokenizer(file)}[kind]()
    template = family.template or (llama_cpp_template(family.template_file) if family.template_file else None)
    tokenizer.chat_template = template
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    (target / "family.json").write_text(json.dumps({"name": name, "eos_token_id": family.eos_token_id}))
    (target / ".complete").touch()
    return target


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(name)))


def build_model(name: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random-weight model of the family in ``directory``, saved and ready for ``from_pretrained``, with the
    tokenizer and the real ``generation_config`` stop tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    family = FAMILIES[name]
    tokenizer = load_tokenizer(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer))
    eos = family.eos_token_id or [tokenizer.eos_token_id]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=eos[0] if len(eos) == 1 else eos)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> int:
    import time

    print(f"{'family':14} {'tokenizer':28} {'vocab':>7}  {'template':10} seconds")
    for name in FAMILIES:
        started = time.time()
        tokenizer = load_tokenizer(name)
        template = "own" if tokenizer.chat_template else "none"
        print(f"{name:14} {type(tokenizer).__name__:28} {len(tokenizer):7}  {template:10} {time.time() - started:.1f}")
    print(f"cached under {CACHE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
