#!/usr/bin/env bash
# Reliability on a CUDA GPU. Runs from the repo root, ~2-3 minutes.
#
# 1. pytest, CUDA cases only: fault injection mid-commit / mid-processing with
#    rollback on the GPU, forwards vs reloads on the GPU, weight values checked on
#    the device (NaN/Inf refused before anything is written), and the soak
#    (1,000 alternating full/filtered reloads per checkpoint kind: no drift,
#    host RSS, live tensors, torch.cuda.memory_allocated exactly unchanged).
# 2. The cost of the transaction on the GPU (measured, not tuned): per-phase
#    seconds and staged/backup bytes for a full and a filtered reload of a
#    2-layer v2-lite slice, with the backup in host memory and on the device
#    (the streaming reload's backup copies run inside "load": its "backup"
#    column is the planning alone).
#
# Expect: "N passed" with 0 failed and no CUDA case skipped; two "soak {...}"
# lines with cuda_allocated_warm == cuda_allocated_end; the phase table.
# Everything is also written under $OUT (if set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d /tmp/reliability.XXXXXX)}
mkdir -p "$OUT"
export FP8_RELOAD_SOAK_OUT="$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
rm -f "$OUT/soak.jsonl"

python3 - <<'PY'
import torch
print("torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
PY

echo "== 1. pytest: CUDA cases of tests/test_reliability.py, tests/test_concurrency.py, tests/test_soak.py, tests/test_values.py"
python3 -m pytest -q -rs -p no:cacheprovider -W ignore tests/test_reliability.py tests/test_concurrency.py tests/test_soak.py \
    tests/test_values.py -k "cuda or on_the_device" 2>&1 | tee "$OUT/pytest-gpu.log"
rc=${PIPESTATUS[0]}
echo "pytest exit code: $rc"
echo "== soak figures"
cat "$OUT/soak.jsonl" 2>/dev/null || echo "(no soak figures written)"

echo "== 2. transaction cost on the GPU (v2-lite shape, 2 layers: 1 dense + 1 MoE with 64 experts)"
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/backup-cost.txt"
import sys, tempfile, time
import torch
import fp8_reload as fr

if not torch.cuda.is_available():
    print("no CUDA GPU: skipped"); sys.exit(0)
cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    path = fr.write_checkpoint(f"{tmp}/ckpt", cfg, seed=0, kind="fp8", progress=False)
    print(f"checkpoint written in {time.perf_counter() - t0:.1f} s, "
          f"{fr.Checkpoint(path).total_bytes() / 2**20:.0f} MiB")
    model = fr.load_model(path, device="cuda")
    cases = [("full", None), ("8 experts", fr.generate_weight_name_filter({1: list(range(0, 64, 8))}))]
    print(f"{'reload':<10} {'backup':<7} {'staged MiB':>10} {'backup MiB':>10}  "
          + " ".join(f"{k:>8}" for k in ("read", "backup", "wait", "load", "process", "total")) + "  (ms, best of 3)")
    for label, flt in cases:
        for where in ("host", "device"):
            best = {}
            for _ in range(3):
                r = fr.update_weights_from_disk(model, path, flt, backup=where)
                for k, v in r.seconds.items():
                    best[k] = min(best.get(k, 1e9), v)
            print(f"{label:<10} {where:<7} {r.staged_bytes / 2**20:>10.1f} {r.backup_bytes / 2**20:>10.1f}  "
                  + " ".join(f"{best.get(k, 0) * 1e3:>8.1f}" for k in ("read", "backup", "wait", "load", "process", "total")))
    # A fault mid-commit on the GPU at this size: rolled back, bit-identical.
    before = fr.snapshot(model)
    from fp8_reload.layers import FusedMoE
    orig, calls = FusedMoE._load_into_slot, [0]
    def faulty(self, *a, **k):
        orig(self, *a, **k); calls[0] += 1
        if calls[0] == 100:
            raise RuntimeError("injected device fault")
    FusedMoE._load_into_slot = faulty
    try:
        fr.update_weights_from_disk(model, path)
    except fr.CommitError as e:
        print("fault mid-commit:", type(e).__name__, "| restore", f"{e.report.seconds['restore'] * 1e3:.1f} ms",
              "| model unchanged:", fr.compare_states(before, fr.snapshot(model), identity=True) == [])
    finally:
        FusedMoE._load_into_slot = orig
PY
exit $rc
