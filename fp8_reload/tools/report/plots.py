"""The report's pictures: reload time against the share of experts reloaded, and forward
throughput per backend. matplotlib is imported on use (Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path

from .tables import fraction_value, pick, preset_num_experts, raw_times


def plot_reload(df, path: Path) -> Path | None:
    """Reload time vs share of experts reloaded, one panel per machine x preset x kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    rel = df[df["benchmark"].str.contains(r"FilteredReload\.time_reload|RawReadCopy\.time_read_copy|"
                                          r"FullReload\.time_reload")].dropna(subset=["value"])
    if rel.empty:
        return None
    panels = sorted(rel.groupby(["machine", "preset", "kind"]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    styles = {"fixed": ("tab:green", "o"), "scan-all": ("tab:orange", "s"),
              "upstream-style": ("tab:red", "^"), "raw read+copy (safetensors)": ("tab:gray", "x"),
              "raw read+copy (preadv)": ("black", "+")}
    for ax, (machine, preset, kind) in zip(axes[0], panels):
        sub = rel[(rel.machine == machine) & (rel.preset == preset) & (rel.kind == kind)]
        e = preset_num_experts(preset)
        series = {}
        for _, r in sub.iterrows():
            if r["benchmark"].endswith("FilteredReload.time_reload"):
                series.setdefault(r["strategy"], []).append((fraction_value(r["experts"], e), r["value"]))
            elif r["benchmark"].endswith("RawReadCopy.time_read_copy") and r["experts"] != "full":
                reader = r.get("reader") if isinstance(r.get("reader"), str) else "safetensors"
                series.setdefault(f"raw read+copy ({reader})", []).append(
                    (fraction_value(r["experts"], e), r["value"]))
        for name, pts in series.items():
            pts.sort()
            color, marker = styles.get(name, (None, "."))
            ax.plot([x for x, _ in pts], [y * 1e3 for _, y in pts], marker=marker, color=color, label=name)
        full = pick(sub, "FullReload.time_reload")
        raws = raw_times(sub, {}, "full")
        if full:
            ax.axhline(full * 1e3, color="tab:green", ls="--", lw=1, label="full reload")
        if raws:
            ax.axhline(min(raws.values()) * 1e3, color="tab:gray", ls=":", lw=1,
                       label="raw bound, full")
        ax.set_xscale("log")
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        xs = sorted({x for pts in series.values() for x, _ in pts})
        ax.set_xticks(xs, [f"1/{e}" if abs(x - 1 / e) < 1e-9 else f"{x:.0%}" for x in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(minor_thresholds=(1.3, 0.5)))
        ax.set_xlabel(f"share of each layer's {e} experts reloaded")
        ax.set_ylabel("reload time (ms)")
        ax.set_title(f"{machine}: {preset}, {kind} checkpoint", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_forward(fw, path: Path) -> Path | None:
    """Forward TFLOPS per backend vs tokens, one panel per machine x preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    if fw.empty:
        return None
    panels = sorted(fw.groupby(["machine", "preset"]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (machine, preset) in zip(axes[0], panels):
        sub = fw[(fw.machine == machine) & (fw.preset == preset)]
        for backend, b in sub.groupby("backend"):
            b = b.sort_values("tokens")
            ax.plot(b["tokens"], b["tflops"], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sub["tokens"].unique()))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("tokens")
        ax.set_ylabel("TFLOPS (routed-expert GEMMs)")
        ax.set_title(f"{machine}: MoE layer forward, {preset}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

