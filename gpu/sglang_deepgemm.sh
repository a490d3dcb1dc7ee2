#!/usr/bin/env bash
# GPU checks of the sglang patch. Runs from the repo root in well under a minute.
# 1. DeepGEMM's grouped FP8 GEMM on the block scales the patched sglang builds from the
#    [E, 2] layout, after a fresh load and after an in-place reload (PASS/FAIL lines).
# 2. tests_sglang on this host, only if sglang is installed here (it is not among .whl/).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rc=0
python3 gpu/sglang_deepgemm.py 2>&1 | tee "$OUT/sglang_deepgemm.txt"; rc=$(( rc | PIPESTATUS[0] ))
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"; then
  python3 -m pytest -q -p no:cacheprovider -W ignore tests_sglang 2>&1 | tee "$OUT/tests_sglang.txt" | tail -15
  rc=$(( rc | PIPESTATUS[0] ))
else
  echo "NOT RUN tests_sglang / sglang's Triton and DeepGEMM runners: sglang is not installed on this host"
fi
echo "sglang patch GPU checks: $([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
exit "$rc"
