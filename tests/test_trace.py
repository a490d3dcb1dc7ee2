"""Ranges reach torch.profiler and a real NVTX tool, balanced, with the right names and payloads.

The NVTX side is checked with a real NVTX tool: a minimal injection library
(below, compiled with the system C compiler) that the NVTX runtime inside the
``nvtx`` package loads through ``NVTX_INJECTION64_PATH``, exactly as Nsight
Systems / Compute inject theirs. It logs domains, categories, pushes (name,
category, color, payload, thread) and pops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
from fp8_reload import trace
from fp8_reload.tools.profile.events import load_chrome_trace, nest
from tests.conftest import raising_on_call, tokens

REPO = Path(__file__).resolve().parents[1]

# A minimal NVTX v3 tool. Struct layouts and callback ids follow nvToolsExt.h /
# nvtxDetail/nvtxTypes.h (NVTX_ETID_CALLBACKS = 1, NVTX_CB_MODULE_CORE2 = 5,
# CORE2 ids: RangePushEx 4, RangePop 5, NameCategoryA 8, RegisterStringA 10,
# DomainCreateA 12); handles returned to NVTX are our own copies of the names.
NVTX_RECORDER_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
typedef void (*fnptr)(void);
typedef fnptr **fntable;
typedef struct { size_t struct_size; int (*get_module_table)(int, fntable *, unsigned int *); } callbacks_t;
typedef const void *(*get_export_table_t)(uint32_t);
typedef struct {
    uint16_t version, size; uint32_t category; int32_t color_type; uint32_t color;
    int32_t payload_type; int32_t reserved0;
    union { uint64_t u64; int64_t i64; double d; uint32_t u32; int32_t i32; float f; } payload;
    int32_t message_type;
    union { const char *ascii; const void *unicode; const void *registered; } message;
} attrs_t;
static FILE *out;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const char *dname(const void *d) { return d ? (const char *)d : "<default>"; }
static void *domain_create(const char *name) {
    pthread_mutex_lock(&mu); fprintf(out, "domain\t%s\n", name); fflush(out); pthread_mutex_unlock(&mu);
    return strdup(name);
}
static void *register_string(const void *d, const char *s) { (void)d; return strdup(s); }
static void name_category(const void *d, uint32_t id, const char *name) {
    pthread_mutex_lock(&mu);
    fprintf(out, "category\t%s\t%u\t%s\n", dname(d), id, name);
    pthread_mutex_unlock(&mu);
}
static int push_ex(const void *d, const attrs_t *a) {
    const char *msg = a->message_type == 3 ? (const char *)a->message.registered
                    : a->message_type == 1 ? a->message.ascii : "";
    double p = 0; int has = 1;
    switch (a->payload_type) {
    case 1: p = (double)a->payload.u64; break; case 2: p = (double)a->payload.i64; break;
    case 3: p = a->payload.d; break; case 4: p = (double)a->payload.u32; break;
    case 5: p = (double)a->payload.i32; break; case 6: p = (double)a->payload.f; break;
    default: has = 0;
    }
    pthread_mutex_lock(&mu);
    fprintf(out, "push\t%s\t%s\t%u\t%u\t%s\t%.17g\t%lu\n", dname(d), msg, a->category, a->color,
            has ? "payload" : "-", p, (unsigned long)pthread_self());
    pthread_mutex_unlock(&mu);
    return 0;
}
static int pop(const void *d) {
    pthread_mutex_lock(&mu); fprintf(out, "pop\t%s\t%lu\n", dname(d), (unsigned long)pthread_self());
    fflush(out); pthread_mutex_unlock(&mu);
    return 0;
}
int InitializeInjectionNvtx2(get_export_table_t get_export_table) {
    const callbacks_t *cb = (const callbacks_t *)get_export_table(1);
    fntable t = 0; unsigned int n = 0;
    const char *path = getenv("NVTX_RECORDER_LOG");
    out = fopen(path ? path : "/dev/stderr", "w");
    if (!cb || !out || !cb->get_module_table(5, &t, &n) || n < 13) return 0;
    *t[4] = (fnptr)push_ex; *t[5] = (fnptr)pop; *t[8] = (fnptr)name_category;
    *t[10] = (fnptr)register_string; *t[12] = (fnptr)domain_create;
    return 1;
}
"""


def build_nvtx_recorder(workdir: Path) -> Path:
    """Compile the recorder tool; skips when the nvtx package or a C compiler is missing."""
    pytest.importorskip("nvtx", reason="the nvtx package (extra 'profile') is not installed")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the NVTX recorder tool")
    src, lib = workdir / "nvtx_recorder.c", workdir / "libnvtx_recorder.so"
    if not lib.exists():
        src.write_text(NVTX_RECORDER_C)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-lpthread"], check=True)
    return lib


def nvtx_env(lib: Path, log: Path, **extra) -> dict:
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(lib), NVTX_RECORDER_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def parse_nvtx_log(log: Path) -> dict:
    """{domains, categories {(domain, id): name}, ranges [(name, category, color, payload, depth)],
    unbalanced: threads whose pushes and pops do not match}."""
    domains, categories, ranges, depth = [], {}, [], Counter()
    for line in log.read_text().splitlines():
        f = line.split("\t")
        if f[0] == "domain":
            domains.append(f[1])
        elif f[0] == "category":
            categories[(f[1], int(f[2]))] = f[3]
        elif f[0] == "push":
            dom, name, cat, color, has, payload, tid = f[1:]
            ranges.append({"domain": dom, "name": name, "category": categories.get((dom, int(cat))),
                           "color": int(color), "payload": float(payload) if has == "payload" else None,
                           "depth": depth[tid]})
            depth[tid] += 1
        elif f[0] == "pop":
            depth[f[2]] -= 1
    return {"domains": domains, "ranges": ranges,
            "unbalanced": {t: d for t, d in depth.items() if d != 0}}


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Path:
    return build_nvtx_recorder(tmp_path_factory.mktemp("nvtx"))


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


# --------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------

def test_registry_names_categories_colors():
    for name, info in trace.RANGES.items():
        assert name.startswith("fp8_reload/")
        assert info.category in trace.CATEGORY_COLORS
    for phase, name in trace.PHASES.items():
        assert name in trace.RANGES, phase
    # the names the issue asks for
    for name in ("fp8_reload/load_weights", "fp8_reload/process_weights_after_loading", "fp8_reload/forward"):
        assert name in trace.RANGES
    with pytest.raises(ValueError, match="start with"):
        trace.range("load_weights")
    with pytest.raises(ValueError, match="unknown color"):
        trace.range("fp8_reload/x_color", color="chartreuse")


def test_fast_path_without_profiler_and_record_function_with_it():
    # No NVTX tool in this process and no profiler: the cached static range, entered as is.
    if "NVTX_INJECTION64_PATH" not in os.environ:  # (pytest itself run under nsys / ncu)
        assert not trace.nvtx_active()
    r = trace.range("fp8_reload/forward")
    assert r is trace.range("fp8_reload/forward")
    with r:
        pass
    with pytest.raises(KeyError):  # the no-op enter/exit must not swallow exceptions
        with trace.range("fp8_reload/forward"):
            raise KeyError("boom")
    from torch.profiler import profile

    with profile() as prof:
        active = trace.range("fp8_reload/forward", payload=3)
        assert active is not r
        with active:
            torch.ones(2) + 1
    names = [e.name for e in prof.events()]
    assert "fp8_reload/forward" in names


def test_unlisted_names_get_category_other_and_a_stable_color():
    a = trace.range("fp8_reload/deepgemm_grouped_gemm")
    assert a.category == "other"
    assert a.color == trace.range("fp8_reload/deepgemm_grouped_gemm").color
    assert a.color != trace.CATEGORY_COLORS["other"]
    b = trace.range("fp8_reload/deepgemm_grouped_gemm", category="gemm")
    assert b.color == trace.CATEGORY_COLORS["gemm"]


def test_decorator_traces_only_while_profiling_and_keeps_the_function():
    @trace.range("fp8_reload/decorated_for_test")
    def f(a, b=1):
        """doc"""
        return a + b

    assert f.__name__ == "f" and f.__doc__ == "doc"
    assert f(1, b=2) == 3
    from torch.profiler import profile

    with profile() as prof:
        assert f(2) == 3
    assert [e.name for e in prof.events()].count("fp8_reload/decorated_for_test") == 1


def test_recording_collects_names_and_payloads_and_is_not_reentrant():
    with trace.recording() as rec:
        with trace.range("fp8_reload/tensor_read", payload=128):
            with trace.range("fp8_reload/weight_loader", payload=64):
                pass
        with pytest.raises(RuntimeError, match="already active"):
            with trace.recording():
                pass
    assert rec.events == [("fp8_reload/tensor_read", 128), ("fp8_reload/weight_loader", 64)]


def test_set_enabled_false_turns_every_range_into_a_no_op():
    @trace.range("fp8_reload/decorated_off")
    def g():
        return 7

    trace.set_enabled(False)
    try:
        with trace.recording() as rec:
            with trace.range("fp8_reload/forward"):
                assert g() == 7
        assert rec.events == []
    finally:
        trace.set_enabled(True)


def test_exception_inside_a_range_closes_it():
    from torch.profiler import profile

    with profile() as prof:
        with pytest.raises(KeyError):
            with trace.range("fp8_reload/reload"):
                raise KeyError("boom")
        with trace.range("fp8_reload/forward"):
            pass
    evs = {e.name: e for e in prof.events() if e.name.startswith("fp8_reload/")}
    reload, forward = evs["fp8_reload/reload"], evs["fp8_reload/forward"]
    assert reload.time_range.end <= forward.time_range.start


# --------------------------------------------------------------------------
# The instrumented library under torch.profiler
# --------------------------------------------------------------------------

def test_reload_and_forward_ranges_nest_in_a_torch_profiler_trace(ckpts, tiny_cfg, tmp_path):
    from torch.profiler import profile

    path = ckpts[("fp8", 0)]
    model = fr.load_model(ckpts[("fp8", 1)])  # other files: the reload parses its own
    x = tokens(tiny_cfg, 8)
    flt = fr.generate_weight_name_filter({1: [0, 3]})
    with profile() as prof:
        report = fr.update_weights_from_disk(model, path, flt)
        with torch.no_grad():
            model(x)
    out = tmp_path / "t.json"
    prof.export_chrome_trace(str(out))
    events = load_chrome_trace(out)
    ranges = events.ranges
    parent = nest(ranges)
    parent_name = {}
    for r, p in zip(ranges, parent):
        parent_name.setdefault(r.name, set()).add(ranges[p].name if p >= 0 else None)
    assert parent_name["fp8_reload/reload"] == {None}
    for ph in ("plan", "read", "backup", "load_weights", "process_weights_after_loading",
               "invalidate_caches"):
        assert parent_name[f"fp8_reload/{ph}"] == {"fp8_reload/reload"}, ph
    assert parent_name["fp8_reload/index_read"] == {"fp8_reload/plan"}
    # the streaming engine: scales read before the lock, the rest through the ring
    assert parent_name["fp8_reload/scales_read"] == {"fp8_reload/read"}
    assert parent_name["fp8_reload/ring"] == {"fp8_reload/load_weights"}
    assert parent_name["fp8_reload/chunk_read"] == {"fp8_reload/ring"}
    assert parent_name["fp8_reload/process_moe"] == {"fp8_reload/process_weights_after_loading"}
    n = Counter(r.name for r in ranges)
    assert "fp8_reload/weight_loader" not in n  # FP8 on CPU: no tensor takes a Python loader
    assert n["fp8_reload/chunk_read"] >= 1
    assert n["fp8_reload/process_moe"] == len(report.modules_processed) == 1
    assert n["fp8_reload/forward"] == 1
    assert parent_name["fp8_reload/moe"] == {"fp8_reload/forward"}
    for leaf in ("act_quant", "gemm_w13", "activation", "gemm_w2", "combine"):
        assert parent_name[f"fp8_reload/{leaf}"] == {"fp8_reload/moe"}, leaf
    assert parent_name["fp8_reload/linear"] <= {"fp8_reload/attention", "fp8_reload/mlp"}
    # one gate/up GEMM, activation and down GEMM per expert that received tokens
    assert n["fp8_reload/gemm_w13"] == n["fp8_reload/activation"] == n["fp8_reload/gemm_w2"] \
        == n["fp8_reload/combine"] >= len(tiny_cfg.moe_layers)
    ops = {o.name for o in events.work}
    assert "aten::matmul" in ops or "aten::mm" in ops


def test_every_range_a_load_reload_forward_and_rollback_emit_is_listed(ckpts, tiny_cfg, engine,
                                                                        monkeypatch):
    """`RANGES` is the list docs/profiling.md points to and `profile` takes categories from: the
    library emits nothing beyond it (the commit's "wait" phase and a rollback's "restore" were)."""
    import fp8_reload.processing as proc

    with trace.recording() as rec:
        for kind in ("fp8", "bf16"):
            model = fr.load_model(ckpts[(kind, 0)])
            fr.update_weights_from_disk(model, ckpts[(kind, 1)])
            fr.update_weights_from_disk(model, ckpts[(kind, 0)], fr.generate_weight_name_filter({1: [0, 3]}))
            with torch.no_grad():
                model(tokens(tiny_cfg, 8))
        method = proc.FixedFp8MoEMethod
        monkeypatch.setattr(method, "process_weights_after_loading", raising_on_call(
            method.process_weights_after_loading, 1, RuntimeError("injected")))
        with pytest.raises(fr.ReloadError):
            fr.update_weights_from_disk(model, ckpts[("bf16", 1)])
    names = {name for name, _ in rec.events}
    assert {"fp8_reload/wait", "fp8_reload/restore", "fp8_reload/load_model"} <= names
    assert sorted(names - set(trace.RANGES)) == []
    assert set(trace.PHASES.values()) <= set(trace.RANGES)


# --------------------------------------------------------------------------
# A real NVTX tool
# --------------------------------------------------------------------------

RELOAD_AND_FORWARD = """
import torch, fp8_reload as fr
from fp8_reload import trace
from fp8_reload.checkpoint import Checkpoint
assert trace.nvtx_active()
path = {path!r}
m = fr.load_model(path)
flt = fr.generate_weight_name_filter({{1: [0, 3], 2: [5]}})
rep = fr.update_weights_from_disk(m, path, flt)
x = torch.randn(16, m.config.hidden_size).to(torch.bfloat16)
with torch.no_grad():
    m(x)
print("BYTES", rep.bytes_read, "TENSORS", rep.tensors_loaded, "FULL", Checkpoint(path).total_bytes())
"""


def test_ranges_reach_an_nvtx_tool_with_domain_categories_colors_payloads(recorder, ckpts, tmp_path):
    path = ckpts[("fp8", 0)]
    log = tmp_path / "nvtx.log"
    res = _run(RELOAD_AND_FORWARD.format(path=str(path)), nvtx_env(recorder, log))
    fields = res.stdout.split()
    bytes_read, tensors, full = int(fields[1]), int(fields[3]), int(fields[5])
    got = parse_nvtx_log(log)
    assert "fp8_reload" in got["domains"]
    assert not got["unbalanced"], got["unbalanced"]
    ours = [r for r in got["ranges"] if r["domain"] == "fp8_reload"]
    assert ours and all(r["name"].startswith("fp8_reload/") for r in ours)
    for r in ours:
        spec = trace.range(r["name"])
        assert r["category"] == spec.category, r
        assert r["color"] == spec.color, r
    by = lambda name: [r for r in ours if r["name"] == name]  # noqa: E731
    # load_model (a full load) then the filtered reload: tensor_read payloads are bytes read
    loads, reloads = by("fp8_reload/load_model"), by("fp8_reload/reload")
    assert len(loads) == 1 and len(reloads) == 1
    reads = [r["payload"] for r in by("fp8_reload/tensor_read")]  # the fresh load (staged)
    assert sum(reads) == full
    assert len(by("fp8_reload/weight_loader")) == len(reads)
    assert sum(r["payload"] for r in by("fp8_reload/weight_loader")) == full
    streamed = by("fp8_reload/scales_read") + by("fp8_reload/chunk_read")  # the reload
    assert sum(r["payload"] for r in streamed) == bytes_read
    # the filtered reload processed layer 1 (experts 0, 3) and layer 2 (expert 5)
    moe = [r["payload"] for r in by("fp8_reload/process_moe")]
    assert sorted(moe[-2:]) == [1, 2]
    assert [r["payload"] for r in by("fp8_reload/forward")] == [16]
    for name in ("fp8_reload/plan", "fp8_reload/read", "fp8_reload/backup", "fp8_reload/load_weights",
                 "fp8_reload/process_weights_after_loading", "fp8_reload/invalidate_caches"):
        assert by(name) and all(r["depth"] == 1 for r in by(name)), name
    assert tensors == 3 * 3 * 3  # 3 experts x (3 weights + 3 scales + 3 input scales)


FAILING_RELOAD = """
import fp8_reload as fr
m = fr.load_model({good!r})
try:
    fr.update_weights_from_disk(m, {bad!r})
except fr.ReloadError as e:
    print("FAILED", type(e).__name__)
"""


def test_failed_reload_leaves_nvtx_ranges_balanced(recorder, ckpts, tmp_path):
    from tests.conftest import copy_checkpoint, rewrite_tensor

    good = ckpts[("fp8", 0)]
    bad = copy_checkpoint(good, tmp_path / "bad")
    rewrite_tensor(bad, "model.layers.2.mlp.experts.1.up_proj.weight_scale",
                   lambda t: t * float("nan"))
    log = tmp_path / "nvtx.log"
    res = _run(FAILING_RELOAD.format(good=str(good), bad=str(bad)), nvtx_env(recorder, log))
    assert "FAILED" in res.stdout
    got = parse_nvtx_log(log)
    assert not got["unbalanced"]
    assert [r["name"] for r in got["ranges"] if r["depth"] == 0][-1] == "fp8_reload/reload"


def test_nvtx_can_be_switched_off(recorder, tmp_path):
    # (on by default with a tool: the other NVTX tests; off without one: the fast-path test)
    code = "from fp8_reload import trace; print(trace.nvtx_active())"
    log = tmp_path / "nvtx.log"
    assert _run(code, nvtx_env(recorder, log, FP8_RELOAD_NVTX="0")).stdout.strip() == "False"


def test_works_without_the_nvtx_package(recorder, tmp_path):
    """nvtx is optional: unimportable (even with a tool injected), ranges still reach torch.profiler."""
    code = """
import sys
sys.modules["nvtx"] = None  # import nvtx -> ImportError
from fp8_reload import trace
from torch.profiler import profile
assert not trace.nvtx_active()
with profile() as prof:
    with trace.range("fp8_reload/load_weights"):
        with trace.range("fp8_reload/weight_loader", payload=4):
            pass
print(sorted(e.name for e in prof.events() if e.name.startswith("fp8_reload/")))
"""
    out = _run(code, nvtx_env(recorder, tmp_path / "nvtx.log")).stdout.strip().splitlines()[-1]
    assert out == "['fp8_reload/load_weights', 'fp8_reload/weight_loader']"
