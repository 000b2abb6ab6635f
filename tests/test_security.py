"""Issue 55, the parts built so far: a run folder holds one model (the final save replaces the folder's model as a
set, a failed save leaves no temporary folder, metrics.jsonl and JSON reports are rewritten atomically), weight-sync
folders in shared memory do not outlive their process, the calculator bounds its numbers, and reward and environment
services get no credential through a redirect and cannot answer without bound (docs/security-review findings H3, L3,
L4, L5, M7, M8, L1, L2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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


class _Services:
    """A redirecting endpoint and the host it redirects to, which records what reaches it."""

    def __init__(self) -> None:
        self.reached: list[dict] = []
        services = self

        class Target(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                services.reached.append(dict(self.headers))
                self._answer({"rewards": [42.0]})

            do_POST = do_GET  # noqa: N815

            def _answer(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
