"""On-policy distillation (GKD, Agarwal et al. 2024): the generalised JSD against independent formulas, the three
sources of responses, the frozen teacher, the tokenizer check, and a student that moves toward its teacher."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


def _kl(p_log, q_log):
    return sum(math.exp(p) * (p - q) for p, q in zip(p_log, q_log))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_by_hand(beta):
    student, teacher = torch.tensor([[1.0, 0.0, -1.0]]), torch.tensor([[0.0, 2.0, 0.5]])
    s = torch.log_softmax(student, -1)[0].tolist()
    t = torch.log_softmax(teacher, -1)[0].tolist()
    if beta == 0:
        want = _kl(t, s)  # forward KL(teacher || student)
    elif beta == 1:
        want = _kl(s, t)  # reverse KL(student || teacher)
    else:
        m = [math.log(beta * math.exp(a) + (1 - beta) * math.exp(b)) for a, b in zip(t, s)]
        want = beta * _kl(t, m) + (1 - beta) * _kl(s, m)
    got = rlhf.generalized_jsd_loss(student, teacher, beta=beta)
    assert float(got[0]) == pytest.approx(want, rel=1e-5)
    assert float(rlhf.generalized_jsd_loss(teacher, teacher, beta=beta)[0]) == pytest.approx(0.0, abs=1e-6)
    # temperature scales both logit vectors before the softmax
    scaled = rlhf.generalized_jsd_loss(student * 2, teacher * 2, beta=beta, temperature=2.0)
    assert float(scaled[0]) == pytest.approx(float(got[0]), rel=1e-5)


def _config(tmp_path, student, teacher, demo_dir, **overrides) -> rlhf.DistillConfig:
    settings = dict(model_name_or_path=str(student), teacher_model=str(teacher), output_dir=str(tmp_path / "out"),
                    dataset="demo_sft", dataset_dir=str(demo_dir),
                    finetuning_type="full", per_device_train_batch_size=8,
                    max_completion_length=24, cutoff_len=128, max_steps=2, learning_rate=2e-3, save_steps=0,
                    lr_scheduler_type="constant", logging_steps=1, disable_progress_bar=True, report_to="none", seed=0,
                    max_samples=64, resume_from_checkpoint="none", eval_max_new_tokens=24)
    settings.update(overrides)
    return rlhf.DistillConfig(**settings)


def _trainer(config: rlhf.DistillConfig, demo_dir) -> rlhf.DistillTrainer:
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    teacher = rlhf.PolicyModel.from_pretrained(config.teacher_model, is_trainable=False)
    formatter = rlhf.ChatFormatter(policy.tokenizer)
    records = rlhf.load_records("demo_sft", demo_dir, "sft", max_samples=64)
    dataset = rlhf.DistillDataset(records, policy.tokenizer, formatter, cutoff_len=128)
    return rlhf.DistillTrainer(config, policy, dataset, teacher=teacher, formatter=formatter)


@pytest.mark.parametrize("lmbda, seq_kd, source", [(1.0, False, "student"), (0.0, False, "dataset"),
                                                   (0.0, True, "teacher")])
def test_each_step_trains_on_the_chosen_responses(tmp_path, tiny_model_dir, sft_model, demo_dir, lmbda, seq_kd, source):
    trainer = _trainer(_config(tmp_path, tiny_model_dir, sft_model, demo_dir, lmbda=lmbda, seq_kd=seq_kd), demo_dir)
    prompts = [trainer.train_dataset[i] for i in range(4)]
    rollout = trainer.make_rollout(prompts)
    assert rollout.metrics["distill/on_policy"] == float(source == "student")
    completions = [row[label != rlhf.IGNORE_INDEX].tolist() for row, label in zip(rollout.input_ids, rollout.labels)]
    if source == "dataset":
        want = [trainer.formatter.prompt_and_completion(p, p["response"])[1] for p in prompts]
        assert completions == want
    elif source == "teacher":
        assert completions == trainer._teacher_samples(prompts)  # the same seed: the same teacher samples


def _held_out_divergence(trainer: rlhf.DistillTrainer, prompts: list[dict]) -> float:
    """Mean divergence between student and teacher on the teacher's greedy answers to held-out prompts."""
    total, count = 0.0, 0
    for prompt in prompts:
        ids = trainer.formatter.prompt_ids(prompt)
        answer = trainer.teacher.generate([ids], max_new_tokens=24, stop_token_ids=trainer.formatter.stop_token_ids)[0]
        x = torch.tensor([ids + answer])
        with torch.no_grad():
            student = trainer.policy.model(input_ids=x).logits[0, len(ids) - 1:-1]
            teacher = trainer.teacher.model(input_ids=x).logits[0, len(ids) - 1:-1]
        divergence = rlhf.generalized_jsd_loss(student, teacher, beta=0.5)
        total, count = total + float(divergence.sum()), count + len(answer)
    return total / count


def test_the_teacher_is_frozen_and_the_student_moves_toward_it(tmp_path, tiny_model_dir, sft_model, demo_dir):
    """The untrained student distils the SFT model: the training divergence falls, and so does the divergence on
    the teacher's answers to prompts it never trained on."""
    config = _config(tmp_path, tiny_model_dir, sft_model, demo_dir, max_steps=30, lmbda=0.5, beta=0.5)
    trainer = _trainer(config, demo_dir)
    teacher_before = {k: v.clone() for k, v in trainer.teacher.model.state_dict().items()}
    probes = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "system": None}
              for a, b in ((12, 7), (30, 5), (8, 9), (41, 3), (6, 6), (22, 13))]
    before = _held_out_divergence(trainer, probes)
    result = trainer.train()
    rows = [row for row in result.history if "distill/divergence" in row]
    first, last = (sum(r["distill/divergence"] for r in rows[:5]) / 5,
                   sum(r["distill/divergence"] for r in rows[-5:]) / 5)
    assert last < 0.5 * first, [r["distill/divergence"] for r in rows]
    assert _held_out_divergence(trainer, probes) < 0.5 * before
    assert all(torch.equal(teacher_before[k], v) for k, v in trainer.teacher.model.state_dict().items())


def test_a_teacher_with_another_vocabulary_is_one_line(tmp_path, tiny_model_dir, sft_model, demo_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    other = rlhf.PolicyModel.from_pretrained(str(sft_model))
    other.tokenizer.add_tokens(["<extra_token>"])
    with pytest.raises(rlhf.RLHFInputError, match="teacher must use the student's tokenizer"):
        rlhf.check_same_vocabulary(other.tokenizer, policy.tokenizer, "teacher_model")


def test_distill_from_the_command_line_and_its_bad_input(tmp_path, tiny_model_dir, sft_model, demo_dir, capsys):
    config = tmp_path / "distill.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nteacher_model: {sft_model}\ndataset: demo_sft\n"
                      f"dataset_dir: {demo_dir}\n"
                      "per_device_train_batch_size: 4\nmax_completion_length: 8\nmax_steps: 2\n"
                      f"max_samples: 8\nreport_to: none\ndisable_progress_bar: true\noutput_dir: {tmp_path / 'out'}\n")
    assert rlhf.main(["distill", "--config", str(config)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["stages"][-1]["stage"] == "distill"
    assert rlhf.main(["distill", "--config", str(config), "reward_funcs=format"]) == 2
    assert "reward_funcs' is unused by the distill stage" in capsys.readouterr().err
    with pytest.raises(rlhf.RLHFInputError, match="teacher_model' is required"):
        rlhf.DistillConfig()
