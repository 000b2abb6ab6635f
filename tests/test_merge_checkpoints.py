"""ModelMerger on real (tiny) Hugging Face checkpoints: every method against the tensor functions applied to
whole state dicts, sharded inputs and outputs, dtypes, tied embeddings, per-layer parameters, the merged
directory loading with plain ``AutoModelForCausalLM.from_pretrained``, and the one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model_merging as mm

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHTS = [1.0, 0.5, 0.7]


def read_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint (single file or shards)."""
    state = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def finetune_like(base_dir: Path, target: Path, seed: int, *, scale: float = 0.01, shard: str = "40KB",
                  tokenizer=None) -> dict[str, torch.Tensor]:
    """A 'fine-tuned' copy of base: every weight plus N(0, scale^2) noise, saved sharded by save_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(target, max_shard_size=shard)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    return read_state(target)


@pytest.fixture(scope="module")
def family(tiny_arch_dir, tiny_tokenizer, tmp_path_factory):
    """A tiny Llama base (one file) and three fine-tuned copies (sharded; the first carries the tokenizer)."""
    base = tiny_arch_dir("llama")
    root = tmp_path_factory.mktemp("family")
    fts = [root / f"ft{i}" for i in range(3)]
    states = [finetune_like(base, d, seed=i + 1, tokenizer=tiny_tokenizer if i == 0 else None)
              for i, d in enumerate(fts)]
    return {"base": base, "fts": fts, "base_state": read_state(base), "states": states, "root": root}


def derived_seed(seed: int, name: str, index: int) -> int:
    # the documented per-(seed, tensor, model) seed of DARE's drops, written out independently
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def expected_merge(method: str, base: dict, states: list[dict], weights: list[float], **params) -> dict:
    """The merge computed on whole tensors with the module's pure functions (PEFT-tested)."""
    out = {}
    for name, b in base.items():
        fts = [s[name] for s in states]
        tasks = [f - b for f in fts]
        lam = params.get("lam", 1.0)
        if method == "linear":
            out[name] = mm.linear(fts, weights)
        elif method == "task_arithmetic":
            out[name] = b + lam * mm.task_arithmetic(tasks, weights)
        elif method == "ties":
            out[name] = b + lam * mm.ties(tasks, weights, params["density"])
        elif method == "magnitude_prune":
            out[name] = b + lam * mm.magnitude_prune(tasks, weights, params["density"])
        elif method in ("dare_linear", "dare_ties"):
            gens = [torch.Generator().manual_seed(derived_seed(params.get("seed", 0), name, i))
                    for i in range(len(fts))]
            merge = mm.dare_ties if method == "dare_ties" else mm.dare_linear
            out[name] = b + lam * merge(tasks, weights, params["density"], generator=gens)
        elif method == "model_stock":
            out[name] = mm.model_stock(b, fts)
        elif method == "slerp":
            out[name] = mm.slerp(params["t"], b, fts[0])
    return out


METHOD_PARAMS = {
    "linear": {}, "task_arithmetic": {"lambda_": 0.8}, "ties": {"density": 0.5}, "magnitude_prune": {"density": 0.3},
    "dare_linear": {"density": 0.4, "seed": 3}, "dare_ties": {"density": 0.6}, "model_stock": {}, "slerp": {"t": 0.3},
}


def merge_config(family, out: Path, method: str, **params) -> mm.MergeConfig:
    models = [{"model": str(d), "weight": w} for d, w in zip(family["fts"], WEIGHTS)]
    if method == "slerp":
        models = models[:1]
    base = None if method == "linear" else str(family["base"])
    return mm.MergeConfig(method=method, models=models, base_model=base, output_dir=str(out), **params)


@pytest.mark.parametrize("method", list(METHOD_PARAMS))
def test_each_method_matches_the_tensor_functions(family, tmp_path, method):
    params = METHOD_PARAMS[method]
    out = tmp_path / "merged"
    result = mm.ModelMerger(merge_config(family, out, method, max_shard_size="40KB", **params),
                            chunk_elements=64).merge()
    assert (out / "model.safetensors.index.json").is_file() and result.shards > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(family["base_state"])
    assert index["metadata"]["total_size"] == result.total_bytes == sum(
        t.numel() * 4 for t in family["base_state"].values())
    got = read_state(out)
    weights = WEIGHTS if method != "slerp" else [1.0]
    expected = expected_merge(method, family["base_state"], family["states"], weights,
                              lam=params.get("lambda_", 1.0), **{k: v for k, v in params.items() if k != "lambda_"})
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert result.tensors == len(expected) and result.copied == 0


def test_merged_model_loads_and_generates(family, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "ties"
    mm.ModelMerger(merge_config(family, out, "ties", density=0.5)).merge()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = expected_merge("ties", family["base_state"], family["states"], WEIGHTS, density=0.5)
    reference = AutoModelForCausalLM.from_pretrained(family["base"]).eval()
    reference.load_state_dict(expected)
    prompt = torch.tensor([tiny_tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(prompt).logits, reference(prompt).logits)
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
        tokens = merged.generate(prompt, **kwargs)
        assert tokens.shape == (1, prompt.shape[1] + 8) or int(tokens[0, -1]) == tiny_tokenizer.eos_token_id
        assert torch.equal(tokens, reference.generate(prompt, **kwargs))
    # config, generation config and the tokenizer (from the first model, which has one) came along
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "generation_config.json").is_file()
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded("What is 2 + 3?")["input_ids"] == tiny_tokenizer("What is 2 + 3?")["input_ids"]
    assert loaded.chat_template == tiny_tokenizer.chat_template
    assert mm.MergeConfig.from_yaml(out / "merge_config.yaml").density == 0.5


def test_bfloat16_output(family, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    result = mm.ModelMerger(merge_config(family, out, "task_arithmetic", dtype="bfloat16")).merge()
    assert result.dtypes == ["bfloat16"]
    got = read_state(out)
    expected = expected_merge("task_arithmetic", family["base_state"], family["states"], WEIGHTS)
    for name, value in expected.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], value.to(torch.bfloat16)), name  # computed in float32, rounded once
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures(tiny_arch_dir, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    base = tiny_arch_dir(arch)
    states = [finetune_like(base, tmp_path / f"ft{i}", seed=10 + i, shard="1GB") for i in range(2)]
    out = tmp_path / "merged"
    config = mm.MergeConfig(method="ties", base_model=str(base), models=[str(tmp_path / "ft0"), str(tmp_path / "ft1")],
                            density=0.4, output_dir=str(out))
    mm.ModelMerger(config, chunk_elements=100).merge()
    expected = expected_merge("ties", read_state(base), states, [1.0, 1.0], density=0.4)
    got = read_state(out)
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == type(
        AutoModelForCausalLM.from_pretrained(base)).__name__


def test_tied_embeddings(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tiny_tokenizer), tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    states = [finetune_like(tmp_path / "base", tmp_path / f"ft{i}", seed=i, shard="1GB") for i in range(2)]
    assert "lm_head.weight" not in states[0]
    out = tmp_path / "merged"
    result = mm.ModelMerger(mm.MergeConfig(method="ties", base_model=str(tmp_path / "base"), density=0.5,
                                           models=[str(tmp_path / "ft0"), str(tmp_path / "ft1")],
                                           output_dir=str(out))).merge()
    assert "lm_head.weight" not in read_state(out)
    assert any("tied word embeddings" in note for note in result.notes)
    merged = AutoModelForCausalLM.from_pretrained(out)
    expected = expected_merge("ties", read_state(tmp_path / "base"), states, [1.0, 1.0], density=0.5)
    torch.testing.assert_close(merged.lm_head.weight.detach(), expected["model.embed_tokens.weight"])


def test_slerp_with_per_layer_t(family, tmp_path):
    # t anchors [0, 1] over 2 layers: layer 0 at t = 0 (the base), layer 1 at t = 1 (the model); the
    # embeddings take the first anchor, the final norm and lm_head the last one.
    out = tmp_path / "slerp"
    mm.ModelMerger(merge_config(family, out, "slerp", t=[0.0, 1.0])).merge()
    got, base, model = read_state(out), family["base_state"], family["states"][0]
    for name, value in got.items():
        at_base = "layers.0." in name or "embed_tokens" in name
        torch.testing.assert_close(value, base[name] if at_base else model[name], msg=name)
    # a conditional t: attention at 0.25, everything else at 0.75
    out2 = tmp_path / "slerp2"
    mm.ModelMerger(merge_config(family, out2, "slerp",
                                t=[{"filter": "self_attn", "value": 0.25}, {"value": 0.75}])).merge()
    got = read_state(out2)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        t = 0.25 if "self_attn" in name else 0.75
        torch.testing.assert_close(got[name], mm.slerp(t, base[name], model[name]))


def test_per_layer_weights(family, tmp_path):
    # models[0] weighted by anchors [0, 2] over the 2 layers: 0 in layer 0, 2 in layer 1
    config = mm.MergeConfig(method="task_arithmetic", base_model=str(family["base"]), output_dir=str(tmp_path / "o"),
                            models=[{"model": str(family["fts"][0]), "weight": [0.0, 2.0]}, str(family["fts"][1])])
    mm.ModelMerger(config).merge()
    got, base = read_state(tmp_path / "o"), family["base_state"]
    tau0 = {k: family["states"][0][k] - v for k, v in base.items()}
    tau1 = {k: family["states"][1][k] - v for k, v in base.items()}
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        w0 = 0.0 if "layers.0." in name else 2.0
        torch.testing.assert_close(got[name], base[name] + w0 * tau0[name] + tau1[name])


def test_dare_is_seeded_and_independent_of_chunking(family, tmp_path):
    def run(name: str, seed: int, chunk: int) -> dict:
        config = merge_config(family, tmp_path / name, "dare_ties", density=0.5, seed=seed)
        mm.ModelMerger(config, chunk_elements=chunk).merge()
        return read_state(tmp_path / name)

    first, rechunked, other_seed = run("a", 7, 13), run("b", 7, 10**9), run("c", 8, 13)
    assert all(torch.equal(first[k], rechunked[k]) for k in first)
    assert any(not torch.equal(first[k], other_seed[k]) for k in first)


def test_failed_merge_leaves_nothing(family, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = mm._Ties.combine

    def failing(self, job, tasks, state):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk full")
        return original(self, job, tasks, state)

    monkeypatch.setattr(mm._Ties, "combine", failing)
    out = tmp_path / "merged"
    with pytest.raises(RuntimeError, match="disk full"):
        mm.ModelMerger(merge_config(family, out, "ties", density=0.5)).merge()
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging directory


def test_overwrite_replaces_the_output(family, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(mm.MergeError, match=r"output_dir .* already exists; set overwrite: true"):
        mm.ModelMerger(merge_config(family, out, "linear")).merge()
    mm.ModelMerger(merge_config(family, out, "linear", overwrite=True)).merge()
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


# ---------------------------------------------------------------------------------------------- errors


def test_shape_mismatch_names_the_tensor(family, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(family["base"])
    config.intermediate_size = 48
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "wide")
    cfg = mm.MergeConfig(method="ties", base_model=str(family["base"]), density=0.5, output_dir=str(tmp_path / "o"),
                         models=[str(family["fts"][0]), str(tmp_path / "wide")])
    with pytest.raises(mm.MergeError) as err:
        mm.ModelMerger(cfg).merge()
    assert str(err.value) == (f"models[1] ({tmp_path / 'wide'}): tensor model.layers.0.mlp.down_proj.weight has shape "
                              "(32, 48), base_model has (32, 64)")
    assert not (tmp_path / "o").exists()


def test_missing_and_extra_tensors(family, tmp_path):
    state = dict(family["states"][1])
    del state["model.norm.weight"]
    (tmp_path / "missing").mkdir()
    save_file(state, str(tmp_path / "missing" / "model.safetensors"))
    cfg = mm.MergeConfig(method="task_arithmetic", base_model=str(family["base"]), output_dir=str(tmp_path / "o"),
                         models=[str(tmp_path / "missing")])
    with pytest.raises(mm.MergeError, match=r"^models\[0\] \(.*missing\): tensor model.norm.weight is missing; "
                                            r"base_model has it$"):
        mm.ModelMerger(cfg).plan()
    state = {**family["states"][1], "extra.weight": torch.zeros(2)}
    (tmp_path / "extra").mkdir()
    save_file(state, str(tmp_path / "extra" / "model.safetensors"))
    cfg.models = [mm.ModelSpec(str(tmp_path / "extra"))]
    with pytest.raises(mm.MergeError, match=r"tensor extra.weight is not in base_model"):
        mm.ModelMerger(cfg).plan()


def test_architecture_mismatch(family, tiny_arch_dir, tmp_path):
    cfg = mm.MergeConfig(method="linear", models=[str(family["fts"][0]), str(tiny_arch_dir("gpt2"))],
                         output_dir=str(tmp_path / "o"))
    with pytest.raises(mm.MergeError, match=r"models\[1\] .*: architecture GPT2LMHeadModel differs from models\[0\]'s "
                                            r"LlamaForCausalLM"):
        mm.ModelMerger(cfg).plan()


def test_input_errors(family, tmp_path):
    def plan(**kwargs):
        return mm.ModelMerger(mm.MergeConfig(output_dir=str(tmp_path / "o"), **kwargs)).plan()

    with pytest.raises(mm.MergeError, match=r"^models\[0\] \(nowhere\): directory not found "
                                            r"\(relative to the current directory .+\)$"):
        plan(method="linear", models=["nowhere"])
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(mm.MergeError, match="only pickle weights .* never loaded"):
        plan(method="linear", models=[str(tmp_path / "pickled")])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(mm.MergeError, match="is not a safetensors file"):
        plan(method="linear", models=[str(tmp_path / "broken")])
    with pytest.raises(mm.MergeError, match="output_dir .* is one of the inputs"):
        mm.ModelMerger(mm.MergeConfig(method="linear", models=[str(family["fts"][0])],
                                      output_dir=str(family["fts"][0]))).plan()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "tie", "models": ["a"]}, r"method 'tie' is not one of .*; did you mean 'ties'\?"),
    ({"method": "ties", "models": ["a"], "base_model": "b"}, r"density is required by method ties "
                                                             r"\(e.g. density: 0.5\)"),
    ({"method": "ties", "models": ["a"]}, r"set base_model to the model they were fine-tuned from"),
    ({"method": "ties", "models": ["a"], "base_model": "b", "density": 1.5}, r"density must be in "
                                                                             r"\(0.0, 1.0\], got 1.5"),
    ({"method": "slerp", "models": ["a", "b"], "base_model": "c", "t": 0.5}, r"slerp interpolates between two models"),
    ({"method": "slerp", "models": ["a", "b"], "t": [0.2, 1.3]}, r"t must be in \[0.0, 1.0\], got 1.3"),
    ({"method": "model_stock", "models": ["a"], "base_model": "b"}, r"needs at least 2 models, got 1"),
    ({"method": "linear", "models": ["a"], "base_model": "b"}, r"linear averages the models "
                                                               r"and does not use base_model"),
    ({"method": "linear", "models": []}, r"models is empty"),
    ({"method": "linear", "models": [{"model": "a", "wieght": 2}]}, r"models\[0\]: unknown key 'wieght'; did you mean "
                                                                   r"'weight'\?"),
    ({"method": "linear", "models": ["a"], "dtype": "fp8"}, r"dtype must be one of float32, bfloat16, float16"),
    ({"method": "linear", "models": ["a"], "max_shard_size": "lots"}, r"max_shard_size must be a number of bytes"),
    ({"method": "ties", "models": ["a"], "base_model": "b", "density": 0.5, "majority_sign_method": "mean"},
     r"majority_sign_method must be one of total, frequency"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(mm.MergeError, match=message):
        mm.MergeConfig(output_dir="out", **kwargs)


def test_unused_fields_are_reported_not_rejected(family, tmp_path):
    config = merge_config(family, tmp_path / "o", "linear", density=0.5)
    assert config.unused_fields() == ["density"]
    assert "not used by linear: density" in mm.ModelMerger(config).merge().notes[0]


def test_shard_size_parsing():
    assert mm._parse_size("5GB") == 5 * 10**9
    assert mm._parse_size("2GiB") == 2 * 2**30
    assert mm._parse_size("40KB") == 40_000
    assert mm._parse_size(1234) == 1234


def test_no_config_json_is_fine(family, tmp_path):
    # a bare directory of safetensors (no config, no tokenizer) merges too; the summary says so
    for i in range(2):
        (tmp_path / f"m{i}").mkdir()
        save_file({"w": torch.full((3, 2), float(i)), "steps": torch.tensor([7])},
                  str(tmp_path / f"m{i}" / "model.safetensors"))
    result = mm.ModelMerger(mm.MergeConfig(method="linear", models=[str(tmp_path / "m0"), str(tmp_path / "m1")],
                                           output_dir=str(tmp_path / "o"))).merge()
    got = read_state(tmp_path / "o")
    torch.testing.assert_close(got["w"], torch.full((3, 2), 0.5))
    assert torch.equal(got["steps"], torch.tensor([7]))  # integer tensors are copied, not averaged
    assert result.copied == 1 and any("no config.json" in n for n in result.notes)
    shutil.rmtree(tmp_path / "o")
