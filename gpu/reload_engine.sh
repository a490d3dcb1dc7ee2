#!/usr/bin/env bash
# GPU checks for the streaming reload engine (issue 13) and the kernels (issue 14), in parts
# that each fit one device call (10 minutes):
#   PART=checks   the CUDA tests of the engine (streaming, reload, reliability with the soak,
#                 kernels, state), the device-memory peak of full reloads, the processing
#                 probe, the forward probe (eager, host time, graph)               ~6 min
#   PART=reviews  the CUDA cases of the review tests (tests/test_review_*.py)    ~3 min
#   PART=io       the I/O table beside the limits and the field's loaders (v2-lite:4 fp8 then
#                 bf16, one process each; WHOLE=1 adds the whole v2-lite), then the first
#                 reload under ring shapes (.scratch-free: gpu/first_ring.py)       ~5 min
#   PART=all      all three (default; longer than one device call)
# (one selection of both kinds of test took over 7 minutes on a fresh H200 on 2026-12-05:
# test_stream.py, last in the order, never ran)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-all}
case "$PART" in checks|reviews|io|all) ;; *) echo "PART=$PART: expected checks, reviews, io or all" >&2; exit 2;; esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
nproc | tee -a "$OUT/machine.txt"; free -g | head -2 | tee -a "$OUT/machine.txt"
SELECT="cuda or CUDA or gpu or device or stream or requant or concurrency or state or soak"
REVIEWS=(tests/test_review_*.py)
if [ "$PART" = reviews ] || [ "$PART" = all ]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider "${REVIEWS[@]}" -k "$SELECT" \
    > "$OUT/pytest_reviews.log" 2>&1; echo "pytest (reviews) exit $?"; tail -8 "$OUT/pytest_reviews.log"
fi
if [ "$PART" = checks ] || [ "$PART" = all ]; then
  IGNORE=(); for f in "${REVIEWS[@]}"; do IGNORE+=(--ignore "$f"); done
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests "${IGNORE[@]}" -k "$SELECT" \
    > "$OUT/pytest_cuda.log" 2>&1; echo "pytest exit $?"; tail -8 "$OUT/pytest_cuda.log"; grep -h "^soak" "$OUT/pytest_cuda.log"
  timeout 60 python3 gpu/peak_check.py 2>&1 | tee "$OUT/peak_check.txt"
  timeout 90 python3 gpu/process_probe.py --no-tests 2>&1 | grep -E "process|launch" | tee "$OUT/process_probe.txt"
  timeout 90 python3 gpu/kernels_probe.py --skip-processing --out "$OUT/kernels_probe.json" 2>&1 \
    | tee "$OUT/kernels_probe.log" | grep -E "forward|launch|limits"
fi
if [ "$PART" = io ] || [ "$PART" = all ]; then
  # one process per kind: a library's leftover threads slow the Python measured after it
  for kind in fp8 bf16; do
    whole=""; [ "$kind" = fp8 ] && whole=${WHOLE:+--whole}
    # the whole model's rows (its cold reads ~10 s each) took 170+ s on a slow host
    limit=${IO_TIMEOUT:-$([ -n "$whole" ] && echo 300 || echo 200)}
    timeout $limit python3 gpu/reload_io.py --layers 4 --kinds $kind $whole \
      --out "$OUT/reload_io-$kind" 2>&1 | tee "$OUT/reload_io-$kind.log" | grep -E "^\[v2|bit for bit"
  done
  timeout 80 python3 gpu/first_ring.py /tmp/ckpt_io/v2-lite-4-fp8 2>&1 | tee "$OUT/first_ring.txt"
fi
