"""LoRA adapter directories in ModelMerger: merged into their base on the fly, without peft, and equal to
peft's ``merge_and_unload`` (peft is used here only, as the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model_merging as mm

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"),  # peft's notes on embedding layers and init
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]  # peft 0.21


def read_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def make_adapter(base_dir: Path, target: Path, seed: int = 0, **lora) -> dict[str, torch.Tensor]:
    """Save a LoRA adapter with non-zero A and B (and changed modules_to_save) on the model in base_dir;
    returns the state dict of peft's merge_and_unload, the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(target)
    merged = peft_model.merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def merge_adapter_alone(adapter: Path, out: Path, **spec) -> dict[str, torch.Tensor]:
    # a linear "merge" of one model is that model: the adapter merged into its base
    mm.ModelMerger(mm.MergeConfig(method="linear", models=[{"model": str(adapter), **spec}], output_dir=str(out)),
                   chunk_elements=40).merge()
    return read_state(out)


def assert_states_equal(got: dict, expected: dict, base_names: set[str]) -> None:
    assert set(got) == base_names
    for name in base_names:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("rslora", [False, True])
def test_llama_adapter_equals_peft_merge_and_unload(tiny_arch_dir, tmp_path, rslora):
    base = tiny_arch_dir("llama")
    expected = make_adapter(
        base, tmp_path / "adapter", r=4, lora_alpha=8, use_rslora=rslora,
        target_modules=["q_proj", "v_proj", "up_proj", "embed_tokens"], modules_to_save=["lm_head"],
        rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 3})
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)  # found from the adapter, no base in the config
    got = merge_adapter_alone(tmp_path / "adapter", tmp_path / "merged")
    base_state = read_state(base)
    assert_states_equal(got, expected, set(base_state))
    changed = [n for n in base_state if not torch.equal(base_state[n], got[n])]
    assert "lm_head.weight" in changed and "model.embed_tokens.weight" in changed
    assert ("model.layers.1.self_attn.v_proj.weight" in changed
            and "model.layers.1.self_attn.k_proj.weight" not in changed)


def test_gpt2_fan_in_fan_out_adapter_equals_peft(tiny_arch_dir, tmp_path):
    base = tiny_arch_dir("gpt2")
    expected = make_adapter(base, tmp_path / "adapter", r=4, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                            fan_in_fan_out=True)
    got = merge_adapter_alone(tmp_path / "adapter", tmp_path / "merged")
    assert_states_equal(got, expected, set(read_state(base)))


def test_adapter_in_a_ties_merge(tiny_arch_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tiny_arch_dir("llama")
    lora_full = make_adapter(base, tmp_path / "adapter", seed=1, r=4, lora_alpha=8,
                             target_modules=["q_proj", "down_proj"])
    full = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    full.save_pretrained(tmp_path / "full")
    out = tmp_path / "merged"
    mm.ModelMerger(mm.MergeConfig(method="ties", base_model=str(base), density=0.5, output_dir=str(out),
                                  models=[str(tmp_path / "adapter"), str(tmp_path / "full")])).merge()
    base_state, full_state, got = read_state(base), read_state(tmp_path / "full"), read_state(out)
    for name, b in base_state.items():
        expected = b + mm.ties([lora_full[name] - b, full_state[name] - b], [1.0, 1.0], 0.5)
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_adapter_base_resolution(tiny_arch_dir, tmp_path):
    base = tiny_arch_dir("llama")
    expected = make_adapter(base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["o_proj"])
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = "meta-llama/Not-Here"
    path.write_text(json.dumps(config))
    with pytest.raises(mm.MergeError, match=r"^models\[0\] \(.*adapter\): the LoRA adapter's base_model_name_or_path "
                                            r"'meta-llama/Not-Here' is not a local directory; set this model's 'base'"):
        merge_adapter_alone(tmp_path / "adapter", tmp_path / "merged")
    got = merge_adapter_alone(tmp_path / "adapter", tmp_path / "merged", base=str(base))
    assert_states_equal(got, expected, set(read_state(base)))


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "DoRA adapters are not supported"),
    ({"peft_type": "IA3"}, "PEFT adapter type IA3 cannot be merged here"),
    ({"lora_bias": True}, "LoRA biases"),
])
def test_unsupported_adapters_are_clear_errors(tiny_arch_dir, tmp_path, change, message):
    base = tiny_arch_dir("llama")
    make_adapter(base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["o_proj"])
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(mm.MergeError, match=message):
        merge_adapter_alone(tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
