#!/usr/bin/env bash
# On a 2x H200 host: expert-parallel rebalance across 2 ranks with NCCL.
#
#   bash gpu/rebalance_2gpu.sh        (from the repo root; logs and results go under "$OUT")
#
# 1. environment: torch, GPUs, NCCL, peer access, NVLink multicast kept OFF
# (the CPU suite, gloo with 2 and 4 ranks, is CI's: tests/test_*placement*, *rebalance*)
# 2. `fp8-reload rebalance` with NCCL on the two GPUs, every mode, fp8 + bf16 checkpoints:
#    every rank must equal a fresh load under the new placement (bitwise)
# 3. the rebalance benchmark (time vs experts moved, p2p vs disk vs cold disk) on
#    DeepSeek-V2-Lite-sized experts (64 x 8.3 MiB per MoE layer): prints the table,
#    writes $OUT/rebalance_bench.json (commit as results/rebalance_h200.json)
# 4. `fp8-reload rebalance` with NCCL on that V2-Lite-sized checkpoint, every mode
# Ends with one line per step and an overall PASS/FAIL. Budget: < 3 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

# Never use NVLink multicast (NVLS): not available to this project.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

OUT=${OUT:-$(mktemp -d /tmp/rebalance-XXXX)}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || true
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FP8_RELOAD_BENCH_DIR=${FP8_RELOAD_BENCH_DIR:-/tmp/fp8-reload-bench}
PY=python3
BACKEND=${REBALANCE_BACKEND:-nccl}  # gloo only to dry-run this script on a CPU box
T0=$(date +%s)
declare -a SUMMARY
FAIL=0

step() {  # step NAME TIMEOUT_S CMD...: run, tee the log into $OUT, record the outcome
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  echo
  echo "================ $name ================"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t ))
  if [ "$rc" -eq 0 ]; then SUMMARY+=("PASS  $name (${dt}s)");
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then SUMMARY+=("FAIL  $name: timed out after ${limit}s"); FAIL=1;
  else SUMMARY+=("FAIL  $name: exit $rc (${dt}s, see $OUT/$name.log)"); FAIL=1; fi
}

step env 60 $PY - <<'EOF'
import os, torch
try:
    nccl = torch.cuda.nccl.version()
except Exception as e:  # CPU-only torch
    nccl = f"n/a ({type(e).__name__})"
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", nccl)
n = torch.cuda.device_count()
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
if n >= 2:
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
print({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")})
print("posix_fadvise:", hasattr(os, "posix_fadvise"), "| cpus:", os.cpu_count())
bench_dir = os.environ["FP8_RELOAD_BENCH_DIR"]
os.makedirs(bench_dir, exist_ok=True)
os.system(f"df -hT {bench_dir} | tail -n 1")  # tmpfs: the disk-cold rows cannot be cold
assert n >= 2 or os.environ.get("REBALANCE_BACKEND") == "gloo", "the rebalance checks need 2 GPUs"
EOF

step nccl-small 120 $PY -m fp8_reload rebalance --world-size 2 --backend "$BACKEND" --mode all \
  --kind fp8,bf16 --preset small --json "$OUT/rebalance_nccl_small.json"

step bench-checkpoint 150 $PY benchmarks/rebalance.py --checkpoint-only
CKPT=$(grep -E '^/' "$OUT/bench-checkpoint.log" | tail -n 1)

step bench 300 $PY benchmarks/rebalance.py --repeat 5 --json "$OUT/rebalance_bench.json"

step nccl-v2lite 150 $PY -m fp8_reload rebalance --world-size 2 --backend "$BACKEND" --mode all \
  --checkpoint "$CKPT" --kind fp8 --json "$OUT/rebalance_nccl_v2lite.json"

echo
echo "================ summary (rebalance, $(( $(date +%s) - T0 ))s, results in $OUT) ================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
if [ -f "$OUT/bench.log" ]; then
  echo
  echo "benchmark table (also in $OUT/rebalance_bench.json):"
  grep -E "^rebalance benchmark|moved/layer|^ +[0-9]+ (p2p|disk)" "$OUT/bench.log"
fi
if [ "$FAIL" -eq 0 ]; then echo "rebalance 2xGPU: ALL PASS"; else echo "rebalance 2xGPU: FAILURES above"; fi
exit "$FAIL"
