"""From events to tables: nest ranges, attribute work to the innermost open range, and
write the summary (CSV and Markdown)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ... import trace
from ..markdown import markdown_table
from .events import Events, Range, Work, load_chrome_trace, nest, outer_first
from .nsys import load_nsys_sqlite
from .options import PROFILE_RANGE, SCENARIO_PREFIX


def load_events(path) -> Events:
    """A Chrome trace (``.json``) or an Nsight Systems SQLite export (``.sqlite``)."""
    path = Path(path)
    if path.suffix in (".sqlite", ".db"):
        return load_nsys_sqlite(path)
    if path.suffix == ".json":
        return load_chrome_trace(path)
    raise ValueError(f"{path}: expected a torch.profiler Chrome trace (.json) or an "
                     "nsys SQLite export (.sqlite)")


def innermost(ranges: Sequence[Range], work: Sequence[Work]) -> list[int]:
    """For each work item, the innermost range open on its thread at its launch (-1: none)."""
    out = [-1] * len(work)
    by_thread: dict = {}
    for i, r in enumerate(ranges):
        by_thread.setdefault(r.thread, []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: outer_first(ranges[i]))
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
    parent = nest(ranges)
    order = sorted(range(len(ranges)), key=lambda i: outer_first(ranges[i]))
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

    inner = innermost(ranges, work)
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
    is_scenario = summary.range == SCENARIO_PREFIX + summary.scenario
    totals = {s: summary.loc[(summary.scenario == s) & is_scenario, "total_ns"].sum()
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


def fmt_cell(v) -> str:
    """A summary cell: blank for missing values, 3 decimals below 1000, whole above."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


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
    shown["payload"] = [f"{int(p) if float(p).is_integer() else fmt_cell(p)} {u}".strip()
                        if p is not None and p == p else ""
                        for p, u in zip(shown.payload_total, shown.payload_unit)]
    md = [f"# {title}", "",
          f"Source: {events.source}. Kernels = {events.work_label}.", "",
          "## Ranges", "",
          markdown_table(shown, ["scenario", "range", "count", "total_ms", "mean_ms", "self_ms",
                                 "share_pct", "payload", "kernels", "kernel_ms", "copy_mib"],
                         ["scenario", "range", "count", "total ms", "mean ms", "self ms",
                          "% of scenario", "payload", "kernels", "kernel ms", "copies MiB"],
                         fmt_cell), ""]
    if len(work):
        md += [f"## Top {top} kernels per scenario, by innermost range", ""]
        tops = work.groupby("scenario", sort=False).head(top)
        md += [markdown_table(tops, ["scenario", "range", "kind", "kernel", "count", "total_ms", "mean_us"],
                              ["scenario", "innermost range", "kind", "kernel", "count", "total ms",
                               "mean us"], fmt_cell), ""]
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

