"""Agent programs through the OpenAI-compatible endpoint (environment: agent, issue 46 part 4): agents written
against the ``openai`` package call the policy, their requests are sampled in batches by the rollout engine and
recorded, each episode becomes one trajectory (sampled tokens trained, the agent's additions observed) with the
agent's reward, the behaviour log-probs are the policy's own, and faults drop episodes instead of the run."""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

import pytest
import torch
from conftest import sample_episodes

import rlhf

openai = pytest.importorskip("openai", reason="the agent tests need the openai package (requirements-dev.txt)")
pytestmark = pytest.mark.usefixtures("one_thread")

CALLS: list[dict] = []  # what the test agents saw, for the assertions


def two_call_agent(client, record):
    """Asks, reads a tool result the agent writes itself, asks again: two requests, one concatenated trajectory."""
    messages = list(record["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "<result>7</result>"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
    CALLS.append({"first": first, "second": second, "thread": threading.current_thread().name})
    return float(len(second.choices[0].message.content or ""))


def calculator_agent(client, record):
    """A small agent: it lets the model call the calculator with <calc>...</calc> and returns 1.0 when the final
    answer holds the record's answer."""
    messages = list(record["messages"])
    text = ""
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, stop=["</calc>"])
        text = reply.choices[0].message.content or ""
        call = rlhf.parse_tool_call(text + "</calc>" if "<calc>" in text else text, "tag")
        if call is None:
            break
        messages += [{"role": "assistant", "content": text + "</calc>"},
                     {"role": "user", "content": f"<result>{rlhf.calculate(call.arguments['expression'])}</result>"}]
    return float(str(record.get("answer")) in text)


def failing_agent(client, record):
    if "7" in record["messages"][-1]["content"]:
        raise RuntimeError("the agent's tool crashed")
    return two_call_agent(client, record)


def raw_completion_agent(client, record):
    reply = client.completions.create(model="policy", prompt="Q: 2 + 2 =", max_tokens=4)
    CALLS.append({"completion": reply, "models": [m.id for m in client.models.list()]})
    return 0.5


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer, demo_dir) -> rlhf.GRPODataset:
    records = rlhf.load_records("demo_rl", demo_dir, "prompt", max_samples=16)
    return rlhf.GRPODataset(records, tiny_tokenizer, rlhf.ChatFormatter(tiny_tokenizer), cutoff_len=64)


def _trainer(tmp_path: Path, model_dir: Path, dataset, **overrides) -> rlhf.GRPOTrainer:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path / "out"), finetuning_type="full",
                    num_generations=2, per_device_train_batch_size=4, max_completion_length=48, cutoff_len=64,
                    max_steps=1, beta=0.0, learning_rate=1e-3, save_steps=0, logging_steps=1, disable_progress_bar=True,
                    report_to="none", seed=0, resume_from_checkpoint="none", environment="agent",
                    agent="test_agents:two_call_agent", max_turns=4, generation_engine="static")
    settings.update(overrides)
    config = rlhf.GRPOConfig(**settings)
    rlhf.set_seed(0)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    return rlhf.GRPOTrainer(config, policy, dataset, reward_fn=rlhf.RewardFunctionFactory(config, "cpu").build(),
                            formatter=rlhf.ChatFormatter(policy.tokenizer))


def test_an_openai_agent_makes_one_trajectory_per_episode_with_the_policys_log_probs(tmp_path, tiny_model_dir,
                                                                                      prompts):
    """Two requests per episode through openai.OpenAI: the trajectory is the first prompt, the first answer as
    sampled, the agent's added turn (observed), the second answer; the recorded log-probs are the policy's own
    (our engine samples the policy itself) and the agent's reward is the episode's."""
    CALLS.clear()
    trainer = _trainer(tmp_path, tiny_model_dir, prompts)
    try:
        output = sample_episodes(trainer, [prompts[0], prompts[1]], trainer._sampling_params(2, 0))
    finally:
        trainer.close_rollouts()
    assert len(CALLS) == 4 and output.failed == [False] * 4
    assert all(c["thread"].startswith("rlhf-agent") for c in CALLS)
    assert output.metrics["tools/calls_per_episode"] == 2
    tokenizer = trainer.policy.tokenizer
    for i, (record, ids, logps, seen) in enumerate(zip(output.records, output.token_ids, output.logprobs,
                                                        output.observation_mask)):
        assert record["prompt_ids"] == prompts[i // 2]["prompt_ids"]  # the agent sent the record's own messages
        observed = tokenizer.decode([t for t, o in zip(ids, seen) if o])
        assert "<result>7</result>" in observed and sum(not o for o in seen) <= 6 + 5
        # the behaviour log-probs are the policy's, at the run's temperature, token by token
        full = torch.tensor([record["prompt_ids"] + ids])
        with torch.no_grad():
            logits = trainer.policy.model(full).logits[0, len(record["prompt_ids"]) - 1:-1].float()
        mine = torch.log_softmax(logits / trainer.config.temperature, -1).gather(-1, full[0, len(
            record["prompt_ids"]):, None])[:, 0]
        sampled = torch.tensor([not o for o in seen])
        torch.testing.assert_close(torch.tensor(logps)[sampled], mine[sampled], rtol=0, atol=1e-4)
    # the agents' rewards, and the OpenAI answer's own log-probs match the recorded ones
    lengths = sorted(float(len(c["second"].choices[0].message.content or "")) for c in CALLS)
    assert sorted(output.environment_rewards.tolist()) == lengths
    answer = CALLS[0]["second"].choices[0]
    assert answer.finish_reason in ("stop", "length") and len(answer.logprobs.content) >= 1


def test_a_grpo_run_trains_on_agent_episodes(tmp_path, tiny_model_dir, prompts):
    """The run end to end: rollouts from agents, the sampled tokens trained, the agent's additions never."""
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent="test_agents:calculator_agent", max_steps=2,
                       per_device_train_batch_size=8, num_generations=4)
    rollout = trainer.make_rollout([prompts[0], prompts[1]])
    trainer.close_rollouts()
    assert rollout.input_ids.shape[0] == 8 and (rollout.labels != rlhf.IGNORE_INDEX).any()
    result = _trainer(tmp_path / "run", tiny_model_dir, prompts, agent="test_agents:calculator_agent", max_steps=2,
                      per_device_train_batch_size=8, num_generations=4).train()
    rows = [row for row in result.history if "loss" in row]
    assert result.global_step == 2 and all("tools/calls_per_episode" in row for row in rows)


def test_a_failing_agent_drops_its_episodes_and_the_run_goes_on(tmp_path, tiny_model_dir, prompts):
    failing = next(i for i in range(len(prompts)) if "7" in prompts[i]["messages"][-1]["content"])
    working = next(i for i in range(len(prompts)) if "7" not in prompts[i]["messages"][-1]["content"])
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent="test_agents:failing_agent", rollout_retries=1)
    try:
        rollout = trainer.make_rollout([prompts[failing], prompts[working]])
    finally:
        trainer.close_rollouts()
    trained = (rollout.labels != rlhf.IGNORE_INDEX).any(-1).tolist()
    assert trained == [False, False, True, True] and rollout.metrics["rollout/failed_episodes"] == 2


def test_the_completions_endpoint_and_the_models_list(tmp_path, tiny_model_dir, prompts):
    CALLS.clear()
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent="test_agents:raw_completion_agent")
    try:
        output = sample_episodes(trainer, [prompts[0]], trainer._sampling_params(2, 0))
        client = openai.OpenAI(base_url=trainer.source.endpoint.base_url(0), api_key="x", max_retries=0)
        for request in (client.models.list, functools.partial(client.chat.completions.create, model="policy",
                                                              messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(openai.AuthenticationError, match="episode 0 is not running"):  # the rollout is over
                request()
    finally:
        trainer.close_rollouts()
    assert output.failed == [False, False] and len(CALLS) == 2
    assert CALLS[0]["models"] == ["policy"]
    reply = CALLS[0]["completion"].choices[0]
    assert reply.finish_reason in ("stop", "length") and isinstance(reply.text, str)
    assert trainer.policy.tokenizer.decode(output.records[0]["prompt_ids"]) == "Q: 2 + 2 ="


def test_concatenated_trajectory_marks_the_agents_additions_and_refuses_a_rewritten_history():
    def call(ids, sampled, logps):
        return rlhf.AgentCall(0, ids, 8, (), token_ids=sampled, logprobs=logps)

    calls = [call([1, 2], [5, 6], [-0.5, -0.25]), call([1, 2, 5, 6, 7, 7], [8], [-1.0])]
    prompt, tokens, logps, observed = rlhf.concatenated_trajectory(calls)
    assert prompt == [1, 2] and tokens == [5, 6, 7, 7, 8]
    assert logps == [-0.5, -0.25, 0.0, 0.0, -1.0] and observed == [False, False, True, True, False]
    with pytest.raises(ValueError, match="request 2 does not begin with request 1's prompt and answer"):
        rlhf.concatenated_trajectory([calls[0], call([1, 2, 5, 9], [8], [-1.0])])


def test_bad_agent_settings_are_one_line():
    with pytest.raises(rlhf.RLHFInputError, match="'agent' is required with environment: agent"):
        rlhf.GRPOConfig(environment="agent")
    with pytest.raises(rlhf.RLHFInputError, match="dynamic_sampling"):
        rlhf.GRPOConfig(environment="agent", agent="m:f", dynamic_sampling=True)


def test_the_demo_agent_is_the_tool_demo_with_an_agent_program(tmp_path, tiny_model_dir, prompts, monkeypatch):
    """experiments/configs/demo_agent.yaml differs from demo_tools.yaml's GRPO only in how the calculator is run,
    and its agent (experiments/agents/calculator_agent.py) plays episodes on the endpoint without a fault."""
    import dataclasses

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    monkeypatch.syspath_prepend(str(repo))
    agent = rlhf.PipelineConfig.load("experiments/configs/demo_agent.yaml").stage_config("grpo")
    tools = rlhf.PipelineConfig.load("experiments/configs/demo_tools.yaml").stage_config("grpo")
    differ = {f.name for f in dataclasses.fields(agent) if getattr(agent, f.name) != getattr(tools, f.name)}
    assert differ == {"environment", "agent", "reward_funcs", "tool_tags", "tool_result_tags", "output_dir",
                      "logging_dir"}
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent=agent.agent, max_completion_length=24)
    try:
        output = sample_episodes(trainer, [prompts[0], prompts[1]], trainer._sampling_params(2, 0))
    finally:
        trainer.close_rollouts()
    assert output.failed == [False] * 4 and all(ids for ids in output.token_ids)


def test_per_call_makes_each_request_a_row_with_its_episodes_advantage(tmp_path, tiny_model_dir, prompts):
    """agent_trajectory: per_call: two requests per episode are two rows, each trained on its own answer under the
    prompt the agent sent, both with the episode's advantage; the schedule still fills one optimizer step."""
    CALLS.clear()
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent_trajectory="per_call", reward_funcs=["length"])
    try:
        rollout = trainer.make_rollout([prompts[0], prompts[1]])
    finally:
        trainer.close_rollouts()
    assert rollout.input_ids.shape[0] == 8 and rollout.metrics["tools/trained_rows"] == 8
    assert torch.equal(rollout.advantages[0::2], rollout.advantages[1::2])  # an episode's two rows
    assert (rollout.labels != rlhf.IGNORE_INDEX).any(-1).all()
    second = rollout.input_ids[1][rollout.attention_mask[1].bool()].tolist()
    assert "<result>7</result>" in trainer.policy.tokenizer.decode(second)  # its prompt holds the agent's turn
    assert len(trainer.rollout_schedule(rollout)) == 1  # one micro-batch (accumulation 1) of all 8 rows
    result = _trainer(tmp_path / "run", tiny_model_dir, prompts, agent_trajectory="per_call", max_steps=2,
                      per_device_train_batch_size=2, gradient_accumulation_steps=2).train()
    assert result.global_step == 2


def test_per_call_refuses_reinforce_pp():
    with pytest.raises(rlhf.RLHFInputError, match="agent_trajectory"):
        rlhf.GRPOConfig(environment="agent", agent="m:f", agent_trajectory="per_call",
                        advantage_estimator="reinforce_pp")


# -- the agent example's learning curve --------------------------------------------------------------------------------


def calculator_use_agent(client, record):
    """The tool demo's calculator as an agent on the completions API (experiments/agents/calculator_agent.py's loop,
    two requests at most): 1 when the calculator answered one of its calls with a number, the reward
    test_tools.CalculatorAnswered gives the environment's episodes."""
    written = ""
    for _ in range(2):
        reply = client.completions.create(model="policy", prompt=record["prompt_text"] + written, stop=[">>"],
                                          max_tokens=32)
        choice = reply.choices[0]
        written += choice.text
        if getattr(choice, "stop_reason", None) != ">>" or "<<" not in choice.text:
            break  # not a call: the end of the answer (vLLM's stop_reason says which stop ended it)
        written += ">> = " + rlhf.calculate(choice.text[choice.text.rfind("<<") + 2:])
    return float(re.search(r">> = -?\d", written) is not None)


@pytest.fixture(scope="module")
def calculator_caller(tmp_path_factory, tiny_model_dir, demo_dir) -> Path:
    from test_tools import train_calculator_caller

    return train_calculator_caller(tmp_path_factory.mktemp("calculator-caller"), tiny_model_dir, demo_dir)


def test_grpo_on_an_agent_program_learns_to_call_the_calculator(tmp_path, calculator_caller, demo_dir):
    """test_tools.py's calculator learning run with the calculator run by an agent program through the endpoint
    instead of an environment, the agent's reward the only one. Token in, token out and batches in episode order
    make it the same run: step for step the same rewards, until an episode whose call ended inside a token (`>>`
    and more in one token, so the agent's text cannot extend the sampled one) is dropped, about one in 300; the
    share of episodes the calculator answered rises as there (0.41 to about 0.9 over 30 steps)."""
    from test_tools import CALCULATOR, calculator_rows

    tokenizer = rlhf.load_tokenizer(calculator_caller)
    records = rlhf.load_records("demo_tool_rl", demo_dir, "prompt", max_samples=256)
    dataset = rlhf.GRPODataset(records, tokenizer, rlhf.ChatFormatter(tokenizer), cutoff_len=128)
    config = rlhf.GRPOConfig(model_name_or_path=str(calculator_caller), output_dir=str(tmp_path / "out"),
                             finetuning_type="full", num_generations=8, per_device_train_batch_size=32,
                             max_completion_length=32, cutoff_len=128, max_steps=30, beta=0.0, learning_rate=5e-4,
                             lr_scheduler_type="constant", save_steps=0, logging_steps=1, disable_progress_bar=True,
                             report_to="none", seed=0, resume_from_checkpoint="none", generation_engine="static",
                             environment="agent", agent="test_agents:calculator_use_agent",
                             max_turns=CALCULATOR["max_turns"])
    rlhf.set_seed(config.seed)
    policy = rlhf.PolicyModel.from_pretrained(config.model_name_or_path)
    result = rlhf.GRPOTrainer(config, policy, dataset, reward_fn=rlhf.no_reward,
                              formatter=rlhf.ChatFormatter(policy.tokenizer)).train()
    rows = [row for row in result.history if "loss" in row]
    rewards = [row["reward"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1 and last > 0.75, rewards
    assert sum(row["rollout/failed_episodes"] for row in rows) <= 10 and all(row["tools/calls_per_episode"] > 0
                                                                           for row in rows)
    environment = calculator_rows(tmp_path / "environment", calculator_caller, demo_dir, max_steps=5)
    same = min(5, next((i for i, row in enumerate(rows) if row["rollout/failed_episodes"]), 5))
    assert [round(r, 5) for r in rewards[:same]] == [round(row["reward"], 5) for row in environment[:same]]
