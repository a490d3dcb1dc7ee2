"""The rebalance benchmark as one table (and JSON): ``python benchmarks/rebalance.py``.

The same measurements as the asv classes in `rebalance`, on one pool per model for
the whole table: every (experts moved, layers, source) row, each p2p row beside the
contiguous transfer of the same bytes measured by the same ranks in the same run, then
the whole model. Times per row: the driver's (command to every rank and back, as asv
times it) and the ranks' own (barrier to the end of the rebalance, GPU work
synchronized, slowest rank): the headline compares the ranks' time with the ranks' bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import fp8_reload as fr

# The module, not its classes: asv discovers benchmark classes in every module's namespace.
from benchmarks import rebalance as rb
from benchmarks.ep_common import (
    BACKEND,
    KIND,
    SPEC,
    WHOLE,
    WORLD,
    bench_checkpoint,
    close_pools,
    rank_pool,
    whole_pool,
)
from benchmarks.rebalance import LAYERS, MOVED, SOURCES, WHOLE_MOVED, shards
from fp8_reload.testing.io_paths import resident_fraction

TARGET_MS_PER_LAYER = 2.0  # 32 experts per layer on 2xH200
TARGET_SHARE_OF_BOUND = 0.5
PHASES = ("agree", "plan", "stage", "wait", "disk", "exchange", "commit", "outcome")
# The timed samples never wait per phase (`rebalance(phase_times=False)`): their phases are
# host time; the phase split of the device time comes from extra samples (--phase-repeat).


def _samples(bench, args, repeat: int, timed, source: str = "", phase_repeat: int = 0) -> dict:
    """Median / min driver seconds and median slowest-rank seconds over `repeat` samples,
    then, for a rebalance, `phase_repeat` more with a device wait after each phase: their
    median phases split the device time (the timed samples' phases are the host's)."""
    driver, ranks, host, phases, resident = [], [], {}, {}, []
    for i in range(repeat):
        if i:
            bench.setup(*args)
        if source == "disk-cold":
            resident.append(resident_fraction(shards(bench.pool.checkpoint)))
        t0 = time.perf_counter()
        timed(*args)
        driver.append(time.perf_counter() - t0)
        last = bench.last
        if isinstance(last[0], dict):  # a rebalance: {"wall_s", "report"} per rank
            ranks.append(max(r["wall_s"] for r in last))
            _add_phases(host, last)
        else:  # an exchange: [seconds] per rank
            ranks.append(max(t[0] for t in last))
    if phase_repeat and isinstance(bench.last[0], dict):
        bench.phase_times = True
        try:
            for _ in range(phase_repeat):
                bench.setup(*args)
                timed(*args)
                _add_phases(phases, bench.last)
        finally:
            bench.phase_times = False
    med = lambda d: {k: statistics.median(v) for k, v in d.items()}  # noqa: E731
    return {"median_s": statistics.median(driver), "min_s": min(driver), "max_s": max(driver),
            "rank_median_s": statistics.median(ranks), "rank_min_s": min(ranks),
            "phases_median_s": med(phases or host), "host_phases_median_s": med(host),
            "resident_after_evict": statistics.median(resident) if resident else None}


def _add_phases(into: dict, last: list) -> None:
    for r in last:
        for k, v in r["report"].seconds.items():
            into.setdefault(k, []).append(v)


def _row(bench, timed, args, repeat, phase_repeat=0, **fields) -> dict | None:
    try:
        bench.setup(*args)
    except NotImplementedError as e:
        print(f"  skip {fields}: {e}", flush=True)
        return None
    row = {**fields, "repeat": repeat, **_samples(bench, args, repeat, timed, fields.get("source", ""),
                                                  phase_repeat)}
    reps = [r["report"] for r in bench.last] if isinstance(bench.last[0], dict) else []
    row["bytes_per_rank"] = (max(r.bytes_received + r.bytes_disk for r in reps) if reps
                             else bench.nbytes)
    row["experts_per_rank"] = max((r.experts_p2p + r.experts_disk for r in reps), default=0)
    row["gb_per_s"] = row["bytes_per_rank"] / row["rank_median_s"] / 1e9
    return row


HEADER = (f"{'moved/layer':>11} {'layers':>6} {'source':<10} {'MiB/rank':>9} {'ms':>8} "
          f"{'rank ms':>8} {'GB/s':>6} {'bound ms':>9} {'of bound':>8}  phases (device, a wait "
          "after each; median ms)")


def format_row(row: dict) -> str:
    ph = row.get("phases_median_s", {})
    phases = " ".join(f"{k} {ph[k] * 1e3:.2f}" for k in PHASES if k in ph)
    cold = row.get("resident_after_evict")
    note = f"  [{cold:.0%} cached after evict]" if cold is not None and cold >= 0 else ""
    bound = row.get("bound_rank_median_s")
    bound_s = f"{bound * 1e3:>9.3f} {bound / row['rank_median_s']:>8.0%}" if bound else f"{'':>18}"
    line = (f"{row['experts_moved_per_layer']:>11} {row['layers']:>6} {row['source']:<10} "
            f"{row['bytes_per_rank'] / 2**20:>9.1f} {row['median_s'] * 1e3:>8.2f} "
            f"{row['rank_median_s'] * 1e3:>8.3f} {row['gb_per_s']:>6.1f} {bound_s}  {phases}{note}")
    host = row.get("host_phases_median_s") or {}
    if host and host is not ph and host != ph:
        line += "\n" + " " * 12 + "host (timed runs, no waits), ms: " + " ".join(
            f"{k} {host[k] * 1e3:.2f}" for k in (*PHASES, "total") if k in host)
    return line


def table(repeat: int, phase_repeat: int = 0) -> list[dict]:
    rows = []
    reb, ex = rb.Rebalance(), rb.ContiguousExchange()
    for layers in LAYERS:
        for moved in MOVED:
            bound = None
            if moved:
                bound = _row(ex, ex.time_exchange, (moved, layers), repeat,
                             experts_moved_per_layer=moved, layers=layers, source="contiguous")
            for source in SOURCES:
                row = _row(reb, reb.time_rebalance, (moved, source, layers), repeat, phase_repeat,
                           experts_moved_per_layer=moved, layers=layers, source=source)
                if row is None:
                    continue
                if source == "p2p" and bound is not None:
                    row["bound_median_s"] = bound["median_s"]
                    row["bound_rank_median_s"] = bound["rank_median_s"]
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def whole_table(repeat: int, phase_repeat: int = 0) -> list[dict]:
    rows = []
    reb, ex = rb.WholeModelRebalance(), rb.WholeModelExchange()
    for moved in WHOLE_MOVED:
        bound = _row(ex, ex.time_exchange, (moved,), repeat, experts_moved_per_layer=moved,
                     layers="whole", source="contiguous")
        row = _row(reb, reb.time_rebalance, (moved,), repeat, phase_repeat,
                   experts_moved_per_layer=moved, layers="whole", source="p2p")
        if row is None:
            continue
        if bound is not None:
            row["bound_median_s"] = bound["median_s"]
            row["bound_rank_median_s"] = bound["rank_median_s"]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def headline(rows: list[dict], whole_layers: int) -> list[str]:
    """The issue's figures: 32 experts/layer p2p, ms per layer and share of the bound."""
    out = []
    most = {}
    for r in rows:
        if r["source"] == "p2p":
            most[r["layers"]] = max(most.get(r["layers"], 0), r["experts_moved_per_layer"])
    for r in rows:
        if r["source"] != "p2p" or not r["experts_moved_per_layer"] or \
                r["experts_moved_per_layer"] != most[r["layers"]]:
            continue
        n = whole_layers if r["layers"] == "whole" else (1 if r["layers"] == "1" else r["moe_layers"])
        per_layer = r["rank_median_s"] * 1e3 / n
        share = r["bound_rank_median_s"] / r["rank_median_s"] if r.get("bound_rank_median_s") else None
        what = {"1": "one MoE layer", "whole": f"whole model ({n} MoE layers, one plan, one "
                "exchange per peer pair)"}.get(r["layers"], f"all {n} MoE layers")
        out.append(f"p2p, {r['experts_moved_per_layer']} experts/layer, {what}: "
                   f"{per_layer:.3f} ms per layer (target <= {TARGET_MS_PER_LAYER:g}: "
                   f"{'met' if per_layer <= TARGET_MS_PER_LAYER else 'NOT met'}); "
                   + (f"{share:.0%} of one contiguous transfer of the same "
                      f"{r['bytes_per_rank'] / 2**20:.0f} MiB (target >= {TARGET_SHARE_OF_BOUND:.0%}: "
                      f"{'met' if share >= TARGET_SHARE_OF_BOUND else 'NOT met'})" if share else "no bound"))
    return out


def copy_path(device: str) -> str:
    """How the ranks move rows (`FP8_RELOAD_REBALANCE_COPY`): the Triton kernel or torch's
    indexed copies (commits without `rows.copy_path`: torch gathers)."""
    try:
        from fp8_reload.expert_parallel.rows import copy_path as chosen
    except ImportError:
        return "torch gathers (no copy kernel in this commit)"
    return "one Triton copy_rows_ launch per batch" if chosen(torch.device(device)) == "triton" \
        else "torch indexed copies per slot tensor and layer"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--checkpoint-only", action="store_true",
                   help="write (or find) the benchmark checkpoint, print its path, exit")
    p.add_argument("--no-whole", action="store_true", help="skip the whole-model rows")
    p.add_argument("--phase-repeat", type=int, default=3,
                   help="extra samples per rebalance row with a device wait after each phase "
                        "(the phase split; 0: the timed samples' host phases)")
    args = p.parse_args(argv)
    if args.checkpoint_only:
        print(bench_checkpoint())
        return 0
    pool = rank_pool()
    cfg = fr.Checkpoint(pool.checkpoint).config
    print(f"rebalance benchmark: {WORLD} ranks, {BACKEND} on {', '.join(map(str, pool.devices))}; "
          f"{SPEC} = {len(cfg.moe_layers)} MoE layer(s) x {cfg.num_experts} experts "
          f"(H {cfg.hidden_size}, I {cfg.moe_intermediate_size}), {pool.start.slots_per_rank} "
          f"slots/rank, {KIND} checkpoint at {pool.checkpoint}; rows moved by "
          f"{copy_path(pool.devices[0])}", flush=True)
    print(HEADER, flush=True)
    rows = table(args.repeat, args.phase_repeat)
    for r in rows:
        r["moe_layers"] = len(cfg.moe_layers)
    close_pools()
    whole_cfg = fr.MoEConfig.from_spec(WHOLE)
    if not args.no_whole:
        t0 = time.perf_counter()
        whole_pool()
        print(f"whole model: {WHOLE} = {len(whole_cfg.moe_layers)} MoE layers x "
              f"{whole_cfg.num_experts} experts, filled on the device in "
              f"{time.perf_counter() - t0:.1f} s (no checkpoint; every slot checked after each "
              "move)", flush=True)
        rows += whole_table(args.repeat, args.phase_repeat)
        close_pools()
    lines = headline(rows, len(whole_cfg.moe_layers))
    print(f"rows moved by {copy_path(pool.devices[0])}:", flush=True)
    print("\n".join(lines), flush=True)
    if args.json:
        meta = {"world": WORLD, "backend": BACKEND, "spec": SPEC, "whole": WHOLE,
                "devices": pool.devices, "torch": torch.__version__,
                "moe_layers": len(cfg.moe_layers), "whole_moe_layers": len(whole_cfg.moe_layers),
                "experts": cfg.num_experts, "slots_per_rank": pool.start.slots_per_rank,
                "expert_bytes": 3 * cfg.hidden_size * cfg.moe_intermediate_size,
                "copy_path": copy_path(pool.devices[0]),
                "headline": lines}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if not lines:
        print("no p2p row that moves experts ran (see the skips above)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
