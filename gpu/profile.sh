#!/usr/bin/env bash
# Profiling on the GPU host: the NVTX ranges reach Nsight Compute, and `fp8-reload profile`
# works on CUDA. Run from the repo root (after the wheel install / PYTHONPATH setup).
# Logs and reports go to $OUT (default /tmp/profile-out). Target: ~3 minutes.
#
# What success looks like (all printed below):
#  1. `profile` on cuda: a summary table whose ranges include load_weights,
#     process_weights_after_loading, forward, with CUDA kernels per range.
#  2. ncu on a forward, collection filtered with
#     --nvtx-include 'fp8_reload@fp8_reload\/scenario\/forward/': each kernel listed under its
#     innermost fp8_reload range; GEMM kernels (gemm / xmma / cutlass) under
#     fp8_reload/gemm_w13, fp8_reload/gemm_w2 (routed experts) and fp8_reload/linear.
#  3. ncu on a full reload: copy kernels under fp8_reload/weight_loader, quantization kernels
#     (div / clamp / to-fp8 / index_copy) under fp8_reload/process_moe and process_linear.
#  4. The forward report re-filtered on leaf ranges: the escaped name
#     'fp8_reload@fp8_reload\/gemm_w13/' selects the GEMM-range kernels, the unescaped
#     'fp8_reload@fp8_reload/gemm_w13/' selects none ('/' separates nested ranges in ncu).
#  5. Tracing overhead on CUDA with no tool attached: "estimated %" well under 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/profile-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
T0=$(date +%s)
say() { printf '\n===== %s (t=%ss)\n' "$*" "$(( $(date +%s) - T0 ))"; }

say "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if command -v ncu >/dev/null; then ncu --version | tail -1; else echo "ncu: not on PATH"; fi
if command -v nsys >/dev/null; then nsys --version; else echo "nsys: not on PATH"; fi
$PY - <<'PYEOF'
import torch
from fp8_reload import trace
try:
    import importlib.metadata, nvtx  # noqa: F401
    v = importlib.metadata.version("nvtx")
except ImportError:
    v = "not installed"
except Exception:
    v = "installed (version unknown)"
print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, nvtx {v}, "
      f"nvtx tool attached now: {trace.nvtx_active()} (expected False outside ncu/nsys)")
PYEOF

say "1. fp8-reload profile on cuda (torch.profiler; preset small, all scenarios x2)"
timeout 240 $PY -m fp8_reload profile --out "$OUT/profile" --tool torch --device cuda \
    --preset small --repeat 2 > "$OUT/profile.log" 2>&1
echo "exit $?"; grep -E '^\[profile\]' "$OUT/profile.log"
if [ -f "$OUT/profile/summary.md" ]; then
    sed -n '/^Source/,/^## Top/p' "$OUT/profile/summary.md" | head -75
    sed -n '/^## Top/,/^## How/p' "$OUT/profile/summary.md" | grep -E 'forward|reload-full' | head -24
else
    tail -30 "$OUT/profile.log"
fi

# Prints each profiled kernel under its innermost fp8_reload push/pop range, with Nsight
# Compute's Python report interface (extras/python/ncu_report.py: IAction.nvtx_state(),
# INvtxDomainInfo.push_pop_ranges(), IRange.actions_by_nvtx()). Extra arguments are NVTX
# filters re-applied to the report (what --nvtx-include would select).
cat > "$OUT/ncu_by_range.py" <<'PYEOF'
import collections, glob, os, shutil, sys
rep_path, filters = sys.argv[1], sys.argv[2:]
ncu = shutil.which("ncu")
cands = []
for r in ([os.path.dirname(os.path.realpath(ncu))] if ncu else []) + ["/usr/local/cuda", "/opt/nvidia"]:
    for up in (r, os.path.dirname(r)):
        cands += glob.glob(os.path.join(up, "extras/python")) + glob.glob(os.path.join(up, "*/extras/python"))
for c in cands:
    if os.path.exists(os.path.join(c, "ncu_report.py")):
        sys.path.insert(0, c)
        break
try:
    import ncu_report
except ImportError:
    print("ncu_report (Nsight Compute python report interface) not found; searched", cands[:6])
    sys.exit(3)
report = ncu_report.load_report(rep_path)
by_range, stacks, n = collections.OrderedDict(), [], 0
for ri in range(report.num_ranges()):
    rng = report.range_by_idx(ri)
    for ai in range(rng.num_actions()):
        a = rng.action_by_idx(ai)
        stack = []
        try:
            st = a.nvtx_state()
            for did in (st.domains() if st is not None else []):
                d = st.domain_by_id(did)
                if d.name() == "fp8_reload":
                    stack = list(d.push_pop_ranges())
        except Exception as e:  # report interface differences between versions
            stack = [f"<nvtx_state failed: {e}>"]
        inner = stack[-1] if stack else "(no fp8_reload range)"
        by_range.setdefault(inner, collections.Counter())[a.name()] += 1
        if n < 5:
            stacks.append(f"  {a.name()[:50]:50s} <- {' > '.join(stack)}")
        n += 1
if not filters:
    print(f"{n} kernels in the report. First NVTX stacks (domain fp8_reload, outer > inner):")
    print("\n".join(stacks))
    print("kernels per innermost fp8_reload range:")
    for r, kernels in by_range.items():
        print(f"  {r}  ({sum(kernels.values())} kernels)")
        for k, c in kernels.most_common(5):
            print(f"      {c:4d} x {k[:100]}")
for f in filters:
    try:
        rng = report.range_by_idx(0)
        idx = list(rng.actions_by_nvtx([f], []))
        names = collections.Counter(rng.action_by_idx(i).name() for i in idx)
        print(f"filter {f!r}: {len(idx)} kernels  {dict(names.most_common(4))}")
    except Exception as e:
        print(f"filter {f!r}: actions_by_nvtx failed: {e}")
PYEOF

# Nsight Compute runs the worker (what `fp8-reload profile` runs under nsys): tiny model,
# 2 layers (one dense, one MoE), warm-up outside the scenario range, then one scenario run.
WORKER=($PY -m fp8_reload.tools.profile --worker --out "$OUT" --preset tiny --num-layers 2 --device cuda
        --repeat 1 --tokens 64)
NCU=(ncu --nvtx --target-processes all --clock-control none --metrics gpu__time_duration.sum
     --launch-count 600 -f)

ncu_run() {  # report name, NVTX filter, scenario
    local name=$1 filter=$2 scenario=$3
    say "ncu: $name, --nvtx-include '$filter'"
    echo "\$ ${NCU[*]} --nvtx-include '$filter' -o $OUT/$name ${WORKER[*]} --scenario $scenario"
    timeout 200 "${NCU[@]}" --nvtx-include "$filter" -o "$OUT/$name" "${WORKER[@]}" --scenario "$scenario" \
        > "$OUT/$name.log" 2>&1
    echo "exit $?; worker: $(grep '\[worker\]' "$OUT/$name.log")"
    grep -E '==(ERROR|WARNING)==' "$OUT/$name.log" | head -5
    if [ -f "$OUT/$name.ncu-rep" ]; then
        $PY "$OUT/ncu_by_range.py" "$OUT/$name.ncu-rep" || {
            echo "(no python report interface: raw listing with NVTX renaming instead)"
            ncu -i "$OUT/$name.ncu-rep" --print-nvtx-rename kernel --csv --page raw \
                --metrics gpu__time_duration.sum 2>&1 | cut -c1-200 | head -40; }
    else
        tail -20 "$OUT/$name.log"
    fi
}

if command -v ncu >/dev/null; then
    ncu_run ncu_forward 'fp8_reload@fp8_reload\/scenario\/forward/' forward
    ncu_run ncu_reload 'fp8_reload@fp8_reload\/scenario\/reload-full/' reload-full

    say "4. the forward report re-filtered on leaf ranges ('/' inside names escaped as '\/')"
    if ! $PY "$OUT/ncu_by_range.py" "$OUT/ncu_forward.ncu-rep" 'fp8_reload@fp8_reload\/gemm_w13/' \
            'fp8_reload@fp8_reload/gemm_w13/' 'fp8_reload@fp8_reload\/act_quant/' \
            'fp8_reload@fp8_reload\/moe/*/fp8_reload\/gemm_w2'; then
        for f in 'fp8_reload@fp8_reload\/gemm_w13/' 'fp8_reload@fp8_reload/gemm_w13/'; do
            n=$(ncu -i "$OUT/ncu_forward.ncu-rep" --nvtx --nvtx-include "$f" --csv --page raw \
                  --metrics gpu__time_duration.sum 2>&1 | tail -n +3 | grep -c '^"')
            echo "  ncu -i ... --nvtx-include '$f' -> $n kernels"
        done
    fi
else
    echo "ncu not on PATH: skipping the Nsight Compute checks"
fi

say "5. tracing overhead on cuda, no tool attached (preset small)"
timeout 180 $PY -m fp8_reload profile --out "$OUT/overhead" --overhead --device cuda --preset small \
    2>&1 | tail -14

if command -v nsys >/dev/null; then
    say "6. profile with nsys on PATH (here nsys cannot export: expect the torch.profiler fallback)"
    timeout 120 $PY -m fp8_reload profile --out "$OUT/profile_auto" --device cuda --preset tiny \
        --scenario reload-filtered --repeat 1 2>&1 | grep -E '^\[profile\]|nsys|files:|  trace ' | head -20
fi

say "done; logs and reports in $OUT"
ls -la "$OUT"
