"""Every buffer and run of one rank's rebalance, laid out once for all layers, and a
layer's slots packed into (or written back from) one flat buffer. The row copies
themselves are `rows.RowMover`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import FusedMoE
from .rows import RowMover, Run, run_bytes
from .slots import RebalanceError


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
