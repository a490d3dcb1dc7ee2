"""Expert-parallel rebalance: time vs experts moved, P2P vs disk (asv).

Two ranks (the H200 pair with NCCL; gloo CPU ranks elsewhere) start at the
round-robin placement; a rebalance moves ``experts_moved_per_layer`` experts of
every MoE layer across ranks (disjoint pairs swap ranks, so no expert can be
copied locally) and takes them either from the peer (``p2p``: one packed
buffer per direction, `batch_isend_irecv`) or from the checkpoint (``disk``:
a filtered `update_weights_from_disk` per rank, page cache warm;
``disk-cold``: the checkpoint's pages evicted from the page cache first).

How the numbers stay honest:

* The ranks are a persistent pool (`RankPool`): processes, the process group,
  NCCL's point-to-point communicators and the rank models are built once per
  benchmark process and reused, so a sample is one rebalance, not process
  start-up. A timed call is the whole collective, as a serving engine sees it:
  command to every rank, a barrier, `rebalance` (agree, plan, stage, exchange /
  read, commit, all-gather of outcomes; GPU work synchronized) and the replies
  (a pipe round trip, ~0.1 ms: the ``0 moved`` row is this fixed cost).
* asv runs every parameter set in a process of its own, so each builds its
  own pool (seconds; ``rounds = 1`` keeps that to once per parameter set).
  The standalone table below builds one pool for all of them.
* asv re-runs `setup` before every sample (``number = 1``): it moves the pool
  back to the start placement (untimed) and, for ``disk-cold``, evicts the
  checkpoint from the page cache, so every sample moves the same experts.
* Every (placement, source) pair is verified once per process before it is
  timed: each rank's state must equal a fresh load under the new placement,
  bit for bit, or setup fails.

Run standalone for a table (and JSON): ``python benchmarks/rebalance.py``.

Environment knobs: ``FP8_RELOAD_BENCH_DEVICE`` (cpu forces gloo),
``FP8_RELOAD_BENCH_REBALANCE`` (``preset:num_layers``, default ``v2-lite:2`` on
two GPUs: 64 experts of DeepSeek-V2-Lite size, 8.3 MiB each; ``small:3`` on
CPU), ``FP8_RELOAD_BENCH_DIR`` (keep checkpoints there across runs).
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout is the code under test
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import fp8_reload as fr

if __package__ in (None, ""):
    from benchmarks.common import require
else:
    from .common import require

# (current place, place before the package layout change)
ENSURE_CHECKPOINT = ("fp8_reload.checkpoint:ensure_checkpoint", "fp8_reload.rebalance:ensure_checkpoint")
PLACEMENT = ("fp8_reload.expert_parallel:Placement", "fp8_reload.placement:Placement")
SLOTS_PER_RANK = ("fp8_reload.expert_parallel:default_slots_per_rank",
                  "fp8_reload.placement:default_slots_per_rank")
MOVE_EXPERTS = ("fp8_reload.expert_parallel:move_experts", "fp8_reload.placement:move_experts")
RANK_POOL = ("fp8_reload.expert_parallel:RankPool", "fp8_reload.rebalance:RankPool")

WORLD = 2
ON_CUDA = (os.environ.get("FP8_RELOAD_BENCH_DEVICE", "cuda") != "cpu"
           and torch.cuda.is_available() and torch.cuda.device_count() >= WORLD)
BACKEND = "nccl" if ON_CUDA else "gloo"
SPEC = os.environ.get("FP8_RELOAD_BENCH_REBALANCE") or ("v2-lite:2" if ON_CUDA else "small:3")
MOVED = [0, 2, 8, 32]
SOURCES = ["p2p", "disk", "disk-cold"]
KIND = "fp8"

_POOL = None
_VERIFIED: set = set()


def bench_checkpoint() -> Path:
    ensure_checkpoint = require(*ENSURE_CHECKPOINT)
    preset, _, layers = SPEC.partition(":")
    root = Path(os.environ.get("FP8_RELOAD_BENCH_DIR") or Path(tempfile.gettempdir()) / "fp8-reload-bench")
    path = root / f"rebalance-{preset}-{layers or 'all'}-{KIND}-seed0"
    return ensure_checkpoint(path, preset, int(layers) if layers else None, KIND, seed=0)


def rank_pool():
    """The process's pool of ranks at the start placement (built on first use)."""
    global _POOL
    if _POOL is None:
        path = bench_checkpoint()
        cfg = fr.Checkpoint(path).config
        slots = require(*SLOTS_PER_RANK)(cfg.num_experts, WORLD)
        start = require(*PLACEMENT).round_robin(cfg.moe_layers, cfg.num_experts, WORLD, slots)
        _POOL = require(*RANK_POOL)(WORLD, BACKEND, path, start)
        atexit.register(_POOL.close)
    return _POOL


def evict_page_cache(root: Path) -> None:
    """Drop the checkpoint's clean pages from the page cache (no root needed)."""
    for f in sorted(Path(root).glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(root: Path) -> float:
    """Share of the checkpoint's bytes in the page cache (mincore); -1 if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return -1.0
    page = mmap.PAGESIZE
    resident = total = 0
    for f in sorted(Path(root).glob("*.safetensors")):
        size = f.stat().st_size
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return -1.0
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return -1.0
            resident += sum(v & 1 for v in vec)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else -1.0


class Rebalance:
    """Wall time of one collective rebalance across the ranks (lower is better)."""

    params = [MOVED, SOURCES]
    param_names = ["experts_moved_per_layer", "source"]
    number = 1
    repeat = (3, 10, 20.0)
    rounds = 1  # asv runs each parameter set in its own process: each round rebuilds the pool
    warmup_time = 0
    timeout = 900

    def setup(self, moved, source):
        move_experts = require(*MOVE_EXPERTS)
        if not hasattr(os, "posix_fadvise") and source == "disk-cold":
            raise NotImplementedError("no posix_fadvise: cannot evict the page cache here")
        try:
            pool = rank_pool()
        except RuntimeError as e:  # e.g. no second GPU / ranks cannot start here
            raise NotImplementedError(f"cannot start {WORLD} {BACKEND} ranks: {e}") from None
        try:
            new = move_experts(pool.start, moved // 2, seed=moved)
        except ValueError as e:
            raise NotImplementedError(str(e)) from None
        mode = "p2p" if source == "p2p" else "disk"
        if pool.placement != pool.start:
            pool.rebalance(pool.start, "p2p")
        if (new, mode) not in _VERIFIED:
            pool.rebalance(new, mode)
            bad = [(r, d[:3]) for r, d in enumerate(pool.verify()) if d]
            if bad:
                raise RuntimeError(f"rebalance to {moved} moved experts/layer by {mode} does not "
                                   f"equal a fresh load: {bad}")
            _VERIFIED.add((new, mode))
            pool.rebalance(pool.start, "p2p")
        if source == "disk-cold":
            evict_page_cache(Path(pool.checkpoint))
        self.pool, self.new, self.mode = pool, new, mode

    def time_rebalance(self, moved, source):
        self.last = self.pool.rebalance(self.new, self.mode)


# --------------------------------------------------------------------------
# Standalone: a table of the same measurements
# --------------------------------------------------------------------------

def _table(repeat: int) -> list[dict]:
    import statistics
    import time

    rows = []
    bench = Rebalance()
    for moved in MOVED:
        for source in SOURCES:
            try:
                bench.setup(moved, source)
            except NotImplementedError as e:
                print(f"  skip {moved} moved, {source}: {e}", flush=True)
                continue
            times, rank_max, phases, resident = [], [], {}, []
            for i in range(repeat):
                if i:
                    bench.setup(moved, source)
                if source == "disk-cold":
                    resident.append(resident_fraction(Path(bench.pool.checkpoint)))
                t0 = time.perf_counter()
                bench.time_rebalance(moved, source)
                times.append(time.perf_counter() - t0)
                rank_max.append(max(r["wall_s"] for r in bench.last))
                for r in bench.last:
                    for k, v in r["report"].seconds.items():
                        phases.setdefault(k, []).append(v)
            reps = [r["report"] for r in bench.last]
            got = max(r.bytes_received + r.bytes_disk for r in reps)
            med = statistics.median(times)
            row = {"experts_moved_per_layer": moved, "source": source, "repeat": repeat,
                   "median_s": med, "min_s": min(times), "max_s": max(times),
                   "rank_median_s": statistics.median(rank_max),
                   "bytes_per_rank": got,
                   "experts_per_rank": max(r.experts_p2p + r.experts_disk for r in reps),
                   "gb_per_s": got / med / 1e9 if med > 0 else 0.0,
                   "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
                   "resident_after_evict": (statistics.median(resident) if resident else None)}
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


HEADER = (f"{'moved/layer':>11} {'source':<9} {'exp/rank':>8} {'MiB/rank':>9} {'median ms':>10} "
          f"{'min ms':>8} {'GB/s':>6}  phases (median over ranks and samples, ms)")


def _format_row(row: dict) -> str:
    ph = row["phases_median_s"]
    keys = ("plan", "stage", "disk", "exchange", "commit")
    phases = " ".join(f"{k} {ph[k] * 1e3:.2f}" for k in keys if k in ph)
    cold = row.get("resident_after_evict")
    note = f"  [{cold:.0%} cached after evict]" if cold is not None and cold >= 0 else ""
    return (f"{row['experts_moved_per_layer']:>11} {row['source']:<9} {row['experts_per_rank']:>8} "
            f"{row['bytes_per_rank'] / 2**20:>9.1f} {row['median_s'] * 1e3:>10.2f} "
            f"{row['min_s'] * 1e3:>8.2f} {row['gb_per_s']:>6.2f}  {phases}{note}")


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--checkpoint-only", action="store_true",
                   help="write (or find) the benchmark checkpoint, print its path, exit")
    args = p.parse_args(argv)
    if args.checkpoint_only:
        print(bench_checkpoint())
        return 0
    pool = rank_pool()
    cfg = fr.Checkpoint(pool.checkpoint).config
    print(f"rebalance benchmark: {WORLD} ranks, {BACKEND} on {', '.join(map(str, pool.devices))}; "
          f"{SPEC} = {len(cfg.moe_layers)} MoE layer(s) x {cfg.num_experts} experts "
          f"(H {cfg.hidden_size}, I {cfg.moe_intermediate_size}), {pool.start.slots_per_rank} "
          f"slots/rank, {KIND} checkpoint at {pool.checkpoint}", flush=True)
    print(HEADER, flush=True)
    rows = _table(args.repeat)
    if args.json:
        meta = {"world": WORLD, "backend": BACKEND, "spec": SPEC, "devices": pool.devices,
                "torch": torch.__version__, "moe_layers": len(cfg.moe_layers),
                "experts": cfg.num_experts, "slots_per_rank": pool.start.slots_per_rank,
                "expert_bytes": 3 * cfg.hidden_size * cfg.moe_intermediate_size}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
