#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU (none runs in CI, which has no GPU):
#   bench/gpu_check.sh [tests|demo|bench|cudagraphs]...   (default: tests and demo side by side, then bench)
# tests: tests/test_gpu.py (CUDA engine equality, bf16 training, resume) plus the trainer suite's learning
# tests, which train on the GPU whenever one is present; demo: the demo pipeline in bf16 on the GPU;
# bench: bench_generation.py on the GPU (tiny fp32, 0.2B bf16); cudagraphs: the same with the compiled
# decode step under CUDA graphs (mode="reduce-overhead"), an experiment, not a product path.
# Logs and the demo's report go to $OUT (default /tmp/gpu-check). Wheels in .whl/ are installed first
# (a machine without package registries; see /work/.library/device/README.md in the workplace).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RLHF_CACHE=${RLHF_CACHE:-/tmp/rlhf-gpu-cache} HF_HUB_OFFLINE=1 WANDB_MODE=offline
if [ -d .whl ] && [ -z "${GPU_CHECK_INSTALLED:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site GPU_CHECK_INSTALLED=1 || exit 1
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, transformers, peft, accelerate, datasets; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', \
peft.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__); \
import importlib.util; print('flash_attn installed:', importlib.util.find_spec('flash_attn') is not None)"
} 2>&1 | tee -a "$OUT/env.txt"

run_tests() {
    timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -p no:cacheprovider -v -s --no-header \
        tests/test_gpu.py 2>&1 | grep -v "^$" > "$OUT/tests.log"
    timeout "${SUITE_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -n 6 --no-header \
        tests/test_trainers.py tests/test_preference.py tests/test_grpo.py tests/test_ppo.py tests/test_prm.py \
        -k "learn or resume or accumulation or equivalent" 2>&1 | tail -40 > "$OUT/suite.log"
}

run_demo() {
    local dir=/tmp/demo-gpu start=$SECONDS
    rm -rf "$dir"
    timeout "${DEMO_TIMEOUT:-330}" python3 rlhf.py pipeline --config configs/demo.yaml "output_dir=$dir" bf16=true \
        > "$OUT/demo.log" 2>&1
    echo "exit $? after $((SECONDS - start)) s" >> "$OUT/demo.log"
    cp "$dir/report.md" "$OUT/demo_report.md" 2>/dev/null
}

run_bench() {
    {
        timeout 150 python3 bench/bench_generation.py --device cuda --model tiny --batch-sizes 16,128 --repeats 3
        timeout 150 python3 bench/bench_generation.py --device cuda --dtype bfloat16 --model large \
            --batch-sizes 16,128 --repeats 3
    } > "$OUT/bench.log" 2>&1
}

run_cudagraphs() {
    timeout 200 python3 - > "$OUT/cudagraphs.log" 2>&1 <<'EOF'
import runpy, sys, torch
sys.path.insert(0, ".")
import inference_optimizations as io

def compiled_step(state):
    if state.compiled_step is None:
        state.compiled_step = torch.compile(io._decode_step, dynamic=False, mode="reduce-overhead")
    return state.compiled_step

io._compiled_step = compiled_step
for argv in (["--model", "tiny"], ["--dtype", "bfloat16", "--model", "large"]):
    sys.argv = ["bench_generation.py", "--device", "cuda", "--batch-sizes", "16,128", "--repeats", "3",
                "--engines", "hf,compiled", *argv]
    try:
        runpy.run_path("bench/bench_generation.py", run_name="__main__")
    except SystemExit:
        pass
EOF
}

python3 -c "import rlhf; rlhf.build_tiny_model()" || exit 1  # once, before parts run side by side
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    run_tests & run_demo & wait
    run_bench
else
    for part in "${parts[@]}"; do "run_$part"; done
fi
tail -n 3 "$OUT"/*.log
