"""Tables and plots from asv results: the headline figures of the reload suite.

Reads asv's results directory (``results/asv``: ``benchmarks.json`` plus
``<machine>/machine.json`` and ``<machine>/<commit>-<env>.json``) into one tidy
pandas frame (one row per benchmark x parameter set), then derives:

* the headline figures with their targets (filtered vs upstream-style reload,
  full reload vs the raw read+copy bound, fixed vs upstream post-processing,
  reload device-memory peak), as Markdown and CSV with the machine's info;
* ``reload_vs_fraction.png``: reload time against the share of experts reloaded,
  fixed vs scan-all vs upstream-style vs the raw bound;
* ``forward_tflops.png``: MoE layer forward throughput per backend against tokens.

asv compares times (lower is better); throughput is computed only here.
pandas and matplotlib are imported lazily (``pip install fp8-reload[report]``).
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Optional

# Speed targets of the H200 run (issue 4).
TARGET_FILTERED_SPEEDUP = 20.0
TARGET_FULL_VS_RAW = 0.70
TARGET_PROCESS_SPEEDUP = 10.0


def memory_bound_bytes() -> int:
    """The bounded staging a reload may add on the device: one processing chunk of
    float32 temporaries (`processing.CHUNK_BYTES`) and its copy (requantizing
    makes two), independent of the model size."""
    from .processing import CHUNK_BYTES

    return 2 * CHUNK_BYTES


def model_device_bytes(spec: str, kind: str = "fp8") -> int:
    """Bytes of a fixed-mode model's parameters and buffers (built on the meta device)."""
    from .layers import FP8MoEModel
    from .processing import get_mode

    model = FP8MoEModel(preset_config(spec), get_mode("fixed"), kind, device="meta")
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

_MACHINE_KEYS = ("machine", "cpu", "num_cpu", "ram", "os", "arch", "gpu", "torch", "cuda")


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def _literal(v):
    """asv stores parameter values as their repr ("'small'", "128")."""
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v


def _load_json(path: Path) -> dict:
    # asv writes NaN for skipped benchmarks; json accepts it.
    with open(path) as f:
        return json.load(f)


def _product(params: list[list]) -> list[tuple]:
    import itertools

    return list(itertools.product(*params)) if params else [()]


def load_results(results_dir, machine: Optional[str] = None, commit: Optional[str] = None):
    """One row per (machine, commit, benchmark, parameter set).

    Columns: machine, commit, date, benchmark, module, bench_type (time/track),
    unit, params (dict), value (asv's result: the median for times), best (the
    lowest sample, where asv recorded samples), failed, plus one column per parameter name
    (e.g. preset, kind = checkpoint kind, experts, strategy, backend, tokens). For each
    machine only the results file of the newest run (by asv's ``started_at``) is
    kept, unless `commit` (a hash prefix) picks one.
    """
    import pandas as pd

    root = Path(results_dir)
    meta = {}
    if (root / "benchmarks.json").exists():
        meta = {k: v for k, v in _load_json(root / "benchmarks.json").items() if isinstance(v, dict)}
    rows = []
    for mdir in sorted(p for p in root.iterdir() if p.is_dir()):
        if machine and mdir.name != machine:
            continue
        for f in sorted(mdir.glob("*.json")):
            if f.name == "machine.json":
                continue
            data = _load_json(f)
            if "results" not in data or "commit_hash" not in data:
                continue
            if commit and not data["commit_hash"].startswith(commit):
                continue
            cols = data.get("result_columns", ["result", "params"])
            started = [dict(zip(cols, e)).get("started_at") or 0 for e in data["results"].values()]
            run_at = max(started, default=0)
            for bench, entry in data["results"].items():
                rec = dict(zip(cols, entry))
                values = rec.get("result")
                params = [[_literal(v) for v in ps] for ps in (rec.get("params") or [])]
                info = meta.get(bench, {})
                names = info.get("param_names") or [f"p{i}" for i in range(len(params))]
                if not isinstance(values, list):
                    values = [values]
                samples = rec.get("samples") or [None] * len(values)
                for combo, value, smp in zip(_product(params), values, samples):
                    good = [x for x in smp or [] if x is not None and x == x]
                    row = {"machine": mdir.name, "commit": data["commit_hash"],
                           "date": data.get("date"), "run_at": run_at, "file": f.name,
                           "benchmark": bench,
                           "module": bench.split(".", 1)[0],
                           "bench_type": info.get("type") or bench.rsplit(".", 1)[-1].split("_", 1)[0],
                           "unit": info.get("unit", "seconds" if ".time_" in bench else ""),
                           "params": dict(zip(names, combo)),
                           "value": float("nan") if value is None else float(value),
                           "best": min(good) if good and value is not None else float("nan"),
                           "failed": value is None}
                    row.update(dict(zip(names, combo)))
                    rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    if not commit:  # per machine, the results file of the newest run
        newest = df.groupby("machine")["run_at"].transform("max")
        df = df[df["run_at"] == newest]
    return df.reset_index(drop=True)


def machine_info(results_dir, machine: str) -> dict:
    path = Path(results_dir) / machine / "machine.json"
    if not path.exists():
        return {"machine": machine}
    info = _load_json(path)
    return {k: info[k] for k in _MACHINE_KEYS if k in info} | {
        k: v for k, v in info.items() if k not in _MACHINE_KEYS and k != "version"}


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------

def preset_config(spec: str):
    """``"v2-lite:4"`` -> the v2-lite preset cut to 4 layers (the benchmarks' preset labels)."""
    from .config import MoEConfig

    name, _, layers = str(spec).partition(":")
    return MoEConfig.preset(name, **({"num_layers": int(layers)} if layers else {}))


def preset_num_experts(spec: str) -> int:
    return preset_config(spec).num_experts


def fraction_value(label: str, num_experts: int) -> float:
    """Share of a layer's experts a benchmark `experts` label reloads (same rule as
    benchmarks/common.py `fraction_experts`)."""
    if label == "1/layer":
        return 1 / num_experts
    if label == "full":
        return 1.0
    return max(1, round(num_experts * float(label[:-1]) / 100)) / num_experts


def _pick(df, bench_suffix: str, **params) -> Optional[float]:
    sel = df[df["benchmark"].str.endswith(bench_suffix)]
    for k, v in params.items():
        if k not in sel.columns:
            return None
        sel = sel[sel[k] == v]
    vals = sel["value"].dropna()
    return None if vals.empty else float(vals.iloc[0])


def _raw_times(df, params: dict, experts: str) -> dict:
    """{reader: seconds} of RawReadCopy (older results have no reader: "safetensors")."""
    sel = df[df["benchmark"].str.endswith("RawReadCopy.time_read_copy")]
    for k, v in {**params, "experts": experts}.items():
        if k not in sel.columns:
            return {}
        sel = sel[sel[k] == v]
    sel = sel.dropna(subset=["value"])
    readers = sel["reader"] if "reader" in sel.columns else ["safetensors"] * len(sel)
    return {str(r) if isinstance(r, str) else "safetensors": float(v)
            for r, v in zip(readers, sel["value"])}


def _fmt_time(s: Optional[float]) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**20:.1f} MiB"


def headline(df) -> "pd.DataFrame":
    """The headline figures per machine x preset x checkpoint kind, with targets.

    Columns: machine, commit, preset, kind, figure, value, unit, target, met, detail.
    `met` is None where the figure could not be measured (e.g. GPU memory on CPU).
    """
    import pandas as pd

    rows = []
    if df.empty:
        return pd.DataFrame(rows)
    for machine, mdf in df.groupby("machine"):
        commit = mdf["commit"].iloc[0]
        presets = sorted(set(mdf["preset"].dropna())) if "preset" in mdf else []
        kinds = sorted(set(mdf["kind"].dropna())) if "kind" in mdf else []
        for preset in presets:
            for kind in kinds:
                def add(figure, value, unit, target, met, detail):
                    rows.append(dict(machine=machine, commit=commit[:8], preset=preset, kind=kind,
                                     figure=figure, value=value, unit=unit, target=target,
                                     met=met, detail=detail))

                p = dict(preset=preset, kind=kind)
                fixed = _pick(mdf, "FilteredReload.time_reload", **p, experts="1/layer", strategy="fixed")
                up = _pick(mdf, "FilteredReload.time_reload", **p, experts="1/layer",
                           strategy="upstream-style")
                scan = _pick(mdf, "FilteredReload.time_reload", **p, experts="1/layer", strategy="scan-all")
                if fixed and up:
                    r = up / fixed
                    add("filtered reload, 1 expert/layer: upstream-style / fixed", round(r, 2), "x",
                        f">= {TARGET_FILTERED_SPEEDUP:g}x", r >= TARGET_FILTERED_SPEEDUP,
                        f"fixed {_fmt_time(fixed)}, upstream-style {_fmt_time(up)}, "
                        f"scan-all only {_fmt_time(scan)}")
                full = _pick(mdf, "FullReload.time_reload", **p)
                raws = _raw_times(mdf, p, "full")
                if full and raws:
                    reader, raw = min(raws.items(), key=lambda kv: kv[1])
                    r = raw / full
                    add("full reload vs raw read+copy bound", round(100 * r, 1), "% of bound",
                        f">= {100 * TARGET_FULL_VS_RAW:g}%", r >= TARGET_FULL_VS_RAW,
                        f"full reload {_fmt_time(full)}, raw bound {_fmt_time(raw)} ({reader}; "
                        + ", ".join(f"{k} {_fmt_time(v)}" for k, v in sorted(raws.items())) + ")")
                pu = _pick(mdf, "ProcessMoELayer.time_process", **p, impl="upstream")
                pf = _pick(mdf, "ProcessMoELayer.time_process", **p, impl="fixed")
                p1 = _pick(mdf, "ProcessMoELayer.time_process", **p, impl="fixed-1-expert")
                if pu and pf:
                    r = pu / pf
                    add("post-processing, one MoE layer: upstream loop / fixed", round(r, 2), "x",
                        f">= {TARGET_PROCESS_SPEEDUP:g}x", r >= TARGET_PROCESS_SPEEDUP,
                        f"upstream {_fmt_time(pu)}, fixed {_fmt_time(pf)}, "
                        f"fixed with 1 expert loaded {_fmt_time(p1)}")
                peaks = {e: _pick(mdf, "ReloadDeviceMemory.track_peak_bytes", **p, experts=e)
                         for e in ("1/layer", "full")}
                bound = memory_bound_bytes()
                if any(v is not None for v in peaks.values()):
                    worst = max(v for v in peaks.values() if v is not None)
                    add("reload device-memory peak above the model", round(worst / 2**20, 1), "MiB",
                        f"<= {bound >> 20} MiB", worst <= bound,
                        f"1 expert/layer {_fmt_bytes(peaks['1/layer'])}, full {_fmt_bytes(peaks['full'])}"
                        f"; model {_fmt_bytes(model_device_bytes(preset, kind))}")
                else:
                    add("reload device-memory peak above the model", None, "MiB",
                        f"<= {bound >> 20} MiB", None, "not measured (needs CUDA)")
    return pd.DataFrame(rows)


def forward_table(df) -> "pd.DataFrame":
    """MoE layer forward: ms and TFLOPS per machine x preset x backend x tokens, with
    calc_diff vs the float32 reference where measured."""
    import pandas as pd

    fw = df[df["benchmark"].str.endswith("MoEForward.time_forward")].dropna(subset=["value"])
    rows = []
    for _, r in fw.iterrows():
        cfg = preset_config(r["preset"])
        flops = 2 * int(r["tokens"]) * cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        rows.append(dict(machine=r["machine"], preset=r["preset"], backend=r["backend"],
                         tokens=int(r["tokens"]), ms=r["value"] * 1e3,
                         tflops=flops / r["value"] / 1e12))
    out = pd.DataFrame(rows, columns=["machine", "preset", "backend", "tokens", "ms", "tflops"])
    acc = df[df["benchmark"].str.endswith("ForwardAccuracy.track_calc_diff")].dropna(subset=["value"])
    if not acc.empty and not out.empty:
        cd = acc.groupby(["machine", "preset", "backend"])["value"].first().rename("calc_diff")
        out = out.merge(cd.reset_index(), on=["machine", "preset", "backend"], how="left")
    return out


def scales_table(df) -> "pd.DataFrame":
    """DeepGEMM forward per block-scale mode (ms, and throughput relative to
    precomputed scales), plus the expansion alone (BlockScaleExpansion)."""
    import pandas as pd

    rows = []
    sm = df[df["benchmark"].str.endswith("DeepGemmScaleMode.time_forward")].dropna(subset=["value"])
    for (machine, preset, tokens), g in (sm.groupby(["machine", "preset", "tokens"]) if len(sm) else ()):
        t = dict(zip(g["scale_mode"], g["value"]))
        pre = t.get("precomputed")
        row = dict(machine=machine, preset=preset, what=f"DeepGEMM forward, {int(tokens)} tokens")
        for mode in ("precomputed", "cached", "per-forward"):
            row[f"{mode} ms"] = t[mode] * 1e3 if mode in t else None
        row["cached vs precomputed"] = f"{pre / t['cached']:.1%}" if pre and "cached" in t else None
        row["per-forward vs precomputed"] = (f"{pre / t['per-forward']:.1%}"
                                             if pre and "per-forward" in t else None)
        rows.append(row)
    ex = df[df["benchmark"].str.endswith("BlockScaleExpansion.time_block_scales")].dropna(subset=["value"])
    for (machine, preset), g in (ex.groupby(["machine", "preset"]) if len(ex) else ()):
        t = dict(zip(g["expansion"], g["value"]))
        row = dict(machine=machine, preset=preset, what="block scales alone (w13 + w2)",
                   **{"cached ms": t["cached"] * 1e3 if "cached" in t else None,
                      "per-forward ms": t["per-forward"] * 1e3 if "per-forward" in t else None})
        if "cached" in t and "per-forward" in t:
            row["note"] = f"cached lookup {t['per-forward'] / t['cached']:.0f}x faster than re-expanding"
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def _md_table(df) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_cell(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def plot_reload(df, path: Path) -> Optional[Path]:
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
        full = _pick(sub, "FullReload.time_reload")
        raws = _raw_times(sub, {}, "full")
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


def plot_forward(fw, path: Path) -> Optional[Path]:
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


def write_report(results_dir="results/asv", out_dir="results/report", machine: Optional[str] = None,
                 commit: Optional[str] = None, stat: str = "best") -> dict[str, Path]:
    """Write headline.md / headline.csv / results.csv / forward.csv / scales.csv and the plots.

    `stat` "best": times are each benchmark's lowest sample where asv recorded
    samples (``--record-samples``): on a shared machine noise only adds time, and
    one disturbed process can shift asv's median by 100x; "median": asv's value.
    Returns {name: path} of what was written. Raises FileNotFoundError when
    there are no results to report.
    """
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{results_dir}: no asv results directory (run `asv run` first)")
    df = load_results(results_dir, machine=machine, commit=commit)
    if df.empty:
        raise FileNotFoundError(f"{results_dir}: no asv results"
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
    md = format_markdown(df, hl, fw, results_dir, sc, stat)
    (out_dir / "headline.md").write_text(md)
    written["headline.md"] = out_dir / "headline.md"
    for name, fn, data in (("reload_vs_fraction.png", plot_reload, df),
                           ("forward_tflops.png", plot_forward, fw)):
        if fn(data, out_dir / name):
            written[name] = out_dir / name
    return written


def format_markdown(df, hl, fw, results_dir, sc=None, stat="median") -> str:
    parts = ["# fp8-reload benchmark report", "",
             ("Times: each benchmark's best sample where asv recorded samples (asv's median is "
              "`asv_value` in results.csv)." if stat == "best" else "Times: asv's median."), ""]
    for machine, mdf in df.groupby("machine"):
        info = machine_info(results_dir, machine)
        commit = mdf["commit"].iloc[0][:8]
        parts.append(f"## {machine} (commit {commit})")
        parts.append("")
        parts.append(", ".join(f"{k}: {v}" for k, v in info.items() if k != "machine"))
        parts.append("")
        h = hl[hl.machine == machine] if not hl.empty else hl
        if not h.empty:
            parts.append(_md_table(h.drop(columns=["machine", "commit"])))
            parts.append("")
        f = fw[fw.machine == machine] if not fw.empty else fw
        if not f.empty:
            parts.append("MoE layer forward (routed experts, FLOPs = 6 * tokens * top_k * hidden * inter):")
            parts.append("")
            parts.append(_md_table(f.drop(columns=["machine"]).round(4)))
            parts.append("")
        c = sc[sc.machine == machine] if sc is not None and not sc.empty else None
        if c is not None and not c.empty:
            parts.append("Block scales for DeepGEMM (per-tensor scales expanded to 128x128 blocks):")
            parts.append("")
            parts.append(_md_table(c.drop(columns=["machine"]).dropna(axis=1, how="all").round(4)))
            parts.append("")
        failed = mdf[mdf["failed"]]
        if not failed.empty:
            parts.append(f"**{len(failed)} benchmark runs failed**: "
                         + ", ".join(sorted(set(failed["benchmark"]))))
            parts.append("")
    return "\n".join(parts)
