#!/usr/bin/env bash
# Nsight Compute proof that the NVTX ranges reach a tool: capture only kernels inside one
# fp8_reload range (--nvtx-include at capture time; '/' inside a range name is escaped as
# '\/'), then list what was captured with its NVTX stack (gpu/ncu_ranges.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CK=/tmp/ncu-ckpt; rm -rf "$CK"
$PY -m fp8_reload write-checkpoint "$CK" --preset small --num-layers 2 --kind fp8 >/dev/null
cap() {  # filter scenario backend
    echo "== ncu --nvtx --nvtx-include '$1'  (scenario $2, backend ${3:-torch})"
    timeout 120 ncu --nvtx --nvtx-include "$1" --clock-control none --target-processes all \
        --metrics gpu__time_duration.sum --csv --page raw --launch-count 200 \
        $PY -m fp8_reload.tools.profile --worker --checkpoint "$CK" --preset small --num-layers 2 \
        --device cuda --repeat 1 --tokens 256 --scenario "$2" ${3:+--backend $3} 2>/dev/null \
        | $PY gpu/ncu_ranges.py
}
cap 'fp8_reload@fp8_reload\/gemm_w13/' forward
cap 'fp8_reload@fp8_reload\/gemm_w2/' forward
cap 'fp8_reload@fp8_reload\/moe/' forward triton
cap 'fp8_reload@fp8_reload\/moe/' forward deep_gemm
cap 'fp8_reload@fp8_reload\/process_moe/' reload-full
cap 'fp8_reload@fp8_reload\/backup/' reload-full
