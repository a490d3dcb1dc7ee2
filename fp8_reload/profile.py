"""`fp8-reload profile`: run a reload / forward scenario under a profiler and summarize it.

With Nsight Systems (``nsys`` on PATH) the scenario runs in a child process
under ``nsys profile -t cuda,nvtx,osrt`` with an NVTX capture range, the report
is exported to SQLite and the NVTX and CUDA tables become the summary.
Anywhere else (or when nsys cannot record or export) it runs under
``torch.profiler`` and writes a Chrome trace plus the same summary computed from
the trace's events.

The summary, per scenario and range: count, total (inclusive) and self time,
share of the scenario, payload total (bytes, tokens, experts: see
`trace.RANGES`), and the work launched inside the range: CUDA kernels and
memcpys (attributed through the launching API call, on the range's thread), or
on a CPU-only trace the top-level aten ops. A second table lists that work per
innermost range.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import trace
from .config import MoEConfig
from .errors import ReloadError

SCENARIOS = ("reload-full", "reload-filtered", "forward")
SCENARIO_PREFIX = "fp8_reload/scenario/"
PROFILE_RANGE = "fp8_reload/profile"
TOOLS = ("auto", "nsys", "torch")


# --------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------

@dataclass
class Workload:
    """A model, a checkpoint and the inputs the scenarios use."""

    preset: str = "small"
    num_layers: Optional[int] = None
    kind: str = "fp8"
    device: Optional[str] = None
    backend: Optional[str] = None
    processing: str = "fixed"
    tokens: int = 64
    experts: int = 2  # experts per MoE layer in the filtered (EPLB) reload
    repeat: int = 3
    checkpoint: Optional[str] = None
    model: object = field(default=None, repr=False)
    x: object = field(default=None, repr=False)
    filter: object = field(default=None, repr=False)

    def resolve(self, workdir: Path) -> "Workload":
        """Fill in the device and write the checkpoint (once) if none was given."""
        from .checkpoint import write_checkpoint

        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(f"device {self.device!r} requested but torch sees no CUDA device here")
        if self.checkpoint is None:
            overrides = {"num_layers": self.num_layers} if self.num_layers else {}
            cfg = MoEConfig.preset(self.preset, **overrides)
            path = Path(workdir) / f"ckpt-{cfg.name}-{cfg.num_layers}l-{self.kind}"
            if not (path / "config.json").exists():
                print(f"[profile] writing a {self.kind} checkpoint of preset {self.preset!r} to {path}",
                      flush=True)
                write_checkpoint(path, cfg, seed=0, kind=self.kind)
            self.checkpoint = str(path)
        return self

    def prepare(self) -> "Workload":
        """Load the model (not profiled) and build the forward input and the EPLB filter."""
        from .demo import eplb_filter
        from .kernels import BACKENDS, BackendUnavailable, available_backends
        from .reload import load_model

        model = load_model(self.checkpoint, device=self.device, processing=self.processing)
        if self.backend and self.backend not in BACKENDS and self.backend not in available_backends():
            raise BackendUnavailable(f"MoE backend {self.backend!r} is not available here "
                                     f"(available: {', '.join(available_backends())})")
        model.set_backend(self.backend)
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(self.tokens, cfg.hidden_size, generator=g).to(torch.bfloat16).to(self.device)
        self.filter, _ = eplb_filter(cfg, self.experts)
        self.model = model
        return self

    def step(self, scenario: str) -> None:
        from .reload import update_weights_from_disk

        if scenario == "reload-full":
            update_weights_from_disk(self.model, self.checkpoint)
        elif scenario == "reload-filtered":
            update_weights_from_disk(self.model, self.checkpoint, self.filter)
        elif scenario == "forward":
            with torch.no_grad():
                self.model(self.x)
        else:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()

    def run(self, scenarios: Sequence[str]) -> None:
        """The profiled window: every scenario `repeat` times, each in its scenario range."""
        with trace.range(PROFILE_RANGE):
            for scenario in scenarios:
                for _ in range(self.repeat):
                    with trace.range(SCENARIO_PREFIX + scenario,
                                     payload=self.tokens if scenario == "forward" else None):
                        self.step(scenario)

    def warmup(self, scenarios: Sequence[str]) -> None:
        for scenario in scenarios:
            self.step(scenario)

    def argv(self) -> list[str]:
        """Command-line flags that rebuild this workload in a child process."""
        out = ["--preset", self.preset, "--kind", self.kind, "--device", str(self.device),
               "--tokens", str(self.tokens), "--experts", str(self.experts),
               "--repeat", str(self.repeat), "--processing", self.processing,
               "--checkpoint", str(self.checkpoint)]
        if self.num_layers:
            out += ["--num-layers", str(self.num_layers)]
        if self.backend:
            out += ["--backend", self.backend]
        return out


# --------------------------------------------------------------------------
# Events: what both profilers give us
# --------------------------------------------------------------------------

@dataclass
class Range:
    name: str
    start: int  # ns
    end: int  # ns
    thread: object  # anything hashable that identifies the CPU thread
    payload: Optional[float] = None


@dataclass
class Work:
    """A kernel / memcpy / memset (launched at `launch` on `thread`) or a CPU op."""

    name: str
    kind: str  # kernel | memcpy | memset | op
    launch: int  # ns, CPU time of the launching call (of the op itself for CPU ops)
    thread: object
    duration: int  # ns, on the GPU for device work
    nbytes: int = 0
    short: str = ""


@dataclass
class Events:
    ranges: list[Range]
    work: list[Work]
    source: str  # where the events came from
    work_label: str  # what `work` is, for the report


# --------------------------------------------------------------------------
# Loading a torch.profiler Chrome trace
# --------------------------------------------------------------------------

_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def _ns(us) -> int:
    return int(round(float(us) * 1000.0))


def load_chrome_trace(path) -> Events:
    """Ranges and work from a ``torch.profiler`` Chrome trace (``export_chrome_trace``)."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    ranges, launches, device, ops = [], {}, [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        thread = (e.get("pid"), e.get("tid"))
        args = e.get("args") or {}
        if cat == "user_annotation" and name.startswith(trace.PREFIX):
            start = _ns(e["ts"])
            ranges.append(Range(name, start, start + _ns(e.get("dur", 0)), thread, args.get("payload")))
        elif cat in _LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = (_ns(e["ts"]), thread)
        elif cat in _DEVICE_CATS:
            device.append((e, _DEVICE_CATS[cat]))
        elif cat == "cpu_op":
            start = _ns(e["ts"])
            ops.append(Range(name, start, start + _ns(e.get("dur", 0)), thread))
    work: list[Work] = []
    for e, kind in device:
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is None:
            continue  # no launching call in the trace: cannot be attributed to a thread
        name = e.get("name", "")
        work.append(Work(name, kind, launch[0], launch[1], _ns(e.get("dur", 0)),
                         int((e.get("args") or {}).get("bytes", 0) or 0),
                         _short_kernel(name) if kind == "kernel" else name))
    if device:
        return Events(ranges, work, "torch.profiler", "CUDA kernels and copies, by launching thread")
    parents = _nest(ops)
    work = [Work(o.name, "op", o.start, o.thread, o.end - o.start, 0, o.name)
            for o, p in zip(ops, parents) if p < 0]
    return Events(ranges, work, "torch.profiler", "top-level aten ops (CPU trace: no GPU kernels)")


def _short_kernel(name: str) -> str:
    """`void at::native::(anonymous namespace)::foo<4, bar<1>>(int, float*)` -> `foo`."""
    depth, out = 0, []
    for ch in name.replace("(anonymous namespace)::", ""):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    base = "".join(out).split("(")[0].strip()
    return base.split(" ")[-1].split("::")[-1] or name


def attach_payloads(path, recorded: list[tuple[str, Optional[float]]]) -> int:
    """Write recorded range payloads into the Chrome trace's events (``args.payload``).

    torch.profiler has no payload slot; `trace.recording` kept (name, payload) in
    entry order, which is start-time order per name on the profiled thread.
    Returns the number of events that got a payload; names whose counts differ
    are left alone.
    """
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_name: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and \
                str(e.get("name", "")).startswith(trace.PREFIX):
            by_name.setdefault(e["name"], []).append(e)
    rec: dict[str, list] = {}
    for name, payload in recorded:
        rec.setdefault(name, []).append(payload)
    n = 0
    for name, evs in by_name.items():
        payloads = rec.get(name, [])
        if len(payloads) != len(evs):
            continue
        evs.sort(key=lambda e: float(e["ts"]))
        for e, p in zip(evs, payloads):
            if p is not None:
                e.setdefault("args", {})["payload"] = p
                n += 1
    with open(path, "w") as f:
        json.dump(data, f)
    return n


# --------------------------------------------------------------------------
# Loading an Nsight Systems SQLite export
# --------------------------------------------------------------------------
#
# Schema followed: NVIDIA Nsight Systems "SQLite Export Schema Reference"
# (https://docs.nvidia.com/nsight-systems/2021.5/nsys-exporter/exported_data.html, also the
# User Guide's "Exporter SQLite schema" section) and its "Common SQLite examples" page
# ("Correlate CUDA kernel launches with CUDA API kernel launches"):
#   StringIds(id, value)
#   NVTX_EVENTS(start, end, eventType, rangeId, category, color, text, globalTid,
#               endGlobalTid, textId -> StringIds, domainId, uint64Value, int64Value,
#               doubleValue, uint32Value, int32Value, floatValue, jsonTextId, jsonText)
#     eventType: 59 NvtxPushPopRange, 60 NvtxStartEndRange, 75 NvtxDomainCreate
#     (names in ENUM_NSYS_EVENT_TYPE when the export has it); a domain's name is the
#     `text` of its NvtxDomainCreate row; a range's name is `text`, or StringIds[textId]
#     for registered strings (what the nvtx package emits).
#   CUPTI_ACTIVITY_KIND_RUNTIME(start, end, eventClass, globalTid, correlationId, nameId, ...)
#   CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, contextId, streamId, correlationId,
#               globalPid, demangledName -> StringIds, shortName -> StringIds, ...)
#   CUPTI_ACTIVITY_KIND_MEMCPY(start, end, ..., correlationId, globalPid, bytes, copyKind, ...)
#   CUPTI_ACTIVITY_KIND_MEMSET(start, end, ..., correlationId, globalPid, value, bytes, ...)
# Timestamps are ns. globalTid serializes (pid, tid) as pid * 0x1000000 + tid (low bits),
# globalPid the same with tid = 0, so `// 0x1000000` gives the process of either.
# A kernel is attributed to the NVTX ranges open on the thread that launched it: the
# RUNTIME row with the kernel's correlationId (same process) gives thread and launch time.

NVTX_PUSHPOP, NVTX_DOMAIN_CREATE = 59, 75
_MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
                 8: "DtoD", 9: "HtoH", 10: "PtoP"}
_PAYLOAD_COLUMNS = ("int64Value", "uint64Value", "doubleValue", "int32Value", "uint32Value",
                    "floatValue")


def _tables(db) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}


def _columns(db, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _enum_id(db, tables, label: str, default: int) -> int:
    if "ENUM_NSYS_EVENT_TYPE" in tables:
        row = db.execute("SELECT id FROM ENUM_NSYS_EVENT_TYPE WHERE name = ?", (label,)).fetchone()
        if row is not None:
            return int(row[0])
    return default


def load_nsys_sqlite(path, domain: str = trace.DOMAIN) -> Events:
    """Ranges of `domain` and CUDA work from an ``nsys export --type sqlite`` file."""
    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        tables = _tables(db)
        if "NVTX_EVENTS" not in tables:
            raise ValueError(f"{path}: no NVTX_EVENTS table: was the run traced with -t nvtx?")
        strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        pushpop = _enum_id(db, tables, "NvtxPushPopRange", NVTX_PUSHPOP)
        create = _enum_id(db, tables, "NvtxDomainCreate", NVTX_DOMAIN_CREATE)
        cols = _columns(db, "NVTX_EVENTS")
        payload = [c for c in _PAYLOAD_COLUMNS if c in cols]
        payload_sql = f"COALESCE({', '.join(payload)})" if payload else "NULL"
        dom_ids = [r[0] for r in db.execute(
            "SELECT domainId FROM NVTX_EVENTS WHERE eventType = ? AND text = ?", (create, domain))]
        where = "eventType = ? AND end IS NOT NULL"
        params: list = [pushpop]
        if dom_ids:
            where += f" AND domainId IN ({', '.join('?' * len(dom_ids))})"
            params += dom_ids
        ranges = []
        for start, end, text, text_id, gtid, value in db.execute(
                f"SELECT start, end, text, textId, globalTid, {payload_sql} FROM NVTX_EVENTS "
                f"WHERE {where}", params):
            name = text if text is not None else strings.get(text_id, "")
            if name.startswith(trace.PREFIX):
                ranges.append(Range(name, int(start), int(end), int(gtid), value))

        launches = {}
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            for corr, gtid, start in db.execute(
                    "SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                launches[(int(gtid) // 0x1000000, corr)] = (int(start), int(gtid))
        work: list[Work] = []

        def attach(kind, rows):
            for start, end, corr, gpid, name, short, nbytes in rows:
                launch = launches.get((int(gpid) // 0x1000000, corr)) if gpid is not None else None
                if launch is None:
                    continue
                work.append(Work(name, kind, launch[0], launch[1], int(end) - int(start),
                                 int(nbytes or 0), short or name))

        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            rows = db.execute("SELECT start, end, correlationId, globalPid, demangledName, shortName "
                              "FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchall()
            attach("kernel", ((s, e, c, p, strings.get(d, str(d)), strings.get(sn, ""), 0)
                              for s, e, c, p, d, sn in rows))
        for table, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
            if table not in tables:
                continue
            has_kind = "copyKind" in _columns(db, table)
            rows = db.execute(f"SELECT start, end, correlationId, globalPid, bytes, "
                              f"{'copyKind' if has_kind else 'NULL'} FROM {table}").fetchall()
            attach(kind, ((s, e, c, p, f"{kind} {_MEMCPY_KINDS.get(k, '')}".strip()
                           if kind == "memcpy" else kind, "", b) for s, e, c, p, b, k in rows))
        return Events(ranges, work, "nsys", "CUDA kernels and copies, by launching thread")
    finally:
        db.close()


def load_events(path) -> Events:
    """A Chrome trace (``.json``) or an Nsight Systems SQLite export (``.sqlite``)."""
    path = Path(path)
    if path.suffix in (".sqlite", ".db"):
        return load_nsys_sqlite(path)
    if path.suffix == ".json":
        return load_chrome_trace(path)
    raise ValueError(f"{path}: expected a torch.profiler Chrome trace (.json) or an "
                     "nsys SQLite export (.sqlite)")


# --------------------------------------------------------------------------
# Analysis: nesting, attribution, tables
# --------------------------------------------------------------------------

def _outer_first(r: Range) -> tuple:
    """Sort key: by start, longer first; on a tie the profiled window, then scenarios, outside."""
    rank = 0 if r.name == PROFILE_RANGE else 1 if r.name.startswith(SCENARIO_PREFIX) else 2
    return (r.start, -r.end, rank)


def _nest(ranges: Sequence[Range]) -> list[int]:
    """Index of each range's parent (-1: none). Push/pop ranges of one thread are
    nested by construction: a range that starts while another is open is inside it."""
    parent = [-1] * len(ranges)
    order = sorted(range(len(ranges)), key=lambda i: (str(ranges[i].thread), *_outer_first(ranges[i])))
    stack: list[int] = []
    thread = object()
    for i in order:
        r = ranges[i]
        if r.thread != thread:
            stack, thread = [], r.thread
        while stack and ranges[stack[-1]].end <= r.start:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _innermost(ranges: Sequence[Range], work: Sequence[Work]) -> list[int]:
    """For each work item, the innermost range open on its thread at its launch (-1: none)."""
    out = [-1] * len(work)
    by_thread: dict = {}
    for i, r in enumerate(ranges):
        by_thread.setdefault(r.thread, []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: _outer_first(ranges[i]))
    w_by_thread: dict = {}
    for j, w in enumerate(work):
        w_by_thread.setdefault(w.thread, []).append(j)
    for thread, ws in w_by_thread.items():
        rs = by_thread.get(thread, [])
        ws.sort(key=lambda j: work[j].launch)
        stack: list[int] = []
        k = 0
        for j in ws:
            t = work[j].launch
            while k < len(rs) and ranges[rs[k]].start <= t:
                while stack and ranges[stack[-1]].end <= ranges[rs[k]].start:
                    stack.pop()
                stack.append(rs[k])
                k += 1
            while stack and ranges[stack[-1]].end < t:
                stack.pop()
            out[j] = stack[-1] if stack else -1
    return out


def analyze(events: Events):
    """(summary, work) pandas DataFrames; see `write_summary` for the columns."""
    import pandas as pd

    ranges, work = events.ranges, events.work
    parent = _nest(ranges)
    order = sorted(range(len(ranges)), key=lambda i: _outer_first(ranges[i]))
    scenario = [""] * len(ranges)
    depth = [0] * len(ranges)
    for i in order:  # parents start first
        p = parent[i]
        if ranges[i].name.startswith(SCENARIO_PREFIX):
            scenario[i] = ranges[i].name[len(SCENARIO_PREFIX):]
        elif p >= 0:
            scenario[i] = scenario[p]
        else:
            scenario[i] = "all"
        depth[i] = depth[p] + 1 if p >= 0 else 0
    child_time = [0] * len(ranges)
    for i, p in enumerate(parent):
        if p >= 0:
            child_time[p] += ranges[i].end - ranges[i].start

    inner = _innermost(ranges, work)
    incl_kernels = [0] * len(ranges)
    incl_kernel_ns = [0] * len(ranges)
    incl_copy_bytes = [0] * len(ranges)
    for j, i in enumerate(inner):
        seen = set()
        w = work[j]
        while i >= 0:
            if ranges[i].name not in seen:  # a name nested in itself counts once
                seen.add(ranges[i].name)
                if w.kind in ("kernel", "op"):
                    incl_kernels[i] += 1
                    incl_kernel_ns[i] += w.duration
                else:
                    incl_copy_bytes[i] += w.nbytes
            i = parent[i]

    rows = [{
        "scenario": scenario[i], "range": r.name, "category": trace.category_of(r.name),
        "depth": depth[i], "first_start": r.start, "duration_ns": r.end - r.start,
        "self_ns": r.end - r.start - child_time[i],
        "payload": r.payload, "kernels": incl_kernels[i], "kernel_ns": incl_kernel_ns[i],
        "copy_bytes": incl_copy_bytes[i],
    } for i, r in enumerate(ranges)]
    cols = ["scenario", "range", "category", "count", "total_ms", "mean_ms", "self_ms", "share_pct",
            "payload_total", "payload_unit", "kernels", "kernel_ms", "copy_mib", "depth"]
    if not rows:
        return pd.DataFrame(columns=cols), _work_table(events, inner, scenario)
    df = pd.DataFrame(rows)
    g = df.groupby(["scenario", "range"], sort=False)
    summary = g.agg(category=("category", "first"), count=("duration_ns", "size"),
                    total_ns=("duration_ns", "sum"), self_ns=("self_ns", "sum"),
                    payload_total=("payload", lambda s: s.dropna().sum() if s.notna().any() else None),
                    kernels=("kernels", "sum"), kernel_ns=("kernel_ns", "sum"),
                    copy_bytes=("copy_bytes", "sum"), depth=("depth", "min"),
                    first_start=("first_start", "min")).reset_index()
    totals = {s: summary.loc[(summary.scenario == s) & (summary.range == SCENARIO_PREFIX + s), "total_ns"].sum()
              for s in summary.scenario.unique()}
    window = summary.loc[summary.range == PROFILE_RANGE, "total_ns"].sum()
    summary["total_ms"] = summary.total_ns / 1e6
    summary["mean_ms"] = summary.total_ns / summary["count"] / 1e6
    summary["self_ms"] = summary.self_ns / 1e6
    summary["share_pct"] = [100.0 * t / (totals.get(s) or window or t or 1)
                            for s, t in zip(summary.scenario, summary.total_ns)]
    summary["payload_unit"] = [trace.RANGES[r].payload if r in trace.RANGES else ""
                               for r in summary.range]
    summary["kernel_ms"] = summary.kernel_ns / 1e6
    summary["copy_mib"] = summary.copy_bytes / 2**20
    # Scenarios in the order they ran, ranges in call-tree order (parents first).
    first = {s: summary.loc[summary.scenario == s, "first_start"].min() for s in summary.scenario.unique()}
    summary["_s"] = summary.scenario.map(first)
    summary = summary.sort_values(["_s", "first_start", "depth"]).reset_index(drop=True)
    return summary[cols], _work_table(events, inner, scenario)


def _work_table(events: Events, inner: list[int], scenario: list[str]):
    import pandas as pd

    rows = [{"scenario": scenario[i] if i >= 0 else "-",
             "range": events.ranges[i].name if i >= 0 else "(outside fp8_reload ranges)",
             "kind": w.kind, "kernel": w.short or w.name, "full_name": w.name,
             "duration_ns": w.duration, "nbytes": w.nbytes}
            for w, i in zip(events.work, inner)]
    cols = ["scenario", "range", "kind", "kernel", "count", "total_ms", "mean_us", "copy_mib", "full_name"]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows)
    t = df.groupby(["scenario", "range", "kind", "kernel"], sort=False).agg(
        count=("duration_ns", "size"), total_ns=("duration_ns", "sum"), nbytes=("nbytes", "sum"),
        full_name=("full_name", "first")).reset_index()
    t["total_ms"] = t.total_ns / 1e6
    t["mean_us"] = t.total_ns / t["count"] / 1e3
    t["copy_mib"] = t.nbytes / 2**20
    return t.sort_values(["scenario", "total_ns"], ascending=[True, False]).reset_index(drop=True)[cols]


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------

def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown_table(df, columns: Sequence[str], headers: Optional[Sequence[str]] = None) -> str:
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


def write_summary(events: Events, out: Path, title: str, top: int = 12) -> dict[str, Path]:
    """Write summary.csv, kernels.csv and summary.md to `out`; returns the paths."""
    summary, work = analyze(events)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary_csv": out / "summary.csv", "kernels_csv": out / "kernels.csv",
             "summary_md": out / "summary.md"}
    summary.to_csv(paths["summary_csv"], index=False)
    work.to_csv(paths["kernels_csv"], index=False)
    shown = summary.copy()
    shown["range"] = ["\u2003" * int(d) + r for r, d in zip(shown.range, shown.depth)]
    shown["payload"] = [f"{int(p) if float(p).is_integer() else _fmt(p)} {u}".strip()
                        if p is not None and p == p else ""
                        for p, u in zip(shown.payload_total, shown.payload_unit)]
    md = [f"# {title}", "",
          f"Source: {events.source}. Kernels = {events.work_label}.", "",
          "## Ranges", "",
          markdown_table(shown, ["scenario", "range", "count", "total_ms", "mean_ms", "self_ms",
                                 "share_pct", "payload", "kernels", "kernel_ms", "copy_mib"],
                         ["scenario", "range", "count", "total ms", "mean ms", "self ms",
                          "% of scenario", "payload", "kernels", "kernel ms", "copies MiB"]), ""]
    if len(work):
        md += [f"## Top {top} kernels per scenario, by innermost range", ""]
        tops = work.groupby("scenario", sort=False).head(top)
        md += [markdown_table(tops, ["scenario", "range", "kind", "kernel", "count", "total_ms", "mean_us"],
                              ["scenario", "innermost range", "kind", "kernel", "count", "total ms",
                               "mean us"]), ""]
    md += ["## How to read this", "",
           "* **total ms**: wall time inside the range, summed over its `count` instances; nested "
           "ranges are included (inclusive). **self ms** subtracts the directly nested fp8_reload "
           "ranges, so self times of one scenario add up to its total.",
           "* **% of scenario**: total / the scenario range's total "
           "(`fp8_reload/scenario/<name>`, repeated `count` times).",
           "* **payload**: the sum of the numeric NVTX payloads (bytes read / copied, tokens, "
           "experts; see `fp8_reload.trace.RANGES`).",
           "* **kernels / kernel ms**: work launched while the range was open on its thread "
           "(inclusive), and its summed duration. GPU kernels run asynchronously: kernel ms "
           "can exceed or trail the range's wall time.",
           "* `kernels.csv` lists every kernel / op / copy per innermost range "
           "(`full_name` has the demangled name).", ""]
    paths["summary_md"].write_text("\n".join(md))
    return paths


# --------------------------------------------------------------------------
# Profiling back ends
# --------------------------------------------------------------------------

def profile_torch(workload: Workload, scenarios: Sequence[str], out: Path) -> Path:
    """Run under torch.profiler; returns the Chrome trace path (payloads attached)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if str(workload.device).startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof, trace.recording() as rec:
        workload.run(scenarios)
    path = Path(out) / "trace.json"
    prof.export_chrome_trace(str(path))
    attach_payloads(path, rec.events)
    return path


def nsys_commands(nsys: str, out: Path, worker: Sequence[str]) -> dict[str, list[str]]:
    """The nsys command lines: record (capture range = the profiled window), export, stats."""
    rep = Path(out) / "trace.nsys-rep"
    return {
        "profile": [nsys, "profile", "-t", "cuda,nvtx,osrt", "--capture-range=nvtx",
                    f"--nvtx-capture={PROFILE_RANGE}@{trace.DOMAIN}", "--capture-range-end=stop",
                    "--env-var=NSYS_NVTX_PROFILER_REGISTER_ONLY=0", "--force-overwrite=true",
                    "-o", str(rep.with_suffix("")), *worker],
        "export": [nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                   "-o", str(rep.with_suffix(".sqlite")), str(rep)],
        "stats": [nsys, "stats", "--report", "nvtx_sum", "--report", "cuda_gpu_kern_sum",
                  "--format", "csv", "--force-export", "false", "-o", str(Path(out) / "nsys_stats"),
                  str(rep)],
    }


class NsysFailed(RuntimeError):
    pass


def worker_command(workload: Workload, scenarios: Sequence[str], python: str = sys.executable) -> list[str]:
    """The child process nsys (or ncu) profiles: `_worker_main` with this workload."""
    return [python, "-m", "fp8_reload.profile", "--worker", "--scenario", ",".join(scenarios),
            *workload.argv()]


def profile_nsys(nsys: str, workload: Workload, scenarios: Sequence[str], out: Path) -> Path:
    """Record under nsys in a child process, export to SQLite; returns the SQLite path."""
    cmds = nsys_commands(nsys, out, worker_command(workload, scenarios))
    for step in ("profile", "export"):
        print(f"[profile] $ {' '.join(cmds[step])}", flush=True)
        res = subprocess.run(cmds[step])
        if res.returncode != 0:
            raise NsysFailed(f"nsys {step} failed (exit {res.returncode})")
    sqlite = Path(out) / "trace.sqlite"
    if not sqlite.exists():
        raise NsysFailed(f"nsys export wrote no {sqlite}")
    res = subprocess.run(cmds["stats"], capture_output=True, text=True)  # optional extras
    if res.returncode != 0:
        print(f"[profile] nsys stats failed (not needed for the summary): {res.stderr.strip()[:300]}")
    return sqlite


# --------------------------------------------------------------------------
# Overhead of the instrumentation
# --------------------------------------------------------------------------

def _per_range_ns(n: int = 200_000) -> dict[str, float]:
    """Cost of one range with no tool attached and no profiler running (ns, thread CPU time),
    with a nullcontext and a bare ``record_function`` for scale."""
    from torch.autograd import profiler as _autograd_profiler

    @trace.range("fp8_reload/linear")
    def decorated():
        pass

    def plain():
        pass

    def loop(body) -> float:
        t0 = time.thread_time()
        body()
        return (time.thread_time() - t0) / n * 1e9

    def ctx():
        for _ in range(n):
            with trace.range("fp8_reload/weight_loader", payload=1):
                pass

    def empty():
        for _ in range(n):
            pass

    null = contextlib.nullcontext()

    def nullctx():
        for _ in range(n):
            with null:
                pass

    def deco():
        for _ in range(n):
            decorated()

    def call():
        for _ in range(n):
            plain()

    base, base_call = min(loop(empty) for _ in range(3)), min(loop(call) for _ in range(3))
    def rf():
        for _ in range(n // 20):
            with _autograd_profiler.record_function("fp8_reload/x"):
                pass

    return {"with": min(loop(ctx) for _ in range(3)) - base,
            "decorator": min(loop(deco) for _ in range(3)) - base_call,
            "nullcontext": min(loop(nullctx) for _ in range(3)) - base,
            "record_function": min(loop(rf) for _ in range(3)) * 20 - base}


def measure_overhead(workload: Workload, scenarios: Sequence[str], seconds: float = 2.0,
                     max_rounds: int = 25):
    """Cost of the ranges per scenario with no tool attached; returns (DataFrame, per-range costs).

    overhead % = ranges entered per step (counted) x cost of one range (measured over
    an empty loop, the larger of the `with` and decorator forms) / step time (the
    fastest of a few steps). A with/without comparison of whole steps cannot resolve
    this: switching ranges off leaves the calls in place, and two processes with and
    without the instrumentation differ by more than 1% from run to run on a shared
    machine. On CPU, times are CPU time of the calling thread with torch on one
    intra-op thread (waiting for a core does not count); on CUDA, wall time.
    """
    import pandas as pd

    cost = _per_range_ns()
    per_range = max(cost["with"], cost["decorator"])
    cuda = str(workload.device).startswith("cuda")
    clock = time.perf_counter if cuda else time.thread_time
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # all the work on the timed thread: its CPU time is the step's
    rows = []
    try:
        for scenario in scenarios:
            t0 = clock()
            workload.step(scenario)
            rounds = int(min(max_rounds, max(5, seconds / max(clock() - t0, 1e-6))))
            with trace.recording() as rec:
                workload.step(scenario)
            steps = []
            for _ in range(rounds):
                t0 = clock()
                workload.step(scenario)
                steps.append(clock() - t0)
            step = min(steps)  # contention only ever adds time
            n = len(rec.events)
            rows.append({"scenario": scenario, "ranges_per_step": n, "step_ms": step * 1e3,
                         "median_step_ms": statistics.median(steps) * 1e3, "range_ns": per_range,
                         "overhead_ms": n * per_range * 1e-6,
                         "overhead_pct": 100.0 * n * per_range * 1e-9 / step, "rounds": rounds,
                         "clock": "wall" if cuda else "thread CPU, 1 intra-op thread"})
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows), cost


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------

def _parse_scenarios(s: str) -> list[str]:
    names = list(SCENARIOS) if s == "all" else [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenario {bad[0]!r}; choose from {', '.join(SCENARIOS)} or all")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=False, default=None, help="output directory (created)")
    p.add_argument("--scenario", default="all",
                   help="reload-full | reload-filtered | forward | all (or a comma list)")
    p.add_argument("--tool", choices=TOOLS, default="auto",
                   help="auto: nsys when on PATH (falls back to torch.profiler if it fails)")
    p.add_argument("--backend", default=None, help="MoE forward backend (default: torch reference)")
    p.add_argument("--preset", default="small", choices=MoEConfig.PRESETS, help="model shape")
    p.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    p.add_argument("--kind", choices=("fp8", "bf16"), default="fp8", help="checkpoint kind")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--processing", default="fixed", help="processing mode (fixed, upstream, ...)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per forward")
    p.add_argument("--experts", type=int, default=2, help="experts per MoE layer in reload-filtered")
    p.add_argument("--repeat", type=int, default=3, help="profiled runs of each scenario")
    p.add_argument("--checkpoint", default=None, help="existing checkpoint (default: write one under --out)")
    p.add_argument("--summarize", default=None, metavar="TRACE",
                   help="only summarize an existing trace.json / .sqlite into --out")
    p.add_argument("--overhead", action="store_true",
                   help="measure the cost of the ranges with no tool attached instead of profiling")


def _workload(args) -> Workload:
    return Workload(preset=args.preset, num_layers=args.num_layers, kind=args.kind, device=args.device,
                    backend=args.backend, processing=args.processing, tokens=args.tokens,
                    experts=args.experts, repeat=args.repeat, checkpoint=args.checkpoint)


def _prepare(workload: Workload) -> None:
    from .kernels import BackendUnavailable

    try:
        workload.prepare()
    except BackendUnavailable as e:
        raise SystemExit(f"fp8-reload profile: {e}") from None


def _print_files(trace_path: Path, paths: dict, extra: Sequence[str] = ()) -> None:
    print()
    print(Path(paths["summary_md"]).read_text().split("## How to read")[0].rstrip())
    print()
    print("files:")
    if trace_path.suffix == ".json":
        print(f"  trace     {trace_path}  (open in https://ui.perfetto.dev or chrome://tracing)")
    else:
        print(f"  report    {trace_path.with_suffix('.nsys-rep')}  (open with nsys-ui)")
        print(f"  sqlite    {trace_path}  (sqlite3; tables NVTX_EVENTS, CUPTI_ACTIVITY_KIND_*)")
    for line in extra:
        print("  " + line)
    print(f"  summary   {paths['summary_md']}  (Markdown)")
    print(f"  tables    {paths['summary_csv']}, {paths['kernels_csv']}  (CSV, pandas.read_csv)")


def _write_overhead(out: Path, workload: Workload, table, cost: dict) -> None:
    table.to_csv(out / "overhead.csv", index=False)
    md = [f"# Trace overhead, no tool attached ({workload.preset}, {workload.device}, "
          f"nvtx {'active' if trace.nvtx_active() else 'inactive'}, torch {torch.__version__})", "",
          f"One range: {cost['with']:.0f} ns (`with trace.range(...)`; `with "
          f"contextlib.nullcontext()` here: {cost['nullcontext']:.0f} ns), "
          f"{cost['decorator']:.0f} ns (decorated call, over a plain call); "
          f"`record_function` with no profiler running: {cost['record_function']:.0f} ns.", "",
          markdown_table(table, ["scenario", "ranges_per_step", "step_ms", "overhead_ms", "overhead_pct",
                                 "rounds"],
                         ["scenario", "ranges / step", "step ms (fastest)", "ranges ms", "overhead %",
                          "rounds"]), "",
          f"overhead % = ranges per step x {table.range_ns.iloc[0]:.0f} ns / step time. Step "
          f"time: {table.clock.iloc[0]}.", ""]
    (out / "overhead.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"files: {out / 'overhead.md'}, {out / 'overhead.csv'}")


def _check_ranges(events: Events, scenarios: Sequence[str]) -> None:
    expected = (["fp8_reload/load_weights", "fp8_reload/process_weights_after_loading"]
                if any(s.startswith("reload") for s in scenarios) else [])
    expected += ["fp8_reload/forward"] if "forward" in scenarios else []
    missing = [n for n in expected if not any(r.name == n for r in events.ranges)]
    if missing:
        print(f"[profile] warning: the trace lacks ranges {missing}")


def run_profile(args) -> int:
    """`fp8-reload profile`."""
    if args.out is None:
        raise SystemExit("fp8-reload profile: --out DIR is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        events = load_events(args.summarize)
        paths = write_summary(events, out, f"fp8-reload profile summary of {args.summarize}")
        _print_files(Path(args.summarize), paths)
        return 0
    scenarios = _parse_scenarios(args.scenario)
    workload = _workload(args).resolve(out)
    if args.overhead:
        _prepare(workload)
        _write_overhead(out, workload, *measure_overhead(workload, scenarios))
        return 0

    nsys = shutil.which("nsys") if args.tool in ("auto", "nsys") else None
    if args.tool == "nsys" and nsys is None:
        raise SystemExit("fp8-reload profile --tool nsys: nsys is not on PATH")
    title = (f"fp8-reload profile: {', '.join(scenarios)} x{workload.repeat} "
             f"(preset {workload.preset}, {workload.kind}, {workload.device}, "
             f"backend {workload.backend or 'torch'})")
    if nsys is not None:
        try:
            sqlite = profile_nsys(nsys, workload, scenarios, out)
            events = load_nsys_sqlite(sqlite)
            _check_ranges(events, scenarios)
            paths = write_summary(events, out, title)
            extra = [f"nsys stats {p}" for p in sorted(out.glob("nsys_stats*.csv"))]
            _print_files(sqlite, paths, extra)
            return 0
        except NsysFailed as e:
            if args.tool == "nsys":
                raise SystemExit(f"fp8-reload profile: {e}")
            print(f"[profile] {e}; falling back to torch.profiler", flush=True)
    print(f"[profile] loading the model on {workload.device} and warming up", flush=True)
    _prepare(workload)
    try:
        workload.warmup(scenarios)
    except ReloadError as e:
        raise SystemExit(f"fp8-reload profile: the warm-up reload failed "
                         f"(processing={workload.processing!r}): {e}") from None
    print(f"[profile] profiling {', '.join(scenarios)} x{workload.repeat} under torch.profiler", flush=True)
    path = profile_torch(workload, scenarios, out)
    events = load_chrome_trace(path)
    _check_ranges(events, scenarios)
    paths = write_summary(events, out, title)
    _print_files(path, paths)
    return 0


def _worker_main(argv=None) -> int:
    """Child process under nsys / ncu: load, warm up, run the profiled window."""
    p = argparse.ArgumentParser(prog="python -m fp8_reload.profile --worker")
    p.add_argument("--worker", action="store_true", required=True)
    add_arguments(p)
    args = p.parse_args(argv)
    scenarios = _parse_scenarios(args.scenario)
    workload = _workload(args).resolve(Path(args.out or "."))
    workload.prepare()
    workload.warmup(scenarios)
    print(f"[worker] nvtx {'active' if trace.nvtx_active() else 'inactive'}; running "
          f"{', '.join(scenarios)} x{workload.repeat} on {workload.device}", flush=True)
    workload.run(scenarios)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
