#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU (none runs in CI, which has no GPU):
#   bench/gpu_check.sh [tests|suite|demo|bench|rollouts|vision]...
# With no argument: tests, then suite, beside demo; then bench.
#   tests     tests/test_gpu.py (engines on CUDA, bf16 training, resume, reference placement)
#   suite     the trainer suite's learning, resume and invariance tests, which train on the GPU whenever one
#             is present (needs pytest-xdist)
#   demo      the demo pipeline with bf16=true
#   bench     bench_generation.py on cuda: the tiny model in fp32, a 0.22B Llama in bf16
#   rollouts  200 compiled generate calls of one shape: time per call and GPU memory must stay flat
#   vision    bench/gpu_vl_check.py (image prompts through every engine against the trainer's forward; Qwen's
#             AutoProcessor where torchvision imports) and bench_generation.py --model tiny-vl on cuda
# Logs and the demo's report.md go to $OUT (default /tmp/gpu-check). Wheels in .whl/ (downloaded with
# `pip download --only-binary=:all:` for the GPU machine's Python) are installed first, for a machine that
# reaches no package registry.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RLHF_CACHE=${RLHF_CACHE:-/tmp/rlhf-gpu-cache} HF_HUB_OFFLINE=1 WANDB_MODE=offline
if [ -d .whl ] && [ -z "${GPU_CHECK_INSTALLED:-}" ]; then
    rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
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
}

run_suite() {  # the trainer suite's learning, resume and invariance tests, which train on the GPU when one is present
    timeout "${SUITE_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -n 6 --no-header --tb=short \
        tests/test_trainers.py tests/test_preference.py tests/test_grpo.py tests/test_ppo.py tests/test_prm.py \
        -k "learn or resume or accumulation or equivalent" > "$OUT/suite.log" 2>&1
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
        timeout 120 python3 bench/bench_generation.py --device cuda --model tiny --batch-sizes 16,128 --repeats 3
        timeout 120 python3 bench/bench_generation.py --device cuda --dtype bfloat16 --model large \
            --batch-sizes 16,128 --repeats 3
    } > "$OUT/bench.log" 2>&1
}

run_vision() {
    {
        timeout "${VISION_TIMEOUT:-150}" python3 bench/gpu_vl_check.py --device cuda
        timeout 120 python3 bench/bench_generation.py --device cuda --model tiny-vl --batch-sizes 16,64 \
            --new-tokens 32 --repeats 3 --engines hf,compiled,static,eager
    } > "$OUT/vision.log" 2>&1
}

run_rollouts() {  # 200 generate calls of one shape, as GRPO makes them: time per call and GPU memory stay flat
    timeout "${ROLLOUTS_TIMEOUT:-120}" python3 - > "$OUT/rollouts.log" 2>&1 <<'EOF'
import sys, time, torch
sys.path.insert(0, ".")
import inference_optimizations as io, rlhf
path = rlhf.build_tiny_model()
tokenizer = rlhf.load_tokenizer(path)
model = rlhf.load_causal_lm(str(path), attn_implementation="sdpa")[0].cuda().eval()
prompts = [[1] + [10 + (i * 7 + j) % 200 for j in range(18 + i % 5)] for i in range(8)]
params = io.SamplingParams(max_new_tokens=64, temperature=1.0, n=8, seed=0)
for call in range(200):
    start = time.perf_counter()
    io.generate(model, prompts, params, pad_token_id=tokenizer.pad_token_id, eos_token_id=None, engine="compiled")
    seconds = time.perf_counter() - start
    if call in (0, 1, 2, 10, 50, 100, 127, 128, 129, 130, 150, 199):
        print(f"call {call}: {seconds * 1000:.1f} ms, allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB", flush=True)
EOF
}

python3 -c "import rlhf; rlhf.build_tiny_model()" || exit 1  # once, before parts run side by side
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
    { run_tests; run_suite; } & run_demo & wait
    run_bench
else
    for part in "${parts[@]}"; do
        case "$part" in
            tests|suite|demo|bench|rollouts|vision) "run_$part" ;;
            *) echo "error: unknown part '$part'; use tests, suite, demo, bench, rollouts or vision" >&2; exit 2 ;;
        esac
    done
fi
tail -n 3 "$OUT"/*.log
