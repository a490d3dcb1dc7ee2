"""The asv suite itself: every benchmark runs (or skips cleanly) on the tiny preset.

Two levels:
* in process: each benchmark's setup_cache, setup and one call for every
  parameter set, like `asv run --quick` without the process per benchmark;
  checks the values make sense (bytes agree between reload and read+copy, each
  timed post-processing starts from the same state);
* end to end: a real `asv run --python=same --quick` on the working tree,
  results file checked for failures (needs asv and a git checkout).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8_reload as fr

REPO = Path(__file__).resolve().parents[1]
MODULES = ["reload", "processing", "forward", "accuracy", "io", "grouped"]
# Why a benchmark may skip on a machine without CUDA.
CPU_SKIPS = ("needs a CUDA device", "needs triton", "needs deep_gemm", "is not available")
# why a case of the tiny preset skips on a GPU host too (DeepGEMM's 128-wide tiles)
SHAPE_SKIPS = ("multiples of 128",)
ENV = {"FP8_RELOAD_BENCH_PRESETS": "tiny", "FP8_RELOAD_BENCH_TOKENS": "8,32",
       # the expert-parallel benchmarks: tiny models, one move size, few tokens
       "FP8_RELOAD_BENCH_REBALANCE": "tiny:3", "FP8_RELOAD_BENCH_WHOLE": "tiny",
       "FP8_RELOAD_BENCH_MOVED": "2", "FP8_RELOAD_BENCH_SOURCES": "p2p,hybrid",
       "FP8_RELOAD_BENCH_EP_TOKENS": "32"}


@pytest.fixture(scope="module")
def suite():
    """The benchmark modules imported with tiny parameters (params are fixed at import)."""
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:  # parameters are read at import only
            for k, v in ENV.items():
                mp.setenv(k, v)
            common = importlib.reload(importlib.import_module("benchmarks.common"))
            importlib.reload(importlib.import_module("benchmarks.fixtures"))  # binds common's DEVICE
            mods = {m: importlib.reload(importlib.import_module(f"benchmarks.{m}")) for m in MODULES}
    finally:
        torch.set_num_threads(threads)
    assert common.PRESETS == ["tiny"]
    return common, mods


def _fixtures():
    return importlib.import_module("benchmarks.fixtures")  # (reloaded by `suite`)


def discover(mods):
    """(module name, class, method name) for every asv benchmark, asv's naming rules."""
    out = []
    for mname, mod in mods.items():
        for cname, cls in vars(mod).items():
            if not inspect.isclass(cls) or cls.__module__ != mod.__name__ or cname.startswith("_"):
                continue
            for attr in dir(cls):
                if attr.startswith(("time_", "track_", "peakmem_", "mem_")):
                    out.append((mname, cls, attr))
    return out


@pytest.fixture(scope="module")
def cache(suite, tmp_path_factory):
    """What `CheckpointSuite.setup_cache` returns: {checkpoint key: path}."""
    common, _ = suite
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("asv-cache"))  # asv runs setup_cache in a temp dir
    try:
        return common.CheckpointSuite().setup_cache()
    finally:
        os.chdir(cwd)


def common_setup_cache(suite):
    return suite[0].CheckpointSuite.setup_cache


# The package's switches (upper-case module globals of plain values, FP8_RELOAD_*
# environment variables) a benchmark may flip to time one path: the grouped run measures
# every benchmark in one process (as the `ran` fixture does), so each must put them back;
# on the H200 an engine left at "staged" made every later streaming test run the staged
# engine (156 failures in one pytest process). Not switches: state the library keeps.
LIBRARY_STATE = {"fp8_reload.kernels.triton.requant.PREPARED"}  # off after a refused fast launch
SWITCHED: list = []  # (benchmark, {switch: (before, after)}) the `ran` fixture saw


def _switches() -> dict:
    found = {k: v for k, v in os.environ.items() if k.startswith("FP8_RELOAD_")}
    for name, module in list(sys.modules.items()):
        if name.startswith("fp8_reload.") and module is not None:
            found.update((f"{name}.{attr}", v) for attr, v in vars(module).items()
                         if attr.isupper() and isinstance(v, (str, int, float, bool, type(None)))
                         and f"{name}.{attr}" not in LIBRARY_STATE)
    return found


@pytest.fixture(scope="module")
def ran(suite, cache):
    """{(Class.method, params): value | 'skip: reason'} for the whole suite."""
    _, mods = suite
    results = {}
    switches = _switches()
    caches = {}  # one per setup_cache function, as asv keys them
    for _, cls, method in discover(mods):
        needs_cache = hasattr(cls, "setup_cache")
        own = needs_cache and cls.setup_cache is not common_setup_cache(suite)
        if own and cls.setup_cache not in caches:  # in the checkpoints' directory: reused
            cwd = os.getcwd()
            os.chdir(Path(next(iter(cache.values()))).parent)
            try:
                caches[cls.setup_cache] = cls().setup_cache()
            finally:
                os.chdir(cwd)
        params = (cls.params if isinstance(cls.params[0], list) else [cls.params]) \
            if hasattr(cls, "params") else []
        for combo in itertools.product(*params):
            bench = cls()
            args = (((caches[cls.setup_cache] if own else cache),) if needs_cache else ()) + combo
            grouped = cls.__module__.endswith(".grouped")  # same names: keyed apart
            key = (f"{cls.__name__}.{method}" + ("@grouped" if grouped else ""), combo)
            try:
                try:
                    bench.setup(*args)
                except NotImplementedError as e:
                    results[key] = f"skip: {e}"
                    continue
                results[key] = getattr(bench, method)(*args)
                if hasattr(bench, "teardown"):
                    bench.teardown(*args)
            finally:  # (a skip or a failure must put them back as well)
                now = _switches()
                if flipped := {k: (v, now[k]) for k, v in switches.items() if k in now and now[k] != v}:
                    SWITCHED.append((key, flipped))
                switches = now
    return results


def test_no_benchmark_leaves_a_reload_switch_flipped(ran):
    assert SWITCHED == []


def test_the_io_benchmark_puts_its_switches_back_when_a_reload_fails(monkeypatch):
    """(CPU) The I/O benchmark's reloads skip here (`IOPaths` needs CUDA), so the test above
    sees its switches only on a GPU: its reload, failing, must still put them back."""
    import benchmarks.io as io_bench
    import fp8_reload.reload.chunks as chunks
    import fp8_reload.reload.transaction as transaction

    before, seen = (transaction.ENGINE, chunks.READ_IO), []

    def failing(model, path, flt):
        seen.append((transaction.ENGINE, chunks.READ_IO))
        raise OSError("the disk went away")

    monkeypatch.setattr(io_bench.fr, "update_weights_from_disk", failing)
    with pytest.raises(OSError):
        io_bench._reload(None, "ckpt", None, "direct", "staged")
    assert seen == [("staged", "direct")] and (transaction.ENGINE, chunks.READ_IO) == before


def test_every_benchmark_runs_or_skips_for_a_stated_reason(ran):
    assert len(ran) > 50
    ran_ok = {k for k, v in ran.items() if not isinstance(v, str)}
    names = {k[0].split(".")[0] for k in ran_ok}
    assert {"FilteredReload", "FullReload", "RawReadCopy", "ProcessMoELayer", "MoEForward",
            "ForwardAccuracy", "BlockScaleExpansion"} <= names
    for key, v in ran.items():
        if isinstance(v, str):
            assert torch.cuda.is_available() or any(r in v for r in CPU_SKIPS) or (
                key[0].endswith("@grouped") and v.endswith("not a case of this group")), (key, v)
        elif key[0].split(".")[1].startswith("track_"):
            assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, (key, v)
        else:
            assert v is None, (key, v)  # time_ benchmarks return nothing


def test_torch_backend_is_never_skipped(ran):
    torch_runs = [v for k, v in ran.items() if k[0].startswith("MoEForward") and k[1][1] == "torch"
                  and not k[0].endswith("@grouped")]  # grouped: only its cases (tested below)
    assert torch_runs and not any(isinstance(v, str) for v in torch_runs)


def test_raw_bound_reads_exactly_the_bytes_of_the_fixed_reload(ran, suite, cache):
    common, mods = suite

    def raw_bytes(kind, experts, reader):
        b = mods["reload"].RawReadCopy()
        b.setup(cache, "tiny", kind, experts, reader)
        return b.nbytes

    def scan_all_bytes(kind, experts):
        b = mods["reload"].FilteredReload()
        b.setup(cache, "tiny", kind, experts, "scan-all")
        return b._run().bytes_read

    for kind in common.KINDS:
        for experts in common.FRACTIONS:
            fixed = ran[("ReloadBytes.track_bytes_read", ("tiny", kind, experts))]
            for reader in ("safetensors", "preadv"):
                assert fixed == raw_bytes(kind, experts, reader) > 0
            assert scan_all_bytes(kind, experts) == raw_bytes(kind, "full", "preadv") >= fixed
        assert ran[("ReloadBytes.track_bytes_read", ("tiny", kind, "full"))] == \
            raw_bytes(kind, "full", "safetensors")


def test_the_memory_bound_is_recorded_with_the_results(ran):
    from fp8_reload.processing import reload_memory_bound

    bound = ran[("DeviceMemoryBound.track_bound_bytes", ())]
    assert bound == fr.reload.device_memory_bound() == reload_memory_bound() + fr.reload.backup.ON_DEVICE


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_both_raw_readers_deliver_the_checkpoint_bytes(suite, tmp_path, kind):
    common, mods = suite
    path = fr.write_checkpoint(tmp_path / kind, common.preset_config("tiny"), kind=kind)
    paths = {f"tiny-{kind}": str(path)}
    out = {}
    for reader in ("safetensors", "preadv"):
        b = mods["reload"].RawReadCopy()
        b.setup(paths, "tiny", kind, "full", reader)
        for group in b.groups.values():
            for _, dst in group:
                dst.zero_() if dst.dtype != torch.float8_e4m3fn else dst.view(torch.uint8).zero_()
        b.time_read_copy(paths, "tiny", kind, "full", reader)
        out[reader] = {n: _u8(d).cpu().clone() for g in b.groups.values() for n, d in g}
    ck = fr.Checkpoint(path)
    expected = dict(ck.read(ck.names))
    assert set(out["preadv"]) == set(expected)
    for name, t in expected.items():
        assert torch.equal(out["preadv"][name], _u8(t)), name
        assert torch.equal(out["safetensors"][name], _u8(t)), name


def test_one_expert_per_layer_reads_one_expert_per_layer(suite):
    common, _ = suite
    cfg = common.preset_config("tiny")
    chosen = common.fraction_experts(cfg, "1/layer")
    assert set(chosen) == set(cfg.moe_layers) and all(len(v) == 1 for v in chosen.values())
    assert all(len(v) == cfg.num_experts for v in common.fraction_experts(cfg, "100%").values())


def _layer_bytes(layer):
    return {k: (id(p), p.data.clone()) for k, p in layer._parameters.items() if p is not None}


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("impl", ["upstream", "fixed", "fixed-1-expert"])
def test_each_timed_post_processing_starts_from_the_same_state(suite, tmp_path, kind, impl):
    common, mods = suite
    processing, scope = mods["processing"].IMPLS[impl]
    path = str(fr.write_checkpoint(tmp_path / kind, common.preset_config("tiny"), kind=kind))
    state = _fixtures().UnprocessedLayer(path, processing, scope)
    before = _layer_bytes(state.layer)
    state.process()
    first = _layer_bytes(state.layer)
    for _ in range(2):
        state.restore()
        now = _layer_bytes(state.layer)
        assert {k: v[0] for k, v in now.items()} == {k: v[0] for k, v in before.items()}
        assert all(torch.equal(_u8(now[k][1]), _u8(before[k][1])) for k in before)
        state.process()
        again = _layer_bytes(state.layer)
        assert all(torch.equal(_u8(again[k][1]), _u8(first[k][1])) for k in first)
    if processing == "upstream":  # upstream replaced Parameters; restore() put the originals back
        assert {k: v[0] for k, v in first.items()} != {k: v[0] for k, v in before.items()}


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_synchronized_wraps_setup_and_timed_methods_only(suite):
    common, _ = suite
    calls = []

    class B:
        def setup(self):
            calls.append("setup")

        def time_x(self):
            calls.append("x")

        def track_y(self):
            return 1

    orig_track = B.track_y
    common.synchronized(B)
    assert B.track_y is orig_track and B.time_x.__wrapped__ and B.setup.__wrapped__
    B().setup()
    B().time_x()
    assert calls == ["setup", "x"]


# --------------------------------------------------------------------------
# End to end through asv
# --------------------------------------------------------------------------

def _git_head():
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def test_asv_quick_run_of_the_whole_suite(tmp_path):
    pytest.importorskip("asv")
    sha = _git_head()
    if sha is None:
        pytest.skip("not a git checkout: asv needs a commit hash")
    from fp8_reload.tools.regress import asv_run, ensure_machine

    env = dict(os.environ, HOME=str(tmp_path), **ENV)
    ensure_machine("ci", env=env)
    # forkserver: one import of torch for the whole run (CPU only; CUDA needs spawn)
    method = "spawn" if torch.cuda.is_available() else "forkserver"
    result = asv_run(REPO, sha, REPO, tmp_path, [], True, method, "ci", ["--show-stderr"], env=env,
                     log=lambda s: None)
    data = json.loads(result.read_text())
    meta = json.loads((tmp_path / "results" / "benchmarks.json").read_text())
    names = {k for k, v in meta.items() if isinstance(v, dict)}
    assert names == set(data["results"]) and len(names) >= 10
    cols = data["result_columns"]
    for bench, entry in data["results"].items():
        values = dict(zip(cols, entry))["result"]
        assert None not in values, f"{bench} failed in asv: {values}"
        assert any(not math.isnan(v) for v in values) or bench.split(".")[1] in (
            "ReloadDeviceMemory", "DeepGemmScaleMode", "IOPaths"), f"{bench}: everything skipped"
    shutil.rmtree(tmp_path / "env", ignore_errors=True)


def test_forward_fixture_layer_equals_the_fully_loaded_models_layer(suite, tmp_path):
    common, _ = suite
    cfg = common.preset_config("tiny")
    path = str(fr.write_checkpoint(tmp_path / "fp8", cfg, kind="fp8"))
    batch = _fixtures().RoutedBatch(path, 16)
    full = fr.load_model(path, device=common.DEVICE)
    layer = full.model.layers[cfg.moe_layers[0]].mlp.experts
    for name, p in layer.named_parameters():
        assert torch.equal(_u8(p.data), _u8(getattr(batch.layer, name).data)), name
    ref = fr.kernels.run_moe(layer, batch.x, batch.topk_weights, batch.topk_ids, backend="torch")
    assert torch.equal(batch.forward("torch"), ref)


def test_kept_checkpoints_are_reused_only_when_they_match(suite, tmp_path):
    common, _ = suite
    first = common.write_checkpoints(tmp_path, presets=["tiny"], kinds=["fp8"])
    index = Path(first["tiny-fp8"]) / "model.safetensors.index.json"
    stamp = index.stat().st_mtime_ns
    assert common.write_checkpoints(tmp_path, presets=["tiny"], kinds=["fp8"]) == first
    assert index.stat().st_mtime_ns == stamp  # reused, not rewritten
    (Path(first["tiny-fp8"]) / "config.json").write_text("{}")  # damaged: rewritten
    common.write_checkpoints(tmp_path, presets=["tiny"], kinds=["fp8"])
    assert fr.Checkpoint(first["tiny-fp8"]).config == common.preset_config("tiny")


def test_grouped_figures_are_the_per_process_benchmarks_figures(suite, ran):
    """`grouped` (the GPU run) has the classes, parameters and values of the per-process
    benchmarks: same parameter lists, every case measured or skipped for a stated reason,
    and its selection picks exactly its cases."""
    _, mods = suite
    g = mods["grouped"]
    for name in ("FilteredReload", "FullReload", "RawReadCopy", "ReloadDeviceMemory", "ProcessMoELayer",
                 "MoEForward", "ForwardAccuracy", "DeepGemmScaleMode", "ValidateStaged", "IOPaths"):
        mod = next(m for m in mods.values() if m is not g and hasattr(m, name))
        assert getattr(g, name).params == getattr(mod, name).params, name
        assert getattr(g, name).param_names == getattr(mod, name).param_names, name
    assert g.IOS == mods["io"].IOS
    cases = g.reload_cases() + g.forward_cases() + g.io_cases()
    for name, params in cases:
        cls, method = name.split(".")
        track = method if method.startswith("track_") else f"track_{method}"
        v = ran[(f"{cls}.{track}@grouped", params)]
        assert not isinstance(v, str) or any(r in v for r in CPU_SKIPS + SHAPE_SKIPS), (name, params, v)
    import re
    sel = g.selection(list(g.GROUPS))
    assert len(sel) == len(cases) and len(g.selection()) == len(cases) - len(g.io_cases())
    for name, params in cases:
        cls, method = name.split(".")
        track = method if method.startswith("track_") else f"track_{method}"
        shown = f"({', '.join(map(repr, params))})" if params else ""
        assert sum(bool(re.search(r, f"grouped.{cls}.{track}{shown}")) for r in sel) == 1


@pytest.mark.parametrize("repeat, samples", [
    ((2, 7, math.inf), 7), ((3, 20, 0.0), 3), (6, 6), ((0, 5, 0.0), 1), ((5, 2, math.inf), 2), (0, None)],
    ids=["up-to-max", "min-when-out-of-time", "int", "at-least-one", "at-most-max", "zero"])
def test_grouped_reads_repeat_as_asv_does(monkeypatch, repeat, samples):
    """`grouped_measure` takes the samples a class's ``repeat`` asks asv for (the
    post-processing: up to 20 in 10 s): a tuple (min, max, max_time) never gives none nor
    more than max, an int is that many, 0 means `REPEAT`."""
    import types

    gm = importlib.import_module("benchmarks.grouped_measure")

    class Bench:
        number = 1
        warmup_time = 0.0
        setups = 0

        def setup(self):
            type(self).setups += 1

        def time_it(self):
            pass

    Bench.repeat = repeat
    monkeypatch.setattr(gm, "MODULES", (types.SimpleNamespace(Bench=Bench),))
    assert gm.measure_one({}, "Bench.time_it", ())[0] == "ok"
    assert Bench.setups == 1 + (gm.REPEAT if samples is None else samples)


def test_host_time_per_call_counts_the_final_synchronize_only_when_asked(monkeypatch):
    """`host_time_per_call`: the loop's time per call (warm-up calls not counted), the
    synchronize that ends it only with ``to_sync``."""
    import time

    from fp8_reload.testing import bench

    calls, syncs = [], []
    monkeypatch.setattr(bench, "synchronize", lambda: (syncs.append(1), time.sleep(0.05)))

    def fn():
        calls.append(1)
        time.sleep(0.002)

    host = bench.host_time_per_call(fn, 5, warmup=2)
    assert len(calls) == 7 and len(syncs) == 2
    assert 0.002 <= host < 0.002 + 0.05 / 5  # the final synchronize (50 ms) is not in it
    assert bench.host_time_per_call(fn, 5, to_sync=True) >= 0.002 + 0.05 / 5


def test_the_io_group_measures_only_the_page_cache_states_asked_for():
    """``FP8_RELOAD_BENCH_IO_CACHES=warm``: the I/O group without its cold reads (the reload
    and I/O groups then fit one device call), every warm case still there; the asv grid keeps
    both states (asv replaces a benchmark's results with its grid: a warm-only grid would drop
    the cold figures a commit's results file already holds)."""
    code = ("import json; from benchmarks import grouped as g; print(json.dumps("
            "[sorted({p[-1] for _, p in g.io_cases()}), len(g.io_cases()), g.IOPaths.params[-1]]))")
    root = Path(__file__).resolve().parents[1]

    clean = {k: v for k, v in os.environ.items() if not k.startswith("FP8_RELOAD_BENCH_")}

    def cases(**env):
        out = subprocess.run([sys.executable, "-c", code], cwd=root, text=True, capture_output=True,
                             env={**clean, "FP8_RELOAD_BENCH_DEVICE": "cuda", **env})
        if out.returncode:
            return out.stderr.strip().splitlines()[-1], None
        picked, n, grid = json.loads(out.stdout)
        assert grid == ["warm", "cold"]  # asv keeps the figures of a grid's other cases
        return picked, n

    both, n_both = cases()
    warm, n_warm = cases(FP8_RELOAD_BENCH_IO_CACHES="warm")
    assert both == ["cold", "warm"] and warm == ["warm"] and 2 * n_warm == n_both > 0
    for bad in ("Warm,cold", ",", "hot"):  # a typo would be measured warm, filed under its name
        err, _ = cases(FP8_RELOAD_BENCH_IO_CACHES=bad)
        assert err.startswith("ValueError: FP8_RELOAD_BENCH_IO_CACHES=") and "expected warm" in err

