"""Section 6 rewards: the verifiable exact-answer checker, the format check, the length penalty, weighted
composites and the running normaliser, on hand values; HTTPReward against a real local HTTP server (retries,
fail-fast 4xx, malformed answers, the bearer token); RewardFunctionFactory; LearnedReward from saved reward
models (full, ensemble with an uncertainty penalty, LoRA); constitution principles; process_rewards."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import math
import socket
import statistics
import sys
import threading
import time

import pytest
import torch
from conftest import captured_log

import rlhf

COMPLETIONS = ["37 + 8 = 45\nAnswer: 45", "37 + 8 = 46\nAnswer: 46", "37 + 8 = 45", "Answer: 4\nAnswer: 45"]
ANSWERS = ["45", "45", "45", "45"]


def test_exact_answer_and_format():
    prompts = ["What is 37 + 8?"] * 4
    assert rlhf.exact_answer_reward(prompts, COMPLETIONS, ANSWERS).tolist() == [1.0, 0.0, 0.0, 1.0]  # last wins
    assert rlhf.format_reward(prompts, COMPLETIONS, ANSWERS).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert rlhf.exact_answer_reward(["p"], ["Answer: 3"], [None]).tolist() == [0.0]
    with pytest.raises(ValueError):
        rlhf.exact_answer_reward(["p"], ["a", "b"], ["1"])  # lengths must agree


def test_length_penalty_and_composite():
    penalty = rlhf.length_penalty(10, scale=0.5)
    assert penalty([""] * 3, ["x" * 10, "x" * 20, "x" * 5], [None] * 3).tolist() == [0.0, -0.5, -0.25]
    with pytest.raises(rlhf.RLHFInputError):
        rlhf.length_penalty(0)
    composite = rlhf.CompositeReward([("correct", rlhf.exact_answer_reward, 1.0), ("format", rlhf.format_reward, 0.2)])
    total = composite([""] * 4, COMPLETIONS, ANSWERS)
    torch.testing.assert_close(total, torch.tensor([1.2, 0.2, 0.0, 1.2]))
    assert composite.last_components["format"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_running_normalizer_matches_statistics_and_resumes():
    batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0]), torch.tensor([-4.0, 0.5])]
    normalizer = rlhf.RunningRewardNormalizer(clip=2.0)
    for batch in batches:
        normalizer.update(batch)
    seen = [x for b in batches for x in b.tolist()]
    assert normalizer.mean == pytest.approx(statistics.mean(seen))
    assert normalizer.std == pytest.approx(statistics.stdev(seen))
    out = normalizer.normalize(torch.tensor([statistics.mean(seen), 100.0]))
    assert out.tolist() == pytest.approx([0.0, 2.0])  # centred, and clipped
    again = rlhf.RunningRewardNormalizer()
    again.load_state_dict(normalizer.state_dict())
    assert again.mean == normalizer.mean and again.std == normalizer.std


# -- HTTPReward against a real local HTTP server ----------------------------------------------------------------

class _RewardService:
    """A reward service on 127.0.0.1 (ThreadingHTTPServer on a free port). ``plan`` says what each request
    gets, in order (the last entry repeats): "ok" (rewards = len(response)), "close" (drop the connection
    without answering), "sleep" (answer "ok" after 1 s), an int (that HTTP status), bytes (that body, 200),
    or a dict / list (that JSON, 200). Every request's headers and JSON body are recorded."""

    def __init__(self, plan: list) -> None:
        self.plan, self.requests = plan, []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep pytest's output clean
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append((dict(self.headers), body))
                action = service.plan[min(len(service.requests), len(service.plan)) - 1]
                if action == "close":
                    self.close_connection = True
                    return
                if action == "sleep":
                    time.sleep(1.0)
                    action = "ok"
                if isinstance(action, int):
                    payload, status = json.dumps({"error": "nope"}).encode(), action
                elif isinstance(action, bytes):
                    payload, status = action, 200
                else:
                    answer = (action if isinstance(action, (dict, list))
                              else {"rewards": [float(len(r)) for r in body["responses"]]})
                    payload, status = json.dumps(answer).encode(), 200
                with contextlib.suppress(OSError):  # the client may have timed out and gone
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> _RewardService:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


PROMPTS, RESPONSES, REF_ANSWERS = ["What is 1 + 1?", "What is 2 + 2?"], ["Answer: 2", "4"], ["2", None]


def test_http_reward_normal_answer_sends_the_documented_payload(monkeypatch):
    monkeypatch.delenv("RLHF_REWARD_API_KEY", raising=False)
    with _RewardService(["ok"]) as service:
        rewards = rlhf.HTTPReward(service.url, timeout=5)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [9.0, 1.0]
    assert len(service.requests) == 1
    headers, body = service.requests[0]
    assert body == {"prompts": PROMPTS, "responses": RESPONSES, "answers": REF_ANSWERS}
    assert headers["Content-Type"] == "application/json" and "Authorization" not in headers


@pytest.mark.parametrize("failure", [503, "close", 429])
def test_http_reward_retries_transient_failures(failure):
    with _RewardService([failure, failure, "ok"]) as service, captured_log() as records:
        rewards = rlhf.HTTPReward(service.url, timeout=5, retries=3, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert rewards.tolist() == [9.0, 1.0]
    assert len(service.requests) == 3  # succeeded on the third attempt
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "attempt 1 of 3" in warnings[0] and "attempt 2 of 3" in warnings[1]


def test_http_reward_retries_a_timeout():
    with _RewardService(["sleep", "ok"]) as service:
        started = time.time()
        rewards = rlhf.HTTPReward(service.url, timeout=0.3, retries=2, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert rewards.tolist() == [9.0, 1.0] and len(service.requests) == 2
    assert time.time() - started < 1.0  # the slow answer was not waited for


def test_http_reward_gives_up_after_its_attempts():
    with _RewardService([503]) as service:
        reward = rlhf.HTTPReward(service.url, timeout=5, retries=3, backoff=0.01)
        with pytest.raises(rlhf.RewardAPIError, match="attempts") as info:
            reward(PROMPTS, RESPONSES, REF_ANSWERS)
    assert service.url in str(info.value) and "3 attempts" in str(info.value)
    assert len(service.requests) == 3
    assert isinstance(info.value, rlhf.RLHFInputError)  # the CLI prints it as one line


def test_http_reward_closed_port_is_an_api_error():
    with socket.socket() as probe:  # a port that was free a moment ago and that nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(rlhf.RewardAPIError, match="attempts") as info:
        rlhf.HTTPReward(url, timeout=2, retries=2, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert url in str(info.value) and "2 attempts" in str(info.value)


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_http_reward_client_errors_fail_fast(status):
    with _RewardService([status, "ok"]) as service:
        with pytest.raises(rlhf.RewardAPIError, match=f"HTTP {status}") as info:
            rlhf.HTTPReward(service.url, timeout=5, retries=3, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert len(service.requests) == 1  # no retry: the request itself is wrong
    assert service.url in str(info.value)


@pytest.mark.parametrize("answer", [b"not json", b"<html>502</html>", {"rewards": [1.0]}, {"rewards": [1, 2, 3]},
                                    {"scores": [1.0, 2.0]}, {"rewards": [1.0, "2"]}, {"rewards": [True, 1.0]},
                                    [1.0, 2.0], {"rewards": "1,2"}])
def test_http_reward_malformed_answers(answer):
    with _RewardService([answer, "ok"]) as service:
        with pytest.raises(rlhf.RewardAPIError) as info:
            rlhf.HTTPReward(service.url, timeout=5, retries=3, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert service.url in str(info.value)
    assert len(service.requests) == 1  # a wrong answer is not a transient failure


def test_http_reward_bearer_token_is_sent_and_never_logged(monkeypatch):
    secret = "sk-test-7f3a9c1e5b"
    monkeypatch.setenv("RLHF_REWARD_API_KEY", secret)
    with _RewardService([503, "ok", 503]) as service, captured_log() as records:
        rewards = rlhf.HTTPReward(service.url, timeout=5, retries=2, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
        with pytest.raises(rlhf.RewardAPIError) as info:
            rlhf.HTTPReward(service.url, timeout=5, retries=1, backoff=0.01)(PROMPTS, RESPONSES, REF_ANSWERS)
    assert rewards.tolist() == [9.0, 1.0]
    assert [h["Authorization"] for h, _ in service.requests] == [f"Bearer {secret}"] * 3
    assert records, "the failed attempt should have been logged"
    logged = " ".join(r.getMessage() + str(r.args) for r in records)
    assert secret not in logged and secret not in str(info.value)


def test_http_reward_rejects_a_url_without_scheme():
    with pytest.raises(rlhf.RLHFInputError, match="reward_api_url"):
        rlhf.HTTPReward("localhost:8000/score")


# -- RewardFunctionFactory ---------------------------------------------------------------------------------------


def _grpo_config(tmp_path, **overrides) -> rlhf.GRPOConfig:
    settings = dict(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=4,
                    report_to="none", disable_progress_bar=True)
    settings.update(overrides)
    return rlhf.GRPOConfig(**settings)


def test_factory_weighted_composite_matches_hand_sum(tmp_path):
    config = _grpo_config(tmp_path, reward_funcs=["exact_answer", "format"], reward_weights=[2.0, 0.5])
    reward = rlhf.RewardFunctionFactory(config).build()
    total = reward([""] * 4, COMPLETIONS, ANSWERS)
    exact, fmt = [1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]  # see test_exact_answer_and_format
    torch.testing.assert_close(total, torch.tensor([2.0 * e + 0.5 * f for e, f in zip(exact, fmt)]))
    assert reward.last_components["exact_answer"].tolist() == exact and reward.last_components["format"].tolist() == fmt
    unweighted = rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["exact_answer", "format"])).build()
    torch.testing.assert_close(unweighted([""] * 4, COMPLETIONS, ANSWERS), torch.tensor([2.0, 1.0, 0.0, 2.0]))


def test_factory_length_reward(tmp_path):
    config = _grpo_config(tmp_path, reward_funcs=["length"], length_target_chars=10)
    reward = rlhf.RewardFunctionFactory(config).build()
    out = reward([""] * 3, ["x" * 10, "x" * 25, ""], [None] * 3)
    torch.testing.assert_close(out, torch.tensor([0.0, -1.5, -1.0]))


def test_factory_imports_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_grpo_rewards.py").write_text(
        "import torch\n"
        "def shout(prompts, completions, answers):\n"
        "    return [float(c.count('!')) for c in completions]\n"
        "NOT_CALLABLE = 3\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_grpo_rewards", raising=False)
    config = _grpo_config(tmp_path, reward_funcs=["my_grpo_rewards:shout", "format"], reward_weights=[1.0, 10.0])
    reward = rlhf.RewardFunctionFactory(config).build()
    torch.testing.assert_close(reward(["p"] * 3, ["hi!!", "Answer: 3!", "."], [None] * 3),
                               torch.tensor([2.0, 11.0, 0.0]))
    for spec, message in (("my_grpo_rewards:missing", "cannot import"), ("no_such_module_xyz:f", "cannot import"),
                          ("my_grpo_rewards:NOT_CALLABLE", "not callable")):
        with pytest.raises(rlhf.RLHFInputError, match=message):
            rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=[spec])).build()


def test_factory_wrong_count_from_user_function_is_an_input_error(tmp_path, monkeypatch):
    (tmp_path / "my_bad_rewards.py").write_text("def one(prompts, completions, answers):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_bad_rewards", raising=False)
    reward = rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["my_bad_rewards:one"])).build()
    with pytest.raises(rlhf.RLHFInputError, match="returned 1 scores for 2 completions"):
        reward(["p", "q"], ["a", "b"], [None, None])


def test_factory_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(rlhf.RLHFInputError, match="unknown reward 'exact'") as info:
        rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["format", "exact"])).build()
    for name in ("exact_answer", "format", "length", "reward_model", "api", "module:function"):
        assert name in str(info.value)


def test_factory_api_needs_a_url(tmp_path):
    with pytest.raises(rlhf.RLHFInputError, match="reward_api_url"):
        rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["api"])).build()
    with pytest.raises(rlhf.RLHFInputError, match="reward_api_url"):  # reward_model served over HTTP
        rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["reward_model"],
                                                reward_model_type="api")).build()
    config = _grpo_config(tmp_path, reward_funcs=["api"], reward_api_url="http://127.0.0.1:9/x", reward_api_timeout=7,
                          reward_api_retries=5)
    built = rlhf.RewardFunctionFactory(config).build()
    (name, api, weight), = built.parts
    assert isinstance(api, rlhf.HTTPReward) and (api.url, api.timeout, api.retries, weight) == (
        "http://127.0.0.1:9/x", 7, 5, 1.0)


def test_factory_api_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("RLHF_REWARD_API_KEY", raising=False)
    with _RewardService(["ok"]) as service:
        config = _grpo_config(tmp_path, reward_funcs=["api", "format"], reward_weights=[0.5, 1.0],
                              reward_api_url=service.url)
        total = rlhf.RewardFunctionFactory(config).build()(PROMPTS, RESPONSES, REF_ANSWERS)
    torch.testing.assert_close(total, torch.tensor([0.5 * 9 + 1.0, 0.5 * 1 + 0.0]))


def test_factory_reward_model_dir_without_a_reward_model(tmp_path, tiny_model_dir):
    for directory in (tiny_model_dir, tmp_path / "empty"):  # a policy, and an empty folder
        (tmp_path / "empty").mkdir(exist_ok=True)
        config = _grpo_config(tmp_path, reward_funcs=["format"], reward_model=str(directory))
        with pytest.raises(rlhf.RLHFInputError, match="holds no reward model") as info:
            rlhf.RewardFunctionFactory(config).build()
        assert str(directory) in str(info.value)


# -- LearnedReward: a reward model (single, ensemble, LoRA) as a reward function ---------------------------------

LEARNED_PROMPTS = ["What is 2 + 3?", "Compute 12 + 7 - 5."]
LEARNED_COMPLETIONS = ["5", "Step 1: 12 + 7 = 19\nAnswer: 14"]


def _chat_ids(tokenizer, prompt: str, completion: str) -> list[int]:
    """The whole conversation rendered by the tokenizer's own chat template, tokenised in one piece."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": completion}],
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _direct_scores(members, tokenizer) -> torch.Tensor:
    """(K, B) scores of each reward model on each conversation, one conversation at a time (no padding)."""
    rows = [_chat_ids(tokenizer, p, c) for p, c in zip(LEARNED_PROMPTS, LEARNED_COMPLETIONS)]
    return torch.tensor([[float(m(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))) for ids in rows]
                         for m in members])


def _perturbed(model: rlhf.RewardModel, scale: float, seed: int) -> rlhf.RewardModel:
    torch.manual_seed(seed)
    with torch.no_grad():  # move the trainable weights so the save/load round trip has something to keep
        for parameter in model.model.parameters():
            if parameter.requires_grad:
                parameter.add_(scale * torch.randn_like(parameter))
    return model.eval()


def test_learned_reward_through_the_factory_matches_direct_scores(tmp_path, tiny_model_dir, tiny_tokenizer):
    reward_model = _perturbed(rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=0), 0.02, 0)
    reward_model.save_pretrained(tmp_path / "rm")
    config = _grpo_config(tmp_path, reward_funcs=["reward_model"], reward_model=str(tmp_path / "rm"),
                          per_device_eval_batch_size=1)  # two batches of one row: batching must not matter
    reward = rlhf.RewardFunctionFactory(config).build()
    scores = reward(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None])
    expected = _direct_scores([reward_model], tiny_tokenizer)[0]
    assert float(expected.std()) > 1e-4  # two different scores, so a mix-up would show
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert reward.last_components["reward_model"].tolist() == scores.tolist()
    # reward_model alone (no reward_funcs) is the reward too, and batching changes nothing
    alone = rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_model=str(tmp_path / "rm"))).build()
    torch.testing.assert_close(alone(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None]), expected,
                               atol=1e-5, rtol=1e-5)


def test_learned_reward_ensemble_mean_minus_penalty_std(tmp_path, tiny_model_dir, tiny_tokenizer):
    members = [_perturbed(rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=k), 0.02, k) for k in range(2)]
    for k, member in enumerate(members):
        member.save_pretrained(tmp_path / "ens" / f"member-{k}")
    rlhf.RewardEnsemble.write_manifest(tmp_path / "ens", ["member-0", "member-1"])
    direct = _direct_scores(members, tiny_tokenizer)  # (2, B)
    mean = [(a + b) / 2 for a, b in zip(direct[0].tolist(), direct[1].tolist())]
    std = [abs(a - b) / 2 for a, b in zip(direct[0].tolist(), direct[1].tolist())]  # population std of two values
    assert min(std) > 1e-4
    for penalty in (0.0, 1.5):
        config = _grpo_config(tmp_path, reward_funcs=["reward_model"], reward_model=str(tmp_path / "ens"),
                              reward_uncertainty_penalty=penalty)
        reward = rlhf.RewardFunctionFactory(config).build()
        scores = reward(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None])
        torch.testing.assert_close(scores, torch.tensor([m - penalty * s for m, s in zip(mean, std)]),
                                   atol=1e-5, rtol=1e-5)
        learned = reward.parts[0][1]
        assert isinstance(learned, rlhf.LearnedReward) and len(learned.model.members) == 2
        torch.testing.assert_close(learned.last_uncertainty, torch.tensor(std), atol=1e-5, rtol=1e-5)


def test_learned_reward_lora_reward_model(tmp_path, tiny_model_dir, tiny_tokenizer):
    config = rlhf.RewardModelConfig(model_name_or_path=str(tiny_model_dir), finetuning_type="lora", lora_rank=4,
                                    output_dir=str(tmp_path))
    reward_model = rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=0).prepare_for_training(config)
    assert reward_model.is_peft
    _perturbed(reward_model, 0.1, 0)
    reward_model.save_pretrained(tmp_path / "rm-lora")
    assert (tmp_path / "rm-lora" / "adapter_config.json").is_file()
    base = rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=0).eval()
    expected = _direct_scores([reward_model], tiny_tokenizer)[0]
    assert float((expected - _direct_scores([base], tiny_tokenizer)[0]).abs().max()) > 1e-3  # the adapter matters
    grpo = _grpo_config(tmp_path, reward_funcs=["format", "reward_model"], reward_weights=[0.0, 1.0],
                        reward_model=str(tmp_path / "rm-lora"), reward_model_type="lora")
    reward = rlhf.RewardFunctionFactory(grpo).build()
    torch.testing.assert_close(reward(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None]), expected,
                               atol=1e-5, rtol=1e-5)
    learned = reward.parts[1][1]
    assert not any(p.requires_grad for p in learned.model.parameters())  # a frozen scorer


def test_learned_reward_uses_the_records_system_prompt(tmp_path, tiny_model_dir, tiny_tokenizer):
    reward_model = _perturbed(rlhf.RewardModel.from_pretrained(str(tiny_model_dir), seed=0), 0.02, 0)
    learned = rlhf.LearnedReward(reward_model)
    records = [{"system": "Be brief.", "messages": [{"role": "user", "content": p}]} for p in LEARNED_PROMPTS]
    with_system = learned(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None], records=records)
    text = tiny_tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": LEARNED_PROMPTS[0]},
                                               {"role": "assistant", "content": LEARNED_COMPLETIONS[0]}],
                                              tokenize=False)
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        direct = float(reward_model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)))
    assert with_system[0].item() == pytest.approx(direct, abs=1e-5)
    without = learned(LEARNED_PROMPTS, LEARNED_COMPLETIONS, [None, None])
    assert abs(float(without[0] - with_system[0])) > 1e-6


# -- constitution: principles and the wrapper --------------------------------------------------------------------


def test_principle_parse_checks_on_hand_values():
    answer = rlhf.Principle.parse("answer_line")
    assert (answer.name, answer.weight, answer.critique) == ("answer_line", 1.0, None)
    assert answer.check("p", "x\nAnswer: 3") == 1.0 and answer.check("p", "3") == 0.0
    short = rlhf.Principle.parse("max_chars=10@0.5")
    assert (short.name, short.weight) == ("max_chars=10", 0.5)
    assert [short.check("p", "x" * n) for n in (0, 5, 10, 20, 40)] == [1.0, 1.0, 1.0, 0.5, 0.25]
    repeat = rlhf.Principle.parse("no_repetition@2")
    assert repeat.weight == 2.0
    assert repeat.check("p", "a b c d e") == 1.0  # 3 distinct trigrams of 3
    assert repeat.check("p", "a b c a b c") == 0.75  # trigrams abc bca cab abc: 3 distinct of 4
    assert repeat.check("p", "a b") == 1.0  # too short to repeat
    assert repeat.check("p", "x x x x x x") == 0.25  # one distinct of 4
    regex = rlhf.Principle.parse(r"regex=^Step \d+@0.25")
    assert (regex.name, regex.weight) == (r"regex=^Step \d+", 0.25)
    assert regex.check("p", "Step 1: add") == 1.0 and regex.check("p", "The Step 1") == 0.0
    email = rlhf.Principle.parse("regex=[a-z]+@[a-z]+@1")  # an explicit weight after an '@' in the pattern
    assert email.weight == 1.0 and email.check("p", "mail me at a@b") == 1.0
    bare = rlhf.Principle.parse(r"regex=\w+@\w+\.com")  # what follows the '@' is no number: the pattern's own
    assert (bare.name, bare.weight) == (r"regex=\w+@\w+\.com", 1.0)
    assert bare.check("p", "write to me@example.com") == 1.0 and bare.check("p", "me at example.com") == 0.0
    trailing = rlhf.Principle.parse(r"regex=^\S+@")  # a trailing '@' is the pattern's
    assert (trailing.name, trailing.weight) == (r"regex=^\S+@", 1.0)
    assert rlhf.Principle.parse("critique=Rate 5@inf").critique == "Rate 5@inf"  # not a finite weight: text
    mention = rlhf.Principle.parse("critique=Thank @reviewers by name.")
    assert (mention.critique, mention.weight) == ("Thank @reviewers by name.", 1.0)
    critique = rlhf.Principle.parse("critique=Be concise.@0.2")
    assert (critique.critique, critique.weight, critique.check) == ("Be concise.", 0.2, None)
    assert critique.name.startswith("critique:Be concise")


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_check", "unknown check 'no_such_check'"), ("max_chars", "needs an argument"),
    ("max_chars=ten", "not a whole number"), ("max_chars=-5", "not a whole number"), ("regex=", "needs an argument"),
    ("regex=(unclosed", "does not compile"), ("answer_line@heavy", "not a finite number"),
    ("no_repetition=1@O.5", "not a finite number"), ("max_chars=10@heavy", "not a finite number"),
    ("answer_line@", "unknown check 'answer_line@'"), ("critique", "needs its text"),
    ("critique=@0.5", "needs its text"), ("answer_line@nan", "not a finite number")])
def test_principle_parse_rejects_bad_specs(spec, message):
    with pytest.raises(rlhf.RLHFInputError, match=message) as info:
        rlhf.Principle.parse(spec)
    assert "constitution" in str(info.value)


def test_constitutional_wrapper_adds_weighted_violations():
    base = rlhf.CompositeReward([("exact_answer", rlhf.exact_answer_reward, 1.0)])
    principles = [rlhf.Principle.parse(s) for s in ("answer_line@0.5", "max_chars=10@2", "no_repetition")]
    wrapper = rlhf.ConstitutionalRewardWrapper(base, principles)
    completions = ["Answer: 45", "a b c a b c then Answer: 4", "45"]
    out = wrapper(["p"] * 3, completions, ["45"] * 3)
    expected = []
    for c, base_score in zip(completions, [1.0, 0.0, 0.0]):
        answer_line = 1.0 if "Answer:" in c else 0.0
        max_chars = min(1.0, 10 / len(c))
        words = c.split()
        grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
        distinct = len(set(grams)) / len(grams) if grams else 1.0
        expected.append(base_score + 0.5 * (answer_line - 1) + 2 * (max_chars - 1) + (distinct - 1))
    torch.testing.assert_close(out, torch.tensor(expected))
    assert set(wrapper.last_components) == {"exact_answer", "principle/answer_line", "principle/max_chars=10",
                                            "principle/no_repetition"}
    alone = rlhf.ConstitutionalRewardWrapper(None, principles[:1])  # no base reward: the constitution alone
    assert alone(["p"] * 2, ["Answer: 1", "1"], [None, None]).tolist() == [0.0, -0.5]


def test_constitutional_critique_needs_a_critic_and_reads_the_principle_as_system():
    critique = rlhf.Principle.parse("critique=Be concise.@0.5")
    with pytest.raises(rlhf.RLHFInputError, match="critique principles need a reward model"):
        rlhf.ConstitutionalRewardWrapper(rlhf.format_reward, [critique])

    class Critic:
        wants_records = True

        def __init__(self):
            self.seen = []

        def __call__(self, prompts, completions, answers, records=None):
            self.seen.append(records)
            return torch.tensor([float(len(c)) for c in completions])

    critic = Critic()
    wrapper = rlhf.ConstitutionalRewardWrapper(rlhf.format_reward, [critique], critic=critic)
    records = [{"system": "old", "messages": [{"role": "user", "content": "q1"}]},
               {"system": "", "messages": [{"role": "user", "content": "q2"}]}]
    out = wrapper(["q1", "q2"], ["Answer: 1", "ok"], [None, None], records=records)
    torch.testing.assert_close(out, torch.tensor([1.0 + 0.5 * 9, 0.0 + 0.5 * 2]))
    assert [r["system"] for r in critic.seen[0]] == ["Be concise.", "Be concise."]
    assert [r["messages"] for r in critic.seen[0]] == [r["messages"] for r in records]
    assert records[0]["system"] == "old"  # the caller's records are not modified


def test_factory_constitution(tmp_path):
    config = _grpo_config(tmp_path, reward_funcs=["format"], constitution=["max_chars=4@1"])
    reward = rlhf.RewardFunctionFactory(config).build()
    assert isinstance(reward, rlhf.ConstitutionalRewardWrapper)
    torch.testing.assert_close(reward(["p"] * 2, ["Answer: 1", "ab"], [None] * 2), torch.tensor([1.0 + 4 / 9 - 1, 0.0]))
    with pytest.raises(rlhf.RLHFInputError, match="reward_model"):  # a critique without a reward model
        rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["format"],
                                                constitution=["critique=Be kind."])).build()
    with pytest.raises(rlhf.RLHFInputError, match="unknown check"):
        rlhf.RewardFunctionFactory(_grpo_config(tmp_path, reward_funcs=["format"], constitution=["polite"])).build()


# -- process_rewards ---------------------------------------------------------------------------------------------


def test_process_rewards_normalises_then_clips():
    normalizer = rlhf.RunningRewardNormalizer()
    first, second = [1.0, 2.0, 3.0, 10.0], [-4.0, 0.5, 30.0, 2.0]
    out1 = rlhf.process_rewards(torch.tensor(first), normalizer=normalizer, clip=1.5)
    mean1, std1 = statistics.mean(first), statistics.stdev(first)
    want1 = [max(-1.5, min(1.5, (r - mean1) / (std1 + 1e-8))) for r in first]
    assert out1.tolist() == pytest.approx(want1, abs=1e-6)
    out2 = rlhf.process_rewards(torch.tensor(second), normalizer=normalizer, clip=1.5)
    seen = first + second  # the normaliser sees this batch before normalising it
    mean2, std2 = statistics.mean(seen), statistics.stdev(seen)
    want2 = [max(-1.5, min(1.5, (r - mean2) / (std2 + 1e-8))) for r in second]
    assert out2.tolist() == pytest.approx(want2, abs=1e-6)
    assert max(abs(x) for x in out2.tolist()) == pytest.approx(1.5)  # 30 is clipped
    # clip alone, normaliser alone, neither
    assert rlhf.process_rewards(torch.tensor([-3.0, 0.2, 3.0]), clip=1.0).tolist() == pytest.approx([-1.0, 0.2, 1.0])
    single = rlhf.process_rewards(torch.tensor(first), normalizer=rlhf.RunningRewardNormalizer())
    assert single.tolist() == pytest.approx([(r - mean1) / std1 for r in first], abs=1e-6)
    raw = torch.tensor([5.0, -7.0])
    assert torch.equal(rlhf.process_rewards(raw), raw)
    assert not math.isnan(rlhf.process_rewards(torch.tensor([1.0]), normalizer=rlhf.RunningRewardNormalizer()).item())
