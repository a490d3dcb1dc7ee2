"""Slot rows moved between a rank's Parameters and flat buffers, all layers in few launches.

A `Run` is `k` slots of one layer against ``k`` packed rows of a buffer at some offset,
laid out as `pack_slots` does (tensor-major ``[k, bytes]`` blocks), its start aligned
to `RUN_ALIGN` so weight blocks stay 16-byte aligned whatever the runs before it.
`RowMover` copies a batch of runs of any layers either way:

* by default one `index_select` / `index_copy_` per slot tensor and run, every run's
  index in one tensor (one copy);
* with ``FP8_RELOAD_REBALANCE_COPY=triton``, one `copy_rows_` launch for the whole
  batch, its address table computed by a few whole-batch tensor ops on the host and sent
  in one copy (on CPU: Triton's interpreter, for the tests). Opt-in: on 2xH200 it was
  the slower of the two (one v2-lite layer, 32 experts moved: 32.9 against 3.3 ms per
  rank; the whole model 113.8 against 22.8 ms; `results/h200x2/`), for reasons not yet
  found.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels.registry import triton_unavailable
from ..layers import FusedMoE
from .slots import RebalanceError, as_words, slot_tensors

RUN_ALIGN = 256  # bytes: a run's start in its buffer


def run_bytes(k: int, width: int) -> int:
    """Bytes a run of `k` rows of `width` bytes takes in a buffer (padded to `RUN_ALIGN`)."""
    return -(-k * width // RUN_ALIGN) * RUN_ALIGN


@dataclass
class Run:
    """Slots `slots` of layer `lid` <-> the rows of ``buf[offset:]``; scattering, slot
    ``slots[i]`` takes row ``rows[i]`` (default i: one row may fill several slots)."""

    lid: int
    slots: list[int]
    buf: torch.Tensor
    offset: int
    k: int
    rows: list[int] | None = None


def use_kernel(device: torch.device) -> bool:
    choice = os.environ.get("FP8_RELOAD_REBALANCE_COPY", "").strip().lower()
    return choice == "triton" and (device.type != "cuda" or triton_unavailable() is None)


class RowMover:
    """The slot tensors of `layers` (id -> layer) as row tables, looked up once per
    rebalance; `gather` and `scatter` move batches of `Run`s."""

    def __init__(self, layers: dict[int, FusedMoE], device: torch.device):
        self.layers, self.device = layers, device
        self.kernel = use_kernel(device)
        self._tensors: dict[int, list[torch.Tensor]] = {}
        self._widths: dict[int, list[int]] = {}
        self._table: dict[int, int] = {}  # layer id -> row of the address table
        self._addr: list[list[int]] = []
        self._width: list[list[int]] = []

    def tensors(self, lid: int) -> list[torch.Tensor]:
        if lid not in self._tensors:
            ts = slot_tensors(self.layers[lid])
            for t in ts:
                if not t.is_contiguous():
                    raise ValueError(f"layer {lid}: slot tensor of shape {tuple(t.shape)} is not "
                                     "contiguous")
            self._tensors[lid] = ts
        return self._tensors[lid]

    def widths(self, lid: int) -> list[int]:
        """Bytes of one slot's row of each slot tensor."""
        if lid not in self._widths:
            self._widths[lid] = [t.numel() // max(t.shape[0], 1) * t.element_size()
                                 for t in self.tensors(lid)]
        return self._widths[lid]

    def row_bytes(self, lid: int) -> int:
        return sum(self.widths(lid))

    def gather(self, runs: list[Run]) -> None:
        """Slots -> buffers."""
        self._move(runs, to_buffer=True)

    def scatter(self, runs: list[Run]) -> None:
        """Buffers -> slots, in place (the Parameters keep their identity)."""
        self._move(runs, to_buffer=False)

    def _move(self, runs: list[Run], to_buffer: bool) -> None:
        runs = [r for r in runs if r.slots]
        if not runs:
            return
        with torch.no_grad():
            if self.kernel:
                self._by_kernel(runs, to_buffer)
            else:
                self._by_torch(runs, to_buffer)

    def _row_of(self, lid: int) -> int:
        if lid not in self._table:
            self._table[lid] = len(self._addr)
            self._addr.append([t.data_ptr() for t in self.tensors(lid)])
            self._width.append(self.widths(lid))
        return self._table[lid]

    def _by_kernel(self, runs: list[Run], to_buffer: bool) -> None:
        from ..kernels.triton.copy_rows import copy_rows_  # needs triton: imported on use

        rows_of, slots, base, pos, k = [], [], [], [], []
        for r in runs:
            at = r.buf.data_ptr() + r.offset
            row = self._row_of(r.lid)
            picks = r.rows if r.rows is not None else range(len(r.slots))
            for s, i in zip(r.slots, picks):
                rows_of.append(row)
                slots.append(s)
                base.append(at)
                pos.append(i)
                k.append(r.k)
        n_t = max(len(w) for w in self._width)
        addr = torch.tensor([a + [0] * (n_t - len(a)) for a in self._addr], dtype=torch.int64)
        width = torch.tensor([w + [0] * (n_t - len(w)) for w in self._width], dtype=torch.int64)
        before = width.cumsum(1) - width  # a tensor's block starts after the blocks before it
        li = torch.tensor(rows_of)
        w = width[li]
        cols = torch.tensor([slots, base, pos, k], dtype=torch.int64)
        at_slot = addr[li] + cols[0, :, None] * w
        at_buf = cols[1, :, None] + before[li] * cols[3, :, None] + cols[2, :, None] * w
        src, dst = (at_slot, at_buf) if to_buffer else (at_buf, at_slot)
        copy_rows_(src.flatten(), dst.flatten(), w.flatten(), self.device)

    def _by_torch(self, runs: list[Run], to_buffer: bool) -> None:
        flat = [s for r in runs for s in r.slots]
        picks = [] if to_buffer else [i for r in runs if r.rows is not None for i in r.rows]
        idx = torch.tensor(flat + picks, dtype=torch.long)
        if self.device.type == "cuda":  # one copy, from pinned memory, no wait
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        at, at_pick = 0, len(flat)
        views: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for r in runs:
            if r.lid not in views:
                views[r.lid] = [(t.view(t.shape[0], -1).view(torch.uint8), w)
                                for t, w in zip(self.tensors(r.lid), self.widths(r.lid))]
            n = len(r.slots)
            dst, at = idx[at:at + n], at + n
            pick = None
            if r.rows is not None and not to_buffer:
                pick, at_pick = idx[at_pick:at_pick + n], at_pick + n
            off = r.offset
            for rows, w in views[r.lid]:
                if not w:
                    continue
                rows, block = as_words(rows, r.buf[off:off + r.k * w].view(r.k, w))
                off += r.k * w
                if to_buffer:
                    torch.index_select(rows, 0, dst, out=block)
                else:
                    rows.index_copy_(0, dst, block if pick is None else block.index_select(0, pick))


@dataclass
class Moves:
    """Every buffer and run of one rank's rebalance, laid out once for all layers.

    Staging gathers `sends` (then, with the exchange in flight, `local` and `backup`);
    the commit scatters `received` and `local_in`; a rollback scatters `restore`: each
    changed slot's old row from the send buffer that already holds it, or else from the
    backup buffer, so rows that leave anyway are not copied twice."""

    send_bufs: dict[int, torch.Tensor]
    recv_bufs: dict[int, torch.Tensor]
    sends: list[Run]
    received: list[Run]
    local: list[Run]
    local_in: list[Run]
    backup: list[Run]
    restore: list[Run]
    local_bytes: int
    wire_send: dict[int, torch.Tensor]  # what the exchange posts: the buffers themselves, or
    wire_recv: dict[int, torch.Tensor]  # host copies where the group (gloo) cannot reach the GPU

    def to_wire(self) -> None:
        """The packed send buffers into the posted ones (when they differ)."""
        for p, buf in self.send_bufs.items():
            if self.wire_send[p] is not buf:
                self.wire_send[p].copy_(buf)

    def from_wire(self) -> None:
        """The received bytes into the buffers the commit scatters from (when they differ)."""
        for p, buf in self.recv_bufs.items():
            if self.wire_recv[p] is not buf:
                buf.copy_(self.wire_recv[p])

    def payload(self, runs: list[Run], mover: RowMover) -> int:
        """Bytes of slot state in `runs` (a buffer also holds the runs' alignment padding)."""
        return sum(r.k * mover.row_bytes(r.lid) for r in runs)


def _by_layer(items):
    """(layer, [x, ...]) runs of consecutive items of one layer (the plan orders them so)."""
    out: list[tuple[int, list[int]]] = []
    for lid, x in items:
        if not out or out[-1][0] != lid:
            out.append((lid, []))
        out[-1][1].append(x)
    return out


def _lay_out(mover: RowMover, runs, device) -> tuple[torch.Tensor, list[tuple[int, list[int], int]]]:
    """One buffer for `runs` ((layer, [x])), and each run's (layer, [x], offset) in it."""
    placed, off = [], 0
    for lid, xs in runs:
        placed.append((lid, xs, off))
        off += run_bytes(len(xs), mover.row_bytes(lid))
    return torch.empty(off, dtype=torch.uint8, device=device), placed


def plan_moves(mover: RowMover, mine, wire) -> Moves:
    """The buffers (on the model's device; send and receive ones mirrored on `wire`, the
    communication device, if it is another) and runs of rank plan `mine`."""
    device = mover.device
    slots_of: dict[int, dict[int, list[int]]] = {}  # layer -> new expert -> the slots it fills
    for lid, changed in mine.changed.items():
        for s in sorted(changed):
            slots_of.setdefault(lid, {}).setdefault(changed[s], []).append(s)

    def filling(lid, buf, off, experts):
        slots = [s for e in experts for s in slots_of[lid][e]]
        rows = [i for i, e in enumerate(experts) for _ in slots_of[lid][e]]
        return Run(lid, slots, buf, off, len(experts), None if rows == list(range(len(experts)))
                   else rows)

    send_bufs, recv_bufs, sends, received, restore = {}, {}, [], [], []
    kept: set[tuple[int, int]] = set()  # changed (layer, slot)s a send buffer holds
    for peer, items in mine.sends.items():
        buf, placed = _lay_out(mover, _by_layer(items), device)
        send_bufs[peer] = buf
        for lid, slots, off in placed:
            sends.append(Run(lid, slots, buf, off, len(slots)))
            back = [(s, i) for i, s in enumerate(slots)
                    if s in mine.changed.get(lid, ()) and (lid, s) not in kept]
            kept.update((lid, s) for s, _ in back)
            if back:
                restore.append(Run(lid, [s for s, _ in back], buf, off, len(slots),
                                   [i for _, i in back]))
    for peer, items in mine.recvs.items():
        buf, placed = _lay_out(mover, _by_layer(items), device)
        recv_bufs[peer] = buf
        received += [filling(lid, buf, off, experts) for lid, experts, off in placed]

    here = [(lid, [(e, f.src_slot) for e, f in sorted(mine.fetch[lid].items())
                   if f.source == "local"]) for lid in mine.fetch]
    here = [(lid, pairs) for lid, pairs in here if pairs]
    buf, placed = _lay_out(mover, [(lid, [s for _, s in pairs]) for lid, pairs in here],
                           device)
    local = [Run(lid, slots, buf, off, len(slots)) for lid, slots, off in placed]
    local_in = [filling(lid, buf, off, [e for e, _ in pairs])
                for (lid, slots, off), (_, pairs) in zip(placed, here)]
    local_bytes = sum(len(slots) * mover.row_bytes(lid) for lid, slots, _ in placed)

    rest = [(lid, [s for s in sorted(changed) if (lid, s) not in kept])
            for lid, changed in mine.changed.items()]
    buf, placed = _lay_out(mover, [(lid, slots) for lid, slots in rest if slots], device)
    backup = [Run(lid, slots, buf, off, len(slots)) for lid, slots, off in placed]
    wire = torch.device(wire)

    def mirror(bufs):
        same = wire.type == device.type and wire.index in (None, device.index)
        return dict(bufs) if same else {p: torch.empty(b.numel(), dtype=torch.uint8, device=wire)
                                        for p, b in bufs.items()}

    return Moves(send_bufs, recv_bufs, sends, received, local, local_in, backup, restore + backup,
                 local_bytes, mirror(send_bufs), mirror(recv_bufs))


def pack_slots(layer: FusedMoE, slots: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The complete state of `slots` as one flat uint8 buffer (`out` if given, written in
    place): tensor-major, a contiguous ``[len(slots), bytes]`` block per slot tensor, so
    packing and unpacking are one gather or scatter per tensor (a `RowMover` run)."""
    dev = layer.w13_weight.device
    mover = RowMover({0: layer}, dev)
    n = len(slots) * mover.row_bytes(0)
    buf = out if out is not None and out.device == dev else torch.empty(n, dtype=torch.uint8, device=dev)
    mover.gather([Run(0, list(slots), buf, 0, len(slots))])
    if out is not None and out is not buf:
        out[:n].copy_(buf)
        return out
    return buf


def write_slots(layer: FusedMoE, slots: list[int], packed: torch.Tensor, rows: list[int] | None = None
                ) -> None:
    """Scatter a `pack_slots` buffer into `slots` in place (Parameters keep their identity);
    slot ``slots[i]`` takes packed row ``rows[i]`` (default i: one row may fill several)."""
    dev = layer.w13_weight.device
    mover = RowMover({0: layer}, dev)
    width = mover.row_bytes(0)
    if packed.numel() % width:
        raise RebalanceError(f"layer {layer.layer_id}: a buffer of {packed.numel()} bytes does "
                             f"not hold whole slots of {width} bytes")
    k = packed.numel() // width
    rows = None if rows is None or list(rows) == list(range(k)) else list(rows)
    mover.scatter([Run(0, list(slots), packed.to(dev), 0, k, rows)])
