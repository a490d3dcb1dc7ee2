#!/usr/bin/env bash
# The MoE forward kernels on the H200 (Triton, DeepGEMM contiguous/masked).
#   1. compile every DeepGEMM/Triton kernel the benchmarks and the GPU tests use, in parallel
#      processes (DeepGEMM JIT-compiles each shape with nvcc; both cache on disk);
#   2. GPU tests: accuracy bounds, agreement, reload == fresh load (bitwise), stale-cache and
#      [E,2]-misread controls, CUDA-graph replay;
#   3. the timed benchmarks: fp8-reload bench-kernels.
# Writes $OUT/kernels/{kernels.md,kernels_*.csv}, $OUT/pytest_kernels.log, $OUT/prewarm.log.
# Expected wall time ~3-4 minutes, most of it the DeepGEMM nvcc JIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kernels-out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[kernels +$(( $(date +%s) - T0 ))s] $*"; }

if ! python3 -c "import deep_gemm" >/dev/null 2>&1 && [ -d .whl ]; then
  stamp "installing .whl/*.whl into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/dg-jit-cache}
mkdir -p "$DG_JIT_CACHE_DIR"
NPROC=$(nproc)
JIT_PROCS=$(( NPROC > 4 ? NPROC - 4 : 1 ))

stamp "environment"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
python3 - <<'PY'
import torch, importlib.metadata as md
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for pkg in ("triton", "sgl-deep-gemm", "apache-tvm-ffi"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "MISSING")
from fp8_reload import kernels
status = kernels.backend_status()
for name, why in status.items():
    print(f"backend {name:17s}", "available" if why is None else f"UNAVAILABLE: {why}")
if status["deep_gemm"] is None:
    from fp8_reload.kernels.deep_gemm import deep_gemm_lib
    print(deep_gemm_lib().describe())
PY

stamp "compiling every kernel (benchmarks + GPU tests' shapes) in $JIT_PROCS processes -> $OUT/prewarm.log"
timeout 300 python3 -m fp8_reload bench-kernels --jit-only --jit-procs "$JIT_PROCS" --jit-extra small:64 \
  > "$OUT/prewarm.log" 2>&1
PREWARM_RC=$?
stamp "prewarm rc=$PREWARM_RC"
grep -E "prewarm\]" "$OUT/prewarm.log" | tail -n 30
[ "$PREWARM_RC" = 0 ] || tail -n 30 "$OUT/prewarm.log"

stamp "GPU tests -> $OUT/pytest_kernels.log"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py \
  > "$OUT/pytest_kernels.log" 2>&1
PYTEST_RC=$?
stamp "GPU tests rc=$PYTEST_RC"
tail -n 40 "$OUT/pytest_kernels.log"

stamp "timed benchmarks"
timeout 300 python3 -m fp8_reload bench-kernels --out "$OUT/kernels" --iters 20
BENCH_RC=$?
stamp "done: pytest rc=$PYTEST_RC, bench-kernels rc=$BENCH_RC (0 = every target met and every backend within its accuracy bound)"
ls -la "$OUT/kernels" 2>/dev/null
[ "$PYTEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
