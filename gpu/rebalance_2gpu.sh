#!/usr/bin/env bash
# On a 2x H200 host: expert parallelism across 2 ranks with NCCL, end to end.
#
#   OUT=/tmp/out bash gpu/rebalance_2gpu.sh          (from the repo root)
#   REBALANCE_BACKEND=gloo bash gpu/rebalance_2gpu.sh  (dry run on a CPU box: gloo, small models)
#   REBALANCE_STEPS="env copy-test checkpoint speed speed-triton" bash gpu/rebalance_2gpu.sh
#                                              (only the named steps; default: all but speed-triton)
#
# Steps (each under a timeout, all under one budget, REBALANCE_BUDGET_S, default 460 s):
#  env          torch, GPUs, NCCL, peer access; NVLink multicast kept OFF
#  cli-small    `fp8-reload rebalance`, every mode, fp8 + bf16: every rank equals a fresh load
#               under the new placement; the EP forward before/after on a skewed routing:
#               tokens and MoE time per rank, each rank against the single-device forward
#  copy-test    the rebalance's row moves on the GPU: the batched copy kernel (compiled) against
#               slices, both copy paths against pack_slots, a rollback from the send buffers
#  checkpoint   the v2-lite:3 benchmark checkpoint (2 MoE layers of 64 V2-Lite experts)
#  speed        the issue's rows alone: p2p, 32 experts/layer, one layer, all layers of v2-lite:3
#               and the whole 26-layer v2-lite, each beside one contiguous transfer of the same
#               bytes in the same run; per-phase device times from extra samples (a wait after
#               each phase), host phase times of the timed samples (-> rebalance_speed.json)
#  speed-triton the same rows moved by one Triton copy_rows_ launch per batch instead of torch
#               gathers (FP8_RELOAD_REBALANCE_COPY=triton: the A/B of the copy path)
#  bench        rebalance time vs experts moved x source x layers, each p2p row beside one
#               contiguous NCCL transfer of the same bytes (same ranks, same run), then the
#               whole v2-lite (26 MoE layers, filled on the device) in one rebalance
#  ep-balance   EP forward, Zipf routing, 4096 tokens/rank, triton: tokens and MoE time per
#               rank and layer, before / after balance_placement + rebalance (+ plot)
#  cli-v2lite   `fp8-reload rebalance` on the v2-lite:3 checkpoint, p2p, local experts in Triton
#  multinode    two `torchrun --nnodes 2` agents (one GPU each) on this host, NCCL
#  asv          the headline benchmarks under asv (machine h200x2, gpu/rebalance_asv.sh)
# Outputs under $OUT: rebalance_2gpu.log (everything), rebalance_speed[_triton].json, rebalance_nccl_small.json,
# rebalance_bench.json, ep_balance.json, ep_balance.png, rebalance_nccl_v2lite.json,
# multinode.json, asv_h200x2.tar.gz (results/asv/h200x2 + benchmarks-h200x2.json, to commit).
# Ends with a summary of every figure and PASS/FAIL per step. ~5-6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)

# Never use NVLink multicast (NVLS): not available to this project.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1

OUT=${OUT:-$(mktemp -d /tmp/rebalance-XXXX)}
mkdir -p "$OUT"
LOG="$OUT/rebalance_2gpu.log"
: > "$LOG"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || true
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FP8_RELOAD_BENCH_DIR=${FP8_RELOAD_BENCH_DIR:-/tmp/fp8-reload-bench}
PY=${PYTHON:-python3}
BACKEND=${REBALANCE_BACKEND:-nccl}  # gloo only to dry-run this script on a CPU box
if [ "$BACKEND" = gloo ]; then export FP8_RELOAD_BENCH_DEVICE=cpu; fi
BUDGET=${REBALANCE_BUDGET_S:-460}  # seconds from the start; steps are cut to what is left
STEPS=" ${REBALANCE_STEPS:-env cli-small copy-test checkpoint bench speed ep-balance cli-v2lite multinode asv} "
declare -a SUMMARY
FAIL=0

wanted() { [[ "$STEPS" == *" $1 "* ]]; }

step() {  # step NAME TIMEOUT_S CMD...: run within the budget, log, record the outcome
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then SUMMARY+=("FAIL  $name: not run, the ${BUDGET}s budget is spent"); FAIL=1; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$(date +%s)
  echo
  echo "================ $name (limit ${limit}s) ================" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t ))
  if [ "$rc" -eq 0 ]; then SUMMARY+=("PASS  $name (${dt}s)");
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then SUMMARY+=("FAIL  $name: timed out after ${limit}s"); FAIL=1;
  else SUMMARY+=("FAIL  $name: exit $rc (${dt}s)"); FAIL=1; fi
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
import fp8_reload.kernels as k
print("MoE backends:", k.available_backends(), "| cpus:", os.cpu_count())
os.makedirs(os.environ["FP8_RELOAD_BENCH_DIR"], exist_ok=True)
os.system(f"df -hT {os.environ['FP8_RELOAD_BENCH_DIR']} | tail -n 1")  # tmpfs: disk-cold cannot be cold
assert n >= 2 or os.environ.get("REBALANCE_BACKEND") == "gloo", "the rebalance checks need 2 GPUs"
EOF

step cli-small 120 $PY -m fp8_reload rebalance --world-size 2 --backend "$BACKEND" --mode all \
  --kind fp8,bf16 --preset small --tokens 1024 --json "$OUT/rebalance_nccl_small.json"

step copy-test 120 $PY -m pytest -q -p no:cacheprovider tests/test_rebalance_transfer.py

step checkpoint 120 $PY benchmarks/rebalance.py --checkpoint-only
CKPT=$(grep -E '^/' "$LOG" | tail -n 1)

step bench 200 $PY benchmarks/rebalance.py --repeat 5 --json "$OUT/rebalance_bench.json"

# 32 experts/layer on the GPUs; the CPU dry run's small preset has room for 8 (REBALANCE_SPEED_MOVED)
if [ "$BACKEND" = nccl ]; then SPEED_MOVED=${REBALANCE_SPEED_MOVED:-32}; else SPEED_MOVED=${REBALANCE_SPEED_MOVED:-8}; fi
step speed 150 env FP8_RELOAD_BENCH_MOVED=$SPEED_MOVED FP8_RELOAD_BENCH_SOURCES=p2p \
  $PY benchmarks/rebalance.py --repeat 7 --phase-repeat 3 --json "$OUT/rebalance_speed.json"

step speed-triton 150 env FP8_RELOAD_BENCH_MOVED=$SPEED_MOVED FP8_RELOAD_BENCH_SOURCES=p2p FP8_RELOAD_REBALANCE_COPY=triton \
  $PY benchmarks/rebalance.py --repeat 7 --phase-repeat 3 --json "$OUT/rebalance_speed_triton.json"

step ep-balance 120 $PY benchmarks/ep_forward.py --json "$OUT/ep_balance.json" --plot "$OUT/ep_balance.png"

# p2p only: the bench verified disk and hybrid moves of this checkpoint against fresh loads.
# The local experts through Triton on the GPUs (both sides of the comparison), torch on CPU.
if [ "$BACKEND" = nccl ]; then MOE=triton; else MOE=torch; fi
step cli-v2lite 100 $PY -m fp8_reload rebalance --world-size 2 --backend "$BACKEND" --mode p2p \
  --checkpoint "$CKPT" --kind fp8 --tokens 1024 --moe-backend "$MOE" --json "$OUT/rebalance_nccl_v2lite.json"

step multinode 90 bash -c '
  port=$((29600 + RANDOM % 300)); pids=()
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node '"$PY"' -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
      --node-rank $node --master-addr 127.0.0.1 --master-port $port -m fp8_reload rebalance \
      --backend '"$BACKEND"' --mode p2p,hybrid --tokens 256 --json '"$OUT"'/multinode.json &
    pids+=($!)
  done
  rc=0; for p in "${pids[@]}"; do wait $p || rc=1; done; exit $rc'

if ! wanted asv; then :
elif $PY -c "import asv" 2>/dev/null; then
  step asv 220 bash gpu/rebalance_asv.sh "$OUT"
else
  SUMMARY+=("SKIP  asv: asv is not installed here")
fi

SUM=$(mktemp /tmp/rebalance-summary-XXXX)  # not $LOG itself: the greps below read it
{
echo
echo "================ summary (rebalance 2xGPU, $(( $(date +%s) - T0 ))s, results in $OUT) ================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo
echo "-- rebalance benchmark (ms: per call from the driver; rank ms: slowest rank; bound: one"
echo "   contiguous transfer of the same bytes by the same ranks; phases of the p2p rows below):"
grep -E "^rebalance benchmark|^whole model|moved/layer" "$LOG" | cut -c1-160
grep -E "^ +[0-9]+ +(1|all|whole) +(p2p|disk|hybrid|disk-cold) " "$LOG" | cut -c1-94
grep -E "^ +[1-9][0-9]* +(1|all|whole) +p2p |^ +host \(timed runs" "$LOG" | sed -E 's/^ +([0-9]+) +([a-z0-9]+) +p2p .*(agree .*)$/  p2p \1 moved, layers \2 (device): \3/'
grep -E "^rows moved by|^p2p, " "$LOG"
echo
echo "-- EP forward balance (tokens and MoE ms per rank and layer):"
grep -E "^EP forward benchmark|^placement|^(start|balanced) +[0-9]|^balanced: |slowest rank / mean per layer|^goal:" "$LOG"
echo
echo "-- fp8-reload rebalance runs (EP forward vs single device per rank), multinode, asv:"
$PY gpu/rebalance_figures.py "$OUT"
if [ "$FAIL" -eq 0 ]; then echo "rebalance 2xGPU: ALL PASS"; else echo "rebalance 2xGPU: FAILURES above"; fi
} > "$SUM"
cat "$SUM"; cat "$SUM" >> "$LOG"; rm -f "$SUM"
exit "$FAIL"
