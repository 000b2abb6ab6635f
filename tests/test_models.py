"""Section 4 (models): log-probabilities, LoRA / freeze, padding, generation, saving and loading.

Every model here is a real (tiny) Hugging Face model built by conftest.py; log-probabilities are
checked against a naive ``log_softmax(...).gather(...)`` written out in the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlhf

ARCHS = ("llama", "qwen2", "gpt2", "mamba")
EXPECTED_LINEAR = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
    "mamba": {"in_proj", "x_proj", "dt_proj", "out_proj"},
}
TEXTS = ["What is 12 + 7?", "What is 3 - 1?\nAnswer: 2", "Compute 45 + 12 - 8. Step 1: 45 + 12 = 57"]


def _naive(logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor):
    """The textbook definition: full log-softmax in fp32, pick the next token, mask by labels."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = labels[:, 1:] != rlhf.IGNORE_INDEX
    per_token = logp * mask
    return per_token, per_token.sum(-1), mask.sum(-1)


def _right_padded(tokenizer, texts: list[str], prompt_tokens: int = 3):
    """A right-padded batch; labels mask the first ``prompt_tokens`` tokens and the padding."""
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), rlhf.IGNORE_INDEX)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        labels[row, prompt_tokens:len(seq)] = torch.tensor(seq[prompt_tokens:])
    return seqs, ids, mask, labels


@pytest.fixture(scope="module")
def policies(tiny_arch_dir):
    cache: dict[str, rlhf.PolicyModel] = {}

    def get(arch: str) -> rlhf.PolicyModel:
        if arch not in cache:
            cache[arch] = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir(arch))).eval()
        return cache[arch]

    return get


def _fresh_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# -- token_log_probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_log_probs_matches_naive_log_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    got = rlhf.token_log_probs(logits, targets)
    want = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert got.shape == (3, 7)
    assert got.dtype == torch.float32  # half-precision logits are normalised in fp32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got <= 0).all()


@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 2 * 7 * 50, 1 << 24])
def test_token_log_probs_chunks_give_the_same_values_and_gradients(monkeypatch, chunk_elements):
    """Rows one at a time (a large vocabulary), two per chunk (3 rows: uneven), or all at once: the same."""
    monkeypatch.setattr(rlhf, "LOG_SOFTMAX_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 7, 50, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    got = rlhf.token_log_probs(logits, targets)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    reference = logits.detach().requires_grad_()
    want = torch.log_softmax(reference, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, reference.grad)
    assert rlhf.token_log_probs(logits[:0], targets[:0]).shape == (0, 7)


@pytest.mark.parametrize("chunk_elements", [1, 3 * 50, 1 << 24])
def test_slot_log_probs_equal_indexing_the_rows_out_first(monkeypatch, chunk_elements):
    """Packed pair rows: a slot can predict two tokens (the prompt's last slot predicts chosen's and
    rejected's first). Normalising each slot where it stands gives the values and gradients of copying
    the slot's row out to every target first (token_log_probs(flat[source], targets)), in one chunk,
    in uneven chunks of 3 slots, or slot by slot."""
    monkeypatch.setattr(rlhf, "LOG_SOFTMAX_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(3)
    flat = (torch.randn(10, 50, generator=gen) * 4).requires_grad_()
    source = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 9], [6, 7, 8, 8]])  # slot 0 twice; slot 8 feeds padding too
    targets = torch.randint(0, 50, (3, 4), generator=gen)
    got = rlhf._slot_log_probs(flat, source, targets)
    (grad,) = torch.autograd.grad(got.sum(), flat)
    reference = flat.detach().requires_grad_()
    want = rlhf.token_log_probs(reference[source], targets)
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(grad, reference.grad)


def test_token_log_probs_realistic_logit_scale_exact():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 300, generator=gen) * 15 + 30  # logits of trained LMs live around |30|
    targets = torch.randint(0, 300, (2, 5), generator=gen)
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(rlhf.token_log_probs(logits, targets), want, atol=2e-5, rtol=1e-6)


def test_token_log_probs_large_logits_as_exact_as_log_softmax():
    logits = torch.tensor([[[1e4, 0.0, -1e4], [-1e4, 1e4, 1e4]]])
    targets = torch.tensor([[0, 2]])
    got = rlhf.token_log_probs(logits, targets)
    assert torch.isfinite(got).all()
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want)


# -- PolicyModel.compute_log_probs ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_compute_log_probs_matches_naive_and_is_padding_invariant(arch, policies, tiny_tokenizer):
    policy = policies(arch)
    seqs, ids, mask, labels = _right_padded(tiny_tokenizer, TEXTS)
    with torch.no_grad():
        out = policy.compute_log_probs(ids, mask, labels)
        logits = policy.model(input_ids=ids, attention_mask=mask).logits
    per_token, summed, lengths = _naive(logits, ids, labels)
    assert out.per_token.shape == (len(seqs), ids.shape[1] - 1)
    torch.testing.assert_close(out.per_token, per_token, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.summed, summed, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.summed, out.per_token.sum(-1))
    assert out.lengths.tolist() == [len(s) - 3 for s in seqs]
    torch.testing.assert_close(out.mean, out.summed / out.lengths)
    assert (out.per_token[labels[:, 1:] == rlhf.IGNORE_INDEX] == 0).all()

    # each sequence alone (no padding at all) gives the same numbers as its row of the padded batch
    for row, seq in enumerate(seqs):
        alone_ids = torch.tensor([seq])
        with torch.no_grad():
            alone = policy.compute_log_probs(alone_ids, torch.ones_like(alone_ids), labels[row:row + 1, :len(seq)])
        torch.testing.assert_close(alone.per_token[0], out.per_token[row, :len(seq) - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone.summed[0], out.summed[row], atol=1e-4, rtol=1e-5)
        assert int(alone.lengths[0]) == int(out.lengths[row])


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_compute_log_probs_without_labels_scores_every_real_token_after_the_first(arch, policies, tiny_tokenizer):
    policy = policies(arch)
    seqs, ids, mask, _ = _right_padded(tiny_tokenizer, TEXTS)
    with torch.no_grad():
        out = policy.compute_log_probs(ids, mask)
        logits = policy.model(input_ids=ids, attention_mask=mask).logits
    assert out.lengths.tolist() == [len(s) - 1 for s in seqs]
    labels = ids.masked_fill(mask == 0, rlhf.IGNORE_INDEX)
    torch.testing.assert_close(out.per_token, _naive(logits, ids, labels)[0], atol=1e-5, rtol=1e-5)


def test_compute_log_probs_temperature_divides_logits(policies, tiny_tokenizer):
    policy = policies("llama")
    _, ids, mask, labels = _right_padded(tiny_tokenizer, TEXTS)
    with torch.no_grad():
        out = policy.compute_log_probs(ids, mask, labels, temperature=0.5)
        logits = policy.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out.per_token, _naive(logits / 0.5, ids, labels)[0], atol=1e-5, rtol=1e-5)


def test_compute_log_probs_bf16_model_matches_naive(tiny_arch_dir, tiny_tokenizer):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir("llama")), dtype="bfloat16").eval()
    _, ids, mask, labels = _right_padded(tiny_tokenizer, TEXTS)
    with torch.no_grad():
        out = policy.compute_log_probs(ids, mask, labels)
        logits = policy.model(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16
    assert out.per_token.dtype == torch.float32
    per_token, summed, lengths = _naive(logits, ids, labels)
    torch.testing.assert_close(out.per_token, per_token, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.summed, summed, atol=1e-4, rtol=1e-5)
    assert torch.equal(out.lengths, lengths)


# -- linear-layer discovery, LoRA, freeze -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_find_linear_module_names(arch, tiny_arch_dir):
    names = rlhf.find_linear_module_names(_fresh_model(tiny_arch_dir(arch)))
    assert set(names) == EXPECTED_LINEAR[arch]
    assert names == sorted(names)
    assert "lm_head" not in names


def test_find_linear_module_names_tiny_tied_model(tiny_model_dir):
    model = _fresh_model(tiny_model_dir)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert set(rlhf.find_linear_module_names(model)) == EXPECTED_LINEAR["llama"]


@pytest.mark.parametrize("arch", [
    "llama", "qwen2", "gpt2",
    "mamba",
])
def test_apply_lora_all_trains_only_adapters(arch, tiny_arch_dir, tiny_tokenizer, tmp_path):
    model = _fresh_model(tiny_arch_dir(arch))
    ids = torch.tensor([tiny_tokenizer("What is 1 + 2?", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    config = rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_target="all", lora_rank=4)
    peft_model = rlhf.apply_lora(model, config)

    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    wrapped = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_A." in n}
    if arch == "mamba":  # PEFT refuses out_proj on Mamba (its CUDA kernel reads the weight directly)
        assert {"in_proj", "x_proj", "dt_proj"} <= wrapped <= EXPECTED_LINEAR[arch]
    else:
        assert wrapped == EXPECTED_LINEAR[arch]  # every linear layer got an adapter, the head none
    assert not any("lm_head" in n for n in trainable)

    out = peft_model(input_ids=ids).logits  # LoRA B starts at zero: the output is unchanged
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-5)
    out.float().logsumexp(-1).sum().backward()
    grads = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert grads and grads <= set(trainable)


def test_apply_lora_bad_target_lists_available_names(tiny_arch_dir, tmp_path):
    config = rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_target="q_proj,qkv_proj")
    with pytest.raises(rlhf.RLHFInputError) as err:
        rlhf.apply_lora(_fresh_model(tiny_arch_dir("llama")), config)
    message = str(err.value)
    assert "lora_target" in message and "qkv_proj" in message
    for name in EXPECTED_LINEAR["llama"]:
        assert name in message


def test_apply_lora_explicit_targets_gpt2_conv1d(tiny_arch_dir, tiny_tokenizer, tmp_path):
    model = _fresh_model(tiny_arch_dir("gpt2"))
    config = rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_target="c_attn")
    peft_model = rlhf.apply_lora(model, config)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("c_attn.lora_" in n for n in trainable)
    ids = torch.tensor([tiny_tokenizer("abc 12", add_special_tokens=False)["input_ids"]])
    assert torch.isfinite(peft_model(input_ids=ids).logits).all()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mamba"])
def test_apply_freeze_trains_last_or_first_blocks(arch, tiny_arch_dir):
    model = rlhf.apply_freeze(_fresh_model(tiny_arch_dir(arch)), 1)
    blocks = rlhf._decoder_blocks(model)
    assert len(blocks) == 2
    assert all(p.requires_grad for p in blocks[1].parameters())
    assert not any(p.requires_grad for p in blocks[0].parameters())
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in blocks[1].parameters()}  # embeddings, final norm, head frozen

    model = rlhf.apply_freeze(model, -1)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in blocks[0].parameters()}
    model = rlhf.apply_freeze(model, 10)  # more than there are: every block
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in blocks.parameters()}


def test_prepare_for_training_freeze_and_lora(tiny_arch_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir("qwen2")))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="freeze",
                                               freeze_trainable_layers=1))
    assert not policy.is_peft
    assert 0 < policy.num_parameters(trainable_only=True) < policy.num_parameters()
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir("qwen2")))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora"))
    assert policy.is_peft
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora"))  # idempotent
    assert all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)


# -- padding side and generation --------------------------------------------------------------------


def test_tokenizer_loads_with_right_padding(tiny_model_dir, tmp_path):
    assert rlhf.load_tokenizer(tiny_model_dir).padding_side == "right"
    tokenizer = rlhf.load_tokenizer(tiny_model_dir)
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(tmp_path)
    assert rlhf.load_tokenizer(tmp_path).padding_side == "right"


def test_tokenizer_without_pad_gets_eos(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = rlhf.load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_batch_equals_each_prompt_alone(arch, policies, tiny_tokenizer):
    policy = policies(arch)
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"]
               for t in ["What is 45 + 12 - 8? Step", "Hi", "What is 3 - 1?"]]
    assert len({len(p) for p in prompts}) == 3
    batch = policy.generate(prompts, max_new_tokens=8, stop_token_ids=[tiny_tokenizer.eos_token_id])
    alone = [policy.generate([p], max_new_tokens=8, stop_token_ids=[tiny_tokenizer.eos_token_id])[0] for p in prompts]
    assert batch == alone
    assert all(0 < len(c) <= 8 for c in batch)
    assert policy.tokenizer.padding_side == "right"  # generation never flips the training tokenizer
    assert not policy.model.training


def test_generate_cuts_after_stop_token_and_restores_training_mode(policies, tiny_tokenizer):
    policy = policies("llama")
    prompt = tiny_tokenizer("What is 2 + 2?", add_special_tokens=False)["input_ids"]
    free = policy.generate([prompt], max_new_tokens=6)[0]
    stop = free[2]
    cut = policy.generate([prompt], max_new_tokens=6, stop_token_ids=[stop])[0]
    assert cut == free[:free.index(stop) + 1]
    policy.model.train()
    try:
        policy.generate([prompt], max_new_tokens=2)
        assert policy.model.training
    finally:
        policy.model.eval()


# -- saving and loading -----------------------------------------------------------------------------


def _assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("which", ["tiny", "gpt2"])
def test_save_pretrained_loads_with_plain_transformers(which, tiny_model_dir, tiny_arch_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_model_dir if which == "tiny" else tiny_arch_dir("gpt2")
    policy = rlhf.PolicyModel.from_pretrained(str(source))
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the weights on disk already
    policy.save_pretrained(tmp_path / "out")
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer_config.json" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    _assert_state_equal(loaded.state_dict(), policy.model.state_dict())
    assert rlhf.load_tokenizer(tmp_path / "out").get_vocab() == policy.tokenizer.get_vocab()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_adapter_save_and_reload(arch, tiny_arch_dir, tiny_tokenizer, tmp_path):
    from peft import PeftModel

    base = tiny_arch_dir(arch)
    policy = rlhf.PolicyModel.from_pretrained(str(base))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)  # a trained-looking adapter, not the zero init
    policy.eval()
    adapter_dir = tmp_path / "adapter"
    policy.save_pretrained(adapter_dir)
    files = {p.name for p in adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert Path(json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]) == base

    _, ids, mask, labels = _right_padded(tiny_tokenizer, TEXTS)
    with torch.no_grad():
        want = policy.model(input_ids=ids, attention_mask=mask).logits
        base_logits = _fresh_model(base)(input_ids=ids, attention_mask=mask).logits
        assert not torch.allclose(want, base_logits, atol=1e-4)
        with_peft = PeftModel.from_pretrained(_fresh_model(base), str(adapter_dir)).eval()
        torch.testing.assert_close(with_peft(input_ids=ids, attention_mask=mask).logits, want)
        reloaded = rlhf.PolicyModel.from_pretrained(str(adapter_dir)).eval()
        assert reloaded.is_peft
        torch.testing.assert_close(reloaded.model(input_ids=ids, attention_mask=mask).logits, want)
        torch.testing.assert_close(reloaded.compute_log_probs(ids, mask, labels).summed,
                                   policy.compute_log_probs(ids, mask, labels).summed)
    assert rlhf.PolicyModel.from_pretrained(str(adapter_dir), is_trainable=False).num_parameters(True) == 0


def test_load_weights_into_round_trip_with_tied_embeddings(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params_before = {n: p for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    rlhf.load_weights_into(model, tiny_model_dir)
    _assert_state_equal(model.state_dict(), original.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert all(p is params_before[n] for n, p in model.named_parameters())  # in place: optimizers keep working

    rlhf.PolicyModel(original, rlhf.load_tokenizer(tiny_model_dir)).save_pretrained(tmp_path / "saved")
    assert "lm_head.weight" not in load_file(str(tmp_path / "saved" / "model.safetensors"))
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    rlhf.load_weights_into(model, tmp_path / "saved")
    _assert_state_equal(model.state_dict(), original.state_dict())


def test_load_weights_into_rejects_other_architecture(tiny_arch_dir):
    with pytest.raises(rlhf.RLHFInputError, match="does not match"):
        rlhf.load_weights_into(_fresh_model(tiny_arch_dir("llama")), tiny_arch_dir("gpt2"))


def test_load_weights_into_restores_lora_adapter(tiny_arch_dir, tmp_path):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir("llama")))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p))
    saved = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.zero_()
    rlhf.load_weights_into(policy.model, tmp_path / "adapter")
    for name, p in policy.model.named_parameters():
        assert torch.equal(p, saved[name]), name


# -- the embedded tiny model --------------------------------------------------------------------------


def test_installed_modules_find_the_demo_data_in_the_working_directory(tiny_model_dir, tmp_path, monkeypatch):
    """`pip install .` puts rlhf.py in site-packages without data/ or configs/; run from the checkout, `tiny`
    and the default pipeline config are found under the working directory, and elsewhere the error says where
    to run."""
    monkeypatch.setattr(rlhf, "REPO_DIR", tmp_path / "site-packages")  # no data/demo beside the module
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert rlhf.build_tiny_model(cache_dir=tiny_model_dir.parent) == tiny_model_dir  # the same corpus, a cache hit
    assert rlhf.RLHFOrchestrator().config.output_dir == "outputs/demo"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rlhf.RLHFInputError, match="run from the project's checkout"):
        rlhf.build_tiny_model(cache_dir=tmp_path)


def test_build_tiny_model_is_deterministic_and_cached(tiny_model_dir, tmp_path):
    other, third = rlhf.build_tiny_model(cache_dir=tmp_path), rlhf.build_tiny_model(cache_dir=tmp_path / "b")
    assert other.parent == tmp_path and third.parent == tmp_path / "b"
    for built in (third, tiny_model_dir):  # the session's copy was built into yet another cache
        _assert_state_equal(load_file(str(other / "model.safetensors")), load_file(str(built / "model.safetensors")))
        assert rlhf.load_tokenizer(other).get_vocab() == rlhf.load_tokenizer(built).get_vocab()
        assert (other / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()
        assert built.name == other.name  # same content key
    mtime = (other / "model.safetensors").stat().st_mtime_ns
    assert rlhf.build_tiny_model(cache_dir=tmp_path) == other  # second call: a cache hit, no rebuild
    assert (other / "model.safetensors").stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob(".tmp-*"))
    assert rlhf.resolve_model_path("tiny", tmp_path) == str(other)
    different = rlhf.build_tiny_model(cache_dir=tmp_path / "c", seed=1)
    assert different.name != other.name
    assert not torch.equal(load_file(str(different / "model.safetensors"))["model.embed_tokens.weight"],
                           load_file(str(other / "model.safetensors"))["model.embed_tokens.weight"])


def test_tiny_model_is_llama_with_chat_tokenizer(tiny_model_dir, tiny_tokenizer):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(tiny_tokenizer)
    tok = tiny_tokenizer
    assert tok.chat_template
    assert tok.pad_token is not None and tok.eos_token is not None and tok.pad_token_id != tok.eos_token_id
    assert config["eos_token_id"] == tok.eos_token_id and config["pad_token_id"] == tok.pad_token_id
    for number in ("1234567890", "57", "a 305 b"):
        digits = [t for t in tok.tokenize(number) if any(ch.isdigit() for ch in t)]
        assert digits == [ch for ch in number if ch.isdigit()]
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert "What is 1 + 1?" in rendered
    assert (tok.decode(tok("What is 71 - 9?\nAnswer: 62", add_special_tokens=False)["input_ids"])
            == "What is 71 - 9?\nAnswer: 62")
    policy = rlhf.PolicyModel.from_pretrained("tiny")
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert Path(policy.model.name_or_path) == tiny_model_dir


@pytest.mark.parametrize("path", ["/no/such/model/dir", "no-such-model-anywhere"])
def test_missing_model_path_is_an_input_error(path):
    with pytest.raises(rlhf.RLHFInputError, match="model_name_or_path"):
        rlhf.PolicyModel.from_pretrained(path)


@pytest.mark.parametrize("path", ["/no/such/model/dir", "./outputs/none", "outputs/demo/none/sft", "~/none"])
def test_a_missing_local_path_says_it_does_not_exist(path):
    """Not the hub's 'Repo id must be in the form ...': the path can only be local."""
    with pytest.raises(rlhf.RLHFInputError, match="does not exist"):
        rlhf.PolicyModel.from_pretrained(path)


def test_owner_slash_name_under_a_local_folder_is_a_local_path(tmp_path, monkeypatch):
    """'outputs/nomodel' could be a hub id, but 'outputs' is a folder here: no minute of hub retries."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    with pytest.raises(rlhf.RLHFInputError, match="'outputs/nomodel' does not exist"):
        rlhf.PolicyModel.from_pretrained("outputs/nomodel")
    assert not rlhf._names_a_local_path("Qwen/Qwen2.5-0.5B")


def test_a_model_with_its_own_code_needs_trust_remote_code(tmp_path, tiny_model_dir):
    """transformers refuses to run the code; the refusal is a one-line config error naming the fix."""
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="mycustomllama", auto_map={"AutoConfig": "custom.MyConfig",
                                                          "AutoModelForCausalLM": "custom.MyModel"})
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(rlhf.RLHFInputError, match="ships its own modelling code .* set trust_remote_code=true"):
        rlhf.PolicyModel.from_pretrained(str(remote))


def test_an_adapter_whose_base_is_gone_names_both(tmp_path, llama_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(llama_dir))
    policy.prepare_for_training(rlhf.SFTConfig(output_dir=str(tmp_path), finetuning_type="lora", lora_rank=4))
    policy.save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved-away")
    config_file.write_text(json.dumps(config))
    with pytest.raises(rlhf.RLHFInputError, match=r"adapter whose base model .*moved-away \(base_model_name_or_path"):
        rlhf.PolicyModel.from_pretrained(str(tmp_path / "adapter"))


def test_directory_without_model_is_an_input_error(tmp_path):
    with pytest.raises(rlhf.RLHFInputError, match="model_name_or_path"):
        rlhf.PolicyModel.from_pretrained(str(tmp_path))


def test_load_causal_lm_attention_on_cpu(tiny_arch_dir):
    model, implementation = rlhf.load_causal_lm(str(tiny_arch_dir("llama")), attn_implementation="flash_attention_2")
    assert implementation == "sdpa" and model.config._attn_implementation == "sdpa"
    model, implementation = rlhf.load_causal_lm(str(tiny_arch_dir("llama")), attn_implementation="eager")
    assert implementation == "eager" and model.config._attn_implementation == "eager"


def test_tiny_tokenizer_corpus_is_pinned(tiny_model_dir, demo_dir, tmp_path):
    """Adding a data file (as rm_pairs.jsonl was added) leaves the embedded model as it was; a corpus folder
    without the pinned files trains on all of its *.jsonl."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in rlhf.TINY_CORPUS_FILES:
        shutil.copy(demo_dir / name, corpus / name)
    (corpus / "extra.jsonl").write_text('{"prompt": "zebra zebra zebra quokka", "response": "quokka"}\n' * 500)
    assert rlhf.build_tiny_model(cache_dir=tmp_path / "cache", corpus_dir=corpus).name == tiny_model_dir.name
    (corpus / "sft.jsonl").unlink()  # not the pinned corpus any more: every file counts, extra.jsonl included
    other = rlhf.build_tiny_model(cache_dir=tmp_path / "cache", corpus_dir=corpus)
    assert other.name != tiny_model_dir.name and "Ġzebra" in rlhf.load_tokenizer(other).get_vocab()
