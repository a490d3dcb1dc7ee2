"""Nsight Systems: the command lines, and loading its SQLite export into `Events`."""

from __future__ import annotations

import sqlite3
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ... import trace
from ..usage import progress
from .events import Events, Range, Work
from .options import PROFILE_RANGE

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
        for table, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"),
                            ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
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
    """nsys could not record or export (the caller may fall back to torch.profiler)."""


def profile_nsys(nsys: str, worker: Sequence[str], out: Path) -> Path:
    """Record the `worker` command under nsys, export to SQLite; returns the SQLite path."""
    cmds = nsys_commands(nsys, out, worker)
    for step in ("profile", "export"):
        progress(f"[profile] $ {' '.join(cmds[step])}")
        res = subprocess.run(cmds[step])
        if res.returncode != 0:
            raise NsysFailed(f"nsys {step} failed (exit {res.returncode})")
    sqlite = Path(out) / "trace.sqlite"
    if not sqlite.exists():
        raise NsysFailed(f"nsys export wrote no {sqlite}")
    res = subprocess.run(cmds["stats"], capture_output=True, text=True)  # optional extras
    if res.returncode != 0:
        progress(f"[profile] nsys stats failed (not needed for the summary): "
                 f"{res.stderr.strip()[:300]}")
    return sqlite


