"""Bad merge inputs: every mistake is one ``error:`` line with exit status 2 that names where the bad input was
given (``file:line`` of its entry in the merge YAML, or ``command line`` for a ``key=value`` override), and
nothing is written (no output_dir, no staging directory, no input touched)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model_merging as mm

pytestmark = pytest.mark.usefixtures("one_thread")

LORA_KEY = "base_model.model.model.layers.0.self_attn.o_proj.lora_{}.weight"


def copy_with(source: Path, target: Path, change=None) -> Path:
    """A copy of a model directory whose weights pass through ``change(state)`` (no transformers needed)."""
    shutil.copytree(source, target)
    if change is not None:
        state = load_file(str(target / "model.safetensors"))
        change(state)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def write_header(path: Path, header: dict) -> None:
    data = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data + b"\0" * 8)


def lora_adapter(target: Path, base: Path | str) -> Path:
    """A hand-made PEFT LoRA adapter (rank 2 on layer 0's o_proj) recording ``base`` as its base model."""
    target.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file({LORA_KEY.format("A"): torch.randn(2, 32, generator=gen),
               LORA_KEY.format("B"): torch.randn(32, 2, generator=gen)}, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["o_proj"],
         "base_model_name_or_path": str(base)}))
    return target


@pytest.fixture(scope="module")
def inputs(tiny_arch_dir, tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama base and fine-tune (tokenizer included), and one broken input per kind of mistake."""
    base = tiny_arch_dir("llama")
    root = tmp_path_factory.mktemp("inputs")
    gen = torch.Generator().manual_seed(1)
    ft = copy_with(base, root / "ft",
                   lambda s: [t.add_(torch.randn(t.shape, generator=gen) * 0.01) for t in s.values()])
    paths = {"base": base, "ft": ft, "gpt2": tiny_arch_dir("gpt2"), "root": root}

    def make(name: str) -> Path:
        paths[name] = root / name
        paths[name].mkdir()
        return paths[name]

    make("empty")
    (make("pickled") / "pytorch_model.bin").write_bytes(b"x")
    (make("not_safetensors") / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    write_header(make("bad_header") / "model.safetensors", {"w": {"dtype": "F32", "shape": [2]}})
    paths["truncated"] = copy_with(ft, root / "truncated")
    data = (paths["truncated"] / "model.safetensors").read_bytes()
    (paths["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    for name, text in {"bad_config": "{oops", "list_config": "[1, 2]"}.items():
        paths[name] = copy_with(ft, root / name)
        (paths[name] / "config.json").write_text(text)

    def widen(state):
        state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 48)

    paths["wide"] = copy_with(ft, root / "wide", widen)
    paths["int_norm"] = copy_with(ft, root / "int_norm", lambda s: s.update(
        {"model.norm.weight": s["model.norm.weight"].to(torch.int32)}))
    paths["other_tokenizer"] = copy_with(ft, root / "other_tokenizer")
    tokenizer = json.loads((ft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens swapped: shapes agree, meanings do not
    (paths["other_tokenizer"] / "tokenizer.json").write_text(json.dumps(tokenizer))
    lora_adapter(root / "adapter", base)
    paths["adapter"] = root / "adapter"
    paths["adapter_lost_base"] = lora_adapter(root / "adapter_lost_base", "/nowhere/base")
    paths["adapter_list_config"] = lora_adapter(root / "adapter_list_config", base)
    (paths["adapter_list_config"] / "adapter_config.json").write_text("[]")
    paths["adapter_no_weights"] = lora_adapter(root / "adapter_no_weights", base)
    (paths["adapter_no_weights"] / "adapter_model.safetensors").unlink()
    paths["a_file"] = root / "a_file"
    paths["a_file"].write_text("not a model")
    return paths


TASK_ARITHMETIC = """\
method: task_arithmetic
base_model: {base}
models:
  - {ft}
  - {second}
"""


def run(tmp_path: Path, text: str, *arguments: str) -> tuple[int, str, Path]:
    config = tmp_path / "merge.yaml"
    config.write_text(text + f"output_dir: {tmp_path / 'out'}\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = mm.main(["--config", str(config), "--no-progress", *arguments])
    return code, err.getvalue(), config


def assert_error(tmp_path: Path, code: int, err: str, pattern: str) -> None:
    """One ``error:`` line, exit status 2, the pattern found, and nothing but the config in tmp_path."""
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merge.yaml"]


# second model (line 5 of TASK_ARITHMETIC) -> the message after "cfg:5: models[1] (<path>): "
BROKEN_SECOND_MODEL = {
    "empty": r"no model\.safetensors or model\.safetensors\.index\.json in \S+; "
             r"give the directory a model was saved to",
    "pickled": r"only pickle weights \(pytorch_model\.bin\), which are never loaded here",
    "not_safetensors": r"model\.safetensors is not a safetensors file; save the model again",
    "bad_header": r"tensor w in model\.safetensors has a corrupt header entry "
                  r"\(dtype, shape and data_offsets expected\)$",
    "truncated": r"tensor \S+ in model\.safetensors has inconsistent offsets \(truncated file\?\); "
                 r"copy or save the model again$",
    "bad_config": r"config\.json is not valid JSON \(.*\); fix it or save the model again$",
    "list_config": r"config\.json is not a JSON object; fix it or save the model again$",
    "wide": r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \(32, 48\), base_model has \(32, 64\)$",
    "gpt2": r"architecture GPT2LMHeadModel differs from base_model's LlamaForCausalLM",
    "int_norm": r"tensor model\.norm\.weight has dtype torch\.int32, base_model has torch\.float32$",
    "other_tokenizer": r"its tokenizer differs from base_model's \(token id \d+ is .+ here, .+ there\), so their "
                       r"embeddings mean different tokens; merge models that share one tokenizer$",
    "a_file": r"is a file, not a model directory$",
    "adapter_list_config": r"adapter_config\.json is not a JSON object; save the adapter again$",
    "adapter_no_weights": r"no adapter_model\.safetensors in",
}


@pytest.mark.parametrize("name", list(BROKEN_SECOND_MODEL))
def test_a_bad_model_names_its_config_line(inputs, tmp_path, name):
    code, err, config = run(tmp_path, TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs[name]))
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:5: models\[1\] "
                 rf"\({re.escape(str(inputs[name]))}\): " + BROKEN_SECOND_MODEL[name])


def test_the_same_mistake_on_the_command_line_says_so(inputs, tmp_path):
    text = TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs["ft"])
    code, err, _ = run(tmp_path, text, f"models=[{inputs['ft']}, {inputs['wide']}]")
    assert_error(tmp_path, code, err, r"^error: command line: models\[1\] \(\S+wide\): tensor model\.layers\.0\.mlp")
    code, err, _ = run(tmp_path, text, "base_model=/nowhere/base")
    assert_error(tmp_path, code, err, r"^error: command line: base_model \(/nowhere/base\): directory not found$")
    code, err, config = run(tmp_path, text.replace(str(inputs["base"]), "/nowhere/base"))
    assert_error(tmp_path, code, err,
                 rf"^error: {re.escape(str(config))}:2: base_model \(/nowhere/base\): directory not found$")
    code, err, _ = run(tmp_path, text, "--dry-run", "tokenizer_source=/nowhere/tok")  # --dry-run checks the same
    assert_error(tmp_path, code, err, r"^error: command line: tokenizer_source /nowhere/tok: directory not found$")


def test_relative_paths_say_where_they_were_looked_for(inputs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err, config = run(tmp_path, "method: linear\nmodels:\n  - outputs/dpo\n")
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:3: models\[0\] \(outputs/dpo\): "
                 rf"directory not found \(relative to the current directory {re.escape(str(Path.cwd()))}\)$")


def test_lora_adapter_mistakes(inputs, tmp_path):
    # a linear merge has no base_model to fall back on
    code, err, config = run(tmp_path, f"method: linear\nmodels:\n  - {inputs['ft']}\n"
                                      f"  - {inputs['adapter_lost_base']}\n")
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:4: models\[1\] \(\S+\): the LoRA adapter's "
                 r"base_model_name_or_path '/nowhere/base' is not a local directory; set this model's 'base'")
    code, err, config = run(tmp_path, f"method: linear\nmodels:\n  - model: {inputs['adapter']}\n    base: /nowhere\n")
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:3: models\[0\] \(\S+adapter\): base /nowhere "
                 r"\(the LoRA adapter's base model\): directory not found$")
    code, err, config = run(tmp_path, f"method: linear\nmodels:\n  - model: {inputs['adapter']}\n"
                                      f"    base: {inputs['gpt2']}\n")
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:3: models\[0\] \(\S+adapter\): "
                 r"adapter tensor \S+ adapts model\.layers\.0\.self_attn\.o_proj\.weight, "
                 r"which the base \(\S+\) does not have")


def test_tokenizer_with_a_token_added_at_a_new_id_still_merges(inputs, tmp_path):
    # only an id that means another token is an error; an extra id is a resized embedding (a shape error) or unused
    extended = copy_with(inputs["ft"], tmp_path / "extended")
    tokenizer = json.loads((extended / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 10**6, "content": "<new>", "special": True, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False})
    (extended / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = mm.MergeConfig(method="task_arithmetic", base_model=str(inputs["base"]), output_dir=str(tmp_path / "o"),
                            models=[str(inputs["ft"]), str(extended)])
    assert len(mm.ModelMerger(config).plan().jobs) > 0


def test_tokenizer_source_that_differs_is_an_error(inputs, tmp_path):
    text = TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs["ft"])
    code, err, _ = run(tmp_path, text, f"tokenizer_source={inputs['other_tokenizer']}")
    assert_error(tmp_path, code, err, r"^error: command line: tokenizer_source \(\S+\): its tokenizer differs from "
                 r"base_model's")


@pytest.mark.parametrize(("text", "pattern"), [
    ("method: [ties]\nmodels: [{ft}]\n", r":1: method \['ties'\] is not one of .*; did you mean 'ties'\?$"),
    ("method: linear\nmodels: {ft}\n", r":2: models must be a list of model directories or \{model, weight\} entries, "
                                       r"got '\S+'; e.g\. models: \[outputs/dpo, outputs/grpo\]$"),
    ("method: linear\nmodels:\n  model: {ft}\n", r":2: models must be a list .*got a mapping \(put '- ' before each "
                                                 r"entry\)"),
    ("method: task_arithmetic\nbase_model: 3\nmodels: [{ft}]\n", r":2: base_model must be a directory path, got 3 "
                                                                 r"\(quote it if that is the directory's name\)$"),
    ("method: linear\nmodels: [{ft}]\ntokenizer_source: [a]\n", r":3: tokenizer_source must be a directory path"),
    ("method: linear\nmodels:\n  - {ft}\n  - model: {ft}\n    weight: heavy\n",
     r":4: models\[1\]\.weight must be a number or a non-empty list"),
    ("method: ties\nbase_model: {base}\nmodels: [{ft}]\ndensity: [{{filter: mlp, value: 0.5}}]\n",
     r":4: density: no entry of .* applies to tensor \S+; add a last entry without a filter$"),
    ("method: linear\nmodels:\n  - model: {ft}\n    weight: [1, 0]\n  - model: {ft}\n    weight: [-1, 0]\n",
     r":2: the models' weights sum to 0 for tensor \S+, so linear cannot normalise them; change a weight or set "
     r"normalize: false$"),
    ("method: linear\nbase_model: {base}\nmodels: [{ft}]\n", r":2: method linear averages the models and does not use "
                                                            r"base_model"),
])
def test_config_value_mistakes_name_their_line(inputs, tmp_path, text, pattern):
    code, err, config = run(tmp_path, text.format(ft=inputs["ft"], base=inputs["base"]))
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}" + pattern)


def test_output_dir_that_is_a_file_is_refused_even_with_overwrite(inputs, tmp_path):
    target = tmp_path.parent / f"{tmp_path.name}-file"
    target.write_text("keep me")
    text = TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs["ft"])
    for extra in ([], ["overwrite=true"]):
        code, err, _ = run(tmp_path, text, f"output_dir={target}", *extra)
        assert_error(tmp_path, code, err, rf"^error: command line: output_dir {re.escape(str(target))} is a file; "
                     r"give a directory path for the merged model$")
    assert target.read_text() == "keep me"


def test_overwrite_never_deletes_an_input(inputs, tmp_path, monkeypatch):
    parent = tmp_path.parent / f"{tmp_path.name}-parent"
    model = copy_with(inputs["ft"], parent / "ft")
    text = TASK_ARITHMETIC.format(base=inputs["base"], ft=model, second=inputs["ft"]) + "overwrite: true\n"
    code, err, _ = run(tmp_path, text, f"output_dir={parent}")
    assert_error(tmp_path, code, err, rf"^error: command line: output_dir {re.escape(str(parent))} contains an input, "
                 rf"models\[0\] \({re.escape(str(model))}\), which replacing output_dir would delete; choose another")
    # a LoRA adapter's base is read too
    adapter = lora_adapter(tmp_path.parent / f"{tmp_path.name}-adapter", model)
    code, err, config = run(tmp_path, f"method: linear\nmodels: [{adapter}]\noverwrite: true\n", f"output_dir={parent}")
    assert_error(tmp_path, code, err, r"^error: command line: output_dir \S+ contains an input, models\[0\] \(\S+\)'s "
                 r"base \(\S+\), which replacing")
    code, err, _ = run(tmp_path, f"method: linear\nmodels: [{adapter}]\noverwrite: true\n", f"output_dir={model}")
    assert_error(tmp_path, code, err, r"^error: command line: output_dir \S+ is one of the inputs \(models\[0\]\); "
                 r"choose a new directory$")
    # ... and so is the current directory
    monkeypatch.chdir(parent)
    code, err, _ = run(tmp_path, TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs["ft"]),
                       "output_dir=.", "overwrite=true")
    assert_error(tmp_path, code, err, r"^error: command line: output_dir \. contains the current directory, which "
                 r"overwrite: true would delete; choose another output_dir$")
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in inputs["ft"].iterdir())


def test_unreadable_input_is_a_one_line_error(inputs, tmp_path, monkeypatch):
    def denied(path, label):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(mm, "_read_safetensors_header", denied)
    code, err, config = run(tmp_path, TASK_ARITHMETIC.format(base=inputs["base"], ft=inputs["ft"], second=inputs["ft"]))
    assert_error(tmp_path, code, err, rf"^error: {re.escape(str(config))}:4: models\[0\] \(\S+\): cannot read \S+model"
                 r"\.safetensors \(Permission denied\)$")


def test_base_on_a_full_model_is_noted(inputs, tmp_path):
    result = mm.ModelMerger(mm.MergeConfig(method="linear", output_dir=str(tmp_path / "o"),
                                           models=[{"model": str(inputs["ft"]), "base": "/nowhere"}])).merge()
    assert "models[0].base ignored: 'base' is for LoRA adapters, and that model is a full one" in result.notes


@pytest.mark.parametrize(("arguments", "message"), [
    ([], r"the following arguments are required: --config"),
    (["--config", "x.yaml", "--dryrun"], r"unrecognized arguments: --dryrun"),
])
def test_argument_mistakes_are_one_line(capsys, arguments, message):
    with pytest.raises(SystemExit) as exit_:
        mm.main(arguments)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: command line: {message} "
                        r"\(python model_merging\.py --help lists the options\)\n", err), err


def test_python_entry_points(inputs, tmp_path):
    with pytest.raises(TypeError, match=r"ModelMerger takes a MergeConfig .*got dict"):
        mm.ModelMerger({"method": "linear"})
    with pytest.raises(TypeError, match=r"overrides must be a list of key=value strings, got the string 'density=0.3'"):
        mm.MergeConfig.from_yaml(tmp_path / "merge.yaml", "density=0.3")
    with pytest.raises(TypeError, match=r"argv must be a list of arguments"):
        mm.main("--config merge.yaml")
    # from_dict's source prefixes input mistakes too (rlhf.py's merge stage passes source="merge")
    config = mm.MergeConfig.from_dict({"method": "linear", "models": ["/nowhere"], "output_dir": str(tmp_path / "o")},
                                      source="merge")
    with pytest.raises(mm.MergeError, match=r"^merge: models\[0\] \(/nowhere\): directory not found$"):
        mm.ModelMerger(config).plan()
    # a config built in Python has no source to name
    with pytest.raises(mm.MergeError, match=r"^models\[0\] \(/nowhere\): directory not found$") as err:
        mm.ModelMerger(mm.MergeConfig(method="linear", models=["/nowhere"], output_dir=str(tmp_path / "o"))).plan()
    assert err.value.fields == ("models[0]", "models")
    assert not (tmp_path / "o").exists()
