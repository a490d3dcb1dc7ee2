"""The report's pictures: reload time against the share of experts reloaded, and forward
throughput per backend. matplotlib is imported on use (Agg backend, no display).

Both are grids of panels, two per row, each panel readable on its own (title: machine,
shape, checkpoint kind), one legend for the whole figure below the panels so no legend
covers data, and only series with at least two points: a lone point shows no trend and is
in the headline table anyway.
"""

from __future__ import annotations

import math
from pathlib import Path

from .tables import fraction_value, pick, preset_num_experts, raw_times

COLUMNS = 2
STRIP = 0.45  # inches below the panels for the legend
BACKEND_COLORS = {"torch": "tab:blue", "triton": "tab:orange", "deep_gemm": "tab:green",
                  "deep_gemm_masked": "tab:red"}
STYLES = {"fixed": ("tab:green", "o"), "scan-all": ("tab:orange", "s"),
          "upstream-style": ("tab:red", "^"), "plain read+copy (safetensors)": ("tab:gray", "x"),
          "plain read+copy (preadv)": ("black", "+")}


def percent(share: float) -> str:
    """A share as a percentage with up to 3 significant digits: 1/64 -> 1.56%, 1 -> 100%."""
    return f"{100 * share:.3g}%"


def _figure(panels: int):
    """A grid of `panels` axes, two per row, plus where the legend goes: the free cell of an
    odd grid, else a strip below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(COLUMNS, panels)
    rows = math.ceil(panels / cols)
    strip = panels % cols == 0  # no free cell: the legend needs a strip of its own
    height = 4.2 * rows + (STRIP if strip else 0)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, height), squeeze=False)
    cells = list(axes.flat)
    legend_ax = None
    if not strip:
        legend_ax = cells[panels]
        legend_ax.axis("off")
    return plt, fig, cells[:panels], legend_ax


def _finish(plt, fig, axes, legend_ax, path: Path) -> Path:
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if legend_ax is not None:
        legend_ax.legend(handles.values(), handles.keys(), loc="center", fontsize=10, frameon=False)
        fig.tight_layout()
    else:
        height = fig.get_figheight()
        fig.tight_layout(rect=(0, STRIP / height, 1, 1))
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)),
                   fontsize=9, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def reload_series(sub, num_experts: int) -> dict[str, list[tuple[float, float]]]:
    """{series: [(share of experts, seconds)]} of one panel, series with >= 2 points only."""
    series: dict[str, list] = {}
    for _, r in sub.iterrows():
        if r["benchmark"].endswith("FilteredReload.time_reload"):
            series.setdefault(r["strategy"], []).append((fraction_value(r["experts"], num_experts),
                                                         r["value"]))
        elif r["benchmark"].endswith("RawReadCopy.time_read_copy") and r["experts"] != "full":
            reader = r.get("reader") if isinstance(r.get("reader"), str) else "safetensors"
            series.setdefault(f"plain read+copy ({reader})", []).append(
                (fraction_value(r["experts"], num_experts), r["value"]))
    return {name: sorted(pts) for name, pts in series.items() if len(pts) >= 2}


def plot_reload(df, path: Path) -> Path | None:
    """Reload time vs share of experts reloaded, one panel per machine x preset x kind that
    has a curve to show."""
    rel = df[df["benchmark"].str.contains(r"FilteredReload\.time_reload|RawReadCopy\.time_read_copy|"
                                          r"FullReload\.time_reload")].dropna(subset=["value"])
    if rel.empty:  # results without reload benchmarks (e.g. expert parallel only)
        return None
    panels = []
    kinds = {"fp8": 0, "bf16": 1}  # the FP8 checkpoint first, as in the tables
    for key in sorted(rel.groupby(["machine", "preset", "kind"]).groups,
                      key=lambda k: (k[0], k[1], kinds.get(k[2], 2), k[2])):
        sub = rel[(rel.machine == key[0]) & (rel.preset == key[1]) & (rel.kind == key[2])]
        series = reload_series(sub, preset_num_experts(key[1]))
        if series:
            panels.append((key, sub, series))
    if not panels:
        return None
    plt, fig, axes, legend_ax = _figure(len(panels))
    import matplotlib.ticker as ticker

    for ax, ((machine, preset, kind), sub, series) in zip(axes, panels):
        e = preset_num_experts(preset)
        for name, pts in series.items():
            color, marker = STYLES.get(name, (None, "."))
            ax.plot([x for x, _ in pts], [y * 1e3 for _, y in pts], marker=marker, color=color,
                    label=name)
        full = pick(sub, "FullReload.time_reload")
        raws = raw_times(sub, {}, "full")
        if full:
            ax.axhline(full * 1e3, color="tab:green", ls="--", lw=1, label="full reload")
        if raws:
            ax.axhline(min(raws.values()) * 1e3, color="tab:gray", ls=":", lw=1,
                       label="plain read+copy, whole checkpoint")
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = sorted({x for pts in series.values() for x, _ in pts})
        ax.set_xticks(xs, [percent(x) for x in xs])
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.LogFormatter(minor_thresholds=(1.3, 0.5)))
        ax.tick_params(axis="both", labelsize=8)
        ax.set_xlabel(f"experts reloaded per MoE layer (of {e}; one = {percent(1 / e)})", fontsize=9)
        ax.set_ylabel("reload time (ms)", fontsize=9)
        ax.set_title(f"{machine}: {preset}, {kind} checkpoint", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    return _finish(plt, fig, axes, legend_ax, path)


def plot_forward(fw, path: Path) -> Path | None:
    """Forward TFLOPS per backend vs tokens, one panel per machine x preset."""
    if fw.empty:
        return None
    keys = sorted(fw.groupby(["machine", "preset"]).groups)
    plt, fig, axes, legend_ax = _figure(len(keys))
    import matplotlib.ticker as ticker

    for ax, (machine, preset) in zip(axes, keys):
        sub = fw[(fw.machine == machine) & (fw.preset == preset)]
        for backend, b in sub.groupby("backend", sort=False):
            b = b.sort_values("tokens")
            ax.plot(b["tokens"], b["tflops"], marker="o", label=backend,
                    color=BACKEND_COLORS.get(backend))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sub["tokens"].unique()))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.tick_params(axis="both", labelsize=8)
        ax.set_xlabel("tokens", fontsize=9)
        ax.set_ylabel("TFLOPS (routed-expert GEMMs)", fontsize=9)
        ax.set_title(f"{machine}: MoE layer forward, {preset}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    return _finish(plt, fig, axes, legend_ax, path)
