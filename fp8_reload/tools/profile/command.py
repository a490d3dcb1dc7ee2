"""`fp8-reload profile`: run a reload / forward scenario under a profiler and summarize it.

With Nsight Systems (``nsys`` on PATH) the scenario runs in a child process
under ``nsys profile -t cuda,nvtx,osrt`` with an NVTX capture range, the report
is exported to SQLite and the NVTX and CUDA tables become the summary.
Anywhere else (or when nsys cannot record or export) it runs under
``torch.profiler`` and writes a Chrome trace plus the same summary computed from
the trace's events.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from ... import trace
from ...device import resolve_device
from ...errors import BackendUnavailable, ReloadError
from ...kernels import get_backend
from ..cli import add_profile_arguments
from ..usage import UsageError, progress
from .analyze import load_events, write_summary
from .events import Events, attach_payloads, load_chrome_trace
from .nsys import NsysFailed, load_nsys_sqlite, profile_nsys
from .options import SCENARIO_PREFIX, SCENARIOS
from .overhead import measure_overhead, write_overhead
from .workload import Workload


def profile_torch(workload: Workload, scenarios: Sequence[str], out: Path) -> Path:
    """Run under torch.profiler; returns the Chrome trace path (payloads attached)."""
    activities = [ProfilerActivity.CPU]
    if str(workload.device).startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof, trace.recording() as rec:
        workload.run(scenarios)
    path = Path(out) / "trace.json"
    prof.export_chrome_trace(str(path))
    attach_payloads(path, rec.events)
    return path


def worker_command(workload: Workload, scenarios: Sequence[str], python: str = sys.executable) -> list[str]:
    """The child process nsys (or ncu) profiles: `_worker_main` with this workload."""
    return [python, "-m", "fp8_reload.tools.profile", "--worker", "--scenario", ",".join(scenarios),
            *workload.argv()]


def _parse_scenarios(s: str) -> list[str]:
    names = list(SCENARIOS) if s == "all" else [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in SCENARIOS]
    if bad or not names:
        raise UsageError(f"unknown scenario {(bad or [s])[0]!r}; choose from {', '.join(SCENARIOS)} "
                         "or all")
    return names


def _workload(args) -> Workload:
    return Workload(preset=args.preset, num_layers=args.num_layers, kind=args.kind, device=args.device,
                    backend=args.backend, processing=args.processing, tokens=args.tokens,
                    experts=args.experts, repeat=args.repeat, checkpoint=args.checkpoint)


def _prepare(workload: Workload) -> None:
    try:
        workload.prepare()
    except BackendUnavailable as e:
        raise UsageError(str(e)) from None


def headline(summary, top: int = 3) -> list[str]:
    """One line per scenario: its mean time and the ranges with the most self time."""
    lines = []
    for scenario, part in summary.groupby("scenario", sort=False):
        whole = part[part.range == SCENARIO_PREFIX + scenario]
        if whole.empty:
            continue
        total = float(whole.total_ms.iloc[0])
        inner = part[part.range != SCENARIO_PREFIX + scenario].nlargest(top, "self_ms")
        spent = ", ".join(f"{r.range.removeprefix('fp8_reload/')} {100 * r.self_ms / total:.0f}%"
                          for r in inner.itertuples() if total > 0)
        lines.append(f"  {scenario:16s} {float(whole.mean_ms.iloc[0]):9.2f} ms per run "
                     f"(x{int(whole['count'].iloc[0])}); most self time: {spent or '-'}")
    return lines


def _print_files(trace_path: Path, paths: dict, extra: Sequence[str] = ()) -> None:
    import pandas as pd

    lines = headline(pd.read_csv(paths["summary_csv"]))
    print("\n".join(["", "headline (the summary has every range and kernel):"] + lines
                     if lines else ["", "the trace holds no scenario ranges"]))
    print()
    print("files:")
    if trace_path.suffix == ".json":
        print(f"  trace     {trace_path}  (open in https://ui.perfetto.dev or chrome://tracing)")
    else:
        print(f"  report    {trace_path.with_suffix('.nsys-rep')}  (open with nsys-ui)")
        print(f"  sqlite    {trace_path}  (sqlite3; tables NVTX_EVENTS, CUPTI_ACTIVITY_KIND_*)")
    for line in extra:
        print("  " + line)
    print(f"  summary   {paths['summary_md']}  (Markdown: every range, top kernels, how to read it)")
    print(f"  tables    {paths['summary_csv']}, {paths['kernels_csv']}  (CSV, pandas.read_csv)")


def _check_ranges(events: Events, scenarios: Sequence[str]) -> None:
    expected = (["fp8_reload/load_weights", "fp8_reload/process_weights_after_loading"]
                if any(s.startswith("reload") for s in scenarios) else [])
    expected += ["fp8_reload/forward"] if "forward" in scenarios else []
    missing = [n for n in expected if not any(r.name == n for r in events.ranges)]
    if missing:
        progress(f"[profile] warning: the trace lacks ranges {missing}")


def _summarize(trace_file: str, out: Path) -> int:
    path = Path(trace_file)
    if not path.is_file():
        raise UsageError(f"{path}: no such trace file")
    try:
        events = load_events(path)
    except ValueError as e:
        raise UsageError(str(e).split("\n")[0]) from None
    paths = write_summary(events, out, f"fp8-reload profile summary of {path}")
    _print_files(path, paths)
    return 0


def command(args) -> int:
    """`fp8-reload profile`. Every check that can fail runs before anything is written."""
    out = Path(args.out)
    if args.summarize:
        return _summarize(args.summarize, out)
    scenarios = _parse_scenarios(args.scenario)
    nsys = shutil.which("nsys") if args.tool in ("auto", "nsys") and not args.overhead else None
    if args.tool == "nsys" and nsys is None and not args.overhead:
        raise UsageError("--tool nsys: nsys (Nsight Systems) is not on PATH")
    if args.checkpoint is not None and not (Path(args.checkpoint) / "config.json").is_file():
        raise UsageError(f"--checkpoint {args.checkpoint}: no config.json there")
    workload = _workload(args)
    workload.device = resolve_device(workload.device)
    if workload.backend:  # an unknown or unavailable backend, before a checkpoint is written
        try:
            get_backend(workload.backend)
        except BackendUnavailable as e:
            raise UsageError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    workload.resolve(out)
    if args.overhead:
        _prepare(workload)
        write_overhead(out, workload, *measure_overhead(workload, scenarios))
        return 0

    title = (f"fp8-reload profile: {', '.join(scenarios)} x{workload.repeat} "
             f"(preset {workload.preset}, {workload.kind}, {workload.device}, "
             f"backend {workload.backend or 'torch'})")
    if nsys is not None:
        try:
            sqlite = profile_nsys(nsys, worker_command(workload, scenarios), out)
            events = load_nsys_sqlite(sqlite)
            _check_ranges(events, scenarios)
            paths = write_summary(events, out, title)
            extra = [f"nsys stats {p}" for p in sorted(out.glob("nsys_stats*.csv"))]
            _print_files(sqlite, paths, extra)
            return 0
        except NsysFailed as e:
            if args.tool == "nsys":
                raise UsageError(str(e)) from None
            progress(f"[profile] {e}; falling back to torch.profiler")
    progress(f"[profile] loading the model on {workload.device} and warming up")
    _prepare(workload)
    try:
        workload.warmup(scenarios)
    except ReloadError as e:
        raise UsageError(f"the warm-up reload failed (processing={workload.processing!r}): "
                         f"{str(e).splitlines()[0]}") from None
    progress(f"[profile] profiling {', '.join(scenarios)} x{workload.repeat} under torch.profiler")
    path = profile_torch(workload, scenarios, out)
    events = load_chrome_trace(path)
    _check_ranges(events, scenarios)
    paths = write_summary(events, out, title)
    _print_files(path, paths)
    return 0


def worker_main(argv=None) -> int:
    """Child process under nsys / ncu: load, warm up, run the profiled window."""
    p = argparse.ArgumentParser(prog="python -m fp8_reload.tools.profile --worker")
    p.add_argument("--worker", action="store_true", required=True)
    add_profile_arguments(p, worker=True)
    args = p.parse_args(argv)
    scenarios = _parse_scenarios(args.scenario)
    workload = _workload(args).resolve(Path(args.out or "."))
    workload.prepare()
    workload.warmup(scenarios)
    print(f"[worker] nvtx {'active' if trace.nvtx_active() else 'inactive'}; running "
          f"{', '.join(scenarios)} x{workload.repeat} on {workload.device}", flush=True)
    workload.run(scenarios)
    return 0

