"""Multi-turn tool use: tool-call parsing (tags and the chat templates' JSON), the calculator, episodes turn by
turn with their token budgets, tool outputs that are never trained on (no label, zero gradient), the chat
template's own tool turns, the HTTP environment adapter, and faults: retried calls, dropped episodes, the
watchdog."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import sample_episodes

import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


# -- parsing and the calculator ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, fmt, want", [
    ("First 12 * 7 <calc>12*7</calc>", "tag", ("calculator", {"expression": "12*7"})),
    ("<calc>1+1</calc> then <calc> 2 + 3 </calc>", "tag", ("calculator", {"expression": "2 + 3"})),
    ("no call here", "tag", None),
    ("<calc>unclosed", "tag", None),
    ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>',
     "chat_template", ("calculator", {"expression": "3+4"})),
    ('{"name": "calculator", "parameters": {"expression": "9-2"}}', "chat_template",
     ("calculator", {"expression": "9-2"})),
    ("<tool_call>{not json}</tool_call>", "chat_template", None),
])
def test_parse_tool_call(text, fmt, want):
    call = rlhf.parse_tool_call(text, fmt)
    assert (None if call is None else (call.name, call.arguments)) == want


@pytest.mark.parametrize("expression, want", [
    ("12*7", "84"), ("(3 + 4) * 2 - 1", "13"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"), ("-3 + 1", "-2"),
    ("17 // 5", "3"), ("17 % 5", "2"),
])
def test_calculator_by_hand(expression, want):
    assert rlhf.calculate(expression) == want


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "1 / 0", "2 ** 1000", "1 +", "[1]"])
def test_calculator_refuses_anything_but_arithmetic(expression):
    assert rlhf.calculate(expression).startswith("error:")


def test_tool_environment_steps():
    env = rlhf.CalculatorEnvironment()
    assert env.reset({"messages": []}) is None
    assert env.step("compute <calc>6*7</calc>") == ("<result>42</result>", 0.0, False)
    assert env.step("Answer: 42") == (None, 0.0, True)
    other = rlhf.ToolEnvironment({"calculator": rlhf.calculate}, tool_format="chat_template")
    observation, _, done = other.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert observation == "error: no tool named 'search'" and not done


# -- episodes ---------------------------------------------------------------------------------------------------------


class Scripted:
    """Answers every turn with the same observation until its third turn, rewards 0.5 per step."""

    def __init__(self, observation: str = " [tool says 7] ") -> None:
        self.turns, self.observation = 0, observation

    def reset(self, record):
        return None

    def step(self, completion):
        self.turns += 1
        return (self.observation if self.turns < 3 else None), 0.5, self.turns >= 3


def scripted():
    return Scripted()


class Alternating(Scripted):
    """Scripted, with episode rewards 0, 1, 0, 1, ... in the order the episodes start, so every group of two varies."""

    started = 0

    def reset(self, record):
        self.reward, Alternating.started = float(Alternating.started % 2), Alternating.started + 1
        return super().reset(record)

    def step(self, completion):
        observation, _, done = super().step(completion)
        return observation, self.reward if done else 0.0, done


class Answering:
    """Answers every prompt for the policy: the first turn's observation is the record's answer line."""

    def reset(self, record):
        self.answer = record["answer"]
        return None

    def step(self, completion):
        if self.answer is None:
            return None, 0.0, True
        observation, self.answer = f"\nAnswer: {self.answer}\n", None
        return observation, 0.0, False


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=16)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _trainer(tmp_path: Path, model_dir: Path, dataset, eval_records=None, **overrides) -> rlhf.GRPOTrainer:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=2, per_device_train_batch_size=4, max_completion_length=40, cutoff_len=64,
                    max_steps=1, beta=0.0, learning_rate=1e-3, save_steps=0, logging_steps=1, disable_progress_bar=True,
                    report_to="none", reward_funcs=["format"], seed=0, resume_from_checkpoint="none",
                    environment="test_tools:scripted", max_turns=4, max_turn_tokens=6)
    settings.update(overrides)
    config = rlhf.GRPOConfig(**settings)
    rlhf.set_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    return rlhf.GRPOTrainer(config, policy, dataset, reward_fn=lambda p, c, a: torch.zeros(len(c)),
                            formatter=rlhf.ChatFormatter(policy.tokenizer), eval_records=eval_records)


def test_an_episode_alternates_turns_and_observations_within_its_budgets(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, max_completion_length=64)  # three turns and two answers fit
    params = trainer._sampling_params(2, 0)
    output = sample_episodes(trainer, [prompts[0], prompts[1]], params)
    observation = trainer.formatter.encode(" [tool says 7] ")
    for tokens, seen in zip(output.token_ids, output.observation_mask):
        assert len(tokens) == len(seen) <= 64
        generated_runs = [len(run) for run in _runs(seen, False)]
        assert all(run <= 6 for run in generated_runs)  # max_turn_tokens per turn
        observed = [tokens[i] for i, s in enumerate(seen) if s]
        assert observed == observation * 2  # two answers, untouched; the third step ends the episode
        assert len(_runs(seen, True)) == 2 and len(_runs(seen, False)) == 3
    assert torch.equal(output.environment_rewards, torch.full((4,), 1.5))  # three steps of 0.5 each
    assert output.metrics["tools/calls_per_episode"] == pytest.approx(2.0)


def _runs(mask: list[bool], value: bool) -> list[list[int]]:
    runs, current = [], []
    for i, m in enumerate(mask + [not value]):
        if m == value:
            current.append(i)
        elif current:
            runs, current = runs + [current], []
    return runs


def test_tool_outputs_are_never_trained_on(tmp_path, tiny_model_dir, prompts):
    """Observed tokens get no label, so the loss's gradient through them is exactly zero, as is any KL term's."""
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, beta=0.0)
    trainer.rollout_index = 0
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    output_mask = trainer._last_observation_mask if hasattr(trainer, "_last_observation_mask") else None
    assert output_mask is None
    completion = rollout.labels[:, 1:] != rlhf.IGNORE_INDEX
    # an observation's tokens sit in the completion (after the prompt) but carry no label
    for row in range(rollout.input_ids.shape[0]):
        start = int(rollout.prompt_lengths[row])
        width = int(rollout.attention_mask[row].sum())
        unlabeled = [t for t in range(start, width) if rollout.labels[row, t] == rlhf.IGNORE_INDEX]
        assert unlabeled, "every scripted episode has tool output"
    per_token = torch.randn(completion.shape, requires_grad=True)
    ref = torch.randn(completion.shape)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = rlhf.grpo_loss(per_token, None, ref, advantages, completion, beta=0.1, loss_type="dapo")
    loss.backward()
    assert torch.all(per_token.grad[~completion] == 0) and torch.any(per_token.grad[completion] != 0)


def test_a_grpo_run_with_the_calculator_and_the_chat_templates_tool_turns(tmp_path, tiny_model_dir, prompts):
    result = _trainer(tmp_path, tiny_model_dir, prompts, environment="calculator", max_steps=2).train()
    assert result.global_step == 2 and "tools/calls_per_episode" in result.history[0]
    # chat_template format: the template's own tool message closes the turn's end-of-turn text and opens the next
    trainer = _trainer(tmp_path / "ct", tiny_model_dir, prompts, tool_format="chat_template")
    record = prompts[0]
    turn = trainer.formatter.encode("Let me check.") + list(trainer.formatter.stop_token_ids[:1])
    ids = trainer.source._observation_ids(record, list(record["messages"]), turn, "7")
    assert trainer.policy.tokenizer.decode(ids) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_rloo_and_reinforce_pp_run_on_environments(tmp_path, tiny_model_dir, prompts, estimator):
    """The estimators see the episode rewards; REINFORCE++'s token-level advantages are zero on every tool token
    (its return-to-go and whitening run over the policy's own tokens only), and a run trains."""
    Alternating.started = 0
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:Alternating",
                       advantage_estimator=estimator, scale_rewards="none", max_completion_length=64)
    trainer.rollout_index = 0
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])  # Alternating's episode rewards, in the order the episodes start
    if estimator == "rloo":  # each reward minus the mean of the other one in its group of two
        assert torch.allclose(rollout.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    else:
        labelled = rollout.labels[:, 1:] != rlhf.IGNORE_INDEX
        assert rollout.advantages.shape == labelled.shape
        assert torch.all(rollout.advantages[~labelled] == 0)
        observation = trainer.formatter.encode(" [tool says 7] ")
        for row in range(4):  # each episode's tool tokens are in its completion, unlabelled
            start, width = int(rollout.prompt_lengths[row]), int(rollout.attention_mask[row].sum())
            tokens, labels = rollout.input_ids[row, start:width].tolist(), rollout.labels[row, start:width]
            assert [t for t, label in zip(tokens, labels) if label == rlhf.IGNORE_INDEX] == observation * 2
        # the whitened return of a better episode is above a worse one's on every token
        means = [float(rollout.advantages[row][labelled[row]].mean()) for row in range(4)]
        assert [m > 0 for m in means] == [bool(r) for r in rewards]
    Alternating.started = 0
    result = _trainer(tmp_path / "run", tiny_model_dir, prompts, environment="test_tools:Alternating",
                      advantage_estimator=estimator, scale_rewards="none", max_completion_length=64).train()
    assert result.global_step == 1 and "tools/calls_per_episode" in result.history[0]


@pytest.mark.parametrize("environment, informative", [("test_tools:Alternating", True), ("test_tools:scripted", False)])
def test_dynamic_sampling_keeps_the_tool_outputs_out_of_the_loss(tmp_path, tiny_model_dir, prompts, environment,
                                                                 informative):
    """DAPO's dynamic sampling over episodes: groups are judged on the environment's rewards, and the kept (or,
    when none varies, filler) completions keep their observation masks, so tool tokens stay unlabeled."""
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment=environment, dynamic_sampling=True,
                       max_sampling_rounds=2, max_completion_length=64)  # three turns and two answers fit
    trainer.rollout_index = 0
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    metrics = rollout.metrics
    assert metrics["dynamic_sampling/rounds"] == (1.0 if informative else 2.0)
    assert metrics["dynamic_sampling/filler_frac"] == (0.0 if informative else 1.0)
    for row in range(rollout.input_ids.shape[0]):
        start, width = int(rollout.prompt_lengths[row]), int(rollout.attention_mask[row].sum())
        tokens = rollout.input_ids[row, start:width].tolist()
        labels = rollout.labels[row, start:width]
        observation = trainer.formatter.encode(" [tool says 7] ")
        unlabeled = [t for t, label in zip(tokens, labels) if label == rlhf.IGNORE_INDEX]
        if informative:  # the kept completions train on their own turns only
            assert unlabeled == observation * 2
        else:  # fillers stay out of the loss entirely
            assert len(unlabeled) == len(tokens)


def test_held_out_accuracy_is_measured_through_the_environment(tmp_path, tiny_model_dir, prompts, demo_dir):
    """With an environment, eval/accuracy comes from greedy episodes (here the environment writes the answer, so
    every episode is right) and the plain greedy answers stay beside it (the untrained model's: all wrong)."""
    records = rlhf.load_records("demo_eval", demo_dir, "prompt", max_samples=5)
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, eval_records=records, environment="test_tools:Answering",
                       max_completion_length=24, per_device_eval_batch_size=2)
    trainer.step_metrics = {"kept": 1.0}
    metrics = trainer.evaluate()
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/format_rate"] == 1.0
    assert metrics["eval/tool_calls_per_episode"] == 1.0
    assert metrics["eval/accuracy_without_environment"] == 0.0
    assert trainer.step_metrics == {"kept": 1.0}  # the evaluation's episodes are not training statistics


# -- the HTTP environment ----------------------------------------------------------------------------------------------


class _Service(BaseHTTPRequestHandler):
    episodes: dict[int, int] = {}

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            episode = len(self.episodes)
            self.episodes[episode] = 0
            answer = {"episode_id": episode, "observation": None}
        else:
            self.episodes[body["episode_id"]] += 1
            done = self.episodes[body["episode_id"]] >= 2
            answer = {"observation": None if done else " ok ", "reward": 1.0, "done": done}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_http_environment_runs_episodes_and_a_dead_one_drops_them(tmp_path, tiny_model_dir, prompts):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="http", environment_url=url)
        output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))
        assert torch.equal(output.environment_rewards, torch.full((2,), 2.0))
    finally:
        server.shutdown()
        server.server_close()
    trainer = _trainer(tmp_path / "down", tiny_model_dir, prompts, environment="http", environment_url=url,
                       environment_retries=2, environment_timeout=1.0)
    output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))  # the service is gone: dropped
    assert output.failed == [True, True] and output.token_ids == [[], []]


@pytest.mark.parametrize("overrides, message", [
    ({"environment": "http"}, "environment_url' is required"),
    ({"environment": "calculator", "tool_format": "xml"}, "tool_format"),
    ({"environment": "calculator", "tool_tags": ["<calc>"]}, "need two tags each"),
])
def test_bad_environment_settings_are_one_line(overrides, message):
    with pytest.raises(rlhf.RLHFInputError, match=message):
        rlhf.GRPOConfig(reward_funcs=["format"], **overrides)


def test_an_unknown_environment_is_one_line(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="no_such_module:env")
    with pytest.raises(rlhf.RLHFInputError, match="cannot load 'no_such_module:env'"):
        sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))


def test_the_completion_budget_cuts_an_episode(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, max_completion_length=12)
    output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))
    assert all(len(t) == 12 for t in output.token_ids) and output.finish_reasons == ["length", "length"]
    assert all(seen[6:] == [True] * 6 for seen in output.observation_mask)  # the first answer, cut to fit


# -- faults: retried calls, dropped episodes and groups, the watchdog (issue 46 part 5) --------------------------------


class FailsFirstStep(Scripted):
    """Raises on the first call of its first step, then behaves: a transient fault a retry mends."""

    calls = 0

    def step(self, completion):
        FailsFirstStep.calls += 1
        if self.turns == 0 and not getattr(self, "failed_once", False):
            self.failed_once = True
            raise ConnectionError("transient")
        return super().step(completion)


class BrokenForFirstPrompt(Scripted):
    """Every step raises for episodes of the first prompt (its record says so), so they fail after every retry."""

    def reset(self, record):
        self.broken = record["prompt_ids"] == BrokenForFirstPrompt.first
        return super().reset(record)

    def step(self, completion):
        if self.broken:
            raise RuntimeError("tool crashed")
        return super().step(completion)


class Hangs(Scripted):
    def step(self, completion):
        import time

        time.sleep(Hangs.seconds)
        return super().step(completion)


def test_a_transient_environment_fault_is_retried(tmp_path, tiny_model_dir, prompts):
    FailsFirstStep.calls = 0
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:FailsFirstStep", rollout_retries=1)
    output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))
    assert output.failed == [False, False] and all(any(seen) for seen in output.observation_mask)  # answered
    assert FailsFirstStep.calls >= 2 * 2  # each episode's first step twice
    once = _trainer(tmp_path / "none", tiny_model_dir, prompts, environment="test_tools:FailsFirstStep",
                    rollout_retries=0)
    assert sample_episodes(once, [prompts[0]], once._sampling_params(2, 0)).failed == [True, True]


def test_a_failing_environment_drops_its_episodes_group_and_the_run_goes_on(tmp_path, tiny_model_dir, prompts):
    """Episodes of the first prompt fail on every try: they are counted, their group (both completions) gets no
    label, so no loss term covers them, the other group trains, and the run ends normally."""
    BrokenForFirstPrompt.first = prompts[0]["prompt_ids"]
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:BrokenForFirstPrompt",
                       rollout_retries=1, max_steps=2)
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    trained = (rollout.labels != rlhf.IGNORE_INDEX).any(-1).tolist()
    assert trained[:2] == [False, False] and trained[2:] == [True, True]
    assert rollout.metrics["rollout/failed_episodes"] == 2
    assert rollout.metrics["rollout/dropped_groups"] == 1
    result = _trainer(tmp_path / "run", tiny_model_dir, prompts, environment="test_tools:BrokenForFirstPrompt",
                      rollout_retries=1, max_steps=2).train()
    rows = [row for row in result.history if "loss" in row]
    assert result.global_step == 2 and all("rollout/failed_episodes" in row for row in rows)


def test_an_environment_call_that_times_out_is_a_fault(tmp_path, tiny_model_dir, prompts):
    Hangs.seconds = 3.0
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:Hangs", environment_timeout=0.2,
                       rollout_retries=1)
    output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))
    assert output.failed == [True, True]


def test_a_rollout_without_progress_stops_the_run_naming_what_hung(tmp_path, tiny_model_dir, prompts):
    Hangs.seconds = 30.0
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:Hangs", environment_timeout=60,
                       rollout_timeout=1.0)
    with pytest.raises(rlhf.RLHFInputError, match=r"environment 'test_tools:Hangs' \(step 1, episode 0\) made no "
                                                  r"progress for 1 s; .*raise rollout_timeout"):
        trainer.train()
    import signal

    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def _first_prompt_fails(first_prompt: str):
    def reward(prompts, completions, answers):
        if first_prompt in prompts:
            raise ValueError("scorer crashed")
        return torch.ones(len(completions))
    return reward


def test_a_reward_that_fails_on_some_completions_drops_only_their_groups(tmp_path, tiny_model_dir, prompts):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment=None)
    trainer.scorer.reward_fn = _first_prompt_fails(prompts[0]["messages"][-1]["content"])
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    trained = (rollout.labels != rlhf.IGNORE_INDEX).any(-1).tolist()
    assert trained == [False, False, True, True] and rollout.metrics["rollout/failed_episodes"] == 2
    assert rollout.metrics["reward"] == 1.0  # the scored completions' mean, not a made-up zero


def test_a_reward_that_fails_on_every_completion_stops_the_run_with_its_own_error(tmp_path, tiny_model_dir,
                                                                                  prompts):
    """Failing on every completion is a broken reward, not a fault of some calls: after the retries the run stops
    with the reward's own error (which a pipeline's rollback_on_error then handles)."""
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment=None, rollout_retries=1)
    trainer.scorer.reward_fn = lambda p, c, a: (_ for _ in ()).throw(TimeoutError("reward service timed out"))
    with pytest.raises(TimeoutError, match="reward service timed out"):
        trainer.train()


def test_an_environment_that_fails_every_episode_stops_the_run_with_one_line(tmp_path, tiny_model_dir, prompts):
    BrokenForFirstPrompt.first = prompts[0]["prompt_ids"]
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment="test_tools:BrokenForFirstPrompt",
                       rollout_retries=0)
    with pytest.raises(rlhf.RLHFInputError, match="every episode of rollout 0 failed in its environment"):
        trainer.make_rollout([prompts[0], prompts[0]])


def test_a_stage_that_cannot_drop_completions_stops_with_one_line(tmp_path, tiny_model_dir, prompts, monkeypatch):
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, environment=None, rollout_retries=0)
    monkeypatch.setattr(trainer.scorer, "drops_failed", False)
    trainer.scorer.reward_fn = _first_prompt_fails(prompts[0]["messages"][-1]["content"])
    with pytest.raises(rlhf.RLHFInputError, match="failed on 2 completions after 1 attempts each.*cannot leave"):
        trainer.make_rollout([prompts[0], prompts[1]])


def test_bad_fault_settings_are_one_line():
    with pytest.raises(rlhf.RLHFInputError, match="rollout_retries >= 0"):
        rlhf.GRPOConfig(reward_funcs=["format"], rollout_retries=-1)


# -- learning to call the calculator -----------------------------------------------------------------------------------

# the tool-use demo's calculator (experiments/configs/demo_tools.yaml): a turn stops at `>>`, the tool's answer
# follows as ` = 19`; two turns are a call and the answer line
CALCULATOR = dict(environment="calculator", tool_tags=["<<", ">>"], tool_result_tags=[" = ", ""], max_turns=2)


class CalculatorAnswered:
    """1 when the calculator answered one of the episode's calls with a number: a turn stops at the closing tag, so
    what follows `>>` is the tool's; a malformed call gets no answer or an `error:` one."""

    __name__ = "calculator_answered"

    def __call__(self, prompts, completions, answers):
        return torch.tensor([float(re.search(r">> = -?\d", c) is not None) for c in completions])


def train_calculator_caller(out: Path, model_dir: Path, demo_dir: Path) -> Path:
    """The tiny model after 40 SFT steps on the tool demonstrations (`Step 1: <<31 - 2>> = 29`): it has the call
    format half learned, so about half its sampled episodes get a number from the calculator, which GRPO can raise
    within a test. The demo's own reward, exact_answer, needs the demo's full SFT: this model is right about 1% of
    the time, too rarely for a run of this length to learn from."""
    rlhf.train_sft(rlhf.SFTConfig(model_name_or_path=str(model_dir), dataset="demo_tool_sft", dataset_dir=str(demo_dir),
                                  cutoff_len=128, finetuning_type="full", per_device_train_batch_size=16, max_steps=40,
                                  learning_rate=3e-3, lr_scheduler_type="constant", save_steps=0,
                                  disable_progress_bar=True, report_to="none", output_dir=str(out),
                                  resume_from_checkpoint="none"))
    return out


def calculator_rows(tmp_path: Path, model_dir: Path, demo_dir: Path, **overrides) -> list[dict]:
    """The logged steps of 30 GRPO steps with the calculator on the demo's tool prompts, rewarded by
    CalculatorAnswered."""
    tokenizer = rlhf.load_tokenizer(model_dir)
    records = rlhf.load_records("demo_tool_rl", demo_dir, "prompt", max_samples=256)
    dataset = rlhf.GRPODataset(records, tokenizer, rlhf.ChatFormatter(tokenizer), cutoff_len=128)
    # auto would decide by timing whether compiling the decode step pays; static keeps the run's length independent
    # of the machine's load (the samples are the same either way)
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=8, per_device_train_batch_size=32, max_completion_length=32, cutoff_len=128,
                    max_steps=30, beta=0.0, learning_rate=5e-4, lr_scheduler_type="constant", save_steps=0,
                    logging_steps=1, disable_progress_bar=True, report_to="none", reward_funcs=["format"], seed=0,
                    resume_from_checkpoint="none", generation_engine="static", **CALCULATOR)
    settings.update(overrides)
    config = rlhf.GRPOConfig(**settings)
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    result = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=CalculatorAnswered(),
                              formatter=rlhf.ChatFormatter(policy.tokenizer)).train()
    return [row for row in result.history if "loss" in row]


def first_and_last_rewards(rows: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and of the last five steps."""
    rewards = [row["reward"] for row in rows]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@pytest.fixture(scope="module")
def calculator_caller(tmp_path_factory, tiny_model_dir, demo_dir) -> Path:
    return train_calculator_caller(tmp_path_factory.mktemp("calculator-caller"), tiny_model_dir, demo_dir)


def test_grpo_learns_to_call_the_calculator(tmp_path, calculator_caller, demo_dir):
    """The share of episodes the calculator answers rises from about half to about 0.9: over seeds 0-3 with either
    engine the first five steps averaged 0.47-0.68 and the last five 0.81-0.95, so a rise of 0.1 to above 0.75
    leaves room for other machines' arithmetic (test_vllm.py runs the same with vLLM)."""
    rows = calculator_rows(tmp_path, calculator_caller, demo_dir)
    first, last = first_and_last_rewards(rows)
    assert last > first + 0.1 and last > 0.75, [row["reward"] for row in rows]
    assert all(row["tools/calls_per_episode"] > 0 for row in rows)
