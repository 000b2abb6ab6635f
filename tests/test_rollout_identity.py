"""Moving rollout collection into its own section (issue 54) changed no sample, seed or result: short runs of every
online trainer and episode source (the demo GRPO with a reference and two iterations, dynamic sampling, a low-precision
engine copy, the calculator environment, the calculator agent as one trajectory and per call, online DPO, PPO and
distillation) write the metrics.jsonl they wrote before the move, figure for figure (timings aside).

The figures were recorded before the move with ``python tests/test_rollout_identity.py --record`` (and are
re-recorded only where a change means to alter sampling or training, saying why in its commit). They are exact on
the versions they were recorded with; with other releases of torch or transformers the same run may round
differently, so there they are compared within 1e-4."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import rlhf  # noqa: E402

RECORD = REPO / "tests" / "data" / "rollout_identity.json"
TIMING = ("perf/", "time", "_s")  # wall-clock figures differ run to run

COMMON = dict(finetuning_type="full", dataset="demo_rl", dataset_dir=str(REPO / "data" / "demo"), max_samples=32,
              cutoff_len=96, max_completion_length=24, learning_rate=1e-3, logging_steps=1, save_steps=0,
              disable_progress_bar=True, report_to="none", seed=0, resume_from_checkpoint="none", max_steps=3,
              generation_engine="static", eval_steps=0, plot_loss=False)
# the untrained model's completions score alike on exact answers: the length reward makes every run train
GRPO = dict(COMMON, reward_funcs=["length", "format"], length_target_chars=40, num_generations=4,
            per_device_train_batch_size=8)
CALCULATOR = dict(GRPO, dataset="demo_tool_rl", reward_funcs=["exact_answer", "length"], environment="calculator",
                  tool_tags=["<<", ">>"], tool_result_tags=[" = ", ""], max_turns=3, max_turn_tokens=8, beta=0.0)


class ThreeTurns(rlhf.ToolEnvironment):
    """Answers every turn until max_turns (the untrained model writes no calculator call): multi-turn episodes."""

    def __init__(self) -> None:
        super().__init__({})
        self.turns = 0

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        self.turns += 1
        return f" <result>{len(completion)}</result>", 0.1 * self.turns, False


def three_turns() -> ThreeTurns:
    return ThreeTurns()


RUNS = {
    "grpo": ("grpo", dict(GRPO, beta=0.04, num_iterations=2, eval_dataset="demo_multistep")),
    "grpo_dynamic_sampling": ("grpo", dict(GRPO, beta=0.0, dynamic_sampling=True, max_sampling_rounds=2)),
    "grpo_fp16_copy": ("grpo", dict(GRPO, beta=0.0, rollout_dtype="fp16")),
    "reinforce_pp": ("reinforce_pp", dict(GRPO)),
    "calculator_environment": ("grpo", dict(CALCULATOR, eval_dataset="demo_tool_multistep")),
    "three_turn_environment": ("grpo", dict(CALCULATOR, environment="test_rollout_identity:three_turns",
                                            reward_funcs=["length"], eval_dataset="demo_tool_multistep")),
    "calculator_agent": ("grpo", dict(CALCULATOR, environment="agent", reward_funcs=[],
                                      agent="experiments.agents.calculator_agent:solve")),
    "two_call_agent": ("grpo", dict(GRPO, beta=0.0, environment="agent", reward_funcs=["length"],
                                    agent="test_agents:two_call_agent")),
    "two_call_agent_per_call": ("grpo", dict(GRPO, beta=0.0, environment="agent", reward_funcs=["length"],
                                             agent="test_agents:two_call_agent", agent_trajectory="per_call")),
    "online_dpo": ("online_dpo", dict(COMMON, reward_funcs=["length"], length_target_chars=40,
                                      per_device_train_batch_size=4)),
    "ppo": ("ppo", dict(COMMON, reward_funcs=["length"], length_target_chars=40, per_device_train_batch_size=4,
                        ppo_epochs=2, max_steps=4)),
    "distill": ("distill", dict(COMMON, dataset="demo_sft", per_device_train_batch_size=4, lmbda=0.5, max_steps=4)),
}


def run(name: str, model_dir: Path, output_dir: Path) -> list[dict]:
    """One short run; its metrics.jsonl rows without the timings."""
    stage, settings = RUNS[name]
    settings = dict(settings, model_name_or_path=str(model_dir), output_dir=str(output_dir))
    if stage == "distill":
        settings["teacher_model"] = str(model_dir)
    config = rlhf.STAGES[stage].config(**settings)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rlhf.STAGES[stage].runner(config)
    finally:
        torch.set_num_threads(previous)
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in rows]


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_writes_the_metrics_it_wrote_before_the_move(name, recorded, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("openai", reason="the agent runs need the openai package (requirements-dev.txt)")
    monkeypatch.chdir(REPO)  # the agent is named module:function from the repository
    monkeypatch.syspath_prepend(str(REPO))
    rows = run(name, tiny_model_dir, tmp_path / name)
    want = recorded["runs"][name]
    exact = recorded["versions"] == _versions()
    assert [sorted(r) for r in rows] == [sorted(r) for r in want]
    for step, (got, expected) in enumerate(zip(rows, want)):
        for key, value in expected.items():
            if exact or not isinstance(value, float):
                assert got[key] == value, f"{name} row {step} {key}: {got[key]!r} != {value!r}"
            else:
                assert math.isclose(got[key], value, rel_tol=1e-4, abs_tol=1e-4), f"{name} row {step} {key}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_rollout_identity.py --record   (rewrites " + str(RECORD) + ")")
    import os
    import tempfile

    os.chdir(REPO)
    from conftest import inference_optimizations  # noqa: F401  (the tests' CPU kernels and thread count)

    model = rlhf.build_tiny_model()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in RUNS:
            runs[name] = run(name, model, Path(scratch) / name)
            print(name, len(runs[name]), "rows")
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"versions": _versions(), "runs": runs}, indent=1) + "\n")
