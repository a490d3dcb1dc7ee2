"""Expert-parallel rebalance: time vs experts moved, source and layers, beside the link's bound.

Two ranks (`ep_common`) start at the round-robin placement; a rebalance moves
``experts_moved_per_layer`` experts of the first MoE layer (``layers = "1"``) or of
every MoE layer (``"all"``) across ranks (disjoint pairs swap ranks, so nothing can be
copied locally) and takes them from the peer (``p2p``: one packed buffer per
direction, `batch_isend_irecv`), from the checkpoint (``disk``: a filtered
`update_weights_from_disk` per rank, page cache warm; ``disk-cold``: evicted first),
or both (``hybrid``: rank 1 may not serve, so rank 0 reads from disk what only rank 1
holds while rank 1 receives by p2p).

* ``ContiguousExchange``: the bound, measured in the same run by the same ranks: one
  contiguous buffer of the bytes a rank receives in that p2p rebalance, each way.
* ``WholeModelRebalance`` / ``WholeModelExchange``: every MoE layer of a whole model
  (v2-lite: 26 layers) in one rebalance (one plan, one exchange per peer pair), and its
  bound.

How the numbers stay honest:

* The ranks are a persistent pool (`RankPool`): processes, the process group, NCCL's
  point-to-point communicators and the rank models are built once per benchmark
  process. A timed call is the whole collective, as an engine sees it: command to every
  rank, a barrier, `rebalance` (agree, plan, stage, exchange / read, commit, all-gather
  of outcomes; GPU work synchronized) and the replies (a pipe round trip, ~0.1 ms: the
  ``0 moved`` row is this fixed cost). The bound is timed the same way.
* asv re-runs `setup` before every sample (``number = 1``): it moves the pool back to the
  start placement (untimed) and, for ``disk-cold``, evicts the checkpoint from the page
  cache, so every sample moves the same experts.
* Every move is verified once per process before it is timed: each rank's state must
  equal a fresh load under the new placement (or, for the filled whole model, every
  slot must hold its new expert's bytes), or setup fails.

Run standalone for a table and JSON: ``python benchmarks/rebalance.py`` (`rebalance_table`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout is the code under test
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import require  # noqa: E402  (asv imports this directory as `benchmarks`)
from benchmarks.ep_common import (  # noqa: E402
    CHECK_FILLED,
    EXCHANGE,
    ON_CUDA,
    checkpoint_start,
    moved_placement,
    rank_pool,
    verify_move,
    whole_pool,
    whole_start,
)
from fp8_reload.testing.io_paths import evict  # noqa: E402

# Experts moved per layer (FP8_RELOAD_BENCH_MOVED): 32 is more than the CPU model's 16 allow.
MOVED = [int(m) for m in os.environ.get("FP8_RELOAD_BENCH_MOVED", "0,2,8,32" if ON_CUDA else "0,8")
         .split(",") if m.strip()]
SOURCES = [s.strip() for s in os.environ.get("FP8_RELOAD_BENCH_SOURCES", "p2p,disk,hybrid,disk-cold")
           .split(",") if s.strip()]
LAYERS = ["1", "all"]
WHOLE_MOVED = [m for m in MOVED if m >= 8] or [m for m in MOVED if m] or [2]
# source -> (rebalance mode, ranks that may not serve)
MODE = {"p2p": ("p2p", ()), "disk": ("disk", ()), "disk-cold": ("disk", ()), "hybrid": ("hybrid", (1,))}

_RECEIVED: dict = {}  # (pool, placement, mode) -> bytes a rank receives, once verified


def shards(root: Path) -> list[Path]:
    return sorted(Path(root).glob("*.safetensors"))


def _verified(kind: str, pool, new, mode: str, exclude=()) -> int:
    key = (kind, new, mode, tuple(exclude))
    if key not in _RECEIVED:
        check = require(*CHECK_FILLED) if kind == "whole" else None
        _RECEIVED[key] = verify_move(pool, new, mode, exclude, check)
    return _RECEIVED[key]


class _Timed:
    """Common asv settings: one sample is one collective call; setup re-arms it."""

    number = 1
    repeat = (3, 10, 20.0)
    rounds = 1  # asv runs each parameter set in its own process: each round rebuilds the pool
    warmup_time = 0
    timeout = 900


def _phase_kw(bench) -> dict:
    """Per-phase device times only when asked (they cost a wait per phase; older commits'
    pools take no such argument)."""
    return {"phase_times": True} if getattr(bench, "phase_times", False) else {}


class Rebalance(_Timed):
    """Wall time of one collective rebalance across the ranks (lower is better)."""

    params = [MOVED, SOURCES, LAYERS]
    param_names = ["experts_moved_per_layer", "source", "layers"]

    def setup(self, moved, source, layers):
        if not hasattr(os, "posix_fadvise") and source == "disk-cold":
            raise NotImplementedError("no posix_fadvise: cannot evict the page cache here")
        if source == "hybrid" and not moved:
            raise NotImplementedError("nothing moves: the same as p2p")
        new = moved_placement(checkpoint_start(), moved, layers)  # may skip: before any rank starts
        pool = rank_pool()
        mode, exclude = MODE[source]
        self.received = _verified("checkpoint", pool, new, mode, exclude)
        if pool.placement != pool.start:
            pool.rebalance(pool.start, "p2p")
        if source == "disk-cold":
            evict(shards(pool.checkpoint))
        self.pool, self.new, self.mode, self.exclude = pool, new, mode, exclude

    def time_rebalance(self, moved, source, layers):
        self.last = self.pool.rebalance(self.new, self.mode, self.exclude, **_phase_kw(self))


class ContiguousExchange(_Timed):
    """The bound beside each p2p row: one contiguous transfer of the bytes a rank receives
    in that rebalance, both directions at once, timed the same way (pool call, barrier)."""

    params = [[m for m in MOVED if m] or [2], LAYERS]
    param_names = ["experts_moved_per_layer", "layers"]

    def setup(self, moved, layers):
        self.exchange = require(*EXCHANGE)
        new = moved_placement(checkpoint_start(), moved, layers)
        self.pool = rank_pool()
        self.nbytes = _verified("checkpoint", self.pool, new, "p2p")

    def time_exchange(self, moved, layers):
        self.last = self.pool.call(self.exchange, self.nbytes, 1, 0)


class WholeModelRebalance(_Timed):
    """Every MoE layer of the whole model moved in one p2p rebalance."""

    params = [WHOLE_MOVED]
    param_names = ["experts_moved_per_layer"]

    def setup(self, moved):
        self.new = moved_placement(whole_start(), moved)
        pool = whole_pool()
        self.received = _verified("whole", pool, self.new, "p2p")
        if pool.placement != pool.start:
            pool.rebalance(pool.start, "p2p")
        self.pool = pool

    def time_rebalance(self, moved):
        self.last = self.pool.rebalance(self.new, "p2p", **_phase_kw(self))


class WholeModelExchange(_Timed):
    """The bound of `WholeModelRebalance`: the same bytes as one contiguous transfer."""

    params = [WHOLE_MOVED]
    param_names = ["experts_moved_per_layer"]

    def setup(self, moved):
        self.exchange = require(*EXCHANGE)
        new = moved_placement(whole_start(), moved)
        self.pool = whole_pool()
        self.nbytes = _verified("whole", self.pool, new, "p2p")

    def time_exchange(self, moved):
        self.last = self.pool.call(self.exchange, self.nbytes, 1, 0)


if __name__ == "__main__":
    from benchmarks.rebalance_table import main

    sys.exit(main())
