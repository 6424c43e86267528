#!/usr/bin/env bash
# What runs on a GPU machine, in one go (issue 27): the tests that need a GPU, the same
# tests with each GPU ordering bug planted (they must fail), the copy paths' benchmark and
# `kv-offload bench --tier host --device cuda`, then the whole unit suite with a GPU
# present. Needs torch with CUDA, cupy and cuda-bindings (kv-offload[cuda]); nothing is
# installed: the tree is imported from here (PYTHONPATH).
#
#   OUT=/tmp/gpu-session bash benchmarks/gpu_session.sh
#
# Writes session.log, tests.log, suite.log, cuda_paths*.json and bench_cpu.jsonl under
# $OUT. SKIP_BENCH=1: tests only.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
exec > >(tee "$OUT/session.log") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider)

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -c "import sys, torch, cupy, numpy; import cuda.bindings as cb
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'cupy', cupy.__version__, 'cuda-bindings', cb.__version__, 'numpy', numpy.__version__,
      'driver', cupy.cuda.runtime.driverGetVersion())
pool = torch.empty(1 << 20, dtype=torch.int8)
torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
print('a cudaHostRegister-ed tensor: torch is_pinned()', pool.is_pinned(), '; the driver:',
      cupy.cuda.runtime.pointerGetAttributes(pool.data_ptr()).type, '(1: page-locked host)')"

step "tests that need a GPU"
timeout 300 "${PYTEST[@]}" tests/unit/kernels/test_gpu_device.py \
    "tests/unit/kernels/test_cuda.py::test_gpu_round_trip_matches_cpu_reference" \
    "tests/unit/kernels/test_cuda.py::test_backend_on_gpu_pins_and_round_trips" \
    "tests/unit/store/host/test_cpu_backend.py::test_pool_is_pinned_with_cuda" \
    "tests/unit/store/host/test_cpu_backend.py::test_budget_sizes_the_pool" \
    tests/unit/kernels/test_cuda_paths.py 2>&1 | tee "$OUT/tests.log" | tail -25

planted() {  # $1: what is planted, $2: python that plants it, $3: pytest -k
    step "planted bug: $1 (these tests must FAIL)"
    timeout 120 python3 - "$3" <<EOF 2>&1 | tail -6
import sys
import pytest
$2
code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/unit/kernels/test_gpu_device.py",
                    "-k", sys.argv[1]])
print("PLANTED BUG RESULT:", "tests failed, as they must" if code == 1 else f"exit {code}: NOT caught")
EOF
}
planted "copies do not wait for the engine's event" \
    "from kv_offload.kernels.cuda_runtime import CupyRuntime
CupyRuntime.stream_wait_event = lambda self, stream, event: None" "waits or zeroes"
planted "a job's descriptor buffer goes back to the pool at once" \
    "from kv_offload.kernels.cuda import CudaJob
CudaJob.hold = lambda self, buffer: self._pool.release(buffer)" "descriptors"
planted "a closed host tier leaves its pool pinned" \
    "from kv_offload.store.host import tier
tier.release_pinned = lambda pool: None" "unpins"

if [ -z "${SKIP_BENCH:-}" ]; then

step "copy paths side by side (benchmarks/bench_cuda_paths.py)"
timeout 300 python3 benchmarks/bench_cuda_paths.py --json "$OUT/cuda_paths.json"
for knob in "chunk-kib 64" "grid 132" "grid 528"; do  # the kernel's knobs, kernel only
    step "kernel with --kernel-$knob"
    # shellcheck disable=SC2086
    timeout 200 python3 benchmarks/bench_cuda_paths.py --paths kernel --kernel-$knob \
        --json "$OUT/cuda_paths_${knob// /}.json" | tail -32
done

step "kv-offload bench --tier host --device cuda"
for args in "--model llama-8b" "--model llama-8b --pattern scattered" \
            "--page-kib 2 --layers 32" "--page-kib 2 --layers 32 --pattern scattered" \
            "--page-kib 16 --layers 32" "--page-kib 16 --layers 32 --pattern scattered" \
            "--model qwen3-next" "--model deepseek-mla"; do
    echo "--- kv-offload bench --tier host --device cuda $args"
    # shellcheck disable=SC2086
    timeout 120 python3 -c "import sys; from kv_offload.tools.cli import main; sys.exit(main())" \
        bench --tier host --device cuda --repeats 5 $args --json - >>"$OUT/bench_cpu.jsonl"
done

fi  # SKIP_BENCH

step "the unit suite with a GPU present (no servers here: those tests skip)"
timeout "${SUITE_S:-150}" "${PYTEST[@]}" -v -n "${SUITE_WORKERS:-8}" -rfE --continue-on-collection-errors \
    tests/unit >"$OUT/suite.log" 2>&1
grep -E "(FAILED|ERROR) |passed|failed" "$OUT/suite.log" | tail -60  # -v: names even on timeout
step "end"
