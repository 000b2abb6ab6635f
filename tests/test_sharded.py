"""Weights sharded across processes (FSDP2, as configs/accelerate/fsdp.yaml launches it; ZeRO-3 alike).

Each forward of a sharded model gathers its weights from every process, so the processes must make
the same forwards: generation decodes in lockstep until all are done (``synced``), held-out
evaluation tops a shorter share up, and saving gathers the whole weights onto the main process.
accelerate only shards on GPUs, so this runs two CPU processes over gloo with PyTorch's own
``fully_shard`` (tests/_sharded_worker.py) against the functions the trainers call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(mode: str, out: Path, model_dir: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(REPO / "tests/_sharded_worker.py"), mode,
                           str(model_dir), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_model_dir) -> list[dict]:
    return _launch("parts", tmp_path_factory.mktemp("sharded"), tiny_model_dir)


def test_generation_on_a_sharded_model_runs_in_lockstep(reports):
    for report in reports:
        assert report["processes"] == 2 and report["sharding"] == "fsdp2"
        for engine in ("static", "eager", "compiled"):
            assert report["generate"][engine]["equal"], (report["rank"], engine)
    # the first process stopped after 3 tokens while the second decoded all 12: without lockstep the first
    # would leave the second waiting for its weights (or pair its gathers with the next training forward)
    for engine in ("static", "eager"):
        assert max(reports[0]["generate"][engine]["lengths"]) <= 3 and reports[1]["generate"][engine]["lengths"] == [12]


def test_exact_match_evaluation_of_a_sharded_model_equals_one_process(reports):
    for report in reports:
        assert report["exact_match"]["sharded"] == report["exact_match"]["unsharded"]


def test_training_continues_after_generating_with_a_sharded_model(reports):
    # under inference_mode the gathered weights became inference tensors and this step raised
    assert reports[0]["trained_loss"] == pytest.approx(reports[1]["trained_loss"])


def test_sharded_weights_gather_save_and_load_back(reports):
    main, other = reports
    assert main["gathered_on_this_process"] and not other["gathered_on_this_process"]
    assert main["trained_vs_original"] > 1e-4  # the step changed the weights, so the comparisons below mean something
    assert main["reloaded_vs_gathered"] == 0.0  # Hugging Face layout written from the gathered weights
    assert main["restored_vs_original"] == 0.0  # whole weights loaded back into the shards


def test_sharded_reward_model_saves_backbone_and_head(reports):
    expected, reloaded = reports[0]["reward_scores"]
    assert reloaded == pytest.approx(expected, abs=1e-5)


def test_fsdp_v1_is_refused_with_the_fix(reports):
    for report in reports:
        assert "fsdp_version: 2" in report["fsdp1_refused"]


@pytest.fixture(scope="module")
def trainer_reports(tmp_path_factory, tiny_model_dir) -> list[dict]:
    return _launch("trainers", tmp_path_factory.mktemp("sharded-trainers"), tiny_model_dir)


@pytest.mark.parametrize("stage", ["sft", "sft_lora", "rm", "dpo", "grpo", "ppo"])
def test_trainers_on_a_sharded_model_train_checkpoint_and_resume(trainer_reports, stage):
    """The trainers' own code on a sharded model (the policy is the sharded root, except for PPO, where it sits
    inside the sharded actor-critic, whose root shard holds its embeddings and LM head): rollouts and held-out
    exact-match evaluation (3 prompts: shares of 2 and 1) in lockstep, SFT's eval loss, the reward model's pairwise
    accuracy and DPO's preference metrics on 5 held-out items, a checkpoint of the gathered weights and optimizer state
    at step 2, a second run resuming from it to step 4 that ends with the weights of 4 uninterrupted steps, and the
    final model in Hugging Face layout holding the trained weights."""
    assert trainer_reports[0][stage]["eval"] == trainer_reports[1][stage]["eval"]  # both report the whole set
    for process in trainer_reports:
        report = process[stage]
        metric = "eval/accuracy" if stage == "rm" else "eval/mean_completion_tokens"  # pairwise / exact match
        assert report["eval_before"][0][metric] > 0 and report["eval"][1]
        _assert_trained_checkpointed_and_resumed(process, stage)


def _assert_trained_checkpointed_and_resumed(process: dict, stage: str) -> None:
    """One process's report of tests/_sharded_worker.py's ``train_twice`` for a sharded model: 2 steps with a
    checkpoint of the gathered weights and optimizer state, a resume to step 4 ending where 4 uninterrupted steps end
    (the optimizer's moments gathered whole into the checkpoint and sharded again), the final model as trained."""
    report = process[stage]
    assert report["sharded"] == [True, True]
    assert report["resumed_from"] == [None, "checkpoint-2"]
    if process["rank"] == 0:  # the main process logs the history and writes
        assert report["steps"][0] == [1, 2] and report["steps"][1][-2:] == [3, 4]
        assert report["checkpoint_files"] == ["COMPLETE", "model_state.safetensors", "optimizer.json",
                                              "optimizer.safetensors", "rng_state.json", "rng_state.safetensors",
                                              "scheduler.json", "trainer_state.json"]
        assert report["resumed_vs_checkpoint"] == 0.0
        assert report["resumed_vs_uninterrupted"] <= 1e-6
        assert report["saved_vs_trained"] == 0.0
        if stage in ("ppo", "rm"):  # the value head, the reward head
            assert report["head_vs_trained"] == 0.0
        if stage == "sft_lora":  # the adapter file holds every trained LoRA tensor
            assert report["adapter_tensors"][0] == report["adapter_tensors"][1] > 0


def test_zero3_weights_gather_a_module_at_a_time_for_the_weight_sync(tmp_path, tiny_model_dir):
    """DeepSpeed ZeRO-3 (2 CPU processes over gloo, tests/_zero3_worker.py): after one AdamW step the partitioned
    policy's weights come back whole, one module at a time, under the unsharded names (the tied LM head once),
    equal to an unsharded copy trained alike and the same on both processes; ``sharded_layout`` tells their dtypes
    and shapes without gathering; the gathered bytes alive at once are one module's; a filter picks a layer; and a
    reader that stops early still gathers the rest, so the other process is not left waiting."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (not in requirements.txt): `DS_BUILD_OPS=0 pip install deepspeed`")
    out = tmp_path / "zero3"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR="cpu")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    # the first run builds DeepSpeed's CPU communication op (~2 minutes, cached after)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_free_port()), str(REPO / "tests/_zero3_worker.py"), str(tiny_model_dir), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["processes"] == 2 and report["sharding"] == "zero3" and report["partitioned"]
        assert report["tied"] and "lm_head.weight" not in report["expected_names"]
        assert report["names"] == report["expected_names"]  # the unsharded state_dict's order, tied weights once
        assert report["loss"][0] == pytest.approx(report["loss"][1])
        assert report["trained_vs_initial"] > 5e-4  # the step moved the weights by about the learning rate
        assert report["max_diff"] < 1e-4 and report["identical_across_ranks"]
        assert report["layout"] == report["gathered_layout"]
        assert report["partitioned_after"]  # nothing left gathered
        meter = report["meter"]
        assert meter["peak"] == report["largest_module_bytes"] < report["model_bytes"] / 10
        assert meter["total"] == report["model_bytes"] and meter["live_after"] == 0
        assert report["wanted_names"] == report["wanted_expected"] == [row[0] for row in report["wanted_layout"]]
        assert len(report["wanted_names"]) == 9 and report["wanted_max_diff"] < 1e-4
        assert report["after_close"] == {"names_equal": True, "max_diff": report["max_diff"],
                                         "identical_across_ranks": True}
    assert reports[0]["early_close"]["taken"] == reports[1]["names"][:3]
    assert reports[1]["early_close"]["taken"] == reports[1]["names"]
    assert reports[0]["trained_after"] == pytest.approx(reports[1]["trained_after"])


def _needs_deepspeed() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (not in requirements.txt): `DS_BUILD_OPS=0 pip install deepspeed`")


def _accelerate_launch(launch: list[str], worker_args: list[str], out: Path) -> list[dict]:
    """tests/_sharded_worker.py started by ``accelerate launch`` on 2 CPU processes, as a user launches the trainers
    (DeepSpeed runs over gloo there; a DDP launch falls back to CPU processes)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR="cpu")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch, "--num_processes", "2",
                           "--mixed_precision", "no", "--main_process_port", str(_free_port()),
                           str(REPO / "tests/_sharded_worker.py"), *worker_args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def zero3_and_ddp(tmp_path_factory, tiny_model_dir) -> dict:
    """The worker's trainers, prepared by accelerate as launched: under DeepSpeed ZeRO-3 (the first launch builds
    DeepSpeed's CPU communication op, about 2 minutes, cached after), and the same under DDP to compare with."""
    _needs_deepspeed()
    out = tmp_path_factory.mktemp("zero3-trainers")
    runs = {}
    for name, launch in (("zero3", ["--use_deepspeed", "--zero_stage", "3"]), ("ddp", ["--multi_gpu"])):
        runs[name] = _accelerate_launch(launch, ["trainers", str(tiny_model_dir), str(out / name), "accelerate"],
                                        out / name)
    runs["out"] = out
    return runs


@pytest.mark.parametrize("stage", ["sft", "sft_lora", "rm", "dpo", "grpo", "ppo"])
def test_trainers_under_deepspeed_zero3_train_checkpoint_resume_and_match_ddp(zero3_and_ddp, stage):
    """``accelerate launch --use_deepspeed --zero_stage 3`` on 2 CPU processes: each trainer's model and optimizer
    become one DeepSpeed engine (partitioned weights, gradients and moments); it trains, evaluates in lockstep, writes
    a checkpoint of the gathered weights and of DeepSpeed's moments keyed by parameter name, resumes from it to end
    where 4 uninterrupted steps end, and saves the final model in Hugging Face layout. The same launch under DDP
    takes the same steps: its losses, gradient norms and final weights equal ZeRO-3's within float tolerance."""
    from safetensors.torch import load_file

    zero3, ddp = zero3_and_ddp["zero3"], zero3_and_ddp["ddp"]
    assert zero3[0][stage]["eval"] == zero3[1][stage]["eval"]  # both processes report the whole held-out set
    for process in zero3:  # DeepSpeed's float32 weights and moments gathered into the checkpoint, partitioned again
        _assert_trained_checkpointed_and_resumed(process, stage)
    # ZeRO-3 trains as DDP does (the same samples: each process draws as it would under DDP)
    ours, theirs = zero3[0][stage], ddp[0][stage]
    assert theirs["sharded"] == [False, False]
    for run in range(2):
        assert ours["losses"][run] == pytest.approx(theirs["losses"][run], rel=1e-4, abs=1e-6)
        assert ours["grad_norms"][run] == pytest.approx(theirs["grad_norms"][run], rel=1e-3, abs=1e-6)
    files = sorted(path.name for path in (zero3_and_ddp["out"] / "zero3" / stage).glob("*.safetensors"))
    assert files
    for name in files:
        a = load_file(str(zero3_and_ddp["out"] / "zero3" / stage / name))
        b = load_file(str(zero3_and_ddp["out"] / "ddp" / stage / name))
        # the gathered state names the tied LM head too (as FSDP2's does); the unsharded save leaves it to the tie
        assert set(a) ^ set(b) <= {"lm_head.weight"}
        # The reward head's output bias is left out: a pairwise loss's gradient for it is exactly 0 (chosen and
        # rejected share it), so Adam, which divides by the gradient's own scale, steps it on float noise alone.
        # The rest within the learning rate (1e-3), for the same reason on parameters whose gradient is about 0.
        compared = (set(a) & set(b)) - ({"2.bias"} if name == "reward_head.safetensors" else set())
        assert max(float((a[k].float() - b[k].float()).abs().max()) for k in compared) < 1e-3, name


def test_a_zero3_pipeline_builds_the_trained_models_partitioned_and_matches_ddp(tmp_path, tiny_model_dir):
    """configs/accelerate/deepspeed_zero3.yaml as shipped (zero3_init_flag on) on 2 CPU processes: each stage's model
    is built partitioned (DeepSpeed's zero.Init), its full-parameter reference loaded whole beside it, and every stage
    gets its own engine; SFT, DPO and GRPO take the steps a DDP launch takes (losses and grad norms)."""
    _needs_deepspeed()
    from test_multiprocess import run_pipeline

    zero3 = run_pipeline(tmp_path / "zero3", ["--config_file", str(REPO / "configs/accelerate/deepspeed_zero3.yaml")],
                         {"DS_ACCELERATOR": "cpu"})
    ddp = run_pipeline(tmp_path / "ddp", ["--multi_gpu"])
    log = " ".join(zero3["log"].split())  # as one line: the console wraps long ones
    assert log.count("built partitioned across 2 processes (DeepSpeed zero3_init_flag)") >= 3
    for stage in ("sft", "dpo", "grpo"):
        assert len(zero3[stage]) == 3
        for (loss, norm), (ddp_loss, ddp_norm) in zip(zero3[stage], ddp[stage]):
            assert loss == pytest.approx(ddp_loss, rel=1e-4, abs=1e-7), stage
            assert norm == pytest.approx(ddp_norm, rel=1e-3, abs=1e-6), stage


@pytest.mark.parametrize("case", ["micro_batch", "ewc"])
def test_a_deepspeed_config_that_sets_what_the_rlhf_config_decides_is_refused_in_one_line(tmp_path, case,
                                                                                          tiny_model_dir):
    """A DeepSpeed config file's micro-batch size that differs from per_device_train_batch_size (which the trainers
    use) stops the launch at the first prepare with one line naming both keys; EWC, which reads each parameter's
    gradient, is refused under DeepSpeed in one line; no traceback."""
    _needs_deepspeed()
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu":
                                  3 if case == "micro_batch" else "auto",
                                  "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}))
    stage = (["dpo", "dataset=demo_preference", "dataset_dir=data/demo", "max_samples=16", "ewc_lambda=1.0",
              "ewc_dataset=demo_sft"] if case == "ewc" else ["sft", "--config", "configs/sft.yaml"])
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
                           "--deepspeed_config_file", str(config), "--num_processes", "2", "--mixed_precision", "no",
                           "--main_process_port", str(_free_port()), str(REPO / "rlhf.py"), *stage,
                           "model_name_or_path=tiny", "max_steps=1", "per_device_train_batch_size=2",
                           f"output_dir={tmp_path / 'out'}", "report_to=none"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    expected = ("error: DeepSpeed config key 'train_micro_batch_size_per_gpu' is 3, but the rlhf config's "
                "'per_device_train_batch_size' is 2" if case == "micro_batch" else
                "error: config field 'ewc_lambda' is not supported under DeepSpeed")
    assert output.count(expected) == 2, output[-3000:]
    assert "[rank0]: Traceback" not in output


def test_trainers_under_deepspeed_zero2_resume_exactly(tmp_path, tiny_model_dir):
    """ZeRO-2 (weights whole on every process, optimizer state and gradients partitioned): each trainer's checkpoint
    holds DeepSpeed's moments keyed by parameter name, and the run resumed from step 2 saves at step 4 the files an
    uninterrupted 4-step run saves. DeepSpeed links its per-parameter views of the state after the first group's
    first step only, which left the other groups' empty (``_link_zero12_fragments``)."""
    _needs_deepspeed()
    from safetensors.torch import load_file

    _accelerate_launch(["--use_deepspeed", "--zero_stage", "2"],
                       ["trainers", str(tiny_model_dir), str(tmp_path), "accelerate"], tmp_path)
    for stage in ("sft", "sft_lora", "rm", "dpo", "grpo", "ppo"):
        files = sorted(path.name for path in (tmp_path / stage).glob("*.safetensors"))
        assert files, stage
        for name in files:
            resumed = load_file(str(tmp_path / stage / name))
            straight = load_file(str(tmp_path / f"{stage}_straight" / name))
            assert set(resumed) == set(straight)
            assert max(float((resumed[k] - straight[k]).abs().max()) for k in resumed) <= 1e-6, (stage, name)
