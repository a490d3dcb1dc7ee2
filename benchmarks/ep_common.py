"""Shared by the expert-parallel benchmarks (`rebalance`, `ep_forward`): where they run, on
what, and the persistent pools of ranks they time.

Two ranks: the H200 pair with NCCL, gloo CPU ranks elsewhere. Two kinds of rank models:

* from a checkpoint (``SPEC``, default ``v2-lite:3`` on two GPUs: 2 MoE layers of 64
  DeepSeek-V2-Lite experts, 8.25 MiB each; ``small:3`` on CPU), for every source
  (p2p, disk, hybrid) and for the forward;
* the whole model (``WHOLE``, default all 27 layers of ``v2-lite`` on GPUs, ``small``
  on CPU) built in place on the device, every slot filled with bytes derived from
  (layer, expert) (`fp8_reload.testing.ep_bench`): writing a 15 GiB checkpoint would
  take minutes, and a p2p rebalance moves bytes whatever they are; each move is
  checked slot by slot before it is timed.

A process keeps one pool per kind (asv runs each parameter set in a process of its
own). Environment: ``FP8_RELOAD_BENCH_DEVICE`` (cpu forces gloo),
``FP8_RELOAD_BENCH_REBALANCE`` (``preset:num_layers``), ``FP8_RELOAD_BENCH_WHOLE``
(``preset[:num_layers]``), ``FP8_RELOAD_BENCH_DIR`` (keep checkpoints there).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # imported by a benchmark run as a script
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
FILLED_MODEL = ("fp8_reload.testing.ep_bench:filled_rank_model",)
CHECK_FILLED = ("fp8_reload.testing.ep_bench:check_filled",)
EXCHANGE = ("fp8_reload.testing.ep_bench:contiguous_exchange",)

WORLD = 2
ON_CUDA = (os.environ.get("FP8_RELOAD_BENCH_DEVICE", "cuda") != "cpu"
           and torch.cuda.is_available() and torch.cuda.device_count() >= WORLD)
BACKEND = "nccl" if ON_CUDA else "gloo"
SPEC = os.environ.get("FP8_RELOAD_BENCH_REBALANCE") or ("v2-lite:3" if ON_CUDA else "small:3")
WHOLE = os.environ.get("FP8_RELOAD_BENCH_WHOLE") or ("v2-lite" if ON_CUDA else "small")
KIND = "fp8"

_POOLS: dict = {}


def bench_checkpoint() -> Path:
    ensure_checkpoint = require(*ENSURE_CHECKPOINT)
    preset, _, layers = SPEC.partition(":")
    root = Path(os.environ.get("FP8_RELOAD_BENCH_DIR") or Path(tempfile.gettempdir()) / "fp8-reload-bench")
    path = root / f"rebalance-{preset}-{layers or 'all'}-{KIND}-seed0"
    return ensure_checkpoint(path, preset, int(layers) if layers else None, KIND, seed=0)


def start_placement(layers, num_experts: int):
    """Round-robin over the ranks, one spare slot per rank."""
    slots = require(*SLOTS_PER_RANK)(num_experts, WORLD)
    return require(*PLACEMENT).round_robin(layers, num_experts, WORLD, slots)


def _pool(key: str, make):
    if key not in _POOLS:
        try:
            _POOLS[key] = pool = make()
        except RuntimeError as e:  # e.g. no second GPU / ranks cannot start here
            raise NotImplementedError(f"cannot start {WORLD} {BACKEND} ranks: {e}") from None
        atexit.register(pool.close)
    return _POOLS[key]


def checkpoint_start():
    """The start placement of the checkpoint pool (known before any rank starts)."""
    cfg = fr.MoEConfig.from_spec(SPEC)
    return start_placement(cfg.moe_layers, cfg.num_experts)


def whole_start():
    cfg = fr.MoEConfig.from_spec(WHOLE)
    return start_placement(cfg.moe_layers, cfg.num_experts)


def rank_pool():
    """The process's pool of checkpoint-loaded ranks at the start placement."""
    return _pool("checkpoint", lambda: require(*RANK_POOL)(WORLD, BACKEND, bench_checkpoint(),
                                                          checkpoint_start()))


def whole_pool():
    """The process's pool of ranks holding the whole `WHOLE` model, filled on the device."""
    builder = require(*FILLED_MODEL)
    pool_cls = require(*RANK_POOL)
    return _pool("whole", lambda: pool_cls(WORLD, BACKEND, WHOLE, whole_start(), builder=builder))


def close_pools() -> None:
    """Free the ranks (and their GPU memory) before another pool starts."""
    for key in list(_POOLS):
        _POOLS.pop(key).close()


def moved_placement(start, moved: int, layers: str = "all"):
    """`start` with `moved` experts per layer moved across ranks (disjoint pairs swap ranks,
    so nothing can be copied locally), in every MoE layer or only the first (``"1"``)."""
    try:
        new = require(*MOVE_EXPERTS)(start, moved // 2, seed=moved)
    except ValueError as e:
        raise NotImplementedError(str(e)) from None
    if layers == "1" and len(start.layers) > 1:
        table = start.table.clone()
        table[0] = new.table[0]
        new = type(start)(start.layers, start.num_experts, start.ep_size, start.slots_per_rank, table)
    return new


def verify_move(pool, new, mode: str = "p2p", exclude=(), check=None) -> int:
    """Move `pool` to `new` once and back to its start, checking every rank on the way:
    against a fresh load (checkpoint pools) or slot by slot (`check`, filled pools).
    Returns the bytes a rank received from its peer (the most of any rank): what the
    contiguous-transfer bound must move to be comparable."""
    if pool.placement != pool.start:
        pool.rebalance(pool.start, "p2p")
    out = pool.rebalance(new, mode, exclude)
    bad = pool.call(check) if check is not None else pool.verify()
    bad = [(r, d[:3]) for r, d in enumerate(bad) if d]
    if bad:
        raise RuntimeError(f"rebalance by {mode} does not reach the placement's state: {bad}")
    pool.rebalance(pool.start, "p2p")
    return max(r["report"].bytes_received for r in out)
