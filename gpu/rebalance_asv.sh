#!/usr/bin/env bash
# The expert-parallel headline benchmarks under asv on the 2-GPU host (asv machine h200x2),
# for `fp8-reload report`; the last step of gpu/rebalance_2gpu.sh.
#
#   bash gpu/rebalance_asv.sh OUT_DIR
#
# Runs: p2p rebalance of every MoE layer (32 experts/layer on GPUs) beside its contiguous
# bound, the whole model and its bound, and the EP forward's per-layer balance before/after.
# Writes OUT_DIR/asv_h200x2.tar.gz: results/asv/h200x2/ and results/asv/benchmarks-h200x2.json,
# to unpack at the repository root and commit (a machine of its own: the single-GPU h200
# results stay the newest of theirs). Prints the report's expert-parallel tables. asv
# rewrites results/asv/benchmarks.json of the copy it runs in: run it on a scratch copy.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: rebalance_asv.sh OUT_DIR}
PY=${PYTHON:-python3}
MACHINE=${ASV_MACHINE:-h200x2}
export ASV_PYTHONPATH=${PYTHONPATH:-}
if [ "${FP8_RELOAD_BENCH_DEVICE:-cuda}" = cpu ]; then HEAD=8; else HEAD=32; fi  # CPU: dry run

if ! SHA=$(git rev-parse HEAD 2>/dev/null); then
  echo "no git repository here: committing this copy to a scratch repo for asv"
  git init -q . && git symbolic-ref HEAD refs/heads/main && git add -A >/dev/null && \
    git -c user.email=h200@local -c user.name=h200 commit -qm "h200x2 run of ${FP8_RELOAD_COMMIT:-unknown}" \
    && SHA=$(git rev-parse HEAD) || { echo "asv: FAILED, git is needed by asv"; exit 1; }
fi
$PY - "$MACHINE" <<'EOF'
import sys, torch
from fp8_reload.tools.regress import ensure_machine
gpu = {}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    gpu = dict(gpu=f"{torch.cuda.device_count()}x {p.name} ({p.total_memory / 2**30:.0f} GiB)",
               cuda=torch.version.cuda)
print("asv machine:", ensure_machine(sys.argv[1], torch=torch.__version__, **gpu))
EOF
$PY -m asv run --python=same --set-commit-hash "$SHA" --machine "$MACHINE" --launch-method spawn \
  --record-samples -a repeat=3 -a rounds=1 --show-stderr \
  -b "\.Rebalance\.time_rebalance\($HEAD, 'p2p', 'all'\)" \
  -b "ContiguousExchange\.time_exchange\($HEAD, 'all'\)" \
  -b "WholeModel(Rebalance|Exchange)\.time_(rebalance|exchange)\($HEAD\)" \
  -b "EPBalance\.track_moe_imbalance" 2>&1 | grep -v "^\s*$" | tail -40
rc=${PIPESTATUS[0]}
# benchmarks.json as benchmarks-$MACHINE.json (the convention of benchmarks-h200.json): the
# committed benchmarks.json keeps describing the CPU suite the CPU results were run with.
cp results/asv/benchmarks.json "results/asv/benchmarks-$MACHINE.json"
tar czf "$OUT/asv_$MACHINE.tar.gz" "results/asv/$MACHINE" "results/asv/benchmarks-$MACHINE.json"
$PY -m fp8_reload report --results results/asv --machine "$MACHINE" --out "/tmp/report-$MACHINE" \
  | sed -n '/## Expert parallel/,$p'
echo "asv: exit $rc; results in $OUT/asv_$MACHINE.tar.gz (unpack at the repository root)"
exit "$rc"
