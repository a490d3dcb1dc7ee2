#!/usr/bin/env bash
# GPU checks for the streaming reload engine (issue 13) and the kernels (issue 14):
# the invariant and streaming tests on CUDA, the I/O table beside the limits and the
# field's loaders (v2-lite:4 fp8 + bf16, then the whole v2-lite), the kernels probe.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
nproc | tee -a "$OUT/machine.txt"; free -g | head -2 | tee -a "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_stream.py tests/test_requant.py \
  "tests/test_reload.py" "tests/test_reliability.py" "tests/test_concurrency.py" -k "cuda or CUDA or stream or requant" \
  > "$OUT/pytest_cuda.log" 2>&1; tail -25 "$OUT/pytest_cuda.log"
# planning across parses, blocked post-processing (its device-peak bound runs only here)
python3 -m pytest -q -p no:cacheprovider tests/test_blocks.py tests/test_filtered_plan.py \
  tests/test_review_s3.py > "$OUT/pytest_plan_blocks.log" 2>&1; tail -5 "$OUT/pytest_plan_blocks.log"
python3 gpu/peak_check.py 2>&1 | tee "$OUT/peak_check.txt"
[ -n "${PROBE:-}" ] && python3 gpu/kernels_probe.py --out "$OUT/kernels_probe.json" 2>&1 | tee "$OUT/kernels_probe.log"
# one process per kind: a library's leftover threads slow the Python measured after it
for kind in fp8 bf16; do
  whole=""; [ "$kind" = fp8 ] && whole=${WHOLE:+--whole}
  timeout ${IO_TIMEOUT:-420} python3 gpu/reload_io.py --layers 4 --kinds $kind $whole \
    --out "$OUT/reload_io-$kind" 2>&1 | tee "$OUT/reload_io-$kind.log"
done
