"""Slot rows moved between a rank's Parameters and flat buffers, all layers in few launches.

A `Run` is `k` slots of one layer against ``k`` packed rows of a buffer at some offset,
laid out as `pack_slots` does (tensor-major ``[k, bytes]`` blocks), its start aligned
to `RUN_ALIGN` so weight blocks stay 16-byte aligned whatever the runs before it.
`RowMover` copies a batch of runs of any layers either way, by one of two paths
(``FP8_RELOAD_REBALANCE_COPY``):

* ``index`` (the default): one `index_select` / `index_copy_` per slot tensor and run,
  every run's index in one tensor (one copy). A third path, one `torch._foreach_copy_` of
  (slot view, buffer row view) pairs per word type, was measured against it on 2xH200
  (results/h200x2/speed, seventh session) and removed: the whole model's stage took
  16.96 against 15.49 ms, one layer's 0.75 against 0.89 ms.
* ``triton``: one `copy_rows_` launch for the whole batch, its address table computed by
  a few whole-batch tensor ops on the host and sent in one copy (on CPU: Triton's
  interpreter, for the tests). Opt-in: on 2xH200 it was the slowest (one v2-lite layer,
  32 experts moved: 32.9 against 3.3 ms per rank; `results/h200x2/speed`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels.registry import triton_unavailable
from ..layers import FusedMoE
from .slots import as_words, slot_tensors

RUN_ALIGN = 256  # bytes: a run's start in its buffer
COPY_PATHS = ("index", "triton")


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


def copy_path(device: torch.device) -> str:
    """The copy path `FP8_RELOAD_REBALANCE_COPY` names (``triton`` only where Triton runs
    on `device`), else ``index``."""
    choice = os.environ.get("FP8_RELOAD_REBALANCE_COPY", "").strip().lower()
    if choice == "triton":
        return "triton" if device.type != "cuda" or triton_unavailable() is None else "index"
    return choice if choice in COPY_PATHS else "index"


class RowMover:
    """The slot tensors of `layers` (id -> layer) as row tables, looked up once per
    rebalance; `gather` and `scatter` move batches of `Run`s."""

    def __init__(self, layers: dict[int, FusedMoE], device: torch.device):
        self.layers, self.device = layers, device
        self.path = copy_path(device)
        self.kernel = self.path == "triton"
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
            if self.path == "triton":
                self._by_kernel(runs, to_buffer)
            else:
                self._by_index(runs, to_buffer)

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

    def _by_index(self, runs: list[Run], to_buffer: bool) -> None:
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
