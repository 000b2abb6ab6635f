"""Section 9, Rollouts: each part on its own, without a trainer (issue 54 part 1). The registries' rows, the prompt
stream, the seeds, the synced engine, the schedulers (on-policy and sampling ahead), the episode sources, the scorer
and retry-then-drop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the registries: every row documented and picked by a config value ------------------------------------------------


def _picking_configs() -> list:
    return [rlhf.GRPOConfig(reward_funcs=["format"]),
            rlhf.GRPOConfig(reward_funcs=["format"], environment="calculator"),
            rlhf.GRPOConfig(environment="agent", agent="experiments.agents.calculator_agent:solve")]


def test_every_episode_source_is_documented_and_picked_by_a_config_value():
    picked = {rlhf.episode_source_name(config) for config in _picking_configs()}
    for name, cls in rlhf.EPISODE_SOURCES.items():
        assert (cls.__doc__ or "").strip(), f"episode source {name} has no docstring"
        assert isinstance(cls.__new__(cls), rlhf.EpisodeSource), name  # the protocol's members
        assert name in picked or rlhf.episode_source_name(SimpleNamespace(episode_source=name)) == name
    assert picked == set(rlhf.BUILT_IN_EPISODE_SOURCES) <= set(rlhf.EPISODE_SOURCES)
    for config in _picking_configs():  # naming the source the environment implies is the same config
        named = rlhf.GRPOConfig(**{**{k: getattr(config, k) for k in ("reward_funcs", "environment", "agent")},
                                   "episode_source": rlhf.episode_source_name(config)})
        assert rlhf.episode_source_name(named) == rlhf.episode_source_name(config)


def test_every_rollout_scheduler_is_documented_and_picked_by_a_config_value():
    for name, cls in rlhf.ROLLOUT_SCHEDULERS.items():
        assert (cls.__doc__ or "").strip(), f"rollout scheduler {name} has no docstring"
        assert rlhf.rollout_scheduler_name(SimpleNamespace(rollout_scheduler=name, max_staleness=1)) == name
    assert rlhf.rollout_scheduler_name(rlhf.GRPOConfig(reward_funcs=["format"])) == "sync"
    assert rlhf.rollout_scheduler_name(SimpleNamespace(rollout_scheduler="auto", max_staleness=2)) == \
        "bounded_staleness"
    for name, builder in rlhf.ROLLOUT_ENGINES.items():
        assert (builder.__doc__ or "").strip(), f"rollout engine {name} has no docstring"


@pytest.mark.parametrize("settings, message", [
    ({"episode_source": "nope"}, "'episode_source' is 'nope'; valid: auto, single_turn"),
    ({"episode_source": "agent_program"}, "does not go with environment None"),
    ({"rollout_scheduler": "nope"}, "'rollout_scheduler' is 'nope'"),
    ({"rollout_scheduler": "bounded_staleness"}, "set max_staleness >= 1"),
])
def test_a_source_or_scheduler_that_cannot_run_is_one_line(settings, message):
    with pytest.raises(rlhf.RLHFInputError, match=message):
        rlhf.GRPOConfig(reward_funcs=["format"], **settings)


def test_a_registered_source_is_picked_by_its_name():
    @rlhf.register_episode_source("echo")
    class Echo(rlhf.SingleTurnSource):
        """Echoes."""

    try:
        config = rlhf.GRPOConfig(reward_funcs=["format"], episode_source="echo")
        assert rlhf.EPISODE_SOURCES[rlhf.episode_source_name(config)] is Echo
    finally:
        rlhf.EPISODE_SOURCES.pop("echo")


# -- prompts and seeds -------------------------------------------------------------------------------------------------


def test_a_rollouts_prompts_are_a_function_of_its_index():
    items = [{"prompt_ids": [i]} for i in range(10)]
    stream = rlhf.PromptStream(items, 4, seed=3)
    batches = stream.batches(0)
    first = [next(batches) for _ in range(7)]
    assert [b.index for b in first] == list(range(7))
    assert all(len(b.prompts) == 4 for b in first)  # an epoch's short last batch is filled with its own prompts
    assert first[2].positions == first[2].positions[:2] * 2
    assert sorted(p for b in first[:3] for p in set(b.positions)) == list(range(10))  # one epoch: each prompt once
    again = next(rlhf.PromptStream(items, 4, seed=3).batches(5))  # a resume draws what the first run drew
    assert again.index == 5 and again.positions == first[5].positions
    assert stream.epoch(3) == 1.0


def test_lookahead_hands_each_batch_the_next_ones():
    batches = [rlhf.PromptBatch(i, []) for i in range(4)]
    seen = [(b.index, [u.index for u in upcoming]) for b, upcoming in rlhf.with_lookahead(iter(batches), 2)]
    assert seen == [(0, [1, 2]), (1, [2, 3]), (2, [3]), (3, [])]
    assert [(b.index, u) for b, u in rlhf.with_lookahead(iter(batches), 0)] == [(i, []) for i in range(4)]


def test_the_seed_formulas_are_the_ones_a_resume_relies_on():
    assert rlhf.rollout_seed(7, 3) == 7 * 1_000_003 + 3
    assert rlhf.rollout_seed(7, 3, rlhf.ROLLOUT_SEED_SALTS["sampling"], 1) == (7 * 1_000_003 + 3) * 1009 + 1
    assert rlhf.turn_seed(10, 2) == 10 + 2 * 7919 and rlhf.turn_seed(None, 2) is None
    assert rlhf.buffer_order_seed(7, 3) == 7 * 1_000_003 + 303
    config = rlhf.GRPOConfig(reward_funcs=["format"], seed=7)
    one = rlhf.rollout_sampling_params(config, 4, 3, rank=0, world_size=1, stop_token_ids=[2], suppress_token_ids=[])
    two = rlhf.rollout_sampling_params(config, 4, 3, rank=1, world_size=2, stop_token_ids=[2], suppress_token_ids=[])
    assert one.seed is None  # one process, our engine: torch's RNG, restored by a resume
    assert two.seed == rlhf.rollout_seed(7, 3, 1009, 1) and two.n == 4 and two.stop_token_ids == (2,)


# -- the synced engine and the schedulers ------------------------------------------------------------------------------


class CopyEngine:
    """A fake engine holding a copy: records its syncs, answers each prompt with its own ids plus the version."""

    holds_weights, shared, takes_images = True, False, False

    def __init__(self) -> None:
        self.versions, self.version, self.calls, self.slept, self.closed = [], None, [], 0, False

    def sample(self, prompts, params, images=None):
        self.calls.append((threading.current_thread().name, [list(p) for p in prompts], params.seed))
        time.sleep(0.01)
        return io.GenerationOutput([list(p) + [self.version or 0] for p in prompts for _ in range(params.n)],
                                   [[-1.0] * (len(p) + 1) for p in prompts for _ in range(params.n)],
                                   ["stop"] * len(prompts) * params.n,
                                   [i for i in range(len(prompts)) for _ in range(params.n)],
                                   policy_version=self.version)

    def sync_weights(self, weights):
        self.versions.append(weights.version)
        self.version = weights.version

    def sleep(self):
        self.slept += 1

    def close(self):
        self.closed = True


def _synced(engine: CopyEngine, step: list[int]) -> rlhf.SyncedEngine:
    weights = SimpleNamespace(sharded=False, meter=None,
                              weights=lambda: io.PolicyWeights(step[0], lambda: iter(())))
    return rlhf.SyncedEngine(lambda: engine, weights, rlhf.DeviceManager())


def _params(n: int, index: int) -> io.SamplingParams:
    return io.SamplingParams(n=n, seed=1000 + index, max_new_tokens=4)


def test_the_synced_engine_starts_once_and_syncs_once_per_step():
    engine, step = CopyEngine(), [0]
    synced = _synced(engine, step)
    assert not synced.holds_weights and synced.engine is None
    assert synced.at(0) is engine and synced.at(0) is engine and engine.versions == [0]
    step[0] = 3
    synced.at(3)
    assert engine.versions == [0, 3] and "perf/weight_sync_s" in synced.pop_metrics() and not synced.pop_metrics()
    synced.close()
    assert engine.closed and synced.engine is None and synced.step == -1


def test_the_sync_scheduler_samples_on_policy_and_lets_the_engine_sleep():
    engine, step = CopyEngine(), [0]
    source = rlhf.SingleTurnSource(None, None, None)
    scheduler = rlhf.SyncScheduler(SimpleNamespace(), source, _synced(engine, step), _params)
    prompts = [{"prompt_ids": [5, 6]}, {"prompt_ids": [7]}]
    watched = []
    episodes = scheduler.sample(prompts, 2, 0, 0, watched.append)
    assert episodes.token_ids == [[5, 6, 0], [5, 6, 0], [7, 0], [7, 0]]
    assert episodes.records == [prompts[0], prompts[0], prompts[1], prompts[1]] and episodes.failed == [False] * 4
    assert engine.calls[0][2] == 1000 and engine.slept == 1 and watched == ["the rollout engine (CopyEngine)"]
    assert "perf/weight_sync_s" in episodes.metrics and episodes.policy_version == 0


def test_the_bounded_staleness_scheduler_samples_ahead_and_drops_what_is_too_old():
    """k = 1: rollout 1 is sent off with step 0's weights while step 0 trains, and trained at step 1 (staleness 1);
    a rollout that waited longer than k steps is dropped and sampled again."""
    engine, step = CopyEngine(), [0]
    scheduler = rlhf.BoundedStalenessScheduler(SimpleNamespace(max_staleness=1), rlhf.SingleTurnSource(None, None,
                                                                                                        None),
                                               _synced(engine, step), _params, steps_per_rollout=1)
    assert scheduler.lookahead == 1
    batches = [rlhf.PromptBatch(i, [{"prompt_ids": [i]}]) for i in range(4)]
    try:
        scheduler.plan(batches[1:2])
        first = scheduler.sample(batches[0].prompts, 1, 0, 0, lambda what: None)
        assert first.metrics["rollout/staleness"] == 0 and len(scheduler.in_flight) == 1
        step[0] = 1
        scheduler.plan(batches[2:3])
        second = scheduler.sample(batches[1].prompts, 1, 1, 1, lambda what: None)
        assert second.token_ids == [[1, 0]] and second.metrics["rollout/staleness"] == 1  # sampled with step 0's
        assert engine.calls[1][0].startswith("rlhf-rollouts") and engine.calls[1][2] == 1001  # ahead, its own seed
        step[0] = 4  # rollout 2 was sent off at step 1 and is needed at step 4: 3 steps stale
        scheduler.plan(batches[3:4])
        third = scheduler.sample(batches[2].prompts, 1, 2, 4, lambda what: None)
        assert third.token_ids == [[2, 4]] and third.metrics["rollout/stale_dropped"] == 1.0
        assert third.metrics["rollout/staleness"] == 0  # sampled again now, with step 4's weights
    finally:
        scheduler.close()
    assert not scheduler.in_flight and scheduler.pool is None


# -- episode sources, without a trainer --------------------------------------------------------------------------------


class Counting:
    """Answers every turn with ' [n]' until its third step; a reward of 0.5 per step."""

    def reset(self, record):
        self.turns = 0
        return None

    def step(self, completion):
        self.turns += 1
        return (f" [{self.turns}]" if self.turns < 3 else None), 0.5, self.turns >= 3


def counting():
    return Counting()


def test_a_tool_environment_source_plays_episodes_on_any_engine(tiny_model_dir):
    policy = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir))
    formatter = rlhf.ChatFormatter(policy.tokenizer)
    config = rlhf.GRPOConfig(reward_funcs=["format"], environment="test_rollouts:counting", max_turns=4,
                             max_turn_tokens=4, max_completion_length=40)
    source = rlhf.EPISODE_SOURCES[rlhf.episode_source_name(config)](config, policy, formatter)
    assert isinstance(source, rlhf.ToolEnvironmentSource) and not source.one_shape_per_rollout
    engine = io.LocalEngine(lambda: policy.model, pad_token_id=policy.tokenizer.pad_token_id,
                            tokenizer=policy.tokenizer, engine="static")
    record = {"prompt_ids": formatter.encode("Q: 1 + 1"), "messages": [{"role": "user", "content": "1 + 1"}]}
    watched = []
    episodes = source.sample([record], io.SamplingParams(n=2, max_new_tokens=40, seed=5), engine, watched.append)
    for tokens, seen in zip(episodes.token_ids, episodes.observation_mask):
        observed = policy.tokenizer.decode([t for t, s in zip(tokens, seen) if s])
        assert observed.replace(" ", "") == "[1][2]" and sum(not s for s in seen) <= 3 * 4
    assert episodes.environment_rewards.tolist() == [1.5, 1.5] and episodes.metrics["tools/calls_per_episode"] == 2
    assert any("(turn 3)" in what for what in watched) and any("step 3, episode 1" in what for what in watched)


# -- scores and faults -------------------------------------------------------------------------------------------------


def test_the_scorer_drops_what_it_cannot_score_and_keeps_the_mean():
    def reward(prompts, completions, answers):
        if any("bad" in c for c in completions):
            raise ConnectionError("scorer down")
        return torch.tensor([float(len(c)) for c in completions])

    config = rlhf.GRPOConfig(reward_funcs=["format"], rollout_retries=1)
    scorer = rlhf.RolloutScorer(config, reward, lambda ids: "".join(map(chr, ids)), drops_failed=True)
    records = [{"messages": [{"role": "user", "content": "q"}]}] * 3
    episodes = rlhf.Episodes([[97], [98, 97, 100], [97, 97, 97]], [[], [], []], ["stop"] * 3, records)
    scores = scorer.score(episodes, 0, lambda what: None)
    assert scores.failed.tolist() == [False, True, False] and scores.rewards.tolist() == [1.0, 2.0, 3.0]
    assert scores.metrics["rollout/failed_episodes"] == 1 and scores.metrics["reward"] == 2.0
    strict = rlhf.RolloutScorer(config, reward, lambda ids: "".join(map(chr, ids)))
    with pytest.raises(rlhf.RLHFInputError, match="failed on 1 completions after 2 attempts each"):
        strict.score(episodes, 0, lambda what: None)
    gone = rlhf.Episodes([[97]], [[]], ["stop"], records[:1], failed=[True])
    with pytest.raises(rlhf.RolloutStopped, match="every episode of rollout 4 failed"):
        scorer.score(gone, 4, lambda what: None)


def test_a_non_finite_reward_makes_the_rollout_skip_its_update():
    scorer = rlhf.RolloutScorer(rlhf.GRPOConfig(reward_funcs=["format"]),
                                lambda p, c, a: torch.tensor([1.0, float("nan")]), str, drops_failed=True)
    scores = scorer.score_completions([{}, {}], [[1], [2]], lambda what: None)
    assert scores.skip_reason == "reward (1 of 2 completions)" and scores.rewards.tolist() == [1.0, 0.0]


def test_retry_then_drop():
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise OSError("down")
        return "up"

    assert rlhf.guarded_call(flaky, 3) == ("up", None) and len(tries) == 3
    tries.clear()
    value, error = rlhf.guarded_call(flaky, 2)
    assert value is None and isinstance(error, OSError) and len(tries) == 2
    value, error = rlhf.guarded_call(lambda: time.sleep(2), 1, timeout=0.1)
    assert isinstance(error, rlhf.CallTimedOut)
    with pytest.raises(rlhf.RLHFInputError):  # a user's mistake is never retried into a dropped episode
        rlhf.guarded_call(lambda: (_ for _ in ()).throw(rlhf.RLHFInputError("fix the config")), 3)
