"""GRPO end to end on the embedded tiny model: zero-advantage steps change nothing, the accumulated gradient
equals an independent whole-rollout formula for every split (dapo / grpo / dr_grpo), num_iterations reuses a
rollout against stored old log-probs, the beta > 0 reference starts at KL 0, a learnable reward is learned,
non-finite rewards skip steps and stop a diverging run after a checkpoint, exact resume, config validation
and the CLI.

Every run is a handful of steps of 8 completions of at most 8-12 tokens (about 0.1 s a step on one thread).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import killed_after_checkpoint

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


# -- helpers ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=32)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _config(tmp_path: Path, model_dir: Path, **overrides) -> rlhf.GRPOConfig:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=4, per_device_train_batch_size=8, max_completion_length=8, cutoff_len=64,
                    max_steps=2, beta=0.0, learning_rate=1e-3, lr_scheduler_type="constant", save_steps=0,
                    logging_steps=1, disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                    resume_from_checkpoint="none")
    settings.update(overrides)
    return rlhf.GRPOConfig(**settings)


def _trainer(config: rlhf.GRPOConfig, dataset, reward_fn) -> rlhf.GRPOTrainer:
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    reference = rlhf.create_reference_model(config, policy) if config.beta > 0 else None  # before training starts
    return rlhf.GRPOTrainer(config, policy, dataset, reward_fn=reward_fn, reference=reference,
                            formatter=rlhf.ChatFormatter(policy.tokenizer))


def _state(trainer: rlhf.GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _rows(result: rlhf.TrainResult) -> list[dict]:
    return [row for row in result.history if "loss" in row]


class DigitShare:
    """Share of digit characters in the completion: about 0.05 for the untrained tiny model, learnable."""

    __name__ = "digit_share"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts, completions, answers):
        self.calls += 1
        return torch.tensor([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])


class Length(DigitShare):
    """Characters in the completion: varies a lot within every group of the untrained model."""

    def __call__(self, prompts, completions, answers):
        self.calls += 1
        return torch.tensor([float(len(c)) for c in completions])


class PerPrompt(DigitShare):
    """Depends on the prompt only: constant within each group, different across groups."""

    def __call__(self, prompts, completions, answers):
        self.calls += 1
        return torch.tensor([float(len(p)) for p in prompts])


class NaNOn(DigitShare):
    """DigitShare, but completion 0 scores NaN on the calls listed (1-based; None: every call)."""

    def __init__(self, calls: set[int] | None = None) -> None:
        super().__init__()
        self.bad_calls = calls

    def __call__(self, prompts, completions, answers):
        scores = super().__call__(prompts, completions, answers)
        if self.bad_calls is None or self.calls in self.bad_calls:
            scores[0] = float("nan")
        return scores


def _hand_logps(policy: rlhf.PolicyModel, input_ids, attention_mask, temperature: float) -> torch.Tensor:
    """Per-token log-probs (N, T-1) by a plain log_softmax over the whole padded rollout."""
    logits = policy.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _window() -> rlhf._LogWindow:
    return rlhf._LogWindow()


# -- a. no signal, no change ---------------------------------------------------------------------------------------


def test_constant_reward_within_groups_changes_nothing(tmp_path, tiny_model_dir, prompts):
    reward = PerPrompt()
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=3), prompts, reward)
    before = _state(trainer)
    result = trainer.train()
    assert reward.calls == 3 and result.global_step == 3
    assert _changed(before, _state(trainer)) == []  # zero advantages: zero gradient, Adam moves nothing
    rows = _rows(result)
    assert len(rows) == 3
    for row in rows:
        assert row["frac_reward_zero_std"] == 1.0 and row["reward_std"] == 0.0
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0
        assert row["reward"] > 5  # prompts are tens of characters long: the rewards themselves are not zero
    assert "stability/skipped_steps" not in result.metrics


# -- b. accumulation invariance against an independent formula ---------------------------------------------------------


def _reference_loss(policy, rollout, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """The GRPO loss over the whole rollout at once, on-policy (ratio exp(logp - sg(logp)) = 1, beta 0)."""
    device = policy.device  # the trainer put the policy on a GPU if there is one; rollouts stay on the CPU
    logps = _hand_logps(policy, rollout.input_ids.to(device), rollout.attention_mask.to(device), 1.0)
    mask = (rollout.labels[:, 1:] != rlhf.IGNORE_INDEX).float().to(device)
    per_token = -torch.exp(logps - logps.detach()) * rollout.advantages[:, None].to(device)
    if loss_type == "dapo":  # token mean over every completion token of the step
        return (per_token * mask).sum() / mask.sum()
    if loss_type == "grpo":  # mean over sequences of each sequence's token mean
        return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    return (per_token * mask).sum() / (rollout.input_ids.shape[0] * max_completion_length)  # dr_grpo


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulation_invariance_on_one_rollout(loss_type, tmp_path, tiny_model_dir, prompts):
    common = dict(loss_type=loss_type, max_grad_norm=0.0, max_completion_length=10)
    whole = _trainer(_config(tmp_path / "a", tiny_model_dir, **common), prompts, Length())
    split = _trainer(_config(tmp_path / "b", tiny_model_dir, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, **common), prompts, Length())
    assert whole.prompts_per_rollout == split.prompts_per_rollout == 2
    assert whole.rollout_plan() == split.rollout_plan()  # accumulation changes neither the samples nor the steps
    assert whole.rollout_plan() == ("grpo: 2 optimizer steps = 2 rollouts of 8 completions (16 sampled), "
                                    "each trained on once")
    for seed in range(1, 20):  # seed 1 on the CPU; a GPU draws other samples, so look for a rollout that fits
        torch.manual_seed(seed)
        rollout = whole.make_rollout([prompts[0], prompts[5]])
        lengths = (rollout.labels[:, 1:] != rlhf.IGNORE_INDEX).sum(-1)
        if len(set(lengths.tolist())) > 1 and int(lengths[:4].sum()) != int(lengths[4:].sum()) \
                and rollout.advantages.abs().min() > 0:
            break
    assert rollout.input_ids.shape[0] == 8 and rollout.old_logps is None and rollout.ref_logps is None
    assert rollout.advantages.abs().min() > 0 and len(set(lengths.tolist())) > 1  # unequal lengths: the split matters
    assert int(lengths[:4].sum()) != int(lengths[4:].sum())  # so a per-micro-batch token mean would differ

    reference = _reference_loss(whole.policy, rollout, loss_type, 10)
    reference.backward()
    want = {n: p.grad.detach().clone() for n, p in whole.policy.model.named_parameters()}
    whole.policy.model.zero_grad(set_to_none=True)

    def gradient(trainer: rlhf.GRPOTrainer, size: int) -> dict[str, torch.Tensor]:
        seen = {}
        original = trainer.optimizer.step

        def step(*args, **kwargs):  # the gradient the optimizer is about to apply
            seen.update({n: p.grad.detach().clone() for n, p in trainer.policy.model.named_parameters()})
            return original(*args, **kwargs)

        trainer.optimizer.step = step
        batches = rollout.micro_batches(size)
        assert len(batches) == trainer.config.gradient_accumulation_steps
        trainer._optimizer_step(batches, _window())
        assert seen, "the optimizer did not step"
        return seen

    got_whole, got_split = gradient(whole, 8), gradient(split, 4)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4
    for name, expected in want.items():
        torch.testing.assert_close(got_whole[name], expected, atol=1e-5 * scale, rtol=1e-4, msg=name)
        torch.testing.assert_close(got_split[name], expected, atol=1e-5 * scale, rtol=1e-4, msg=name)


def _check_grouped_prefix_logits(policy: rlhf.PolicyModel, prompt_lengths: list[int], groups: list[int],
                                  completion_lengths: list[int], same_length_twin: bool = False) -> None:
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(5, 250, (count,), generator=generator).tolist()

    prompts = [tokens(n) for n in prompt_lengths]
    if same_length_twin:  # prompts[2]: the length of prompts[1], one token different
        prompts[2] = prompts[1][:-1] + [prompts[1][-1] + 1]
    rows = [prompts[g] + tokens(n) for g, n in zip(groups, completion_lengths)]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    row_prompt_lengths = torch.tensor([len(prompts[g]) for g in groups])
    completion = (torch.arange(width - 1) + 1 >= row_prompt_lengths[:, None]) & (attention_mask[:, 1:] == 1)

    concatenated = policy.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    shared = rlhf.grouped_prefix_logits(policy.model, input_ids, attention_mask, row_prompt_lengths)
    # the packed tree layout too: narrow rows, and (huge hidden size) wide ones
    assert rlhf.can_pack_pairs(policy.model)
    layouts = [shared] + [rlhf.grouped_packed_logits(policy.model, input_ids, attention_mask, row_prompt_lengths,
                                                     hidden_size=hidden) for hidden in (1, 10**6)]
    for logits in layouts:
        assert logits.shape == concatenated.shape
        torch.testing.assert_close(logits[completion], concatenated[completion], atol=1e-5, rtol=1e-5)

    def gradients(logits: torch.Tensor) -> list[torch.Tensor]:
        logps = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return torch.autograd.grad((logps * completion).sum(), list(policy.model.parameters()), retain_graph=True)

    want_grads = gradients(concatenated)
    for logits in layouts:
        for got, want in zip(gradients(logits), want_grads):
            torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max() + 1e-8), rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_grouped_prefix_logits_equal_the_concatenated_forward(arch, tiny_arch_dir):
    """Each distinct prompt runs once and its KV cache serves its group: the completion logits and the
    gradients equal one forward of the concatenated rows. Groups are uneven (a micro-batch may split
    one), two prompts have the same length but different tokens, and a completion can be one token."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir(arch)))
    _check_grouped_prefix_logits(policy, [7, 12, 12, 9], [0, 0, 0, 1, 1, 2, 3, 3, 3], [1, 5, 9, 3, 12, 6, 2, 8, 1],
                                 same_length_twin=True)


def test_grouped_prefix_logits_keep_padding_inside_learned_positions(tiny_arch_dir):
    """A long prompt with a short completion beside a short prompt with a long one: the longest prompt
    plus the longest completion (260) passes GPT-2's 256 learned positions, the rows (210) do not."""
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_arch_dir("gpt2")))
    assert policy.model.config.n_positions == 256
    _check_grouped_prefix_logits(policy, [200, 7], [0, 0, 1, 1], [10, 4, 60, 30])


def test_pack_groups_layout_and_the_cheaper_layout_wins():
    """Hand-checked: group 0 is prompt [1, 2, 3] with completions [4] and [5, 6]; group 1 is prompt [7, 8]
    with completion [9, 9, 9]. Items: 3 + 1 + 2 = 6 and 2 + 3 = 5 tokens; with hidden size 10**6
    (attention nearly free) one row of 11 beats two rows of 6. Completion branches are numbered 1, 2, ...
    and their positions continue from the prompt's end."""
    rows = [[1, 2, 3, 4, 0], [1, 2, 3, 5, 6], [7, 8, 9, 9, 9]]
    input_ids, prompt_lengths = torch.tensor(rows), torch.tensor([3, 3, 2])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1] * 5, [1] * 5])
    packed = rlhf._pack_groups(input_ids, attention_mask, prompt_lengths, 0, 10**6)
    assert packed["groups"] == 2
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 3, 4, 0, 1, 2, 3, 4]]
    assert packed["pair"].tolist() == [[0] * 6 + [1] * 5]
    assert packed["branch"].tolist() == [[0, 0, 0, 1, 2, 2, 0, 0, 1, 1, 1]]
    # position t predicts token t + 1: a completion's first token reads its prompt's last slot
    assert packed["source"][0, 2].item() == 2 and packed["source"][1, 2:4].tolist() == [2, 4]
    assert packed["source"][2, 1:4].tolist() == [7, 8, 9]
    assert packed["work"] == pytest.approx(11 * (1 + 11 / 6e6))

    # the layout choice (hidden 128, so a slot costs 1 + width / 768): two groups, prompts of 10, G = 2
    def rows_of(completions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = 10 + max(completions)
        ids = torch.tensor([[1 + (i >= 2)] * 10 + [5] * c + [0] * (width - 10 - c) for i, c in enumerate(completions)])
        mask = torch.tensor([[1] * (10 + c) + [0] * (width - 10 - c) for c in completions])
        return ids, mask, torch.tensor([10] * 4)

    uneven = rows_of([2, 30, 3, 4])  # packed: one row of 42 + 17 = 59 -> 59 x (1 + 59/768) = 63.5
    layout = rlhf._pack_groups(*uneven, 0, 128)
    assert layout["work"] == pytest.approx(59 * (1 + 59 / 768))
    prefix = 2 * 10 * (1 + 10 / 768) + 4 * 30 * (1 + 40 / 768)  # prompts, then 4 completion rows of 30: 146.5
    assert rlhf._prefix_layout_work(uneven[1], uneven[2], 2, 128) == pytest.approx(prefix)
    even = rows_of([30, 30, 30, 30])  # packed: two rows of 70 -> 152.8 > 146.5, the KV-cache layout wins
    assert rlhf._pack_groups(*even, 0, 128)["work"] == pytest.approx(2 * 70 * (1 + 70 / 768))
    assert rlhf._prefix_layout_work(even[1], even[2], 2, 128) == pytest.approx(prefix)


@pytest.mark.parametrize("layout", ["kv-cache", "packed"])
def test_share_prompt_trains_like_concatenated_rows(layout, tmp_path, tiny_model_dir, prompts, monkeypatch):
    """share_prompt (the default) changes the compute, not the training: on one rollout (two groups, a
    micro-batch of 6 splits the second) the stored reference and old log-probs and the loss gradient
    equal those of the concatenated rows, with the prompt's KV cache shared or with the groups packed
    (forced here by pricing the KV-cache layout out or the packed one)."""
    packed_calls = []
    inner = rlhf.grouped_packed_logits
    monkeypatch.setattr(rlhf, "grouped_packed_logits", lambda *a, **k: packed_calls.append(1) or inner(*a, **k))
    monkeypatch.setattr(rlhf, "_prefix_layout_work", lambda *a: float("inf") if layout == "packed" else 0.0)
    common = dict(beta=0.1, num_iterations=2, max_completion_length=10, per_device_train_batch_size=6,
                  num_generations=3)
    results = []
    for share in (True, False):
        trainer = _trainer(_config(tmp_path / str(share), tiny_model_dir, share_prompt=share, **common), prompts,
                           Length())
        assert trainer.shares_prompts is share
        torch.manual_seed(1)
        rollout = trainer.make_rollout([prompts[0], prompts[5]])
        assert rollout.prompt_lengths.tolist() == ([len(prompts[0]["prompt_ids"])] * 3
                                                   + [len(prompts[5]["prompt_ids"])] * 3)
        batch = rollout.micro_batches(4)[0]  # rows 0-3: the first group and one row of the second
        loss, _ = trainer.compute_loss(batch)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in trainer.policy.model.named_parameters()}
        results.append((rollout, grads))
        if share:  # reference and old log-probs of the rollout, then the loss: every forward took the layout
            assert len(packed_calls) == (3 if layout == "packed" else 0)
    (shared, shared_grads), (plain, plain_grads) = results
    assert torch.equal(shared.input_ids, plain.input_ids)  # the same samples
    mask = shared.completion_mask
    torch.testing.assert_close(shared.ref_logps[mask], plain.ref_logps[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.old_logps[mask], plain.old_logps[mask], atol=1e-5, rtol=0)
    scale = max(float(g.abs().max()) for g in plain_grads.values())
    assert scale > 1e-4
    for name, want in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], want, atol=1e-5 * scale, rtol=1e-4, msg=name)
    checkpointed = _trainer(_config(tmp_path / "gc", tiny_model_dir, gradient_checkpointing=True), prompts, Length())
    assert not checkpointed.shares_prompts  # recomputation would re-run the shared prompt per use


def test_bnpo_averages_micro_batch_token_means(tmp_path, tiny_model_dir, prompts):
    """bnpo is the one aggregation that depends on the split: the mean of each micro-batch's token mean."""
    trainer = _trainer(_config(tmp_path, tiny_model_dir, loss_type="bnpo", per_device_train_batch_size=4,
                               gradient_accumulation_steps=2, max_completion_length=10), prompts, Length())
    torch.manual_seed(1)
    rollout = trainer.make_rollout([prompts[0], prompts[5]])
    batches = rollout.micro_batches(4)
    assert [trainer.loss_units(b) for b in batches] == [1, 1]
    with torch.no_grad():
        total = sum(trainer.compute_loss(b)[0] for b in batches) / 2
    mask = (rollout.labels[:, 1:] != rlhf.IGNORE_INDEX).float()
    per_row = -rollout.advantages[:, None] * mask  # on-policy every token's loss value is -A (ratio 1)
    want = sum(float(per_row[i:i + 4].sum() / mask[i:i + 4].sum()) for i in (0, 4)) / 2
    assert float(total) == pytest.approx(want, abs=1e-5)


class FirstGroupFlat(DigitShare):
    """0 for every completion of the call's first prompt (its group's advantages are all 0), the
    completion's length for the others (they vary)."""

    def __call__(self, prompts, completions, answers):
        self.calls += 1
        return torch.tensor([0.0 if p == prompts[0] else float(len(c)) for p, c in zip(prompts, completions)])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_skipping_zero_gradient_rows_leaves_the_gradient_unchanged(loss_type, tmp_path, tiny_model_dir, prompts):
    """A micro-batch of two groups, one scored alike (advantages 0), one not: skipping the flat group's
    forward and backward gives the same loss and the same gradient, for every aggregation (bnpo's token
    mean is over the whole micro-batch, so it is rescaled), and the metric counts the skipped rows."""
    results = {}
    for skip in (True, False):
        trainer = _trainer(_config(tmp_path / str(skip), tiny_model_dir, loss_type=loss_type, max_completion_length=10,
                                   skip_zero_gradient_rows=skip), prompts, FirstGroupFlat())
        torch.manual_seed(1)
        rollout = trainer.make_rollout([prompts[0], prompts[5]])
        assert (rollout.advantages[:4] == 0).all() and (rollout.advantages[4:] != 0).all()
        loss, metrics = trainer.compute_loss(rollout.micro_batches(8)[0])
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in trainer.policy.model.named_parameters()}
        results[skip] = (rollout, float(loss), metrics, grads)
    (skipped, loss_skipped, metrics_skipped, grads_skipped), (full, loss_full, metrics_full, grads_full) = \
        results[True], results[False]
    assert torch.equal(skipped.input_ids, full.input_ids)  # the same samples
    assert metrics_skipped["skipped_rows_frac"] == 0.5 and metrics_full["skipped_rows_frac"] == 0.0
    assert loss_skipped == pytest.approx(loss_full, abs=1e-6)
    scale = max(float(g.abs().max()) for g in grads_full.values())
    assert scale > 1e-4
    for name, want in grads_full.items():
        torch.testing.assert_close(grads_skipped[name], want, atol=1e-6 * scale, rtol=1e-5, msg=name)


def test_a_registered_policy_loss_trains_through_the_trainer(tmp_path, tiny_model_dir, prompts, monkeypatch):
    """A loss a user registers (here DAPO's surrogate under another name and module) gives the trainer the same
    loss and gradient as the built-in: the trainer reads the loss and its normaliser from the registry alone."""
    (tmp_path / "same_as_dapo.py").write_text(
        "import rlhf\n"
        "token_mean_surrogate = rlhf.register_policy_loss('token_mean_surrogate', aggregation='step_token_mean')("
        "rlhf.clipped_surrogate_loss)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rlhf, "POLICY_LOSSES", dict(rlhf.POLICY_LOSSES))
    results = {}
    for loss_type in ("dapo", "same_as_dapo:token_mean_surrogate"):
        trainer = _trainer(_config(tmp_path / loss_type.replace(":", "_"), tiny_model_dir, loss_type=loss_type,
                                   max_completion_length=10, per_device_train_batch_size=4,
                                   gradient_accumulation_steps=2), prompts, Length())
        torch.manual_seed(1)
        rollout = trainer.make_rollout([prompts[0], prompts[5]])
        batch = rollout.micro_batches(4)[0]
        loss, _ = trainer.compute_loss(batch)
        loss.backward()
        results[loss_type] = (rollout, float(loss), trainer.loss_units(batch),
                              {n: p.grad.detach().clone() for n, p in trainer.policy.model.named_parameters()})
    (a, loss_a, units_a, grads_a), (b, loss_b, units_b, grads_b) = results.values()
    assert torch.equal(a.input_ids, b.input_ids) and units_a == units_b > 4  # completion tokens, not rows
    assert loss_b == loss_a
    for name, want in grads_a.items():
        assert torch.equal(grads_b[name], want), name


def test_skipping_keeps_one_row_and_never_skips_under_a_kl_term(tmp_path, tiny_model_dir, prompts):
    """With every advantage 0 one row still runs (each process must run a forward and backward for its
    collectives), contributing nothing; with beta > 0 the KL term gives every row a gradient: none is skipped."""
    trainer = _trainer(_config(tmp_path / "flat", tiny_model_dir), prompts, PerPrompt())
    torch.manual_seed(1)
    batch = trainer.make_rollout([prompts[0], prompts[5]]).micro_batches(8)[0]
    kept, share = trainer._rows_that_train(batch)
    assert kept["input_ids"].shape[0] == 1 and (batch["advantages"] == 0).all()
    loss, metrics = trainer.compute_loss(batch)
    assert float(loss) == 0.0 and metrics["skipped_rows_frac"] == 7 / 8
    with_kl = _trainer(_config(tmp_path / "kl", tiny_model_dir, beta=0.1), prompts, PerPrompt())
    torch.manual_seed(1)
    batch = with_kl.make_rollout([prompts[0], prompts[5]]).micro_batches(8)[0]
    assert with_kl._rows_that_train(batch) == (batch, 1.0)


# -- c. num_iterations: old log-probs --------------------------------------------------------------------------------


def test_num_iterations_reuses_the_rollout_with_old_logps(tmp_path, tiny_model_dir, prompts):
    config = _config(tmp_path, tiny_model_dir, num_iterations=2, max_steps=4, temperature=0.7, learning_rate=1e-2,
                     epsilon_low=0.05)
    reward = Length()
    trainer = _trainer(config, prompts, reward)
    torch.manual_seed(3)
    rollout = trainer.make_rollout([prompts[1], prompts[2]])
    assert rollout.old_logps is not None and rollout.old_logps.shape == (8, rollout.input_ids.shape[1] - 1)
    with torch.no_grad():
        hand = _hand_logps(trainer.policy, rollout.input_ids, rollout.attention_mask, 0.7)
    mask = rollout.labels[:, 1:] != rlhf.IGNORE_INDEX
    torch.testing.assert_close(rollout.old_logps[mask], hand[mask], atol=1e-5, rtol=0)
    assert all("old_logps" in b for b in rollout.micro_batches(8))

    seen = []
    original = trainer.compute_loss

    def compute_loss(batch):
        seen.append(batch)
        return original(batch)

    trainer.compute_loss = compute_loss
    result = trainer.train()
    assert reward.calls == 1 + 2  # the rollout above, then one per two steps
    assert len(seen) == 4 and all("old_logps" in b for b in seen)
    assert torch.equal(seen[0]["input_ids"], seen[1]["input_ids"])  # iteration 2 of the same rollout
    assert torch.equal(seen[0]["old_logps"], seen[1]["old_logps"])  # against the same old log-probs
    assert torch.equal(seen[2]["input_ids"], seen[3]["input_ids"])
    assert not torch.equal(seen[1]["input_ids"], seen[2]["input_ids"])  # a new rollout every num_iterations steps
    rows = _rows(result)
    assert rows[0]["clip_ratio/region_mean"] == 0.0  # first iteration: the policy is the old policy, ratio 1
    assert rows[0]["clip_ratio/low_mean"] == 0.0 and rows[0]["clip_ratio/high_mean"] == 0.0
    assert rows[1]["clip_ratio/region_mean"] > 0  # after one update at lr 1e-2 some ratios leave [0.95, 1.05]
    assert "reward" in rows[0] and "reward" not in rows[1] and "reward" in rows[2]  # rollout metrics once per rollout


# -- d. the reference model --------------------------------------------------------------------------------------------


def test_beta_reference_starts_at_zero_kl(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, beta=0.1, max_steps=3, learning_rate=1e-2), prompts,
                       Length())
    assert trainer.reference is not None and trainer.reference.model is not trainer.policy
    torch.manual_seed(0)
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    assert rollout.ref_logps is not None and rollout.old_logps is None
    with torch.no_grad():
        hand = _hand_logps(trainer.policy, rollout.input_ids, rollout.attention_mask, 1.0)
    mask = rollout.labels[:, 1:] != rlhf.IGNORE_INDEX
    torch.testing.assert_close(rollout.ref_logps[mask], hand[mask], atol=1e-5, rtol=0)  # reference == start
    reference_before = {k: v.clone() for k, v in trainer.reference.model.model.state_dict().items()}
    rows = _rows(trainer.train())
    assert abs(rows[0]["kl"]) < 1e-6
    assert rows[-1]["kl"] > 1e-4  # the policy moved away from the frozen reference
    assert all(torch.equal(v, trainer.reference.model.model.state_dict()[k]) for k, v in reference_before.items())


def test_beta_needs_a_reference(tmp_path, tiny_model_dir, prompts):
    config = _config(tmp_path, tiny_model_dir, beta=0.1)
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    with pytest.raises(rlhf.RLHFInputError, match="reference model"):
        rlhf.GRPOTrainer(config, policy, prompts, reward_fn=Length())


# -- e. real learning -------------------------------------------------------------------------------------------------


def test_grpo_learns_a_simple_reward(tmp_path, tiny_model_dir, prompts):
    reward = DigitShare()
    config = _config(tmp_path, tiny_model_dir, max_steps=30, learning_rate=3e-3)
    result = _trainer(config, prompts, reward).train()
    rewards = [row["reward"] for row in _rows(result)]
    assert len(rewards) == 30 and reward.calls == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25, rewards  # the untrained model writes few digits
    assert last > first + 0.3, rewards
    assert (tmp_path / "out" / "model.safetensors").is_file()


# -- f. non-finite rewards ---------------------------------------------------------------------------------------------


def test_nan_reward_skips_the_step(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=1), prompts, NaNOn({1}))
    before = _state(trainer)
    result = trainer.train()
    assert _changed(before, _state(trainer)) == []
    assert result.metrics["stability/skipped_steps"] == 1
    assert _rows(result)[0]["stability/skipped_steps"] == 1.0
    assert trainer.nonfinite_in_a_row == 1 and "reward" in trainer.last_problem


def test_nan_rewards_now_and_then_do_not_stop_the_run(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=4, max_nonfinite_steps=2), prompts,
                       NaNOn({1, 3}))
    before = _state(trainer)
    result = trainer.train()  # never two bad steps in a row
    assert result.global_step == 4 and result.metrics["stability/skipped_steps"] == 2
    assert [row.get("stability/skipped_steps", 0.0) for row in _rows(result)] == [1.0, 0.0, 1.0, 0.0]
    assert _changed(before, _state(trainer))  # the good steps trained
    assert trainer.nonfinite_in_a_row == 0
    assert trainer.scheduler.last_epoch == 4  # skipped steps advance the schedule too: lr follows global_step


def test_always_nan_reward_stops_after_a_checkpoint(tmp_path, tiny_model_dir, prompts):
    from safetensors.torch import load_file

    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=10, max_nonfinite_steps=2), prompts, NaNOn(None))
    before = _state(trainer)
    with pytest.raises(rlhf.TrainingDivergedError, match="2 steps in a row had a non-finite reward") as info:
        trainer.train()
    assert isinstance(info.value, rlhf.RLHFInputError)  # the CLI prints it as one line, exit status 2
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    assert str(checkpoint) in str(info.value)
    assert (checkpoint / "COMPLETE").read_text() == "2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    for name in ("model.safetensors", "optimizer.safetensors", "scheduler.json", "rng_state.safetensors"):
        assert (checkpoint / name).is_file(), name
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert saved and all(torch.equal(saved[k], before[k]) for k in saved)  # the last good weights: the start


def test_nan_reward_skips_every_iteration_of_its_rollout(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=2, num_iterations=2), prompts, NaNOn({1}))
    before = _state(trainer)
    result = trainer.train()
    assert result.metrics["stability/skipped_steps"] == 2
    assert _changed(before, _state(trainer)) == []


def test_always_nan_reward_stops_with_num_iterations(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_steps=6, num_iterations=2, max_nonfinite_steps=2),
                       prompts, NaNOn(None))
    with pytest.raises(rlhf.TrainingDivergedError):
        trainer.train()


# -- g. resume ---------------------------------------------------------------------------------------------------------


def _recording(trainer: rlhf.GRPOTrainer) -> list[tuple[list, rlhf.Rollout]]:
    """Every rollout the trainer makes from now on: (its prompts' ids, the rollout)."""
    seen, original = [], trainer.make_rollout

    def make_rollout(items):
        rollout = original(items)
        seen.append(([item["prompt_ids"] for item in items], rollout))
        return rollout

    trainer.make_rollout = make_rollout
    return seen


def _same_rows(a: rlhf.Rollout, b: rlhf.Rollout) -> bool:
    return a.input_ids.shape == b.input_ids.shape and torch.equal(a.input_ids, b.input_ids)


def _streaming_prompts(tokenizer, demo_dir) -> rlhf.StreamingGRPODataset:
    return rlhf.StreamingGRPODataset(rlhf.resolve_dataset("demo_rl", demo_dir), tokenizer,
                                     rlhf.ChatFormatter(tokenizer), cutoff_len=64, max_samples=32)


def _resume_pair(tmp_path, model_dir, make_dataset, kill_at: int, **settings):
    """(straight run's rollouts, trainer), (resumed run's rollouts, trainer) for the same config."""
    settings = dict(max_steps=4, save_steps=1, lr_scheduler_type="linear", resume_from_checkpoint="auto",
                    learning_rate=1e-2, **settings)
    straight = _trainer(_config(tmp_path / "straight", model_dir, **settings), make_dataset(), DigitShare())
    straight_rollouts = _recording(straight)
    straight.train()
    killed_after_checkpoint(_trainer(_config(tmp_path / "resumed", model_dir, **settings), make_dataset(),
                                      DigitShare()), kill_at)
    resumed = _trainer(_config(tmp_path / "resumed", model_dir, **settings), make_dataset(), DigitShare())
    resumed_rollouts = _recording(resumed)
    assert resumed.train().global_step == 4
    return (straight_rollouts, straight), (resumed_rollouts, resumed)


def test_resume_at_a_rollout_boundary_is_exact_when_streaming(tmp_path, tiny_model_dir, tiny_tokenizer, demo_dir):
    """Streaming prompts take no DataLoader, so this isolates the loop itself: it resumes exactly."""
    (straight_rollouts, straight), (resumed_rollouts, resumed) = _resume_pair(
        tmp_path, tiny_model_dir, lambda: _streaming_prompts(tiny_tokenizer, demo_dir), 2, streaming=True,
        reward_normalize=True)
    assert len(straight_rollouts) == 4 and len(resumed_rollouts) == 2
    for (prompt_a, rows_a), (prompt_b, rows_b) in zip(straight_rollouts[2:], resumed_rollouts):
        assert prompt_a == prompt_b and _same_rows(rows_a, rows_b)
    assert _changed(_state(straight), _state(resumed)) == []
    assert resumed.normalizer.state_dict() == straight.normalizer.state_dict()


def test_resume_at_a_rollout_boundary_is_exact(tmp_path, tiny_model_dir, prompts):
    (straight_rollouts, straight), (resumed_rollouts, resumed) = _resume_pair(
        tmp_path, tiny_model_dir, lambda: prompts, 2)
    assert [p for p, _ in resumed_rollouts] == [p for p, _ in straight_rollouts[2:]]  # this much is right
    assert all(_same_rows(a, b) for (_, a), (_, b) in zip(straight_rollouts[2:], resumed_rollouts))
    assert _changed(_state(straight), _state(resumed)) == []


def test_resume_in_the_middle_of_a_rollout_is_exact(tmp_path, tiny_model_dir, prompts):
    """A checkpoint inside a rollout (num_iterations > 1) keeps that rollout; the resumed run trains on it
    (same rows, same old log-probs) instead of sampling it again, then samples the next one."""
    (straight_rollouts, straight), (resumed_rollouts, resumed) = _resume_pair(tmp_path, tiny_model_dir, lambda: prompts,
                                                                              1, num_iterations=2)
    # step 3: inside rollout 2
    assert (tmp_path / "resumed" / "out" / "checkpoints" / "checkpoint-3" / "rollout.safetensors").is_file()
    assert len(straight_rollouts) == 2 and len(resumed_rollouts) == 1  # only the next rollout is sampled
    assert (resumed_rollouts[0][0] == straight_rollouts[1][0]
            and _same_rows(straight_rollouts[1][1], resumed_rollouts[0][1]))
    assert _changed(_state(straight), _state(resumed)) == []


def test_resume_in_the_middle_of_a_rollout_keeps_its_prompts_when_streaming(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                            demo_dir):
    (straight_rollouts, straight), (resumed_rollouts, resumed) = _resume_pair(
        tmp_path, tiny_model_dir, lambda: _streaming_prompts(tiny_tokenizer, demo_dir), 1, streaming=True,
        num_iterations=2)
    assert [p for p, _ in resumed_rollouts] == [p for p, _ in straight_rollouts[1:]]
    assert _changed(_state(straight), _state(resumed)) == []


def test_resume_restores_the_reward_normaliser(tmp_path, tiny_model_dir, prompts):
    (_, straight), (_, resumed) = _resume_pair(tmp_path, tiny_model_dir, lambda: prompts, 2, reward_normalize=True)
    state = json.loads(
        (tmp_path / "resumed" / "out" / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["trainer"]["reward_normalizer"]["count"] == 16  # two rollouts of 8 completions seen
    assert resumed.normalizer.count == straight.normalizer.count == 32


# -- rollout details ---------------------------------------------------------------------------------------------------


def test_rollout_layout_and_masked_truncation(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, max_completion_length=3, mask_truncated_completions=True,
                               per_device_train_batch_size=4, gradient_accumulation_steps=2), prompts, Length())
    torch.manual_seed(0)
    items = [prompts[3], prompts[4]]
    rollout = trainer.make_rollout(items)
    assert rollout.input_ids.shape[0] == 8 and rollout.advantages.shape == (8,)
    group = trainer.config.num_generations
    for row in range(8):
        prompt = items[row // group]["prompt_ids"]
        assert rollout.input_ids[row, :len(prompt)].tolist() == prompt  # each prompt's G completions are contiguous
        real = int(rollout.attention_mask[row].sum())
        completion = rollout.input_ids[row, len(prompt):real].tolist()
        assert 1 <= len(completion) <= 3
        labels = rollout.labels[row, :real].tolist()
        ended = completion[-1] in trainer.formatter.stop_token_ids
        if len(completion) == 3 and not ended:  # cut off: out of the loss (DAPO's overlong masking)
            assert all(label == rlhf.IGNORE_INDEX for label in labels)
        else:
            assert labels == [rlhf.IGNORE_INDEX] * len(prompt) + completion
    torch.testing.assert_close(rollout.advantages.view(-1, group).mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    assert [trainer.loss_units(b) for b in rollout.micro_batches(4)] == [4, 4]  # grpo: completions


# -- h. config validation ----------------------------------------------------------------------------------------------


def test_grpo_config_validation(tmp_path):
    def make(**overrides):
        settings = dict(output_dir=str(tmp_path), reward_funcs=["format"], num_generations=4,
                        per_device_train_batch_size=8)
        settings.update(overrides)
        return rlhf.GRPOConfig(**settings)

    assert make().epsilon_high == 0.2 and make(epsilon_high=0.28).epsilon_high == 0.28
    assert make(per_device_train_batch_size=2, gradient_accumulation_steps=2).per_device_train_batch_size == 2
    with pytest.raises(rlhf.RLHFInputError, match="'per_device_train_batch_size'.*multiple of num_generations") as info:
        make(per_device_train_batch_size=6)
    assert "(6)" in str(info.value) and "(4)" in str(info.value)
    with pytest.raises(rlhf.RLHFInputError, match="'per_device_train_batch_size'.*\\(6\\)"):
        make(per_device_train_batch_size=3, gradient_accumulation_steps=2)
    with pytest.raises(rlhf.RLHFInputError, match="'reward_weights'.*exact_answer, format"):
        make(reward_funcs=["exact_answer", "format"], reward_weights=[1.0])
    with pytest.raises(rlhf.RLHFInputError, match="'reward_weights'.*format, reward_model"):  # reward_model counts
        make(reward_model="some/dir", reward_weights=[1.0])
    assert make(reward_model="some/dir", reward_weights=[1.0, 2.0]).reward_names() == ["format", "reward_model"]
    with pytest.raises(rlhf.RLHFInputError, match="'reward_funcs' is empty"):
        make(reward_funcs=[])
    assert make(reward_funcs=[], reward_model="some/dir").reward_names() == ["reward_model"]
    for field, value in (("num_generations", 1), ("max_completion_length", 0), ("temperature", 0.0), ("top_p", 0.0),
                         ("num_iterations", 0), ("reward_clip", 0.0), ("reward_uncertainty_penalty", -1.0),
                         ("reward_api_retries", 0), ("epsilon_low", 0.0), ("beta", -0.1)):
        with pytest.raises(rlhf.RLHFInputError, match="config field"):
            make(**{field: value, **({"per_device_train_batch_size": 8} if field != "num_generations" else
                                     {"per_device_train_batch_size": 2})})
    for field, value, valid in (("loss_type", "ppo", "dr_grpo"), ("scale_rewards", "groups", "batch"),
                                ("reward_model_type", "remote", "lora")):
        with pytest.raises(rlhf.RLHFInputError, match=f"'{field}'.*valid:.*{valid}"):
            make(**{field: value})


# -- i. the CLI --------------------------------------------------------------------------------------------------------


def _cli_args(tmp_path: Path, model: Path, demo_dir: Path, *extra: str) -> list[str]:
    return ["grpo", f"model_name_or_path={model}", "dataset=demo_rl", f"dataset_dir={demo_dir}", "max_samples=16",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=8", "cutoff_len=64",
            "max_steps=2", f"output_dir={tmp_path / 'cli'}", "save_steps=0", "logging_steps=1",
            "disable_progress_bar=true", "report_to=none", *extra]


def test_cli_grpo_run_appends_report(tmp_path, tiny_model_dir, demo_dir, capsys):
    # default beta 0.04 with LoRA: the reference is the adapter-disabled policy
    status = rlhf.main(_cli_args(tmp_path, tiny_model_dir, demo_dir, "reward_funcs=exact_answer,format",
                                 "reward_weights=1,0.5", "finetuning_type=lora"))
    assert status == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    entry = report["stages"][-1]
    assert entry["stage"] == "grpo" and entry["global_step"] == 2
    assert (tmp_path / "cli" / "adapter_model.safetensors").is_file()
    status = rlhf.main(_cli_args(tmp_path, tiny_model_dir, demo_dir, "reward_funcs=format", "max_steps=1",
                                 "overwrite_output_dir=true", "finetuning_type=full", "beta=0"))
    assert status == 0, capsys.readouterr().err
    assert len(json.loads((tmp_path / "cli" / "report.json").read_text())["stages"]) == 2  # appended


@pytest.mark.parametrize(("extra", "message"), [
    (("reward_funcs=exact_answr",), "unknown reward 'exact_answr'"),
    (("reward_funcs=format", "per_device_train_batch_size=6"), "multiple of num_generations"),
    (("reward_funcs=api",), "reward_api_url"),
])
def test_cli_grpo_bad_reward_is_one_line(extra, message, tmp_path, tiny_model_dir, demo_dir, capsys):
    status = rlhf.main(_cli_args(tmp_path, tiny_model_dir, demo_dir, *extra))
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cli" / "model.safetensors").exists()


def test_exact_answer_on_prompts_without_answers_is_refused(tmp_path, tiny_model_dir, demo_dir):
    """Every reward would be 0, so nothing could train: refused before the policy loads."""
    config = _config(tmp_path, tiny_model_dir, dataset="demo_sft", dataset_dir=str(demo_dir), max_samples=8,
                     reward_funcs=["exact_answer"])
    with pytest.raises(rlhf.RLHFInputError, match=r"'dataset': 'demo_sft' has no 'answer' in any of its 8 records"):
        rlhf.train_grpo(config)


def test_auto_engine_is_told_how_many_rollouts_the_run_still_plans():
    """`auto` passes the engine the rollouts still ahead (this one included), so it can compile as soon as a timed
    rollout shows they would pay for the compilation (inference_optimizations.compile_pays)."""
    from types import SimpleNamespace

    def engine(setting: str, total_steps: int, done: int = 0, iterations: int = 1, one_shape: bool = True) -> tuple:
        trainer = SimpleNamespace(total_steps=total_steps, steps_per_rollout=iterations, global_step=done)
        context = rlhf.EngineContext(SimpleNamespace(generation_engine=setting), None, None, None, None,
                                     lambda: rlhf._OnlineRLTrainer._rollouts_left(trainer),
                                     one_shape_per_rollout=one_shape)
        return setting, context.expected_calls()

    assert engine("auto", 150) == ("auto", 150)  # the demo's GRPO: 150 rollouts ahead at the start
    assert engine("auto", 150, done=140) == ("auto", 10)
    assert engine("auto", 150, iterations=2) == ("auto", 75)  # num_iterations reuses each rollout
    assert engine("auto", -1) == ("auto", None)  # streaming prompts without max_steps: the work ahead is unknown
    assert engine("static", 10_000) == ("static", None) and engine("compiled", 10) == ("compiled", None)
    assert engine("auto", 150, one_shape=False) == ("auto", None)  # episodes: batches of every shape, no plan


# -- the 2025-26 family: RLOO, REINFORCE++, GSPO, CISPO, DAPO sampling -------------------------------------------------


class HalfConstant(DigitShare):
    """Constant (0.5) for prompts with an even length, digit share otherwise: half the groups are uninformative."""

    def __call__(self, prompts, completions, answers):
        self.calls += 1
        return torch.tensor([0.5 if len(p) % 2 == 0 else sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c)
                             for p, c in zip(prompts, completions)])


def test_dynamic_sampling_never_trains_on_a_zero_variance_group(tmp_path, tiny_model_dir, prompts):
    config = _config(tmp_path, tiny_model_dir, dynamic_sampling=True, max_sampling_rounds=4, max_steps=1)
    trainer = _trainer(config, prompts, HalfConstant())
    trainer.rollout_index = 0
    rollout = trainer.make_rollout([prompts[i] for i in range(2)])
    group = config.num_generations
    trained = rollout.completion_mask.any(-1).view(-1, group)  # (groups, G): rows in the loss
    for g, advantages in enumerate(rollout.advantages.view(-1, group)):
        if bool(trained[g].any()):
            assert float(advantages.abs().sum()) > 0, g  # every group in the loss varies
        else:
            assert rollout.metrics["dynamic_sampling/filler_frac"] > 0
    metrics = rollout.metrics
    assert metrics["dynamic_sampling/rounds"] >= 1 and 0 <= metrics["dynamic_sampling/dropped_frac"] < 1
    # the same rollout again (as a resume samples it) draws the same extra prompts
    again = _trainer(config, prompts, HalfConstant())
    again.rollout_index = 0
    assert torch.equal(again.make_rollout([prompts[i] for i in range(2)]).input_ids, rollout.input_ids)


@pytest.mark.parametrize("overrides", [
    {"advantage_estimator": "rloo", "scale_rewards": "none"},
    {"advantage_estimator": "reinforce_pp", "scale_rewards": "none", "beta": 0.01},
    {"advantage_estimator": "reinforce_pp_baseline", "scale_rewards": "none"},
    {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4, "num_iterations": 2},
    {"loss_type": "cispo", "num_iterations": 2},
    {"dynamic_sampling": True, "overlong_buffer_len": 4, "loss_type": "dapo"},
], ids=["rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "dapo"])
def test_every_estimator_and_loss_learns_a_simple_reward(tmp_path, tiny_model_dir, prompts, overrides):
    reward = DigitShare()
    config = _config(tmp_path, tiny_model_dir, max_steps=30, learning_rate=3e-3, **overrides)
    rewards = [row["reward"] for row in _rows(_trainer(config, prompts, reward).train()) if "reward" in row]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.2, rewards


def test_rloo_and_reinforce_pp_are_stages_of_their_own(tmp_path, tiny_model_dir, demo_dir, capsys):
    config_file = tmp_path / "online.yaml"
    config_file.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: demo_rl\ndataset_dir: {demo_dir}\n"
                           "reward_funcs: [exact_answer]\nnum_generations: 2\nper_device_train_batch_size: 4\n"
                           "max_completion_length: 8\nmax_steps: 1\nmax_samples: 8\nreport_to: none\n"
                           "disable_progress_bar: true\n")
    for stage in ("rloo", "reinforce_pp"):
        code = rlhf.main([stage, "--config", str(config_file), f"output_dir={tmp_path / stage}"])
        assert code == 0, capsys.readouterr().err
        state = json.loads((tmp_path / stage / "report.json").read_text())
        assert state["stages"][-1]["stage"] == stage
    config = rlhf.STAGE_CONFIGS["reinforce_pp"](reward_funcs=["format"])
    assert (config.advantage_estimator, config.scale_rewards, config.beta) == ("reinforce_pp", "none", 0.01)


@pytest.mark.parametrize("overrides, message", [
    ({"advantage_estimator": "gae"}, "gae learns a critic: use the ppo stage"),
    ({"advantage_estimator": "rlo"}, "did you mean 'rloo'"),
    ({"advantage_estimator": "reinforce_pp"}, "must be none with advantage_estimator reinforce_pp"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level"),
    ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, "cispo clips each token"),
    ({"dynamic_sampling": True, "streaming": True, "max_steps": 5}, "cannot do: set streaming: false"),
    ({"overlong_buffer_len": 64}, "below max_completion_length"),
    ({"dynamic_sampling": True, "num_generations": 1, "per_device_train_batch_size": 1}, "dynamic_sampling keeps"),
])
def test_bad_estimator_and_sampling_settings_are_one_line(overrides, message):
    with pytest.raises(rlhf.RLHFInputError, match=message):
        rlhf.GRPOConfig(reward_funcs=["format"], max_completion_length=64, **overrides)
