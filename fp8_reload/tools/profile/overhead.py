"""What the NVTX ranges cost with no tool attached (`fp8-reload profile --overhead`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.autograd import profiler as autograd_profiler

from ... import trace
from ..markdown import markdown_table
from .analyze import fmt_cell
from .workload import Workload


def _per_range_ns(n: int = 200_000) -> dict[str, float]:
    """Cost of one range with no tool attached and no profiler running (ns, thread CPU time),
    with a nullcontext and a bare ``record_function`` for scale."""
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
            with autograd_profiler.record_function("fp8_reload/x"):
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


def write_overhead(out: Path, workload: Workload, table, cost: dict) -> None:
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
                          "rounds"], fmt_cell), "",
          f"overhead % = ranges per step x {table.range_ns.iloc[0]:.0f} ns / step time. Step "
          f"time: {table.clock.iloc[0]}.", ""]
    (out / "overhead.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"files: {out / 'overhead.md'}, {out / 'overhead.csv'}")
