"""Events both profilers give: named ranges and the work (kernels, copies, ops) launched
inside them; loading them from a torch.profiler Chrome trace."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ... import trace
from .options import PROFILE_RANGE, SCENARIO_PREFIX


@dataclass
class Range:
    name: str
    start: int  # ns
    end: int  # ns
    thread: object  # anything hashable that identifies the CPU thread
    payload: float | None = None


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
                         short_kernel_name(name) if kind == "kernel" else name))
    if device:
        return Events(ranges, work, "torch.profiler", "CUDA kernels and copies, by launching thread")
    parents = nest(ops)
    work = [Work(o.name, "op", o.start, o.thread, o.end - o.start, 0, o.name)
            for o, p in zip(ops, parents) if p < 0]
    return Events(ranges, work, "torch.profiler", "top-level aten ops (CPU trace: no GPU kernels)")


def outer_first(r: Range) -> tuple:
    """Sort key: by start, longer first; on a tie the profiled window, then scenarios, outside."""
    rank = 0 if r.name == PROFILE_RANGE else 1 if r.name.startswith(SCENARIO_PREFIX) else 2
    return (r.start, -r.end, rank)


def nest(ranges: Sequence[Range]) -> list[int]:
    """Index of each range's parent (-1: none). Push/pop ranges of one thread are
    nested by construction: a range that starts while another is open is inside it."""
    parent = [-1] * len(ranges)
    order = sorted(range(len(ranges)), key=lambda i: (str(ranges[i].thread), *outer_first(ranges[i])))
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


def short_kernel_name(name: str) -> str:
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


def attach_payloads(path, recorded: list[tuple[str, float | None]]) -> int:
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


