#!/usr/bin/env bash
# The accuracy gate on the H200 with every available MoE backend, both
# checkpoint kinds, on CUDA; then sglang as shipped, which must fail it.
#
# Run from the repo root (after the usual wheel install / PYTHONPATH export).
# Prints the gate tables and the "worst measured vs bound" lines, which the triton /
# deep_gemm entries of fp8_reload/kernels/bounds.toml were set from. Results go to $OUT
# if set. About 2 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fp8-gate-XXXXXX)  # checkpoints: kept out of $OUT (they are large)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}

echo "== environment"
$PY - <<'EOF'
import torch
import fp8_reload.kernels as k
print("torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for mod in ("triton", "deep_gemm"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
print("available MoE backends:", k.available_backends())
EOF

# "small": hidden 512, moe_intermediate 256 (multiples of 128, as DeepGEMM needs),
# 16 experts, 4 layers; the bounds were set on tiny and small.
echo
echo "== gate: fixed, all backends, small preset, cuda (expect exit 0)"
t0=$(date +%s)
$PY -m fp8_reload gate --device cuda --preset small --backend all --workdir "$WORK" \
    --json "$OUT/gate-fixed-small.json" 2>"$OUT/gate-fixed-small.log" | tee "$OUT/gate-fixed-small.txt"
rc_fixed=${PIPESTATUS[0]}
echo "(exit $rc_fixed, $(( $(date +%s) - t0 )) s; progress log: $OUT/gate-fixed-small.log)"
tail -n 3 "$OUT/gate-fixed-small.log"

echo
echo "== gate: upstream (sglang 0.5.23 as shipped), torch backend, cuda (expect exit 1)"
$PY -m fp8_reload gate --device cuda --preset small --backend torch --workdir "$WORK" \
    --processing upstream --json "$OUT/gate-upstream-small.json" 2>/dev/null \
    | grep -E '^(FAIL|gate )' | tee "$OUT/gate-upstream-small.txt"
rc_up=${PIPESTATUS[0]}

echo
echo "== gate: fixed, tiny preset (the CI configuration) on cuda, torch backend (expect exit 0)"
$PY -m fp8_reload gate --device cuda --preset tiny --backend torch --workdir "$WORK" 2>/dev/null \
    | tail -n 4
rc_tiny=${PIPESTATUS[0]}

echo
echo "== summary"
ok=1
[ "$rc_fixed" -eq 0 ] && echo "PASS fixed/small/all backends: exit 0" || { echo "FAIL fixed/small/all backends: exit $rc_fixed (expected 0)"; ok=0; }
[ "$rc_up" -eq 1 ] && grep -q '^gate FAILED' "$OUT/gate-upstream-small.txt" && echo "PASS upstream/small: exit 1 (the gate catches sglang as shipped)" || { echo "FAIL upstream/small: exit $rc_up (expected 1)"; ok=0; }
[ "$rc_tiny" -eq 0 ] && echo "PASS fixed/tiny/torch on cuda: exit 0" || { echo "FAIL fixed/tiny/torch on cuda: exit $rc_tiny (expected 0)"; ok=0; }
echo "results under $OUT"
[ "$ok" -eq 1 ]
