"""Which copies a backup makes, and in what order (`backup.Backup` makes them).

Small tensors go together, one batched copy per dtype; a module's big tensors one copy
each, or per run of adjacent reloaded slots; with a side stream a FusedMoE's expert
weights in pieces of about a chunk, all in the order the commit writes them. A repeated
full reload plans the same copies again: `kept_plan` keeps them with its kept plan.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import chunks

# Tensors at most this big (scales, norms' small buffers) are backed up together, one
# batched copy per dtype: on a GPU each separate copy costs a launch, whatever its size.
SMALL_BYTES = 1 << 16

# (module, tensor, its slots or None for all of it, copied by slot: a FusedMoE's weights)
Pending = tuple[nn.Module, torch.Tensor, "list[int] | None", bool]
# (module, tensor, run of slots or None, the slots whose piece ends with this copy)
Copy = tuple[nn.Module, torch.Tensor, "tuple[int, int] | None", list]


class Copies(NamedTuple):
    small: dict  # dtype -> the small tensors copied together
    big: list[Copy]  # in the order they are queued
    sizes: list[int]  # bytes: each batch of small tensors, then each big copy
    # with a side stream: (id(module), slot or None for all of it) -> the index of the big
    # copy after which it is backed up (a module's last copy, a piece's); their indices
    due: dict[tuple[int, int | None], int]
    marks: set[int]


def kept_plan(kept: dict | None, key: list, pending: list[Pending], written: dict,
              by_piece: bool) -> Copies:
    """`plan_copies`, the copies' sizes and events, kept in `kept` (a kept reload plan's memo,
    `TargetCache.derived_of`) while `key` holds (every captured tensor the same object over
    the same memory, `Backup.capture`) and `written` is the same dict: planning took
    0.4-0.85 ms of host time on the H200 before a repeated full reload's first backup copy.
    The kept copies are views made from the first capture's tensors: the key makes them
    views of the same memory as this capture's."""
    key = (by_piece, SMALL_BYTES, chunks.CHUNK_BYTES, key)
    found = None if kept is None else kept.get("backup_plan")
    if found is not None and found[0] == key and found[1] is written:
        return found[2]
    small, big = plan_copies(pending, written, by_piece)
    sizes = [sum(t.numel() for t in ts) * ts[0].element_size() for ts in small.values()]
    sizes += [piece_bytes(t, r) for _, t, r, _ in big]
    due: dict[tuple[int, int | None], int] = {}
    if by_piece:
        for k, (module, _, _, ends) in enumerate(big):  # (a module's last copy: its own event)
            due.update(((id(module), slot), k) for slot in [*ends, None])
    plan = Copies(small, big, sizes, due, set(due.values()))
    if kept is not None:
        kept["backup_plan"] = (key, written, plan)
    return plan


def plan_copies(pending: list[Pending], written: dict, by_piece: bool) -> tuple[dict, list[Copy]]:
    """(small tensors by dtype, the big copies). `written`: (id(module), slot or None) -> when
    the commit first writes it (`targets.write_order`). `by_piece`: a FusedMoE's weights in
    pieces (`pieces`), and the big copies in the order the commit writes them."""
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    big: list[Copy] = []
    # per copy of `big`: when the commit first writes what it holds (a FusedMoE's whole
    # tensors: just before its first slot, whose writes may touch their rows)
    when: list[tuple[int, int]] = []
    never = len(written)
    first: dict[int, int] = {}  # id(module) -> its first write
    for (mid, _), k in written.items():
        first[mid] = min(k, first.get(mid, never))
    pieced: dict[int, list[torch.Tensor]] = {}  # id(FusedMoE) -> its weights copied in pieces
    for module, tensor, _, by_slot in pending:
        if by_slot and by_piece:
            pieced.setdefault(id(module), []).append(tensor)
    for module, tensor, slots, by_slot in pending:
        at = len(big)
        if by_slot and id(module) in pieced:
            if tensor is pieced[id(module)][0]:  # all of the module's pieces, in its place
                for piece, copies in pieces(module, pieced[id(module)], slots, written):
                    big += copies
                    when += [(written.get((id(module), piece[0]), never), 1)] * len(copies)
            continue
        if slots is None and tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            small.setdefault(tensor.dtype, []).append(tensor)
        elif slots is None:
            big.append((module, dense_view(tensor), None, []))
        else:
            big += [(module, tensor, run, []) for run in runs(slots)]
        when += [(first.get(id(module), never), 0)] * (len(big) - at)
    if by_piece:  # in the order the commit writes: each write waits for its own
        big = [big[k] for k in sorted(range(len(big)), key=when.__getitem__)]
    return small, big


def pieces(module, tensors: list[torch.Tensor], slots: list[int] | None, written: dict) -> list:
    """[(piece, copies)]: a FusedMoE's expert weights at `slots` (None: all), about
    `CHUNK_BYTES` a piece, the slots taken in the order the commit writes them
    (`written`, then any others); a piece is its slots in that order, its copies both
    weights, one copy per run of adjacent slots, the last one naming the piece's slots."""
    todo = range(module.num_local_experts) if slots is None else slots
    never = len(written)
    order = sorted(todo, key=lambda s: (written.get((id(module), s), never), s))
    per_slot = sum(t[0].numel() * t.element_size() for t in tensors)
    size = max(1, chunks.CHUNK_BYTES // max(per_slot, 1))
    out = []
    for at in range(0, len(order), size):
        piece = order[at:at + size]
        copies = [(module, t, run, []) for t in tensors for run in runs(sorted(piece))]
        copies[-1] = (*copies[-1][:3], sorted(piece))
        out.append((piece, copies))
    return out


def dense_view(t: torch.Tensor) -> torch.Tensor:
    """`t` with its dimensions permuted into memory order when that makes it contiguous
    (a linear weight kept transposed for its kernel): copied as one span of bytes, with no
    device-side gather into a temporary first. Restoring through the view writes `t`."""
    if t.is_contiguous():
        return t
    view = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return view if view.is_contiguous() else t


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slots as [start, end) runs of adjacent ones."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


def piece_of(tensor: torch.Tensor, run: tuple[int, int] | None) -> torch.Tensor:
    return tensor if run is None else tensor[run[0]:run[1]]


def piece_bytes(tensor: torch.Tensor, run: tuple[int, int] | None) -> int:
    """The bytes of `piece_of(tensor, run)`, without making the view."""
    n = tensor.numel() * tensor.element_size()
    return n if run is None else n // tensor.shape[0] * (run[1] - run[0])
