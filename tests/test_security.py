"""Issue 55's abuse suite (docs/security.md): a run folder holds one run and one model (a lock; the final save
replaces the folder's model as a set, a killed one is refused by every loader; atomic rewrites), weight-sync folders
in shared memory do not outlive their process, the calculator bounds its numbers, reward and environment services
get no credential through a redirect and cannot answer without bound, and the servers are authenticated and bounded:
hostile requests at the agent endpoint each get their expected answer, a GRPO run under them ends with an
undisturbed run's weights, a stalled weight sync stops the run in one line. vllm-serve's part runs against a real
server in tests/test_vllm.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import inference_optimizations as io
import rlhf

pytestmark = pytest.mark.usefixtures("one_thread")


# -- one model per folder (H3, L5) -------------------------------------------------------------------------------------


def _sft(model_dir: Path, out: Path, demo_dir: Path, **overrides) -> rlhf.TrainResult:
    settings = dict(model_name_or_path=str(model_dir), output_dir=str(out), dataset="demo_sft",
                    dataset_dir=str(demo_dir), max_samples=8, cutoff_len=64, per_device_train_batch_size=4,
                    max_steps=1, learning_rate=1e-2, save_steps=0, report_to="none", disable_progress_bar=True,
                    resume_from_checkpoint="none", finetuning_type="full")
    return rlhf.train_sft(rlhf.SFTConfig(**{**settings, **overrides}))


def test_a_full_run_after_a_lora_run_in_one_folder_loads_the_full_model(tmp_path, tiny_model_dir, demo_dir):
    """The review's H3: a LoRA run, then a full fine-tune into the same output_dir starting over; the folder then held
    the new weights beside the old adapter, which every loader applied on top. Now the final save deletes the model
    files an earlier model left that it does not write."""
    out = tmp_path / "out"
    _sft(tiny_model_dir, out, demo_dir, finetuning_type="lora", lora_rank=4)
    assert (out / "adapter_config.json").exists()
    _sft(tiny_model_dir, out, demo_dir, learning_rate=5e-2)
    assert not list(out.glob("adapter_*")) and (out / "model.safetensors").exists()
    trained = rlhf.PolicyModel.from_pretrained(str(out)).model
    assert not hasattr(trained, "peft_config")  # a plain model: no adapter found to apply
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    for name, value in trained.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), name
    assert (out / "metrics.jsonl").exists()  # what is not a model file stays


def test_stale_model_files_are_the_loaders_files_the_new_save_does_not_write(tmp_path):
    for name in ("adapter_config.json", "adapter_model.safetensors", "model.safetensors", "config.json",
                 "ewc.safetensors", "metrics.jsonl", "report.json", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_text("x")
    (tmp_path / "critic").mkdir()
    stale = {path.name for path in rlhf.stale_model_files(tmp_path, {"model.safetensors", "config.json"})}
    assert stale == {"adapter_config.json", "adapter_model.safetensors", "model-00001-of-00002.safetensors", "critic"}


def test_a_failed_final_save_leaves_no_temporary_folder_and_a_killed_ones_is_swept(tmp_path, tiny_model_dir, demo_dir,
                                                                                  monkeypatch):
    out = tmp_path / "out"
    _sft(tiny_model_dir, out, demo_dir)
    (out / ".tmp-final-deadbeef").mkdir()  # what a kill during a final save leaves
    (out / ".tmp-final-deadbeef" / "model.safetensors").write_text("half")

    save = rlhf.SFTTrainer._save_model

    def full_disk(self, directory):  # the checkpoints save, the final model's folder fills the disk
        if not Path(directory).name.startswith(".tmp-final-"):
            return save(self, directory)
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_text("partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rlhf.SFTTrainer, "_save_model", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _sft(tiny_model_dir, out, demo_dir)
    assert not list(out.glob(".tmp-final-*"))


def test_a_rewrite_is_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    rlhf.write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n"

    def fails(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(OSError):
        rlhf.write_text_atomic(path, "newer\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# -- shared-memory folders (M7) ----------------------------------------------------------------------------------------


def test_sync_folders_go_with_their_client_and_a_dead_processs_are_swept(tmp_path):
    client = io.VLLMClient("127.0.0.1", 9)  # nothing listens: no request is made
    folder = client.sync_dir
    assert folder.is_dir() and f"rlhf-vllm-sync-{os.getpid()}-" in folder.name
    client.close()
    assert not folder.exists()
    mine = io.VLLMClient("127.0.0.1", 9, sync_dir=tmp_path / "given")
    mine.close()  # a folder the user gave is theirs
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = Path(io.shared_memory_dir() or __import__("tempfile").gettempdir())
    left = root / f"rlhf-test-kind-{dead.stdout.strip()}-leftover"
    alive = root / f"rlhf-test-kind-{os.getpid()}-running"
    left.mkdir()
    alive.mkdir()
    try:
        made = io.run_folder("test-kind")
        assert not left.exists() and alive.exists() and made.exists()
    finally:
        for folder in root.glob("rlhf-test-kind-*"):
            folder.rmdir()


# -- tools and rewards (M8, L1, L2) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression", ["(((10**64)**64)**64)**64", "((10**64)**64)**64", "9**64**64", "1e308*10",
                                        "(2**4000)*(2**4000)"])
def test_the_calculator_refuses_numbers_too_large_to_compute_cheaply(expression):
    """The review's M8: 24 characters of model output held the interpreter for 13 s (and with it the watchdog); a
    result of more than 4300 digits raised past the documented error text."""
    assert rlhf.calculate(expression) == "error: result too large"
    assert rlhf.calculate("2**64") == "18446744073709551616" and rlhf.calculate("3 * (4 + 5)") == "27"


class _JSONHandler(BaseHTTPRequestHandler):
    """A test peer's handler: quiet, answering JSON."""

    def log_message(self, *args):
        pass

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Services:
    """A redirecting endpoint and the host it redirects to, which records what reaches it."""

    def __init__(self) -> None:
        self.reached: list[dict] = []
        services = self

        class Target(_JSONHandler):
            def do_GET(self):  # noqa: N802
                services.reached.append(dict(self.headers))
                self._answer({"rewards": [42.0]})

            do_POST = do_GET  # noqa: N815

        self.target = ThreadingHTTPServer(("127.0.0.1", 0), Target)
        location = f"http://localhost:{self.target.server_address[1]}/elsewhere"

        class Redirecting(Target):
            def do_POST(self):  # noqa: N802
                if self.path.startswith("/big"):
                    return self._answer({"observation": "x" * 500, "reward": 0.0, "done": True})
                if self.path.startswith("/key"):
                    services.reached.append(dict(self.headers))
                    return self._answer({"observation": None, "reward": 1.0, "done": True})
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.front = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
        for server in (self.target, self.front):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.front.server_address[1]}"

    def close(self) -> None:
        for server in (self.target, self.front):
            server.shutdown()
            server.server_close()


@pytest.fixture
def services():
    running = _Services()
    yield running
    running.close()


def test_a_reward_api_key_does_not_follow_a_redirect(services, monkeypatch):
    """The review's L1: a 302 sent the bearer token to another host and its answer became the rewards."""
    monkeypatch.setenv("RLHF_REWARD_API_KEY", "sk-secret-123")
    reward = rlhf.HTTPReward(services.url + "/rewards", retries=1)
    with pytest.raises(rlhf.RewardAPIError, match="HTTP 302"):
        reward(["q"], ["a"], [None])
    assert services.reached == []  # nothing reached the other host, with or without the key


def test_an_http_environment_sends_its_key_and_refuses_an_answer_without_bound(services, monkeypatch):
    monkeypatch.setenv("RLHF_ENVIRONMENT_API_KEY", "env-key")
    environment = rlhf.HTTPEnvironment(services.url + "/key", retries=1)
    assert environment.step("text") == (None, 1.0, True)
    assert services.reached[-1].get("Authorization") == "Bearer env-key"
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        rlhf.post_json(services.url + "/big", b"{}", timeout=5, limit=100)


# -- a run folder holds one run (M5, H3 under a kill) -----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_a_second_run_into_a_busy_folder_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, tiny_model_dir,
                                                                                         demo_dir, caplog):
    """The review's M5: a second run into a folder swept the first's checkpoint in the making, rolled its checkpoints
    away and resumed from them. Now the folder is locked for a run's life; the refusal names the holder and touches
    nothing; the lock of a run that died is taken over."""
    from conftest import rlhf_log

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import rlhf, "
                               f"time; rlhf.RunFolderLock.hold({str(out)!r}); print('held', flush=True); "
                               f"time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        in_the_making = out / "checkpoints" / ".tmp-checkpoint-5-0123abcd"
        in_the_making.mkdir(parents=True)
        with pytest.raises(rlhf.RLHFInputError, match=rf"output_dir {out} is in use by another run \(pid "
                                                       rf"{holder.pid} on .+, started 20\d\d-"):
            _sft(tiny_model_dir, out, demo_dir)
        code = rlhf.main(["sft", "--config", str(REPO / "configs" / "demo.yaml"), f"output_dir={out}",
                          "max_steps=1", "disable_progress_bar=true"])
        assert code == 2 and in_the_making.exists() and not (out / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    with rlhf_log(caplog):
        result = _sft(tiny_model_dir, out, demo_dir)
    assert result.global_step == 1 and "taken over" in caplog.text and not in_the_making.exists()
    assert str(out.resolve()) not in rlhf.RunFolderLock.held and (out / ".rlhf.lock").read_text() == ""


KILLED_DURING_FINAL_SAVE = """
import os, signal, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import rlhf, test_security
replace, moved = os.replace, []
def replace_then_die(source, target):  # SIGKILL after the second file of the new model is in place
    replace(source, target)
    if ".tmp-final-" in str(source):
        moved.append(target)
        if len(moved) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
test_security._sft(rlhf.Path({model!r}), rlhf.Path({out!r}), rlhf.Path({demo!r}), learning_rate=5e-2)
"""


def test_a_kill_during_the_final_save_leaves_a_folder_no_loader_reads_and_the_rerun_saves_it_whole(
        tmp_path, tiny_model_dir, demo_dir):
    """A final save replaces the folder's model file by file; killed in between, the folder holds part of each model.
    Every loader refuses it in one line until the rerun, which resumes from the final checkpoint, saves it whole."""
    out = tmp_path / "out"
    _sft(tiny_model_dir, out, demo_dir, finetuning_type="lora", lora_rank=4)
    script = KILLED_DURING_FINAL_SAVE.format(repo=str(REPO), tests=str(REPO / "tests"), model=str(tiny_model_dir),
                                             out=str(out), demo=str(demo_dir))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / rlhf.FINAL_SAVE_MARKER).exists() and list(out.glob(".tmp-final-*"))
    with pytest.raises(rlhf.RLHFInputError, match="half-replaced model .* run the training command again"):
        rlhf.PolicyModel.from_pretrained(str(out))
    _sft(tiny_model_dir, out, demo_dir, learning_rate=5e-2, resume_from_checkpoint="auto")
    assert not (out / rlhf.FINAL_SAVE_MARKER).exists() and not list(out.glob(".tmp-final-*"))
    assert not list(out.glob("adapter_*"))
    _sft(tiny_model_dir, tmp_path / "straight", demo_dir, learning_rate=5e-2)
    saved = rlhf.PolicyModel.from_pretrained(str(out)).model.state_dict()
    straight = rlhf.PolicyModel.from_pretrained(str(tmp_path / "straight")).model.state_dict()
    assert saved.keys() == straight.keys() and all(torch.equal(saved[k], straight[k]) for k in saved)


# -- the servers: authenticated and bounded (H1, H2, M1, M2, M3) -------------------------------------------------------


def test_vllm_serve_refuses_to_listen_beyond_this_machine_without_a_key(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv(io.SERVER_API_KEY_VARIABLE, raising=False)
    assert io.vllm_serve(["--model", str(tiny_model_dir), "--host", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--host 0.0.0.0" in error and io.SERVER_API_KEY_VARIABLE in error
    assert [io.is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "localhost", "0.0.0.0", "::", "10.0.0.1",
                                        "example.com")] == [True] * 4 + [False] * 4
    assert io.bearer_matches("Bearer k3y", "k3y") and io.bearer_matches("bearer  k3y", "k3y")
    assert not any(io.bearer_matches(h, "k3y") for h in (None, "", "k3y", "Bearer k3", "Basic k3y", "Bearer k3yy"))


def _http(port: int, method: str, path: str, body: bytes = b"", *, key: str | None = None,
          length: int | str | None = None, timeout: float = 20.0) -> tuple[int, dict]:
    """One raw HTTP request (what a hostile client can send: any Content-Length, any bytes); the status and the JSON
    answer."""
    import socket

    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    if body or length is not None:
        head.append(f"Content-Length: {len(body) if length is None else length}")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while chunk := connection.recv(1 << 16):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


class _Endpoint:
    """An AgentEndpoint whose two episodes (keys key-0, key-1) are answered by a thread: the HTTP side alone."""

    def __init__(self, idle_seconds: float = 30.0) -> None:
        self.endpoint = rlhf.AgentEndpoint(lambda episode, body, kind: ("text", [1, 2], int(body.get("max_tokens", 2)),
                                                                        ()),
                                           lambda call, body, kind: {"ids": call.token_ids},
                                           {0: "key-0", 1: "key-1"}.get, idle_seconds=idle_seconds)
        self.port, self.stopped = self.endpoint.port, threading.Event()
        threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        while not self.stopped.wait(0.005):
            with self.endpoint.arrived:
                calls, self.endpoint.pending = self.endpoint.pending, []
            for call in calls:
                call.token_ids = [7] * call.max_new_tokens
                call.done.set()

    def close(self) -> None:
        self.stopped.set()
        self.endpoint.close()


ABUSE = [  # (what, method, path, body, key, Content-Length, expected status)
    ("the right key", "POST", "/episodes/0/v1/completions", b'{"max_tokens": 3}', "key-0", None, 200),
    ("the models list", "GET", "/episodes/1/v1/models", b"", "key-1", None, 200),
    ("no key", "POST", "/episodes/0/v1/completions", b"{}", None, None, 401),
    ("a wrong key", "POST", "/episodes/0/v1/completions", b"{}", "key-00", None, 401),
    ("another episode's key", "POST", "/episodes/0/v1/completions", b"{}", "key-1", None, 401),
    ("an episode not running", "POST", "/episodes/2/v1/completions", b"{}", "key-0", None, 401),
    ("no key, a huge body announced", "POST", "/episodes/0/v1/completions", b"", None, 10 ** 14, 401),
    ("an unknown path", "POST", "/v1/completions", b"{}", "key-0", None, 404),
    ("a path past the pattern", "GET", "/episodes/0/v1/models/../../etc", b"", "key-0", None, 404),
    ("a GET of a POST route", "GET", "/episodes/0/v1/completions", b"", "key-0", None, 404),
    ("malformed JSON", "POST", "/episodes/0/v1/completions", b'{"max_tokens": ', "key-0", None, 400),
    ("a JSON list", "POST", "/episodes/0/v1/completions", b"[1, 2]", "key-0", None, 400),
    ("a JSON string", "POST", "/episodes/0/v1/completions", b'"text"', "key-0", None, 400),
    ("Infinity", "POST", "/episodes/0/v1/completions", b'{"max_tokens": Infinity}', "key-0", None, 400),
    ("NaN", "POST", "/episodes/0/v1/completions", b'{"max_tokens": NaN}', "key-0", None, 400),
    ("a wrong type", "POST", "/episodes/0/v1/completions", b'{"max_tokens": [1]}', "key-0", None, 400),
    ("deep nesting", "POST", "/episodes/0/v1/completions", b"[" * 200_000 + b"]" * 200_000, "key-0", None, 400),
    ("not UTF-8", "POST", "/episodes/0/v1/completions", b'{"a": "\xff\xfe"}', "key-0", None, 400),
    ("a huge Content-Length", "POST", "/episodes/0/v1/completions", b"", "key-0", 10 ** 14, 413),
    ("a negative Content-Length", "POST", "/episodes/0/v1/completions", b"", "key-0", -1, 413),
    ("a Content-Length past the cap", "POST", "/episodes/0/v1/completions", b"", "key-0",
     io.HTTP_BODY_LIMIT + 1, 413),
    ("a Content-Length that is no number", "POST", "/episodes/0/v1/completions", b"", "key-0", "12abc", 400),
    ("streaming", "POST", "/episodes/0/v1/completions", b'{"stream": true}', "key-0", None, 400),
]


@pytest.mark.parametrize("idle", [0.5])
def test_the_agent_endpoint_answers_every_abusive_request_as_expected_and_stays_up(idle, capfd):
    """The review's M1 and M3, on the HTTP side of the agent endpoint (which shares BoundedJSONServer with vllm-serve):
    each hostile request gets its status and a JSON error, idle and half-sent connections are closed after the idle
    time, requests keep being served meanwhile, and nothing reaches stderr."""
    import socket

    served = _Endpoint(idle_seconds=idle)
    tried = expected = 0
    try:
        for what, method, path, body, key, length, status in ABUSE * 4:
            got, answer = _http(served.port, method, path, body, key=key, length=length)
            tried += 1
            expected += got == status
            assert got == status, (what, got, answer)
            assert ("error" not in answer) if status == 200 else answer["error"]["code"] == status
        idle_connections = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(60)]
        half_sent = socket.create_connection(("127.0.0.1", served.port))
        half_sent.sendall(b"POST /episodes/0/v1/completions HTTP/1.1\r\nAuthorization: Bearer key-0\r\n"
                          b"Content-Length: 100\r\n\r\n{\"max_to")
        started = time.monotonic()
        assert _http(served.port, *ABUSE[0][1:4], key="key-0")[0] == 200  # served beside 61 idle connections
        assert time.monotonic() - started < 5
        half_sent.settimeout(10)
        answer = b""
        while chunk := half_sent.recv(4096):
            answer += chunk
        assert b" 408 " in answer.split(b"\r\n")[0]  # the body never came: answered once the idle time passed
        for connection in idle_connections:  # closed by the server, not held open forever
            connection.settimeout(10)
            assert connection.recv(1) == b""
            connection.close()
        half_sent.close()
        tried, expected = tried + 63, expected + 63
    finally:
        served.close()
    assert expected == tried == len(ABUSE) * 4 + 63
    assert capfd.readouterr().err == ""  # no traceback on the trainer's stderr


def test_a_wedged_engine_shows_in_health_and_a_second_run_is_refused_until_the_first_lets_go():
    """The review's H2 (the server looked healthy while one request held it) and H4 (two runs sampled from each
    other's weights), on VLLMServer's own rules; tests/test_vllm.py runs them against a real vllm-serve."""
    import types

    loop = types.SimpleNamespace(engine_call_seconds=lambda: 0.0, updates_in_flight=0, running={}, waiting=[])
    server = types.SimpleNamespace(loop=loop, wedged_after=600.0, owner=None, weight_version=0, weights_id=None,
                                   engine=types.SimpleNamespace(tensor_parallel_size=1), server_id="s", gpus=[],
                                   owner_lock=threading.Lock(), owner_timeout=900.0)
    assert io.VLLMServer.health(server)[0] == 200
    loop.engine_call_seconds = lambda: 601.0
    status, answer = io.VLLMServer.health(server)
    assert status == 503 and answer["status"] == "wedged" and answer["engine_call_seconds"] == 601.0
    admit = functools.partial(io.VLLMServer._admit_run, server)
    admit("/generate", {"run": "a"})  # sampling the start weights holds nothing
    assert server.owner is None
    admit("/load_weights", {"run": "a", "run_label": "/runs/a on host"})
    admit("/generate", {"run": "a"})
    for path in ("/generate", "/load_weights", "/init_weight_group", "/reset_prefix_cache"):
        with pytest.raises(io.HTTPRefusal, match=r"serves run /runs/a on host \(for \d+ s\); a server serves one run"):
            admit(path, {"run": "b"})
    with pytest.raises(io.HTTPRefusal, match="serves run"):
        admit("/generate", {})  # a caller that names no run is another run
    server.owner.seen -= 901  # silent past owner_timeout: taken over
    admit("/load_weights", {"run": "b", "run_label": "b"})
    assert server.owner.run == "b"
    client = io.VLLMClient("127.0.0.1", 9, run="a")
    with pytest.raises(io.VLLMServerError, match="another run loaded"):
        client._check_weights({"weights_run": "b"})
    client._check_weights({"weights_run": None})  # the model the server started with
    client._check_weights({"weights_run": "a"})
    client.close()


ADMITTED: list = []


def concurrent_agent(client, record):
    """A hostile agent: a prompt longer than the model's context, then six requests at once with max_turns 3."""
    import concurrent.futures

    import openai

    try:
        client.completions.create(model="policy", prompt="x " * 2000, max_tokens=2)
        ADMITTED.append("an oversized prompt was sampled")
    except openai.BadRequestError as error:
        ADMITTED.append("context" if "context holds 512" in str(error) else str(error))

    def one(_):
        try:
            client.completions.create(model="policy", prompt=record["prompt_text"], max_tokens=2)
            return "sampled"
        except openai.BadRequestError as error:
            return "max_turns" if "(max_turns)" in str(error) else str(error)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        ADMITTED.append(sorted(pool.map(one, range(6))))
    return 1.0


def test_an_episode_gets_its_max_turns_under_concurrent_requests_and_an_oversized_prompt_fails_it_alone(
        tmp_path, tiny_model_dir):
    """The review's M1 (concurrent requests of one episode all passed max_turns) and M2 (one oversized first prompt
    stopped the run)."""
    from conftest import sample_episodes
    from test_agents import _trainer

    records = rlhf.load_records("demo_rl", rlhf.DEMO_DATA_DIR, "prompt", max_samples=2)
    tokenizer = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).tokenizer
    prompts = rlhf.GRPODataset(records, tokenizer, rlhf.ChatFormatter(tokenizer), cutoff_len=64)
    ADMITTED.clear()
    trainer = _trainer(tmp_path, tiny_model_dir, prompts, agent="test_security:concurrent_agent", max_turns=3,
                       agent_trajectory="per_call")
    try:
        episodes = sample_episodes(trainer, [prompts[0], prompts[1]], trainer._sampling_params(2, 0))
    finally:
        trainer.close_rollouts()
    assert ADMITTED.count("context") == 4
    assert [a for a in ADMITTED if a != "context"] == [["max_turns"] * 3 + ["sampled"] * 3] * 4
    assert episodes.failed == [False] * 4 and all(len(calls) == 3 for calls in episodes.calls)


def _abuse(port: int, stop: threading.Event, counts: dict) -> None:
    """Hostile requests at the agent endpoint while a run trains (at most 300): no key, wrong keys, malformed bodies,
    huge announced bodies, idle connections. Connections refused while no rollout runs are not counted."""
    import socket

    cases = [(m, p, b, k, n, s) for _, m, p, b, k, n, s in ABUSE if s != 200 and k not in ("key-0", "key-1")]
    cases += [("POST", f"/episodes/{e}/v1/chat/completions", b'{"messages": []}', "rlhf", None, 401) for e in range(4)]
    i = 0
    while not stop.is_set() and counts["tried"] < 300:
        method, path, body, key, length, status = cases[i % len(cases)]
        i += 1
        try:
            if i % 7 == 0:  # an idle connection, left open
                counts.setdefault("idle", []).append(socket.create_connection(("127.0.0.1", port), timeout=5))
                continue
            got, _ = _http(port, method, path, body, key=key, length=length, timeout=10)
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(0.01)
            continue
        counts["tried"] += 1
        counts["expected"] += got == status


def test_a_grpo_run_under_abuse_ends_with_the_weights_of_an_undisturbed_one(tmp_path, tiny_model_dir):
    from test_agents import _trainer

    records = rlhf.load_records("demo_rl", rlhf.DEMO_DATA_DIR, "prompt", max_samples=8)
    tokenizer = rlhf.PolicyModel.from_pretrained(str(tiny_model_dir)).tokenizer
    prompts = rlhf.GRPODataset(records, tokenizer, rlhf.ChatFormatter(tokenizer), cutoff_len=64)
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def run(folder: str) -> dict:
        trainer = _trainer(tmp_path / folder, tiny_model_dir, prompts, max_steps=2, agent_port=port)
        trainer.train()
        return {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}

    calm = run("calm")
    stop, counts = threading.Event(), {"tried": 0, "expected": 0}
    abuser = threading.Thread(target=_abuse, args=(port, stop, counts), daemon=True)
    abuser.start()
    try:
        abused = run("abused")
    finally:
        stop.set()
        abuser.join(30)
        for connection in counts.pop("idle", []):
            connection.close()
    print(f"abuse during GRPO: {counts['tried']} requests tried, {counts['expected']} answered as expected")
    assert counts["tried"] >= 20 and counts["expected"] == counts["tried"], counts
    assert calm.keys() == abused.keys() and all(torch.equal(calm[k], abused[k]) for k in calm)


class _StallingServer:
    """A peer that answers /health as a vllm-serve does and takes /load_weights without ever answering: a weight
    sync that stalls (a wedged server, a rank that never joins)."""

    def __init__(self) -> None:
        class Handler(_JSONHandler):
            def do_GET(self):  # noqa: N802
                self._answer({"status": "ok", "weight_version": 0, "weight_group_size": 2, "server_id": "s",
                              "gpus": []})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/load_weights":
                    time.sleep(30)  # stalls
                self._answer({"status": "ok", "weight_version": 0})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_a_weight_sync_that_stalls_stops_the_run_within_sync_timeout_in_one_line(tmp_path, tiny_model_dir, demo_dir,
                                                                                 capsys):
    """Part 2's last point, the top complaint in peers' trackers: a sync that stalls stops the run within
    sync_timeout (not NCCL's 30 minutes), with one line naming the stage, the peer and how to resume."""
    stalling = _StallingServer()
    started = time.monotonic()
    code = rlhf.main(["grpo", f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'out'}",
                      "dataset=demo_rl", f"dataset_dir={demo_dir}", "max_samples=4", "num_generations=2",
                      "per_device_train_batch_size=2", "max_completion_length=4", "max_steps=1",
                      "reward_funcs=length", "use_vllm=true", "vllm_mode=server", f"vllm_server_port={stalling.port}",
                      "vllm_weight_transfer=files", "sync_timeout=2", "report_to=none", "disable_progress_bar=true"])
    elapsed = time.monotonic() - started
    stalling.httpd.shutdown()
    error = capsys.readouterr().err.strip()
    assert code == 2 and elapsed < 60 and "Traceback" not in error
    assert error.startswith("error: ") and len(error.splitlines()) <= 3  # one line (the terminal may wrap it)
    assert f"stage grpo, step 0: vLLM server http://127.0.0.1:{stalling.port} took /load_weights and did not answer " \
           f"within 2 s" in " ".join(error.split())
    assert "the same command again" in error or "run the same command" in " ".join(error.split())


def test_announced_weights_must_be_the_models_own(tmp_path):
    """The review's M6: a collective load allocated whatever shapes the request announced. Now each announced tensor
    must have its checkpoint tensor's shape (a name the checkpoint lacks, such as a tied output layer, one of its
    shapes), with a known dtype, and not many more of them than the checkpoint has."""
    from safetensors.torch import save_file

    save_file({"embed.weight": torch.zeros(10, 4), "norm.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    shapes = io.checkpoint_shapes(str(tmp_path))
    assert shapes == {"embed.weight": (10, 4), "norm.weight": (4,)}
    io.check_announced_weights(shapes, [["embed.weight", "bfloat16", [10, 4]], ["lm_head.weight", "float32", [10, 4]]])
    for announced, why in [([["embed.weight", "float32", [10, 5]]], "not one of this model's weights"),
                           ([["huge", "float32", [10 ** 12]]], "no tensor of that shape"),
                           ([["embed.weight", "complex128", [10, 4]]], "give \\[name, dtype, shape\\]"),
                           ([["embed.weight", "float32", [-1, 4]]], "give \\[name, dtype, shape\\]"),
                           ([["norm.weight", "float32", [4]]] * 13, "13 weights announced; the model has 2"),
                           (["embed.weight"], "give \\[name, dtype, shape\\]")]:
        with pytest.raises(ValueError, match=why):
            io.check_announced_weights(shapes, announced)
    io.check_announced_weights(io.checkpoint_shapes(str(tmp_path / "hub-id")), [["anything", "float32", [1]]])


def test_a_sync_folder_others_may_write_in_gets_a_private_folder_and_another_users_is_refused(tmp_path):
    """The review's L7: a vllm_sync_dir in a shared folder was used as found, so another local user could read the
    weights or swap a shard between the write and the load."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /dev/shm and /tmp are
    client = io.VLLMClient("127.0.0.1", 9, sync_dir=shared)
    assert client.sync_dir.parent == shared and client.sync_dir.stat().st_mode & 0o777 == 0o700
    client.close()
    assert not client.sync_dir.exists() and shared.exists()
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    assert io.private_folder(own) == (own, False)  # the user's own folder is used as given
    if os.getuid() == 0:  # only root can give a folder away
        os.chown(own, 12345, -1)
        with pytest.raises(ValueError, match="belongs to another user \\(uid 12345\\)"):
            io.private_folder(own)
