"""The EP forward benchmark as a table, JSON and a plot: ``python benchmarks/ep_forward.py``.

Measures `ep_forward.results` for both placements on one pool (the ranks rebalance
between them by p2p), prints tokens and MoE time per rank and layer, the slowest rank
over the mean before -> after, and draws ``--plot`` (PNG): per MoE layer, each rank's
pairs and MoE time, before and after, the mean as a line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.ep_common import BACKEND, SPEC, WORLD, close_pools, rank_pool
from benchmarks.ep_forward import ALPHA, PLACEMENTS, TOKENS, ep_backend, layer_imbalance, results

TARGET = 1.10  # slowest rank's MoE time within 10% of the mean, after rebalancing


def summary(per: dict) -> list[str]:
    lines = []
    for name in PLACEMENTS:
        tok = layer_imbalance(per[name], "rows")
        moe = layer_imbalance(per[name], "moe_s")
        lines.append(f"{name:<9} slowest rank / mean per layer: tokens {sum(tok) / len(tok):.3f} "
                     f"(worst layer {max(tok):.3f}), MoE time {sum(moe) / len(moe):.3f} "
                     f"(worst layer {max(moe):.3f})")
    after = layer_imbalance(per["balanced"], "moe_s")
    met = max(after) <= TARGET
    lines.append(f"goal: slowest rank's MoE time within {TARGET - 1:.0%} of the mean after "
                 f"rebalancing, in every layer: {'met' if met else 'NOT met'} "
                 f"(worst layer {max(after):.3f})")
    return lines


def table(per: dict) -> list[str]:
    layers = per["start"][0]["layers"]
    head = f"{'placement':<9} {'rank':>4} " + " ".join(
        f"{'L' + str(layer) + ' tokens':>10} {'MoE ms':>8}" for layer in layers) + \
        f" {'tokens':>8} {'MoE ms':>8} {'fwd ms':>8}"
    out = [head, "-" * len(head)]
    for name in PLACEMENTS:
        for r in per[name]:
            cells = " ".join(f"{n:>10} {s * 1e3:>8.3f}" for n, s in zip(r["rows"], r["moe_s"]))
            out.append(f"{name:<9} {r['rank']:>4} {cells} {sum(r['rows']):>8} "
                       f"{sum(r['moe_s']) * 1e3:>8.3f} {r['forward_s'] * 1e3:>8.2f}")
    return out


def plot(per: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = per["start"][0]["layers"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharey="row")
    width = 0.8 / WORLD
    for col, name in enumerate(PLACEMENTS):
        for row, (key, scale, label) in enumerate((("rows", 1, "(token, expert) pairs computed"),
                                                   ("moe_s", 1e3, "MoE time (ms)"))):
            ax = axes[row][col]
            for rank, r in enumerate(per[name]):
                xs = [i + (rank - (WORLD - 1) / 2) * width for i in range(len(layers))]
                ax.bar(xs, [v * scale for v in r[key]], width, label=f"rank {rank}")
            for i in range(len(layers)):
                mean = sum(r[key][i] for r in per[name]) * scale / WORLD
                ax.hlines(mean, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                          label="mean" if i == 0 else None)
            imb = layer_imbalance(per[name], key)
            ax.set_title(f"{name}: slowest / mean {sum(imb) / len(imb):.2f} "
                         f"(worst layer {max(imb):.2f})", fontsize=10)
            ax.set_xticks(range(len(layers)), [f"MoE layer {layer}" for layer in layers])
            if col == 0:
                ax.set_ylabel(label)
            ax.grid(True, axis="y", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the per-rank results here")
    p.add_argument("--plot", default=None, help="write the PNG here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    pool = rank_pool()
    backend = ep_backend()
    print(f"EP forward benchmark: {WORLD} ranks, {BACKEND} on {', '.join(map(str, pool.devices))}; "
          f"{SPEC}, {TOKENS} tokens per rank, Zipf alpha {ALPHA}, MoE backend {backend}",
          flush=True)
    per = {name: results(name) for name in PLACEMENTS}
    moved = pool.start.moved_slots(pool.placement)
    close_pools()
    lines = table(per) + [f"balanced: {moved} of {pool.start.table.numel()} physical slots moved"] \
        + summary(per)
    print("\n".join(lines), flush=True)
    print(f"(measured in {time.perf_counter() - t0:.1f} s)", flush=True)
    if args.json:
        meta = {"world": WORLD, "backend": BACKEND, "spec": SPEC, "tokens_per_rank": TOKENS,
                "alpha": ALPHA, "moe_backend": backend, "devices": pool.devices,
                "torch": torch.__version__, "summary": summary(per)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": per}, indent=1))
    if args.plot:
        where = f"{WORLD} ranks ({BACKEND}, {pool.devices[0].split(':')[0]}), {SPEC}"
        plot(per, Path(args.plot), f"Expert-parallel forward, Zipf({ALPHA}) routing, {TOKENS} "
             f"tokens/rank, {where}, {backend} backend\nstart placement (left) vs after "
             "balance_placement + rebalance (right); dashed: mean over ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
