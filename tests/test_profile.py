"""`fp8-reload profile`: the CPU (torch.profiler) path end to end, the nsys SQLite parser on a
database built with the documented export schema, and the attribution rules."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fp8_reload.checkpoint import Checkpoint
from fp8_reload.tools import cli
from fp8_reload.tools.profile.analyze import analyze, innermost, load_events
from fp8_reload.tools.profile.command import worker_command
from fp8_reload.tools.profile.events import Range, Work, load_chrome_trace, nest, short_kernel_name
from fp8_reload.tools.profile.nsys import load_nsys_sqlite, nsys_commands
from fp8_reload.tools.profile.options import SCENARIOS
from fp8_reload.tools.profile.workload import Workload
from tests.test_trace import REPO, build_nvtx_recorder, nvtx_env, parse_nvtx_log

NEEDED = ("fp8_reload/load_weights", "fp8_reload/process_weights_after_loading", "fp8_reload/forward")


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory, ckpts):
    """One `fp8-reload profile` run on CPU (tiny preset, every scenario once)."""
    out = tmp_path_factory.mktemp("profile")
    argv = ["profile", "--out", str(out), "--tool", "torch", "--preset", "tiny", "--device", "cpu",
            "--repeat", "1", "--tokens", "16", "--checkpoint", str(ckpts[("fp8", 0)])]
    assert cli.main(argv) == 0
    return out


def test_cpu_profile_writes_a_trace_with_the_ranges(cpu_profile):
    data = json.loads((cpu_profile / "trace.json").read_text())
    names = {e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"}
    for name in NEEDED + ("fp8_reload/profile", "fp8_reload/scenario/reload-full",
                          "fp8_reload/scenario/reload-filtered", "fp8_reload/scenario/forward",
                          "fp8_reload/chunk_read", "fp8_reload/gemm_w13"):
        assert name in names, name


def test_cpu_profile_summary_tables(cpu_profile, ckpts):
    summary = pd.read_csv(cpu_profile / "summary.csv")
    assert list(summary.scenario.drop_duplicates()) == ["all", "reload-full", "reload-filtered", "forward"]
    row = lambda s, r: summary[(summary.scenario == s) & (summary.range == r)].iloc[0]  # noqa: E731
    for scenario in ("reload-full", "reload-filtered"):
        for name in NEEDED[:2]:
            assert row(scenario, name)["count"] == 1
        assert row(scenario, f"fp8_reload/scenario/{scenario}")["share_pct"] == pytest.approx(100)
        assert 0 < row(scenario, "fp8_reload/load_weights")["share_pct"] < 100
    fwd = row("forward", "fp8_reload/forward")
    assert fwd["count"] == 1 and fwd["payload_total"] == 16 and fwd["payload_unit"] == "tokens"
    # payloads made it into the Chrome trace: a full reload reads every byte of the checkpoint
    total = Checkpoint(ckpts[("fp8", 0)]).total_bytes()
    read = lambda s: sum(row(s, f"fp8_reload/{r}")["payload_total"]  # noqa: E731
                         for r in ("scales_read", "chunk_read"))
    assert read("reload-full") == total
    assert 0 < read("reload-filtered") < total
    # self times of a scenario add up to its wall time; CPU ops were attributed
    for scenario in ("reload-full", "forward"):
        part = summary[summary.scenario == scenario]
        top = row(scenario, f"fp8_reload/scenario/{scenario}")
        assert part.self_ms.sum() == pytest.approx(top.total_ms, rel=1e-6)
        assert top.kernels > 0
    kernels = pd.read_csv(cpu_profile / "kernels.csv")
    gemm = kernels[(kernels.scenario == "forward") & (kernels.range == "fp8_reload/gemm_w13")]
    assert set(gemm.kernel) & {"aten::matmul", "aten::mm"}
    md = (cpu_profile / "summary.md").read_text()
    assert "| scenario | range |" in md and "fp8_reload/process_weights_after_loading" in md
    assert "How to read this" in md


def test_summarize_an_existing_trace_gives_the_same_table(cpu_profile, tmp_path):
    assert cli.main(["profile", "--out", str(tmp_path), "--summarize", str(cpu_profile / "trace.json")]) == 0
    a = pd.read_csv(cpu_profile / "summary.csv")
    b = pd.read_csv(tmp_path / "summary.csv")
    pd.testing.assert_frame_equal(a, b)


def test_profile_prints_a_headline_and_where_the_files_are_not_the_summary(cpu_profile, tmp_path,
                                                                          capsys):
    assert cli.main(["profile", "--out", str(tmp_path), "--summarize", str(cpu_profile / "trace.json")]) == 0
    out = capsys.readouterr().out
    assert "| scenario | range |" not in out and "How to read" not in out
    lines = out.splitlines()
    head = lines.index("headline (the summary has every range and kernel):")
    for scenario, line in zip(("reload-full", "reload-filtered", "forward"), lines[head + 1:]):
        assert line.split()[0] == scenario and "ms per run" in line and "most self time:" in line
    for name in ("trace.json", "summary.md", "summary.csv", "kernels.csv"):
        assert name in out.split("files:")[1], name


def test_a_failing_nsys_falls_back_to_torch_profiler(tmp_path, ckpts, monkeypatch, capsys):
    """On the H200 nsys records but cannot export: the command must still deliver a trace."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    nsys = bindir / "nsys"
    nsys.write_text("#!/bin/sh\necho 'nsys: cannot export here' >&2\nexit 1\n")
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out"
    assert cli.main(["profile", "--out", str(out), "--scenario", "reload-filtered", "--preset", "tiny",
                     "--device", "cpu", "--repeat", "1", "--checkpoint", str(ckpts[("fp8", 0)])]) == 0
    printed = capsys.readouterr()
    assert "falling back to torch.profiler" in printed.err and "trace.json" in printed.out
    assert (out / "trace.json").exists() and (out / "summary.md").exists()
    # asked for nsys explicitly: no fallback, one line, exit 2
    assert cli.main(["profile", "--out", str(out), "--tool", "nsys", "--scenario", "reload-filtered",
                     "--preset", "tiny", "--device", "cpu", "--checkpoint", str(ckpts[("fp8", 0)])]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "fp8-reload profile: error: nsys profile failed (exit 1)"


def test_nsys_command_lines():
    cmds = nsys_commands("nsys", Path("/o"), ["python", "-m", "fp8_reload.tools.profile", "--worker"])
    p = " ".join(cmds["profile"])
    assert p.startswith("nsys profile -t cuda,nvtx,osrt --capture-range=nvtx "
                        "--nvtx-capture=fp8_reload/profile@fp8_reload --capture-range-end=stop")
    assert p.endswith("-o /o/trace python -m fp8_reload.tools.profile --worker")
    assert " ".join(cmds["export"]) == ("nsys export --type sqlite --force-overwrite true "
                                        "-o /o/trace.sqlite /o/trace.nsys-rep")
    assert cmds["stats"][:2] == ["nsys", "stats"] and "nvtx_sum" in cmds["stats"]


def test_docs_show_the_nsys_commands_the_profile_command_runs():
    doc = (REPO / "docs" / "profiling.md").read_text()
    block = doc.split("## Nsight Systems")[1].split("```bash")[1].split("```")[0]
    lines = " ".join(block.replace("\\\n", " ").split("\n"))
    documented = [" ".join(c.split("#")[0].split()) for c in lines.split("nsys ")[1:]]
    wl = Workload(preset="small", device="cuda", checkpoint="prof/ckpt-small-4l-fp8")
    cmds = nsys_commands("nsys", Path("prof"), worker_command(wl, SCENARIOS, python="python"))
    assert len(documented) == 3
    for step, doc in zip(("profile", "export", "stats"), documented):
        assert "nsys " + doc == " ".join(cmds[step]), step


def test_worker_under_an_nvtx_tool_emits_the_profiled_window(tmp_path, ckpts):
    """What nsys / ncu launch: the worker, with an NVTX tool injected."""
    lib = build_nvtx_recorder(tmp_path)
    log = tmp_path / "nvtx.log"
    res = subprocess.run([sys.executable, "-m", "fp8_reload.tools.profile", "--worker", "--scenario", "all",
                          "--preset", "tiny", "--device", "cpu", "--repeat", "2", "--tokens", "8",
                          "--checkpoint", str(ckpts[("fp8", 0)])],
                         env=nvtx_env(lib, log), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "nvtx active" in res.stdout
    got = parse_nvtx_log(log)
    assert not got["unbalanced"]
    top = [r["name"] for r in got["ranges"] if r["depth"] == 0]
    assert top[-1] == "fp8_reload/profile"  # warmup ran before the capture range
    window = got["ranges"][[r["name"] for r in got["ranges"]].index("fp8_reload/profile"):]
    scen = [r["name"] for r in window if r["depth"] == 1]
    assert scen == ["fp8_reload/scenario/reload-full"] * 2 + ["fp8_reload/scenario/reload-filtered"] * 2 \
        + ["fp8_reload/scenario/forward"] * 2
    assert {r["name"] for r in window} >= set(NEEDED)


def test_overhead_command_writes_its_table(tmp_path, ckpts):
    assert cli.main(["profile", "--out", str(tmp_path), "--overhead", "--scenario", "reload-filtered",
                     "--preset", "tiny", "--device", "cpu", "--checkpoint", str(ckpts[("fp8", 0)])]) == 0
    table = pd.read_csv(tmp_path / "overhead.csv")
    assert list(table.scenario) == ["reload-filtered"]
    assert table.ranges_per_step[0] > 10 and table.range_ns[0] > 0
    assert "overhead %" in (tmp_path / "overhead.md").read_text()


# --------------------------------------------------------------------------
# The nsys SQLite path, on a database with the documented export schema
# --------------------------------------------------------------------------

# Columns as in NVIDIA's "SQLite Export Schema Reference" (Nsight Systems); not every
# column is used by the parser, they are here so the test database looks like an export.
SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER REFERENCES StringIds(id), domainId INTEGER,
    uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
    int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
    eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER,
    nameId INTEGER NOT NULL REFERENCES StringIds(id), returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
    shortName INTEGER NOT NULL, mangledName INTEGER, gridX INTEGER, gridY INTEGER, gridZ INTEGER,
    blockX INTEGER, blockY INTEGER, blockZ INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL,
    deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER);
"""

PID, OTHER_PID = 4242, 5151
TID_A, TID_B = PID * 0x1000000 + 4242, PID * 0x1000000 + 4300  # globalTid = pid << 24 | tid
GPID = PID * 0x1000000


def build_nsys_db(path: Path, enum_table: bool = False) -> Path:
    """Thread A: profile > scenario/forward > forward > moe > {gemm_w13, gemm_w2}, plus
    ranges of another domain and a start/end range; launches on A and B."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    pushpop, create, startend = (59, 75, 60)
    if enum_table:  # an export that names its event types (ids shifted to prove they are read)
        pushpop, create, startend = 159, 175, 160
        db.execute("CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER PRIMARY KEY, name TEXT, label TEXT)")
        db.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                       [(159, "NvtxPushPopRange", "NVTX push/pop"), (175, "NvtxDomainCreate", "domain"),
                        (160, "NvtxStartEndRange", "NVTX start/end")])
    strings = {1: "fp8_reload/gemm_w13", 2: "cudaLaunchKernel", 3: "cudaMemcpyAsync",
               10: "void gemm_kernel<float, 128>(float const*, float*)", 11: "gemm_kernel",
               12: "void dequant_kernel<__nv_fp8_e4m3>(char const*)", 13: "dequant_kernel",
               14: "void late_kernel()", 15: "late_kernel"}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", strings.items())
    nv = """INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid, domainId,
            int64Value, doubleValue) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"""
    rows = [
        (0, None, create, "fp8_reload", None, TID_A, 1, None, None),
        (0, None, create, "other_domain", None, TID_A, 2, None, None),
        (0, 1000, pushpop, "fp8_reload/profile", None, TID_A, 1, None, None),
        (100, 900, pushpop, "fp8_reload/scenario/forward", None, TID_A, 1, 64, None),
        (100, 900, pushpop, "fp8_reload/forward", None, TID_A, 1, 64, None),
        (200, 600, pushpop, "fp8_reload/moe", None, TID_A, 1, 64, None),
        (250, 350, pushpop, None, 1, TID_A, 1, None, 12.5),  # registered string + double payload
        (400, 500, pushpop, "fp8_reload/gemm_w2", None, TID_A, 1, 128, None),
        (260, 300, pushpop, "fp8_reload/not_ours", None, TID_A, 2, None, None),  # other domain
        (255, 345, startend, "fp8_reload/gemm_w2", None, TID_A, 1, None, None),  # start/end: ignored
        (700, None, pushpop, "fp8_reload/unfinished", None, TID_A, 1, None, None),  # never popped
    ]
    db.executemany(nv, rows)
    rt = "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, ?, 0, NULL)"
    db.executemany(rt, [
        (260, 270, TID_A, 1, 2),   # in gemm_w13
        (410, 415, TID_A, 2, 2),   # in gemm_w2
        (150, 160, TID_A, 3, 3),   # memcpy in forward (outside moe)
        (950, 960, TID_A, 4, 2),   # in profile, outside the scenario
        (300, 305, TID_B, 5, 2),   # other thread, while gemm_w13 is open on A: not attributed
        (420, 425, OTHER_PID * 0x1000000 + 1, 2, 2),  # same correlationId, other process
    ])
    k = "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, " \
        "correlationId, globalPid, demangledName, shortName) VALUES (?, ?, 0, 1, 7, ?, ?, ?, ?)"
    db.executemany(k, [
        (600, 1230, 1, GPID, 10, 11),   # runs long after gemm_w13 closed: still gemm_w13's
        (430, 450, 2, GPID, 12, 13),
        (970, 990, 4, GPID, 14, 15),
        (310, 320, 5, GPID, 10, 11),
        (2000, 2010, 99, GPID, 14, 15),  # no launching call in the trace
    ])
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, streamId, "
               "correlationId, globalPid, bytes, copyKind) VALUES (170, 190, 0, 1, 7, 3, ?, 4096, 1)",
               (GPID,))
    db.commit()
    db.close()
    return path


@pytest.mark.parametrize("enum_table", [False, True])
def test_nsys_sqlite_ranges_payloads_and_kernel_attribution(tmp_path, enum_table):
    events = load_nsys_sqlite(build_nsys_db(tmp_path / "r.sqlite", enum_table))
    names = sorted(r.name for r in events.ranges)
    assert names == ["fp8_reload/forward", "fp8_reload/gemm_w13", "fp8_reload/gemm_w2", "fp8_reload/moe",
                     "fp8_reload/profile", "fp8_reload/scenario/forward"]
    payload = {r.name: r.payload for r in events.ranges}
    assert payload["fp8_reload/gemm_w13"] == 12.5 and payload["fp8_reload/gemm_w2"] == 128
    # kernel 5 (thread B) and the kernel without a launch stay unattributed below
    assert len(events.work) == 5
    summary, work = analyze(events)
    s = summary.set_index(["scenario", "range"])
    f = lambda r: s.loc[("forward", r)]  # noqa: E731
    assert f("fp8_reload/scenario/forward").total_ms == pytest.approx(800e-6)
    assert f("fp8_reload/forward").self_ms == pytest.approx(400e-6)
    assert f("fp8_reload/moe").share_pct == pytest.approx(50.0)
    assert f("fp8_reload/moe").self_ms == pytest.approx(200e-6)
    assert f("fp8_reload/gemm_w13").kernels == 1
    assert f("fp8_reload/gemm_w13").kernel_ms == pytest.approx(630e-6)  # GPU time, not range time
    assert f("fp8_reload/gemm_w2").kernels == 1
    assert f("fp8_reload/moe").kernels == 2
    assert f("fp8_reload/forward").kernels == 2
    assert f("fp8_reload/forward").copy_mib == pytest.approx(4096 / 2**20)
    assert f("fp8_reload/moe").copy_mib == 0
    assert s.loc[("all", "fp8_reload/profile")].kernels == 3  # + late_kernel outside the scenario
    assert f("fp8_reload/forward").payload_total == 64 and f("fp8_reload/forward").payload_unit == "tokens"
    by = work.set_index(["range", "kernel"])
    assert by.loc[("fp8_reload/gemm_w13", "gemm_kernel")]["count"] == 1
    assert by.loc[("fp8_reload/gemm_w2", "dequant_kernel")]["full_name"].startswith("void dequant_kernel")
    assert by.loc[("fp8_reload/forward", "memcpy HtoD")]["copy_mib"] == pytest.approx(4096 / 2**20)
    assert by.loc[("(outside fp8_reload ranges)", "gemm_kernel")]["count"] == 1  # thread B's launch
    # the generic loader picks the parser by suffix
    assert len(load_events(tmp_path / "r.sqlite").ranges) == 6


def test_nsys_sqlite_without_cuda_tables_and_summary_files(tmp_path):
    db = sqlite3.connect(tmp_path / "cpu.sqlite")
    db.executescript(SCHEMA.split("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME")[0])
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
                   [(0, None, 75, "fp8_reload", TID_A, 3),
                    (10, 90, 59, "fp8_reload/scenario/reload-full", TID_A, 3),
                    (20, 60, 59, "fp8_reload/load_weights", TID_A, 3)])
    db.commit()
    db.close()
    assert cli.main(["profile", "--out", str(tmp_path / "o"),
                     "--summarize", str(tmp_path / "cpu.sqlite")]) == 0
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    row = summary[summary.range == "fp8_reload/load_weights"].iloc[0]
    assert row.scenario == "reload-full" and row.share_pct == pytest.approx(50.0)
    with pytest.raises(ValueError, match="NVTX_EVENTS"):
        sqlite3.connect(tmp_path / "empty.sqlite").close()
        load_nsys_sqlite(tmp_path / "empty.sqlite")


def test_nesting_and_innermost_rules():
    T, U = "t", "u"
    # same start: the longer range is the parent
    ranges = [Range("fp8_reload/a", 0, 100, T), Range("fp8_reload/b", 0, 50, T),
              Range("fp8_reload/c", 50, 100, T),  # starts where b ends: b's sibling
              Range("fp8_reload/d", 10, 20, U)]
    assert nest(ranges) == [-1, 0, 0, -1]
    work = [Work("k", "kernel", 50, T, 1), Work("k", "kernel", 49, T, 1), Work("k", "kernel", 15, U, 1),
            Work("k", "kernel", 150, T, 1), Work("k", "kernel", 15, "v", 1)]
    assert innermost(ranges, work) == [2, 1, 3, -1, -1]


def test_short_kernel_names():
    assert short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::"
                         "BinaryFunctor<float, float, float, at::native::MulFunctor<float>>, "
                         "std::array<char*, 3>>(int, float*)") == "vectorized_elementwise_kernel"
    assert short_kernel_name("void at::native::(anonymous namespace)::indexSelectSmallIndex<float, long, "
                         "unsigned int, 2, 2, -2>(cuda::detail::TensorInfo<float, unsigned int>)") \
        == "indexSelectSmallIndex"
    assert short_kernel_name("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32") \
        == "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32"


def test_chrome_trace_gpu_attribution(tmp_path):
    """A CUDA torch.profiler trace: kernels are joined to launches through args.correlation."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "fp8_reload/gemm_w2", "pid": 1, "tid": 7,
         "ts": 10.0, "dur": 5.0, "args": {"payload": 32}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 11.0,
         "dur": 1.0, "args": {"correlation": 77}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": 1, "tid": 7, "ts": 12.0,
         "dur": 1.0, "args": {"correlation": 78}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32", "pid": 0, "tid": 7, "ts": 30.0,
         "dur": 4.0, "args": {"correlation": 77}},
        {"ph": "X", "cat": "kernel", "name": "_quant_kernel", "pid": 0, "tid": 7, "ts": 35.0,
         "dur": 2.0, "args": {"correlation": 78}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 8, "ts": 40.0,
         "dur": 2.0, "args": {"correlation": 99, "bytes": 1024}},  # no launch in the trace
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 7, "ts": 11.0, "dur": 1.0},
    ]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    events = load_chrome_trace(path)
    assert [w.name for w in events.work] == ["sm90_xmma_gemm_f32f32", "_quant_kernel"]  # not cpu ops
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 7,
               "ts": 13.0, "dur": 1.0, "args": {"correlation": 99}})  # now launched: a copy keeps its name
    path.write_text(json.dumps({"traceEvents": ev}))
    copy = [w for w in load_chrome_trace(path).work if w.kind == "memcpy"]
    assert [(w.short, w.nbytes) for w in copy] == [("Memcpy HtoD", 1024)]
    summary, work = analyze(events)
    row = summary.iloc[0]
    assert row.kernels == 2 and row.kernel_ms == pytest.approx(0.006) and row.payload_total == 32
