#!/usr/bin/env bash
# The asv suite on the H200: every figure of the report on a v2-lite slice (benchmarks/grouped.py:
# 2 measuring processes + 48 light lookups), the report, the headline ratios against their targets.
#
#   bash gpu/asv_suite.sh                 # from the repo root; ~2.5 minutes on a fresh H200
#   PHASES=1 bash gpu/asv_suite.sh        # also where reload time goes, per phase (+~30 s)
#   FP8_RELOAD_COMMIT=<sha> bash gpu/asv_suite.sh   # record results under this commit when
#                                                # the copy on the device has no .git
#   BENCH_GROUPS=io bash gpu/asv_suite.sh # the I/O paths beside the limits (benchmarks/io.py:
#                                         # warm and cold, ~60 figures, minutes of disk reads)
#   BENCH_GROUPS=reload,io FP8_RELOAD_BENCH_IO_CACHES=warm bash gpu/asv_suite.sh
#                                         # the reload beside the pinned-copy limit in one run:
#                                         # the headline judges "vs pinned host-to-device copy"
#                                         # (253 s on a warm H200, 2026-12-05)
#
# Time: asv runs each parameter combination in a process of its own, ~4-8 s each on the
# H200 (spawn, torch + CUDA start, the model slice, 3 samples): the per-process selection
# took 435 s of asv (45 processes; results/h200/asv-suite/). benchmarks/grouped.py measures
# the figures (48 now) in 2 processes (one per group: reload + post-processing, forward;
# each checkpoint's model loaded once) and hands them to asv through one lookup process each
# that import no torch. Measured on fresh H200s: 144 s and 150 s in all (asv 90-94 s).
# Results: $OUT/asv/<machine>/*.json (+ benchmarks.json) -> commit them as results/asv/,
#          $OUT/report/ (headline.md/csv, forward.csv, PNG plots), $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/asv-suite-out}
mkdir -p "$OUT"
# asv drops PYTHONPATH in the benchmark processes unless ASV_PYTHONPATH carries it
# (deep_gemm, asv_runner etc. live in /tmp/site on the H200).
export PYTHONPATH=${PYTHONPATH:-}:$PWD
export ASV_PYTHONPATH=$PYTHONPATH
export FP8_RELOAD_BENCH_DEVICE=${FP8_RELOAD_BENCH_DEVICE:-cuda}  # cpu: dry run of the plumbing
export FP8_RELOAD_BENCH_PRESETS=${FP8_RELOAD_BENCH_PRESETS:-v2-lite:4}
export FP8_RELOAD_BENCH_DIR=${FP8_RELOAD_BENCH_DIR:-/tmp/fp8-reload-bench-ckpt}
MACHINE=${ASV_MACHINE:-h200}
PY=${PYTHON:-python3}
t_start=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(no nvidia-smi)"
$PY - <<'EOF'
import torch, asv, importlib.util as u
print("torch", torch.__version__, "cuda", torch.version.cuda, "asv", asv.__version__,
      "| triton", bool(u.find_spec("triton")), "deep_gemm", bool(u.find_spec("deep_gemm")))
import fp8_reload.kernels as k
print("MoE backends available:", k.available_backends())
for name, why in getattr(k, "UNAVAILABLE", {}).items():
    print(f"  {name}: unavailable: {why}")
EOF

# asv needs a git commit to file results under. The device copy may have no .git:
# then make a scratch repo here and, if FP8_RELOAD_COMMIT is given, rename afterwards.
if SHA=$(git rev-parse HEAD 2>/dev/null); then
  dirty=$(git status --porcelain | wc -l)
  echo "commit $SHA (dirty files: $dirty)"
  if [ "$dirty" -gt 0 ] && [ -z "${FP8_RELOAD_COMMIT:-}" ]; then
    # (a device copy can carry a .git older than its files: 2026-12-05, HEAD e802b08 + 42 files)
    echo "WARNING: the results are filed under $SHA, which is not the code that runs here;" \
         "set FP8_RELOAD_COMMIT=<the commit of these files>"
  fi
else
  echo "no git repository here: committing this copy to a scratch repo for asv"
  # branch "main": asv.conf.json names it
  git init -q . && git symbolic-ref HEAD refs/heads/main && git add -A >/dev/null && \
    git -c user.email=h200@local -c user.name=h200 commit -qm "h200 run of ${FP8_RELOAD_COMMIT:-unknown}" \
    && SHA=$(git rev-parse HEAD) || { echo "FAILED: git is needed by asv"; exit 1; }
fi

$PY - "$MACHINE" <<'EOF'
import sys, torch
from fp8_reload.tools.regress import ensure_machine
gpu = {}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    gpu = dict(gpu=f"{p.name} ({p.total_memory / 2**30:.0f} GiB)", cuda=torch.version.cuda)
info = ensure_machine(sys.argv[1], torch=torch.__version__, **gpu)
print("asv machine:", info)
EOF

# The checkpoints (v2-lite:4 fp8 + bf16, ~40 s on a fresh host) are written while the
# JIT caches compile; asv's setup_cache then finds them in FP8_RELOAD_BENCH_DIR.
$PY -c "
import time; t = time.perf_counter()
from benchmarks.common import CheckpointSuite
CheckpointSuite().setup_cache()  # what asv's setup_cache will find
print(f'written or reused in {time.perf_counter() - t:.1f}s')" > "$OUT/checkpoints.log" 2>&1 &
CKPT_PID=$!

echo
echo "== JIT caches (DeepGEMM / Triton kernels of the token counts the suite runs, compiled in parallel once)"
if [ "$FP8_RELOAD_BENCH_DEVICE" = cuda ] && [[ ",${BENCH_GROUPS:-forward}," == *,forward,* ]]; then
  $PY -m fp8_reload bench-kernels --jit-only --jit-procs 12 --no-gemm \
    --tokens "${FP8_RELOAD_PREWARM_TOKENS:-128,512,4096}" --out "$OUT/jit" 2>&1 | tail -3
fi

wait "$CKPT_PID" 2>/dev/null; echo "== checkpoints: $(tail -1 "$OUT/checkpoints.log")"

if [ "${PHASES:-0}" = 1 ]; then
echo
echo "== where reload time goes (fixed model, phases of the last of 3 reloads)"
$PY - <<'EOF' 2>&1 | tee "$OUT/phases.log"
import os, time, torch
import fp8_reload as fr
from benchmarks.common import DEVICE, ON_CUDA, PRESETS, fraction_experts, write_checkpoints, device_peak_bytes, sync
from pathlib import Path
t0 = time.perf_counter()
paths = write_checkpoints(Path(os.environ["FP8_RELOAD_BENCH_DIR"]), kinds=["fp8"])
path = paths[f"{PRESETS[0]}-fp8"]
print(f"checkpoints ready in {time.perf_counter() - t0:.1f}s: {path} "
      f"({fr.Checkpoint(path).total_bytes() / 2**30:.2f} GiB)")
m = fr.load_model(path, device=DEVICE)
print("fresh load:", m.load_report.summary())
one = fr.generate_weight_name_filter(fraction_experts(m.config, "1/layer"))
for label, flt, kw in [("1 expert/layer fixed", one, {}),
                       ("1 expert/layer scan-all", one, dict(scan_all=True)),
                       ("1 expert/layer upstream-style", one, dict(scan_all=True, postprocess_all=True)),
                       ("full", None, {})]:
    for _ in range(3):
        sync(); t = time.perf_counter()
        r = fr.update_weights_from_disk(m, path, flt, **kw)
        sync(); dt = time.perf_counter() - t
    peak = "n/a"
    if ON_CUDA:
        peak = f"{device_peak_bytes(lambda: fr.update_weights_from_disk(m, path, flt, **kw)) / 2**20:.1f} MiB"
    print(f"{label:30s} {dt * 1e3:8.1f} ms  device peak +{peak}  {r.summary()}")
EOF

fi

echo
echo "== asv run (spawn; benchmarks.grouped: 2 measuring processes + one lookup per figure)"
# Each figure of the report is one case of benchmarks/grouped.py: the two groups'
# setup_cache processes measure them (3 samples each, the best kept), the lookup
# processes (no torch) hand them to asv. The selection is exactly those cases.
mapfile -t CASES < <($PY -m benchmarks.grouped "${BENCH_GROUPS:-reload,forward}")
BENCH=()
for c in "${CASES[@]}"; do BENCH+=(-b "$c"); done
echo "${#CASES[@]} figures"
# A commit's results already committed (results/asv/<machine>/, another group's run) are
# the start: asv adds to a commit's results file, so the report finds every group in one.
RES=.asv/results/$MACHINE  # asv.conf.json results_dir: local, not the curated results/asv
COMMIT=${FP8_RELOAD_COMMIT:-$SHA}
for f in results/asv/$MACHINE/"${COMMIT:0:8}"-*.json; do
  [ -e "$f" ] || continue
  mkdir -p "$RES" && $PY - "$f" "$RES" "$SHA" <<'EOF'
import json, sys
from pathlib import Path
f, res, sha = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
d = json.loads(f.read_text()); d["commit_hash"] = sha
(res / (sha[:8] + f.name[8:])).write_text(json.dumps(d))
print(f"starting from {f} ({len(d['results'])} results)")
EOF
done
t_asv=$(date +%s)
$PY -m asv run --python=same --set-commit-hash "$SHA" --machine "$MACHINE" --launch-method spawn \
  --record-samples -a rounds=1 --show-stderr "${BENCH[@]}" 2>&1 | tee "$OUT/asv_run.log" \
  | grep -v "^\s*$" | grep -v "^\s*For parameters\|asv: skipped" | tail -150
echo "asv exit status: ${PIPESTATUS[0]} (2: a benchmark failed); asv took $(( $(date +%s) - t_asv ))s"

if [ -n "${FP8_RELOAD_COMMIT:-}" ] && [ "$SHA" != "$FP8_RELOAD_COMMIT" ]; then
  $PY - "$RES" "$SHA" "$FP8_RELOAD_COMMIT" <<'EOF'
import json, sys
from pathlib import Path
res, old, new = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
for f in res.glob(f"{old[:8]}-*.json"):
    d = json.loads(f.read_text()); d["commit_hash"] = new
    f.with_name(new[:8] + f.name[8:]).write_text(json.dumps(d)); f.unlink()
    print("results recorded under", new)
EOF
fi
mkdir -p "$OUT/asv" && cp -r "$RES" .asv/results/benchmarks.json "$OUT/asv/"

echo
echo "== report (headline ratios vs the H200 targets)"
$PY -m fp8_reload report --results "$OUT/asv" --machine "$MACHINE" --out "$OUT/report" 2>&1 \
  | tee "$OUT/report.log"
echo
echo "failed benchmarks (should be none):"
grep -E "failed|Traceback" "$OUT/asv_run.log" | head -20 || true
echo "done in $(( $(date +%s) - t_start ))s; files under $OUT"
