"""The report's expert-parallel tables: rebalance times beside the link's bound, and the EP
forward's balance, from the asv results of `benchmarks/rebalance.py` and `ep_forward.py`.

Each p2p row sits beside ``ContiguousExchange`` of the same run and machine: one
contiguous transfer of the bytes a rank receives in that rebalance, timed the same way,
so "share of bound" is bound time / rebalance time (1.0 would be the link's speed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

SOURCES = ("p2p", "disk", "hybrid", "disk-cold")


def _bench(df, cls: str, method: str):
    """Rows of benchmark ``<module>.<cls>.<method>`` with a value."""
    parts = df["benchmark"].str.split(".")
    sel = df[(parts.str[-2] == cls) & (parts.str[-1] == method)]
    return sel.dropna(subset=["value"])


def _col(sel, name, default):
    return sel[name] if name in sel.columns else [default] * len(sel)


def rebalance_table(df) -> pd.DataFrame:
    """One row per machine x experts moved per layer x layers ("1", "all", "whole"): ms per
    source, the contiguous bound's ms, and the p2p rebalance's share of the bound."""
    import pandas as pd

    rows: dict = {}

    def row(machine, moved, layers):
        return rows.setdefault((machine, int(moved), str(layers)),
                               {"machine": machine, "experts_moved_per_layer": int(moved),
                                "layers": str(layers)})

    reb = _bench(df, "Rebalance", "time_rebalance")
    for (_, r), layers in zip(reb.iterrows(), _col(reb, "layers", "all")):
        row(r["machine"], r["experts_moved_per_layer"], layers)[f"{r['source']} ms"] = r["value"] * 1e3
    ex = _bench(df, "ContiguousExchange", "time_exchange")
    for (_, r), layers in zip(ex.iterrows(), _col(ex, "layers", "all")):
        row(r["machine"], r["experts_moved_per_layer"], layers)["bound ms"] = r["value"] * 1e3
    for cls, key in (("WholeModelRebalance", "p2p ms"), ("WholeModelExchange", "bound ms")):
        method = "time_rebalance" if cls.endswith("Rebalance") else "time_exchange"
        for _, r in _bench(df, cls, method).iterrows():
            row(r["machine"], r["experts_moved_per_layer"], "whole")[key] = r["value"] * 1e3
    out = pd.DataFrame(list(rows.values()))
    if out.empty:
        return out
    cols = ["machine", "experts_moved_per_layer", "layers"] + \
        [f"{s} ms" for s in SOURCES if f"{s} ms" in out.columns] + \
        (["bound ms"] if "bound ms" in out.columns else [])
    out = out.reindex(columns=cols)
    if "bound ms" in out.columns and "p2p ms" in out.columns:
        out["p2p share of bound"] = out["bound ms"] / out["p2p ms"]
    return out.sort_values(["machine", "layers", "experts_moved_per_layer"]).reset_index(drop=True)


def ep_forward_table(df) -> pd.DataFrame:
    """One row per machine x placement: tokens and MoE ms per rank, slowest / mean per layer
    (tokens, MoE time) and the collective forward's ms."""
    import pandas as pd

    rows: dict = {}

    def row(r) -> dict:
        return rows.setdefault((r["machine"], r["placement"]),
                               {"machine": r["machine"], "placement": r["placement"]})

    for method, key, scale in (("track_tokens", "tokens", 1), ("track_moe_seconds", "MoE ms", 1e3)):
        for _, r in _bench(df, "EPForwardRank", method).iterrows():
            row(r)[f"rank {int(r['rank'])} {key}"] = r["value"] * scale
    for method, key in (("track_tokens_imbalance", "tokens slowest/mean"),
                        ("track_moe_imbalance", "MoE slowest/mean")):
        for _, r in _bench(df, "EPBalance", method).iterrows():
            row(r)[key] = r["value"]
    for _, r in _bench(df, "EPForward", "time_forward").iterrows():
        row(r)["forward ms"] = r["value"] * 1e3
    out = pd.DataFrame(list(rows.values()))
    if out.empty:
        return out
    order = {"start": 0, "balanced": 1}
    return out.sort_values(["machine", "placement"], key=lambda s: s.map(order) if s.name == "placement"
                           else s).reset_index(drop=True)
