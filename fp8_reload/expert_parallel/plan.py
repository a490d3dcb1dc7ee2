"""The rebalance plan: what every rank changes and where each new expert comes from.

Per rank: the local slots whose expert changes and, per layer, each logical
expert the rank must obtain and from where: a *local* copy (the rank already
holds it in another slot), a *peer* that holds it (P2P), or *disk*. ``p2p``
takes everything from peers, ``disk`` everything the rank lacks from the
checkpoint, ``hybrid`` from peers when a usable peer holds it and from disk
otherwise. Every rank computes the same plan from the same inputs.

A `RankPlan` is three small index tensors; the rebalance reads them directly, so
planning costs a fixed number of tensor ops whatever the number of layers and
experts. The dict views (`changed`, `fetch`, `sends`, `recvs`) are built on first
use, for reports and tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from .placement import Placement

MODES = ("p2p", "disk", "hybrid")


@dataclass(frozen=True)
class Fetch:
    """How one rank obtains one logical expert of one layer."""

    layer: int
    expert: int
    source: str  # "local" | "peer" | "disk"
    src_rank: int = -1  # the rank holding it (itself for "local")
    src_slot: int = -1  # its local slot there


@dataclass(eq=False)
class RankPlan:
    """One rank's part of a plan. Layers are indices into `layers`; orders are the plan's
    (both ends of an exchange list the same items in the same order)."""

    rank: int
    layers: tuple[int, ...]
    changed_at: torch.Tensor  # [n, 3] (layer, slot, new expert), in (layer, slot) order
    # [m, 4] (layer, expert, source rank or -1: disk, source slot or -1), (layer, expert) order
    items: torch.Tensor
    sends_to: torch.Tensor  # [k, 3] (peer, layer, slot), in (peer, layer, expert) order

    @property
    def slots_changed(self) -> int:
        return self.changed_at.shape[0]

    def _kind(self, src: int) -> str:
        return "local" if src == self.rank else "disk" if src < 0 else "peer"

    def count(self, source: str) -> int:
        src = self.items[:, 2]
        mask = {"local": src == self.rank, "disk": src < 0}.get(source, (src >= 0) & (src != self.rank))
        return int(mask.sum())

    @cached_property
    def changed(self) -> dict[int, dict[int, int]]:
        """layer -> {slot: new expert}"""
        out: dict[int, dict[int, int]] = {}
        for li, slot, x in self.changed_at.tolist():
            out.setdefault(self.layers[li], {})[slot] = x
        return out

    @cached_property
    def fetch(self) -> dict[int, dict[int, Fetch]]:
        """layer -> {expert: Fetch}"""
        out: dict[int, dict[int, Fetch]] = {}
        for li, x, src, slot in self.items.tolist():
            layer = self.layers[li]
            out.setdefault(layer, {})[x] = Fetch(layer, x, self._kind(src), src, slot)
        return out

    @cached_property
    def sends(self) -> dict[int, list[tuple[int, int]]]:
        """peer -> [(layer, slot)] this rank sends it"""
        out: dict[int, list[tuple[int, int]]] = {}
        for peer, li, slot in self.sends_to.tolist():
            out.setdefault(peer, []).append((self.layers[li], slot))
        return out

    @cached_property
    def recvs(self) -> dict[int, list[tuple[int, int]]]:
        """peer -> [(layer, expert)] this rank receives from it"""
        out: dict[int, list[tuple[int, int]]] = {}
        for li, x, src, _ in self.items[_by_source(self.items, self.rank)].tolist():
            out.setdefault(src, []).append((self.layers[li], x))
        return out

    def disk_experts(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for li, x, _, _ in self.items[self.items[:, 2] < 0].tolist():
            out.setdefault(self.layers[li], []).append(x)
        return out


def _by_source(items: torch.Tensor, rank: int) -> torch.Tensor:
    """Indices of the items received from peers, grouped by peer (stable: plan order)."""
    src = items[:, 2]
    peer = ((src >= 0) & (src != rank)).nonzero().flatten()
    return peer[torch.sort(src[peer], stable=True).indices]


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
              exclude_sources: Iterable[int] = ()) -> RebalancePlan:
        """The plan of every rank, from whole-model tensor ops over the [layers, ranks,
        slots] tables: a fixed number of ops whatever the number of layers or moves.
        Peers serving an expert are chosen greedily in (layer, rank, expert) order,
        each time the candidate that has served the fewest so far."""
        if mode not in MODES:
            raise ValueError(f"unknown rebalance mode {mode!r}; choose one of {', '.join(MODES)}")
        old._check_same_layout(new)
        excluded = frozenset(int(r) for r in exclude_sources)
        n_layers, r, s, e = len(old.layers), old.ep_size, old.slots_per_rank, old.num_experts
        before = old.table.view(n_layers, r, s)
        after = new.table.view(n_layers, r, s)

        # Changed slots, in (layer, rank, slot) order, and the distinct experts each
        # (layer, rank) must obtain, in (layer, rank, expert) order.
        where = (before != after).nonzero()
        wanted = after[where[:, 0], where[:, 1], where[:, 2]]
        key = torch.unique((where[:, 0] * r + where[:, 1]) * e + wanted)
        item_layer, item_rank, item_expert = key // (r * e), key // e % r, key % e
        # first[l, k, x]: the first slot of rank k holding expert x in layer l (s: none)
        first = torch.full((n_layers, r, e), s, dtype=torch.long).scatter_reduce_(
            2, before, torch.arange(s).expand(n_layers, r, s), "amin")
        n = key.numel()
        held = first[item_layer, :, item_expert] < s  # [items, ranks]
        local = held[torch.arange(n), item_rank]
        peer = held.clone()
        peer[torch.arange(n), item_rank] = False
        if excluded:
            peer[:, sorted(k for k in excluded if 0 <= k < r)] = False
        served = cls._serve(local, peer, mode, item_layer, item_expert, old.layers, excluded)
        src_rank = torch.where(local, item_rank, served)
        src_slot = first[item_layer, src_rank.clamp(min=0), item_expert].masked_fill(src_rank < 0, -1)

        changed_at = torch.stack([where[:, 0], where[:, 2], wanted], 1)
        items = torch.stack([item_layer, item_expert, src_rank, src_slot], 1)
        sent = torch.stack([item_rank, item_layer, src_slot], 1)
        ranks = []
        for k in range(r):
            out = sent[served == k]
            ranks.append(RankPlan(k, old.layers, changed_at[where[:, 1] == k],
                                  items[item_rank == k],
                                  out[torch.sort(out[:, 0], stable=True).indices]))
        return cls(old, new, mode, excluded, ranks)

    @staticmethod
    def _serve(local, peer, mode, item_layer, item_expert, layers, excluded) -> torch.Tensor:
        """The serving peer of each item (-1: local or disk). Items with one candidate
        are decided at once; the rest greedily, counting what each peer served before."""
        n_items, n_ranks = peer.shape
        source = torch.full((n_items,), -1, dtype=torch.long)
        if mode == "disk" or not n_items:
            return source
        need = ~local
        n_cand = peer.sum(1)
        orphan = need & (n_cand == 0)
        if mode == "p2p" and bool(orphan.any()):
            i = int(orphan.nonzero()[0])
            raise ValueError(f"layer {layers[int(item_layer[i])]}: expert {int(item_expert[i])} "
                             f"is held only by excluded ranks {sorted(excluded)}; use mode "
                             "'hybrid' or 'disk'")
        single = need & (n_cand == 1)
        source[single] = peer[single].int().argmax(1)
        multi = (need & (n_cand > 1)).nonzero().flatten().tolist()
        if not multi:
            return source
        served_before = torch.zeros(n_items, n_ranks, dtype=torch.long)
        served_before[single, source[single]] = 1
        served_before = (served_before.cumsum(0) - served_before)[multi].tolist()
        extra = [0] * n_ranks
        for i, before in zip(multi, served_before):
            cands = peer[i].nonzero().flatten().tolist()
            src = min(cands, key=lambda k: (before[k] + extra[k], k))
            extra[src] += 1
            source[i] = src
        return source

    def summary(self) -> str:
        parts = [f"r{p.rank}: {p.slots_changed} slots, {p.count('local')} local / "
                 f"{p.count('peer')} p2p / {p.count('disk')} disk" for p in self.ranks]
        return f"[{self.mode}] " + "; ".join(parts)
