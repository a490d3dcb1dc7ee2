"""Where every row of one rank's rebalance goes: buffer segments and device indices.

From a `RankPlan` and the layers' row widths, once per rebalance: the segments of
each peer's send and receive buffer (one run of rows per layer, the same order on
both ends), the rows copied locally, the slots to back up, and one scatter per
(source buffer, layer) for the commit. Every index any of them needs travels to the
device in one copy, so staging and commit are one gather or scatter per parameter
kind and layer, with no per-expert Python and no host sync.

The backup takes only the changed slots whose old rows are not already in a send
buffer: a slot that sends its expert away and takes a new one (the usual move) is
restored from the bytes it sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from .plan import RankPlan


@dataclass
class Run:
    """`count` rows of layer `li` at `offset` bytes into a buffer; `index` selects slots
    (pack from / scatter to) and `rows` the buffer rows a scatter takes (None: in order)."""

    li: int
    offset: int
    nbytes: int
    index: object = None  # position in `Transfer.index`, then the device tensor
    rows: object = None


def _runs(values: torch.Tensor) -> tuple[list[int], list[int]]:
    out, counts = torch.unique_consecutive(values, return_counts=True)
    return out.tolist(), counts.tolist()


class Transfer:
    """This rank's rows of one rebalance (see the module docstring)."""

    def __init__(self, plan: RankPlan, widths: Sequence[int] | Callable[[int], int],
                 num_experts: int, device):
        """`widths`: row bytes by layer index, or a function of it (called only for layers
        this rank moves rows of, once each)."""
        self._host: list[torch.Tensor] = []
        self.width = cache(widths if callable(widths) else widths.__getitem__)
        me, n_layers = plan.rank, len(plan.layers)
        st, items, ch = plan.sends_to, plan.items, plan.changed_at
        src = items[:, 2]

        self.sends: dict[int, tuple[int, list[Run]]] = {}
        for peer in st[:, 0].unique().tolist():
            rows = st[st[:, 0] == peer]
            self.sends[peer] = self._pack_runs(rows[:, 1], rows[:, 2])
        self.recvs: dict[int, tuple[int, list[Run]]] = {}
        for peer in src[(src >= 0) & (src != me)].unique().tolist():
            self.recvs[peer] = self._pack_runs(items[src == peer, 0], None)
        local = items[src == me]
        self.local = self._pack_runs(local[:, 0], local[:, 3])
        self.changed_layers = ch[:, 0].unique().tolist()

        # Commit: each changed slot takes row `row` of its item's (source, layer) run.
        g = (src + 1) * n_layers + items[:, 0]  # disk items: their own groups, skipped
        order = torch.sort(g, stable=True).indices
        row = torch.empty_like(g)
        row[order] = torch.arange(g.numel()) - torch.searchsorted(g[order], g[order])
        it = torch.searchsorted(items[:, 0] * num_experts + items[:, 1],
                                ch[:, 0] * num_experts + ch[:, 2])
        keep = (src[it] >= 0).nonzero().flatten()
        it = it[keep]
        by = torch.sort(g[it], stable=True).indices
        it, dst = it[by], ch[keep[by], 1]
        starts = {(s, run.li): run for s, (_, runs) in [*self.recvs.items(), (me, self.local)]
                  for run in runs}
        self.scatters: list[tuple[int, Run]] = []  # (source: peer, or me for local, run)
        i = 0
        for key, n in zip(*_runs(g[it])):
            s, li = key // n_layers - 1, key % n_layers
            seg = starts[s, li]
            self.scatters.append((s, self._scatter(seg, dst[i:i + n], row[it[i:i + n]])))
            i += n

        # Backup: changed slots not found among this rank's sent rows.
        self.restores: list[tuple[int, Run]] = []  # (peer whose send buffer holds them, run)
        sent_key = st[:, 1] * (1 << 32) + st[:, 2]
        ch_key = ch[:, 0] * (1 << 32) + ch[:, 1]
        covered = torch.isin(ch_key, sent_key)
        if covered.any():
            srt = torch.sort(sent_key, stable=True)
            pos = srt.indices[torch.searchsorted(srt.values, ch_key[covered])]  # send-list row
            seg_of = [(peer, run) for peer, (_, runs) in self.sends.items() for run in runs]
            seg_start = torch.tensor([0] + [r.nbytes // self.width(r.li) for _, r in seg_of]).cumsum(0)
            seg = torch.searchsorted(seg_start, pos, right=True) - 1
            by = torch.sort(seg, stable=True).indices
            slots, seg, pos = ch[covered, 1][by], seg[by], pos[by]
            i = 0
            for k, n in zip(*_runs(seg)):
                peer, run = seg_of[k]
                self.restores.append((peer, self._scatter(run, slots[i:i + n],
                                                          pos[i:i + n] - seg_start[k])))
                i += n
        rest = ch[~covered]
        self.backup = self._pack_runs(rest[:, 0], rest[:, 1])
        self.index = self._upload(device)

    def _pack_runs(self, li: torch.Tensor, slots: torch.Tensor | None) -> tuple[int, list[Run]]:
        """Per-layer runs of a buffer listing rows of layers `li` (in order); total bytes."""
        runs, off, i = [], 0, 0
        for layer, n in zip(*_runs(li)):
            nbytes = n * self.width(layer)
            idx = None if slots is None else self._add(slots[i:i + n])
            runs.append(Run(layer, off, nbytes, idx))
            off, i = off + nbytes, i + n
        return off, runs

    def _scatter(self, seg: Run, dst: torch.Tensor, rows: torch.Tensor) -> Run:
        k = seg.nbytes // self.width(seg.li)
        in_order = rows.numel() == k and torch.equal(rows, torch.arange(k))
        return Run(seg.li, seg.offset, seg.nbytes, self._add(dst),
                   None if in_order else self._add(rows))

    def _add(self, t: torch.Tensor) -> int:
        self._host.append(t)
        return len(self._host) - 1

    def _upload(self, device) -> list[torch.Tensor]:
        """Every index in one host->device copy (from pinned memory, without a sync)."""
        if not self._host:
            return []
        flat = torch.cat(self._host)
        if torch.device(device).type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        return list(flat.split([t.numel() for t in self._host]))

    def idx(self, pos):
        return None if pos is None else self.index[pos]
