"""pin_cpu_kernels: a process that calls it before its first torch operation computes exactly what a process
started with the AVX2 settings exported computes, so results do not depend on whether the CPU has AVX-512.
Each case runs in a fresh interpreter, because a process fixes its kernels at its first torch operation."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "RLHF_CPU_KERNELS")

# a few steps of what training does on the CPU: matmuls, softmax, RMS norm, a reduction, AdamW
PROGRAM = """
import json, os, sys
sys.path.insert(0, {repo!r})
import inference_optimizations as io
pinned = io.pin_cpu_kernels() if {pin} else None
import torch
torch.set_num_threads(2)
torch.manual_seed(0)
layer = torch.nn.Linear(96, 96)
optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
x = torch.randn(64, 96)
for _ in range(5):
    h = layer(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    loss = torch.log_softmax(h @ h.T / 10, -1).diagonal().mean().neg()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps({{"pinned": pinned, "capability": torch.backends.cpu.get_cpu_capability(),
                   "env": {{k: os.environ.get(k) for k in {settings!r}}}, "weight": layer.weight.flatten().tolist()}}))
"""


def run(pin: bool, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    program = PROGRAM.format(repo=str(REPO), pin=pin, settings=SETTINGS)
    out = subprocess.run([sys.executable, "-c", program], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def has_avx2() -> bool:
    return run(False, ATEN_CPU_CAPABILITY="avx2")["capability"] == "AVX2"


needs_avx2 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")


@needs_avx2
def test_pinned_process_computes_what_an_exported_avx2_process_computes():
    if not has_avx2():
        pytest.skip("this CPU has no AVX2")
    pinned = run(True)
    exported = run(False, ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert pinned["pinned"] == pinned["capability"] == "AVX2"
    assert pinned["env"]["MKL_CBWR"] == "AVX2" and pinned["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert pinned["weight"] == exported["weight"]  # bit for bit
    native = run(False)
    if native["capability"] != "AVX2":  # an AVX-512 machine: its own kernels round differently
        assert native["weight"] != pinned["weight"]


@needs_avx2
def test_native_and_user_settings_win():
    native = run(True, RLHF_CPU_KERNELS="native")
    assert native["pinned"] is None and native["env"]["ATEN_CPU_CAPABILITY"] is None
    assert native["weight"] == run(False)["weight"]
    chosen = run(True, ATEN_CPU_CAPABILITY="default")  # a setting the user exported is kept
    assert chosen["pinned"] == chosen["capability"] == "DEFAULT"
    assert chosen["env"]["MKL_CBWR"] == "AVX2"


def test_cli_pins_before_its_first_torch_operation(tmp_path):
    """`python rlhf.py` reaches main() with no torch operation run yet: its kernels are the pinned ones."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not has_avx2():
        pytest.skip("needs an x86-64 CPU with AVX2")
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    program = ("import runpy, sys, torch; sys.argv = ['rlhf.py', 'plan', '--preset', '7b', '--gpus', '1'];"
               "import rlhf; rlhf.main(sys.argv[1:]); print('capability', torch.backends.cpu.get_cpu_capability())")
    out = subprocess.run([sys.executable, "-c", program], env=clean, capture_output=True, text=True, cwd=REPO,
                         check=True, timeout=300)
    assert "capability AVX2" in out.stdout
    assert "CPU kernels: AVX2 paths" in out.stdout
