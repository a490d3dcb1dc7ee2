"""Expert-parallel rebalance across torch.distributed ranks.

Each rank holds its share of the experts (a `Placement`, loaded with
`load_rank_model`). `rebalance(model, new)` moves every rank to a new placement:

1. **Agree.** Rank 0 broadcasts (old, new, mode); every rank checks it holds
   the same old placement. Every rank then computes the same `RebalancePlan`.
2. **Plan.** Per rank: the local slots whose expert changes and, per layer,
   each logical expert the rank must obtain and from where: a *local* copy
   (the rank already holds it in another slot), a *peer* that holds it (P2P),
   or *disk*. ``p2p`` takes everything from peers, ``disk`` everything the
   rank lacks from the checkpoint, ``hybrid`` from peers when a usable peer
   holds it and from disk otherwise (`exclude_sources` marks peers that must
   not serve, e.g. ones being drained or replaced, as in Elastic EP).
3. **Exchange.** A slot's complete post-processed state is one row of bytes:
   FP8 ``w13``/``w2`` weights, ``w13_weight_scale[s]`` (both columns),
   ``w2_weight_scale[s]`` and, for FP8 checkpoints, the raw per-expert input
   scales (``w*_input_scale_per_expert[s]``). Each pair of ranks exchanges one
   packed buffer per direction in one `batch_isend_irecv`; disk experts are
   read meanwhile with a filtered `update_weights_from_disk` through the new
   slot maps.
4. **Commit.** Rows are written in place into the existing Parameters of the
   changed slots (objects and loader attributes kept), the layer-max input
   scales are recomputed from the raw per-expert scales exactly as a fresh
   load does, `weights_version` is bumped and forward caches dropped.
5. **Finish together.** Ranks all-gather their outcome. If any rank failed,
   every rank restores its changed slots from a backup taken before the
   commit and raises `RebalanceError`; the model and placement are as before.

After a successful rebalance each rank's state equals a fresh `load_model` of
that rank under the new placement, bit for bit (tests check it on every rank).
Works with ``gloo`` on CPU and ``nccl`` on GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import ReloadError
from .layers import FP8MoEModel, FusedMoE
from .placement import Placement
from .processing import merge_input_scales_
from .reload import (ReloadReport, _invalidate_caches, _sync, generate_weight_name_filter,
                     load_model, update_weights_from_disk)

MODES = ("p2p", "disk", "hybrid")


class RebalanceError(ReloadError):
    """A rebalance failed on some rank; every rank rolled back to the old placement."""


# --------------------------------------------------------------------------
# Loading a rank's share
# --------------------------------------------------------------------------

def load_rank_model(path, placement: Placement, rank: int, device="cpu",
                    processing: str = "fixed") -> FP8MoEModel:
    """A fresh load of `rank`'s share of the model under `placement`."""
    model = load_model(path, device=device, processing=processing, **placement.model_kwargs(rank))
    model.placement = placement
    model.ep_rank = rank
    return model


def moe_layer_map(model: FP8MoEModel) -> dict[int, FusedMoE]:
    return {layer.layer_id: layer for _, layer in model.moe_layers()}


def slot_tensors(layer: FusedMoE) -> list[torch.Tensor]:
    """Every tensor of a layer indexed by local slot whose slice a slot owns.

    The merged input scales (one value for the whole layer) are not among them:
    they are recomputed from the raw per-expert buffers after a commit.
    """
    ts = [layer.w13_weight.data, layer.w2_weight.data,
          layer.w13_weight_scale.data, layer.w2_weight_scale.data]
    for name in ("w13_input_scale_per_expert", "w2_input_scale_per_expert"):
        buf = getattr(layer, name, None)
        if buf is not None:
            ts.append(buf)
    return ts


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A `[slots, bytes]` uint8 view of `t` (writes go to `t`'s storage)."""
    if not t.is_contiguous():
        raise RebalanceError(f"slot tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def row_bytes(layer: FusedMoE) -> int:
    """Bytes of one slot's complete state."""
    return sum(_rows(t).shape[1] for t in slot_tensors(layer))


def _index(slots, device) -> torch.Tensor:
    return torch.as_tensor(list(slots), dtype=torch.long).to(device)


def pack_slots(layer: FusedMoE, slots: Sequence[int], out: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """Copy the complete state of `slots` into a flat uint8 buffer (`out` if given).

    Tensor-major layout: for each slot tensor in turn, a contiguous
    ``[len(slots), bytes]`` block, so packing and unpacking are one gather or
    scatter per tensor, straight between the Parameters and the buffer.
    """
    dev = layer.w13_weight.device
    k = len(slots)
    if out is None:
        out = torch.empty(k * row_bytes(layer), dtype=torch.uint8, device=dev)
    idx = _index(slots, dev)
    off = 0
    for t in slot_tensors(layer):
        rows = _rows(t)
        n = k * rows.shape[1]
        block = out[off:off + n].view(k, rows.shape[1])
        if block.device == dev:
            torch.index_select(rows, 0, idx, out=block)
        else:
            block.copy_(rows.index_select(0, idx))
        off += n
    return out


def write_slots(layer: FusedMoE, slots: Sequence[int], packed: torch.Tensor,
                rows: Optional[Sequence[int]] = None) -> None:
    """Scatter a `pack_slots` buffer into `slots` in place (Parameters keep their identity).

    `packed` holds `k` slots; slot ``slots[i]`` takes packed row ``rows[i]``
    (default: row i), so one received expert can fill several slots.
    """
    dev = layer.w13_weight.device
    width = row_bytes(layer)
    if packed.numel() % width:
        raise RebalanceError(f"layer {layer.layer_id}: a buffer of {packed.numel()} bytes does "
                             f"not hold whole slots of {width} bytes")
    k = packed.numel() // width
    packed = packed.to(dev)
    dst = _index(slots, dev)
    pick = None if rows is None or list(rows) == list(range(k)) else _index(rows, dev)
    off = 0
    for t in slot_tensors(layer):
        view = _rows(t)
        n = view.shape[1]
        block = packed[off:off + k * n].view(k, n)
        view.index_copy_(0, dst, block if pick is None else block.index_select(0, pick))
        off += k * n


def refresh_merged_input_scales(layer: FusedMoE) -> None:
    """Layer-max input scales from the raw per-expert values, as a fresh load sets them."""
    empty = torch.empty(0, dtype=torch.long)
    for name in ("w13", "w2"):
        raw = getattr(layer, f"{name}_input_scale_per_expert", None)
        if raw is not None:
            merge_input_scales_(getattr(layer, f"{name}_input_scale").data, raw, empty)


# --------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Fetch:
    """How one rank obtains one logical expert of one layer."""

    layer: int
    expert: int
    source: str  # "local" | "peer" | "disk"
    src_rank: int = -1  # the rank holding it (itself for "local")
    src_slot: int = -1  # its local slot there


@dataclass
class RankPlan:
    rank: int
    changed: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> {slot: new expert}
    fetch: dict[int, dict[int, Fetch]] = field(default_factory=dict)  # layer -> {expert: Fetch}
    sends: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # peer -> [(layer, slot)]
    recvs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # peer -> [(layer, expert)]

    def count(self, source: str) -> int:
        return sum(f.source == source for per in self.fetch.values() for f in per.values())

    @property
    def slots_changed(self) -> int:
        return sum(len(c) for c in self.changed.values())

    def disk_experts(self) -> dict[int, list[int]]:
        out = {layer: sorted(e for e, f in per.items() if f.source == "disk")
               for layer, per in self.fetch.items()}
        return {k: v for k, v in out.items() if v}


@dataclass
class RebalancePlan:
    """What every rank does to go from `old` to `new`; identical on every rank."""

    old: Placement
    new: Placement
    mode: str
    exclude_sources: frozenset
    ranks: list[RankPlan]

    @classmethod
    def build(cls, old: Placement, new: Placement, mode: str = "p2p",
              exclude_sources: Iterable[int] = ()) -> "RebalancePlan":
        if mode not in MODES:
            raise ValueError(f"unknown rebalance mode {mode!r}; choose one of {', '.join(MODES)}")
        old._check_same_layout(new)
        excluded = frozenset(int(r) for r in exclude_sources)
        ranks = [RankPlan(r) for r in range(old.ep_size)]
        served = [0] * old.ep_size  # experts each rank sends: spread the sending load
        for layer in old.layers:
            holders = old.logical_to_physical(layer)
            for dst in range(old.ep_size):
                before = old.rank_experts(layer, dst)
                after = new.rank_experts(layer, dst)
                changed = {s: e for s, (a, e) in enumerate(zip(before, after)) if a != e}
                if not changed:
                    continue
                ranks[dst].changed[layer] = changed
                fetches = {}
                for e in sorted(set(changed.values())):
                    fetches[e] = cls._source(layer, e, dst, before, holders, mode, excluded,
                                             served, old.slots_per_rank)
                    f = fetches[e]
                    if f.source == "peer":
                        served[f.src_rank] += 1
                        ranks[f.src_rank].sends.setdefault(dst, []).append((layer, f.src_slot))
                        ranks[dst].recvs.setdefault(f.src_rank, []).append((layer, e))
                ranks[dst].fetch[layer] = fetches
        return cls(old, new, mode, excluded, ranks)

    @staticmethod
    def _source(layer, e, dst, before, holders, mode, excluded, served, slots_per_rank) -> Fetch:
        if e in before:
            return Fetch(layer, e, "local", dst, before.index(e))
        if mode == "disk":
            return Fetch(layer, e, "disk")
        peers = sorted({p // slots_per_rank for p in holders[e]} - {dst} - excluded)
        if not peers:
            if mode == "hybrid":
                return Fetch(layer, e, "disk")
            raise ValueError(f"layer {layer}: expert {e} is held only by excluded ranks "
                             f"{sorted(excluded)}; use mode 'hybrid' or 'disk'")
        src = min(peers, key=lambda r: (served[r], r))
        slot = next(p % slots_per_rank for p in holders[e] if p // slots_per_rank == src)
        return Fetch(layer, e, "peer", src, slot)

    def summary(self) -> str:
        parts = [f"r{p.rank}: {p.slots_changed} slots, {p.count('local')} local / "
                 f"{p.count('peer')} p2p / {p.count('disk')} disk" for p in self.ranks]
        return f"[{self.mode}] " + "; ".join(parts)


# --------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------

@dataclass
class RebalanceReport:
    """What one rank did in one rebalance. `seconds` holds per-phase wall times."""

    rank: int
    mode: str
    slots_changed: int = 0
    experts_local: int = 0
    experts_p2p: int = 0
    experts_disk: int = 0
    experts_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    bytes_disk: int = 0  # bytes read from the checkpoint
    seconds: dict[str, float] = field(default_factory=dict)
    disk_report: Optional[ReloadReport] = None

    def summary(self) -> str:
        mib = 2.0 ** 20
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        return (f"rank {self.rank} [{self.mode}]: {self.slots_changed} slots changed "
                f"({self.experts_local} local, {self.experts_p2p} p2p, {self.experts_disk} disk), "
                f"sent {self.bytes_sent / mib:.2f} MiB, received {self.bytes_received / mib:.2f} MiB, "
                f"read {self.bytes_disk / mib:.2f} MiB ({phases})")


class _Timer:
    def __init__(self, seconds: dict, device: torch.device):
        self.seconds, self.cuda = seconds, device.type == "cuda"

    def mark(self, name: str, t0: float, sync: bool = True) -> float:
        if self.cuda and sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + t - t0
        return t


def _agree(old: Placement, new: Optional[Placement], mode: str, exclude_sources, group,
           device, holds_rank: bool) -> tuple[Placement, str, frozenset]:
    """Rank 0's (old, new, mode, exclusions) on every rank; every rank must hold `old`
    (and its own share of it: `holds_rank`)."""
    rank = dist.get_rank(group)
    payload = [None]
    if rank == 0 and new is not None:
        payload = [(old.table, new, mode, sorted(exclude_sources))]
    dist.broadcast_object_list(payload, src=_global(group, 0), group=group, device=device)
    if payload[0] is None:
        raise RebalanceError("rank 0 passed no new placement; nothing was changed")
    old_table, new0, mode0, excl0 = payload[0]
    same = torch.tensor([int(torch.equal(old_table, old.table) and holds_rank
                             and old.ep_size == dist.get_world_size(group))],
                        dtype=torch.int64, device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    if not int(same.item()):
        raise RebalanceError("ranks disagree on the current placement (or a rank holds another "
                             "rank's share, or ep_size is not the world size); nothing was changed")
    return new0, mode0, frozenset(excl0)


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _comm_device(model_device: torch.device, group) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else model_device


def rebalance(model: FP8MoEModel, new: Optional[Placement], *, mode: str = "p2p",
              checkpoint=None, exclude_sources: Iterable[int] = (), group=None) -> RebalanceReport:
    """Move this rank of an expert-parallel model to placement `new`; collective.

    Every rank of `group` calls it; rank 0's `new`, `mode` and `exclude_sources`
    are used (other ranks may pass ``new=None``). `checkpoint` (default: the path
    the model was loaded from) serves the experts taken from disk. Returns this
    rank's report. Raises `RebalanceError` on every rank if any rank failed,
    after every rank restored its old state.
    """
    old: Optional[Placement] = getattr(model, "placement", None)
    if old is None:
        raise RebalanceError("the model has no placement: load it with load_rank_model")
    if model.mode.name != "fixed":
        raise RebalanceError(f"rebalance needs processing='fixed' (in-place, scoped); the model "
                             f"uses {model.mode.name!r}")
    layers = moe_layer_map(model)
    device = next(iter(layers.values())).w13_weight.device
    comm = _comm_device(device, group)
    rank = dist.get_rank(group)
    report = RebalanceReport(rank=rank, mode=mode)
    timer = _Timer(report.seconds, device)
    t_start = t = time.perf_counter()

    with model.reload_lock:
        new, mode, excluded = _agree(old, new, mode, exclude_sources, group, comm,
                                     holds_rank=getattr(model, "ep_rank", rank) == rank)
        report.mode = mode
        try:  # every rank has the same inputs, so every rank fails here alike
            plan = RebalancePlan.build(old, new, mode, excluded)
        except ValueError as e:
            raise RebalanceError(f"cannot plan the rebalance: {e}; nothing was changed") from e
        mine = plan.ranks[rank]
        report.slots_changed = mine.slots_changed
        report.experts_local, report.experts_p2p, report.experts_disk = (
            mine.count("local"), mine.count("peer"), mine.count("disk"))
        report.experts_sent = sum(len(v) for v in mine.sends.values())
        t = timer.mark("plan", t)

        error: Optional[BaseException] = None
        backup: dict[int, tuple] = {}
        chunks: dict[int, list[tuple[list[int], torch.Tensor]]] = {}  # layer -> [(experts, packed)]
        send_bufs = {p: _alloc(layers, items, comm) for p, items in mine.sends.items()}
        recv_bufs = {p: _alloc(layers, items, comm) for p, items in mine.recvs.items()}
        try:
            for lid, changed in mine.changed.items():
                layer = layers[lid]
                slots = sorted(changed)
                backup[lid] = (slots, pack_slots(layer, slots),
                               [p.data.clone() for p in _merged_scales(layer)])
                local = [(e, f.src_slot) for e, f in mine.fetch[lid].items() if f.source == "local"]
                if local:
                    packed = pack_slots(layer, [s for _, s in local])
                    chunks.setdefault(lid, []).append(([e for e, _ in local], packed))
                    report.bytes_local += packed.numel()
            for peer, items in mine.sends.items():
                for lid, part, buf in _segments(layers, items, send_bufs[peer]):
                    pack_slots(layers[lid], part, out=buf)
        except Exception as e:  # still take part in the exchange, then fail together
            error = e
        t = timer.mark("stage", t)

        ops = []
        for peer in sorted(set(send_bufs) | set(recv_bufs)):
            if peer in send_bufs:
                ops.append(dist.P2POp(dist.isend, send_bufs[peer], _global(group, peer), group))
            if peer in recv_bufs:
                ops.append(dist.P2POp(dist.irecv, recv_bufs[peer], _global(group, peer), group))
        works = dist.batch_isend_irecv(ops) if ops else []
        report.bytes_sent = sum(b.numel() for b in send_bufs.values())
        report.bytes_received = sum(b.numel() for b in recv_bufs.values())
        t = timer.mark("exchange", t, sync=False)  # posting; waiting is added below

        # Disk experts load while the exchange is in flight, through the new slot maps.
        try:
            if error is None:
                for lid, layer in layers.items():
                    layer.expert_slots = new.local_slots(lid, rank)
                wanted = mine.disk_experts()
                if wanted:
                    path = checkpoint if checkpoint is not None else model.checkpoint_path
                    rep = update_weights_from_disk(model, path, generate_weight_name_filter(wanted))
                    report.disk_report = rep
                    report.bytes_disk = rep.bytes_read
            t = timer.mark("disk", t)
        except Exception as e:
            error = e
        try:
            for w in works:
                w.wait()
        except Exception as e:
            error = error or e
        t = timer.mark("exchange", t)

        try:
            if error is None:
                for peer, items in mine.recvs.items():
                    for lid, experts, buf in _segments(layers, items, recv_bufs[peer]):
                        chunks.setdefault(lid, []).append((experts, buf))
                for lid, changed in mine.changed.items():
                    layer = layers[lid]
                    for experts, packed in chunks.get(lid, []):
                        dst, rows = [], []
                        for i, e in enumerate(experts):
                            for s in sorted(changed):
                                if changed[s] == e:
                                    dst.append(s)
                                    rows.append(i)
                        write_slots(layer, dst, packed, rows)
                    refresh_merged_input_scales(layer)
                    layer.weights_version += 1
                if mine.changed:
                    _invalidate_caches(model)
                _sync(model)
        except Exception as e:
            error = e
        t = timer.mark("commit", t)

        failed = _gather_failures(error, group, comm)
        if failed:
            _restore(model, layers, backup, old, rank)
            t = timer.mark("rollback", t)
            here = f"; here: {type(error).__name__}: {error}" if error is not None else ""
            raise RebalanceError(f"rebalance failed on rank(s) {failed}; every rank rolled back "
                                 f"to the old placement{here}") from error
        model.placement = new
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def _merged_scales(layer: FusedMoE) -> list[torch.Tensor]:
    return [p for p in (layer.w13_input_scale, layer.w2_input_scale) if p is not None]


def _alloc(layers, items, device) -> torch.Tensor:
    """The flat buffer for a list of (layer, slot|expert) items bound to one peer."""
    return torch.empty(sum(row_bytes(layers[lid]) for lid, _ in items), dtype=torch.uint8,
                       device=device)


def _segments(layers, items, buf: torch.Tensor):
    """Split a peer buffer into per-layer runs: yields (layer, [slot|expert], packed view).

    Items are ordered by layer (the plan appends them so), so each run is one
    `pack_slots` block of consecutive bytes on both ends.
    """
    i = off = 0
    while i < len(items):
        lid = items[i][0]
        j = i
        while j < len(items) and items[j][0] == lid:
            j += 1
        n = (j - i) * row_bytes(layers[lid])
        yield lid, [x for _, x in items[i:j]], buf[off:off + n]
        off += n
        i = j


def _gather_failures(error, group, device) -> list[int]:
    world = dist.get_world_size(group)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(flag) for _ in range(world)]
    dist.all_gather(flags, flag, group=group)
    return [r for r, f in enumerate(flags) if int(f.item())]


def _restore(model, layers, backup, old: Placement, rank: int) -> None:
    with torch.no_grad():
        for lid, layer in layers.items():
            layer.expert_slots = old.local_slots(lid, rank)
        for lid, (slots, rows, scales) in backup.items():
            layer = layers[lid]
            write_slots(layer, slots, rows)
            for p, saved in zip(_merged_scales(layer), scales):
                p.data.copy_(saved)
            layer.loaded_experts.clear()
            layer.staged.clear()
            layer.weights_version += 1
    _invalidate_caches(model)
    _sync(model)


# --------------------------------------------------------------------------
# Launching ranks: torchrun (env vars) or torch.multiprocessing spawn
# --------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_rank(backend: str, rank: int, world_size: int, init_method: str,
              timeout_s: float = 300.0) -> torch.device:
    """Join the process group; returns this rank's device (its GPU for nccl)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(backend, local_rank)
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _share_cpu(backend: str, world_size: int) -> None:
    """CPU ranks on one host split its cores instead of each taking all of them."""
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def warm_up_p2p(group=None) -> None:
    """Exchange one byte with every peer: NCCL sets up its point-to-point
    communicators on first use, which should not be charged to a rebalance."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = _comm_device(torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend(group) == "nccl" else torch.device("cpu"), group)
    bufs = {p: (torch.zeros(1, dtype=torch.uint8, device=dev), torch.empty(1, dtype=torch.uint8, device=dev))
            for p in range(world) if p != rank}
    ops = [op for p, (out, inc) in bufs.items()
           for op in (dist.P2POp(dist.isend, out, _global(group, p), group),
                      dist.P2POp(dist.irecv, inc, _global(group, p), group))]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    dist.barrier(group=group)


# Dataclasses a rank may return (decoded back by name); RebalanceReport is added below.
_REPORTS = {"ReloadReport": ReloadReport, "Placement": Placement}


def _encode(obj):
    """JSON-ready form of a rank's result: keeps tuples, non-string dict keys and reports."""
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _REPORTS:
        return {"__report__": type(obj).__name__,
                "fields": {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__report__", "fields"}:
            return _REPORTS[obj["__report__"]](**_decode(obj["fields"]))
        if set(obj) == {"__tensor__", "dtype"}:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        if set(obj) == {"__items__"}:
            return {_decode(k): _decode(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v) for v in obj["__tuple__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


_REPORTS["RebalanceReport"] = RebalanceReport


def _spawn_entry(rank, world_size, backend, port, fn, args, out_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    _share_cpu(backend, world_size)
    device = init_rank(backend, rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        result = fn(rank, world_size, device, *args)
        # JSON, not pickle: the library never unpickles anything (tests/test_reliability.py)
        with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
            json.dump(_encode(result), f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, backend: str, *args) -> list:
    """Run ``fn(rank, world_size, device, *args)`` on every rank; results by rank.

    Under torchrun (RANK/WORLD_SIZE/MASTER_* set) this process is one rank: it
    joins the group from the environment and returns ``[its result]``.
    Otherwise it spawns `world_size` processes on this host.
    """
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = init_rank(backend, rank, world, "env://")
        try:
            return [fn(rank, world, device, *args)]
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fp8-reload-ranks-") as out:
        mp.spawn(_spawn_entry, args=(world_size, backend, _free_port(), fn, args, out),
                 nprocs=world_size, join=True)
        results = []
        for r in range(world_size):
            with open(Path(out) / f"rank{r}.json") as f:
                results.append(_decode(json.load(f)))
        return results


# --------------------------------------------------------------------------
# `fp8-reload rebalance`: a synthetic skewed load, rebalanced and checked
# --------------------------------------------------------------------------

@dataclass
class DemoSpec:
    """What each rank of `fp8-reload rebalance` runs (picklable for spawn)."""

    checkpoints: dict  # kind -> checkpoint dir (written by rank 0 if missing)
    preset: str
    num_layers: Optional[int]
    modes: list
    slots_per_rank: Optional[int] = None
    exclude_sources: tuple = ()  # applied to hybrid runs
    seed: int = 0
    alpha: float = 1.2
    check: bool = True


def ensure_checkpoint(path, preset: str, num_layers: Optional[int], kind: str, seed: int = 0) -> Path:
    """Write the synthetic checkpoint at `path` unless it is already there (atomic rename)."""
    from .checkpoint import write_checkpoint
    from .config import MoEConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    overrides = {"num_layers": num_layers} if num_layers else {}
    cfg = MoEConfig.preset(preset, **overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    write_checkpoint(tmp, cfg, seed=seed, kind=kind)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def param_ids(model) -> dict[str, int]:
    return {n: id(p) for n, p in model.named_parameters()}


def demo_rank(rank: int, world: int, device: torch.device, spec: DemoSpec) -> list[dict]:
    """One rank of the demo: for each (kind, mode) load under the start placement,
    rebalance to the balancer's placement for a synthetic skewed load, and check
    the state equals a fresh load under the new placement. Returns every rank's
    rows (all-gathered), so rank 0 can print them."""
    from .placement import balance_placement, default_slots_per_rank, synthetic_load
    from .state import compare_states, snapshot

    if rank == 0:
        for kind, path in spec.checkpoints.items():
            ensure_checkpoint(path, spec.preset, spec.num_layers, kind, seed=spec.seed)
    warm_up_p2p()  # also a barrier: the checkpoints exist from here on
    comm = _comm_device(device, None)
    rows = []
    for kind, path in spec.checkpoints.items():
        for mode in spec.modes:
            from .checkpoint import Checkpoint

            cfg = Checkpoint(path).config
            slots = spec.slots_per_rank or default_slots_per_rank(cfg.num_experts, world)
            start = Placement.round_robin(cfg.moe_layers, cfg.num_experts, world, slots)
            model = load_rank_model(path, start, rank, device)
            load = synthetic_load(start.layers, cfg.num_experts, seed=spec.seed * 1000 + rank,
                                  alpha=spec.alpha).to(comm)
            dist.all_reduce(load, group=None)  # EPLB sums the ranks' statistics
            load = load.cpu()
            new = balance_placement(load, start) if rank == 0 else None
            ids = param_ids(model)
            exclude = spec.exclude_sources if mode == "hybrid" else ()
            dist.barrier()
            t0 = time.perf_counter()
            report = rebalance(model, new, mode=mode, exclude_sources=exclude)
            dist.barrier()
            wall = time.perf_counter() - t0
            row = {"kind": kind, "mode": mode, "rank": rank, "world": world,
                   "device": str(device), "wall_s": wall, "report": report,
                   "placement": model.placement, "start": start, "load": load,
                   "layers": len(start.layers), "experts": cfg.num_experts, "slots": slots}
            if spec.check:
                fresh = load_rank_model(path, model.placement, rank, device)
                row["diffs"] = compare_states(snapshot(model), snapshot(fresh))
                row["identity_kept"] = param_ids(model) == ids
                del fresh
            del model
            rows.append(row)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    return [r for per_rank in gathered for r in per_rank]


def format_demo(rows: list[dict], backend: str) -> tuple[bool, str]:
    """The per-rank table and a verdict (True when every checked rank matched)."""
    mib = 2.0 ** 20
    first = rows[0]
    lines = [f"rebalance on {first['world']} ranks ({backend}, {first['device'].split(':')[0]}): "
             f"{first['layers']} MoE layers x {first['experts']} experts, "
             f"{first['slots']} slots per rank"]
    start, new, load = first["start"], first["placement"], first["load"]
    before, after = start.imbalance(load), new.imbalance(load)
    lines.append(f"synthetic skewed load, max/mean rank load: {before.mean():.2f} -> "
                 f"{after.mean():.2f} (mean over layers; worst layer {before.max():.2f} -> "
                 f"{after.max():.2f}); {start.moved_slots(new)} of {start.table.numel()} "
                 "physical slots change")
    head = (f"{'kind':<5} {'mode':<7} {'rank':>4} {'slots':>5} {'local':>5} {'p2p':>4} {'disk':>4} "
            f"{'sent MiB':>9} {'recv MiB':>9} {'disk MiB':>9} {'ms':>8}  state == fresh load")
    lines += ["", head, "-" * len(head)]
    ok = True
    for r in sorted(rows, key=lambda r: (r["kind"], MODES.index(r["mode"]), r["rank"])):
        rep: RebalanceReport = r["report"]
        if "diffs" in r:
            good = not r["diffs"] and r["identity_kept"]
            ok &= good
            verdict = ("yes, Parameters kept" if good else
                       f"NO: {len(r['diffs'])} diffs, e.g. {r['diffs'][:2]}"
                       + ("" if r["identity_kept"] else "; Parameters replaced"))
        else:
            verdict = "not checked"
        lines.append(f"{r['kind']:<5} {r['mode']:<7} {r['rank']:>4} {rep.slots_changed:>5} "
                     f"{rep.experts_local:>5} {rep.experts_p2p:>4} {rep.experts_disk:>4} "
                     f"{rep.bytes_sent / mib:>9.3f} {rep.bytes_received / mib:>9.3f} "
                     f"{rep.bytes_disk / mib:>9.3f} {r['wall_s'] * 1e3:>8.1f}  {verdict}")
    lines.append("")
    lines.append("OK: every rank equals a fresh load under the new placement" if ok else
                 "FAIL: some rank differs from a fresh load under the new placement")
    return ok, "\n".join(lines)


def cli_rebalance(args) -> int:
    """`fp8-reload rebalance`: spawn (or join under torchrun) the ranks, run `demo_rank`, print."""
    import json
    import shutil

    modes = list(MODES) if args.mode == "all" else args.mode.split(",")
    kinds = args.kind.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown --mode {m!r}; choose from {', '.join(MODES)} or all")
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    backend = args.backend or default_backend(world)
    with tempfile.TemporaryDirectory(prefix="fp8-reload-rebalance-") as tmp:
        if args.checkpoint:
            if len(kinds) > 1:
                raise SystemExit("--checkpoint takes one checkpoint: give a single --kind")
            ckpts = {kinds[0]: args.checkpoint}
        else:  # under torchrun every rank must name the same directory
            root = (os.path.join(tempfile.gettempdir(), f"fp8-reload-rebalance-{os.environ['MASTER_PORT']}")
                    if torchrun else tmp)
            tag = f"{args.preset}-{args.num_layers or 'all'}-seed{args.seed}"
            ckpts = {k: os.path.join(root, f"{tag}-{k}") for k in kinds}
        spec = DemoSpec(checkpoints=ckpts, preset=args.preset, num_layers=args.num_layers,
                        modes=modes, slots_per_rank=args.slots_per_rank,
                        exclude_sources=tuple(args.exclude_sources), seed=args.seed,
                        alpha=args.alpha, check=not args.no_check)
        try:
            results = run_ranks(demo_rank, world, backend, spec)
        finally:
            if torchrun and not args.checkpoint and int(os.environ["RANK"]) == 0:
                shutil.rmtree(root, ignore_errors=True)
    rows = results[0]
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if format_demo(rows, backend)[0] else 1
    ok, text = format_demo(rows, backend)
    print(text)
    if args.json:
        out = [{"kind": r["kind"], "mode": r["mode"], "rank": r["rank"], "world": r["world"],
                "backend": backend, "device": r["device"], "wall_s": r["wall_s"],
                "equals_fresh_load": (not r.get("diffs")) and r.get("identity_kept", False),
                **{k: v for k, v in vars(r["report"]).items() if k not in ("disk_report",)}}
               for r in rows]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


# --------------------------------------------------------------------------
# A persistent pool of ranks (benchmarks)
# --------------------------------------------------------------------------

def _pool_worker(rank, world, backend, port, checkpoint, start, conn):
    import traceback

    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _share_cpu(backend, world)
        device = init_rank(backend, rank, world, f"tcp://127.0.0.1:{port}")
        model = load_rank_model(checkpoint, start, rank, device)
        warm_up_p2p()
        conn.send(("ok", str(device)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "stop":
                break
            if cmd == "rebalance":
                new, mode, exclude = args
                dist.barrier()
                t0 = time.perf_counter()
                report = rebalance(model, new if rank == 0 else None, mode=mode,
                                   exclude_sources=exclude)
                conn.send(("ok", {"wall_s": time.perf_counter() - t0, "report": report}))
            elif cmd == "verify":
                from .state import compare_states, snapshot

                fresh = load_rank_model(checkpoint, model.placement, rank, device)
                diffs = compare_states(snapshot(model), snapshot(fresh))
                del fresh
                conn.send(("ok", diffs))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` rank processes, each holding one process group membership and
    its share of the model under a placement, driven by commands over pipes.

    The benchmarks time rebalances on it without paying process start-up,
    process-group set-up, NCCL communicator set-up or model loading each time.
    """

    def __init__(self, world_size: int, backend: str, checkpoint, start: Placement,
                 timeout_s: float = 600.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world_size, self.backend, self.checkpoint = world_size, backend, str(checkpoint)
        self.placement = self.start = start
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_worker, daemon=True, name=f"fp8-reload-rank{rank}",
                               args=(rank, world_size, backend, port, self.checkpoint, start, child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.devices = self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self) -> list:
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s:.0f} s")
            status, value = conn.recv()
            (results if status == "ok" else errors).append(value if status == "ok" else f"rank {rank}: {value}")
        if errors:
            raise RuntimeError("rank pool command failed:\n" + "\n".join(errors))
        return results

    def _call(self, *cmd) -> list:
        for conn in self.conns:
            conn.send(cmd)
        return self._collect()

    def rebalance(self, new: Placement, mode: str = "p2p", exclude_sources=()) -> list[dict]:
        """Rebalance every rank to `new`; per rank ``{"wall_s", "report"}``."""
        out = self._call("rebalance", new, mode, tuple(exclude_sources))
        self.placement = new
        return out

    def verify(self) -> list[list[str]]:
        """Per rank: differences from a fresh load under the current placement."""
        return self._call("verify")

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.is_alive():
                    conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.procs, self.conns = [], []
