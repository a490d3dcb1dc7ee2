"""The report's I/O table: every way of moving a checkpoint (`benchmarks/io.py`) beside the
machine's limits measured in the same run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...checkpoint.layout import nbytes, tensor_layout
from ...config import MoEConfig
from ...reload.filters import generate_weight_name_filter

if TYPE_CHECKING:
    import pandas as pd

BENCH = "IOPaths.time_move"
COLUMNS = ["machine", "preset", "kind", "cache", "scope", "io", "ms", "GB/s", "of H2D limit", "of read limit"]


def moved_bytes(preset: str, kind: str, scope: str) -> int:
    """Tensor bytes a case moves: the whole checkpoint, or expert 0 of every MoE layer
    (the limits also move the headers: a few hundred KiB more)."""
    cfg = MoEConfig.from_spec(preset)
    flt = None if scope == "full" else generate_weight_name_filter({layer: [0] for layer in cfg.moe_layers})
    return sum(nbytes(shape, dtype) for name, shape, dtype in tensor_layout(cfg, kind)
               if flt is None or flt(name))


def io_table(df) -> pd.DataFrame:
    """One row per measured case: time, GB/s, and the share of the two limits of the same
    run (full scope): one pinned host-to-device copy (warm), and 16 threads of positional
    reads in the same cache state (cold: with O_DIRECT, the disk's)."""
    import pandas as pd

    sel = df[df["benchmark"].str.endswith(BENCH)].dropna(subset=["value"])
    rows = []
    for (machine, preset, kind), g in (sel.groupby(["machine", "preset", "kind"]) if len(sel) else ()):
        t = {(r["io"], r["scope"], r["cache"]): float(r["value"]) for _, r in g.iterrows()}
        h2d = t.get(("limit-h2d", "full", "warm"))
        sizes = {scope: moved_bytes(preset, kind, scope) for scope in set(g["scope"])}
        for (io, scope, cache), s in sorted(t.items(), key=lambda kv: (kv[0][2] != "warm", kv[0][1], kv[1])):
            read = t.get(("limit-read-direct" if cache == "cold" else "limit-read", "full", cache))
            full = scope == "full"
            rows.append({"machine": machine, "preset": preset, "kind": kind, "cache": cache, "scope": scope,
                         "io": io, "ms": s * 1e3, "GB/s": sizes[scope] / s / 1e9,
                         "of H2D limit": f"{h2d / s:.0%}" if full and h2d else None,
                         "of read limit": f"{read / s:.0%}" if full and read else None})
    return pd.DataFrame(rows, columns=COLUMNS)
