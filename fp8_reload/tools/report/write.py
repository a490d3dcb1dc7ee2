"""Writing the report: headline.md, the CSV tables and the plots."""

from __future__ import annotations

import math
from pathlib import Path

from ..markdown import markdown_table
from ..usage import UsageError
from .io_paths import io_table
from .load import bench_class, load_results, machine_info, result_dirs
from .plots import plot_forward, plot_reload
from .rebalance import ep_forward_table, rebalance_table
from .tables import forward_table, headline, scales_table


def _cell(v) -> str:
    """A report cell: n/a for missing values, yes / **no** for verdicts, 4 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(results_dir="results/asv", out_dir="results/report", machine: str | None = None,
                 commit: str | None = None, stat: str = "best") -> dict[str, Path]:
    """Write headline.md / headline.csv / results.csv / forward.csv / scales.csv and the plots.

    `results_dir`: one asv results directory or a list of them (machine names must differ).
    `stat` "best": times are each benchmark's lowest sample where asv recorded
    samples (``--record-samples``): on a shared machine noise only adds time, and
    one disturbed process can shift asv's median by 100x; "median": asv's value.
    Returns {name: path} of what was written. Raises FileNotFoundError when
    there are no results to report.
    """
    dirs = result_dirs(results_dir)
    out_dir = Path(out_dir)
    for d in dirs:
        if not Path(d).is_dir():
            raise FileNotFoundError(f"{d}: no asv results directory (run `asv run` first)")
    df = load_results(dirs, machine=machine, commit=commit)
    if df.empty:
        raise FileNotFoundError(f"{', '.join(map(str, dirs))}: no asv results"
                                + (f" for machine {machine!r}" if machine else ""))
    if stat not in ("best", "median"):
        raise ValueError(f"stat must be best or median, not {stat!r}")
    df["asv_value"] = df["value"]
    if stat == "best":
        df["value"] = df["best"].where(df["best"].notna(), df["value"])
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    hl = headline(df)
    fw = forward_table(df)
    flat = df.drop(columns=["params"])
    flat.to_csv(out_dir / "results.csv", index=False)
    written["results.csv"] = out_dir / "results.csv"
    hl.to_csv(out_dir / "headline.csv", index=False)
    written["headline.csv"] = out_dir / "headline.csv"
    if not fw.empty:
        fw.to_csv(out_dir / "forward.csv", index=False)
        written["forward.csv"] = out_dir / "forward.csv"
    sc = scales_table(df)
    if not sc.empty:
        sc.to_csv(out_dir / "scales.csv", index=False)
        written["scales.csv"] = out_dir / "scales.csv"
    md = format_markdown(df, hl, fw, dirs, sc, stat)
    md += write_io(df, out_dir, written)
    md += write_expert_parallel(df, out_dir, written)
    (out_dir / "headline.md").write_text(md)
    written["headline.md"] = out_dir / "headline.md"
    for name, fn, data in (("reload_vs_fraction.png", plot_reload, df),
                           ("forward_tflops.png", plot_forward, fw)):
        if fn(data, out_dir / name):
            written[name] = out_dir / name
    return written


def write_io(df, out_dir: Path, written: dict) -> str:
    """io.csv where the results have I/O paths (`benchmarks/io.py`); its Markdown section."""
    table = io_table(df)
    if table.empty:
        return ""
    table.to_csv(out_dir / "io.csv", index=False)
    written["io.csv"] = out_dir / "io.csv"
    return "\n".join(["", "## I/O paths", "",
                      "Moving a checkpoint's tensors (all, or expert 0 of every MoE layer) into device "
                      "memory, page cache warm or evicted, beside the limits measured in the same run: "
                      "one pinned host-to-device copy, and 16 threads of positional reads (cold: "
                      "O_DIRECT, the disk's). GB/s count tensor bytes.", "",
                      markdown_table(table.round(2), cell=_cell), ""])


def write_expert_parallel(df, out_dir: Path, written: dict) -> str:
    """rebalance.csv / ep_forward.csv where the results have them; their Markdown section."""
    parts = []
    for name, table, title in (
            ("rebalance.csv", rebalance_table(df), "Expert-parallel rebalance (ms; the bound is one "
             "contiguous transfer of the same bytes, measured in the same run):"),
            ("ep_forward.csv", ep_forward_table(df), "Expert-parallel forward on a skewed routing, "
             "before (start) and after (balanced) the rebalance:")):
        if table.empty:
            continue
        table.to_csv(out_dir / name, index=False)
        written[name] = out_dir / name
        parts += [title, "", markdown_table(table.round(4), cell=_cell), ""]
    return "\n".join(["", "## Expert parallel", "", *parts]) if parts else ""


def format_markdown(df, hl, fw, results_dir, sc=None, stat="median") -> str:
    parts = ["# fp8-reload benchmark report", "",
             ("Times: each benchmark's best sample where asv recorded samples (asv's median is "
              "`asv_value` in results.csv)." if stat == "best" else "Times: asv's median."), ""]
    for machine, mdf in df.groupby("machine"):
        info = machine_info(results_dir, machine)
        parts.append(f"## {machine} ({_commits(mdf)})")
        parts.append("")
        parts.append(", ".join(f"{k}: {v}" for k, v in info.items() if k != "machine"))
        parts.append("")
        h = hl[hl.machine == machine] if not hl.empty else hl
        if not h.empty:
            parts.append(markdown_table(h.drop(columns=["machine", "commit"]), cell=_cell))
            parts.append("")
        f = fw[fw.machine == machine] if not fw.empty else fw
        if not f.empty:
            parts.append("MoE layer forward (routed experts, FLOPs = 6 * tokens * top_k * hidden * inter):")
            parts.append("")
            parts.append(markdown_table(f.drop(columns=["machine"]).round(4), cell=_cell))
            parts.append("")
        c = sc[sc.machine == machine] if sc is not None and not sc.empty else None
        if c is not None and not c.empty:
            parts.append("Block scales for DeepGEMM (per-tensor scales expanded to 128x128 blocks):")
            parts.append("")
            shown = c.drop(columns=["machine"]).dropna(axis=1, how="all").round(4)
            parts.append(markdown_table(shown, cell=_cell))
            parts.append("")
        failed = mdf[mdf["failed"]]
        if not failed.empty:
            parts.append(f"**{len(failed)} benchmark runs failed**: "
                         + ", ".join(sorted(set(failed["benchmark"]))))
            parts.append("")
    return "\n".join(parts)


def _commits(mdf) -> str:
    """``commit abcd1234``, or, where benchmark classes come from runs of several
    commits, each commit with its classes (newest run last)."""
    runs = mdf.assign(cls=bench_class(mdf)).groupby(["run_at", "commit"])["cls"]
    runs = [(c[:8], sorted(set(classes))) for (_, c), classes in runs]
    if len({c for c, _ in runs}) == 1:
        return f"commit {runs[0][0]}"
    return "; ".join(f"commit {c}: {', '.join(classes)}" for c, classes in runs)


def command(args) -> int:
    """`fp8-reload report`: no results to report is a usage error (exit 2)."""
    try:
        written = write_report(args.results or ["results/asv"], args.out, machine=args.machine,
                               commit=args.commit, stat=args.stat)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    print((written["headline.md"]).read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0
