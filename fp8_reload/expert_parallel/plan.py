"""The rebalance plan: what every rank changes and where each new expert comes from.

Per rank: the local slots whose expert changes and, per layer, each logical
expert the rank must obtain and from where: a *local* copy (the rank already
holds it in another slot), a *peer* that holds it (P2P), or *disk*. ``p2p``
takes everything from peers, ``disk`` everything the rank lacks from the
checkpoint, ``hybrid`` from peers when a usable peer holds it and from disk
otherwise. Every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
              exclude_sources: Iterable[int] = ()) -> RebalancePlan:
        """The plan of every rank, from whole-model tensor ops over the [layers, ranks,
        slots] tables: planning costs one pass over the changed slots, whatever the
        number of layers. Peers serving an expert are chosen greedily in (layer, rank,
        expert) order, each time the candidate that has served the fewest so far."""
        excluded = frozenset(int(r) for r in exclude_sources)
        ranks = cls._plans(old, new, mode, excluded, None)
        return cls(old, new, mode, excluded, ranks)

    @classmethod
    def for_rank(cls, old: Placement, new: Placement, mode: str, exclude_sources: Iterable[int],
                 rank: int) -> RankPlan:
        """``build(...).ranks[rank]``, without making the other ranks' plans (what a
        rebalance needs: the choices are whole-model tensor ops either way, so every rank
        still makes the same ones, and fails alike)."""
        excluded = frozenset(int(r) for r in exclude_sources)
        return cls._plans(old, new, mode, excluded, rank)[rank]

    @classmethod
    def _plans(cls, old: Placement, new: Placement, mode: str, excluded: frozenset,
               only: int | None) -> list[RankPlan]:
        """Every rank's plan (`only`: that rank's alone, the others left empty)."""
        if mode not in MODES:
            raise ValueError(f"unknown rebalance mode {mode!r}; choose one of {', '.join(MODES)}")
        old._check_same_layout(new)
        n_layers, r, s, e = len(old.layers), old.ep_size, old.slots_per_rank, old.num_experts
        before = old.table.view(n_layers, r, s)
        after = new.table.view(n_layers, r, s)
        ranks = [RankPlan(k) for k in range(r)]

        # Changed slots, in (layer, rank, slot) order, and the distinct experts each
        # (layer, rank) must obtain, in (layer, rank, expert) order.
        where = (before != after).nonzero()
        wanted = after[where[:, 0], where[:, 1], where[:, 2]]
        key = torch.unique((where[:, 0] * r + where[:, 1]) * e + wanted)
        item_layer, item_rank, item_expert = key // (r * e), key // e % r, key % e
        # first[l, k, x]: the first slot of rank k holding expert x in layer l (s: none)
        first = old.derived("first_slot", lambda: torch.full((n_layers, r, e), s, dtype=torch.long)
                            .scatter_reduce_(2, before, torch.arange(s).expand(n_layers, r, s), "amin"))
        held = first[item_layer, :, item_expert] < s  # [items, ranks]
        local = held[torch.arange(key.numel()), item_rank]
        peer = held.clone()
        peer[torch.arange(key.numel()), item_rank] = False
        if excluded:
            peer[:, sorted(k for k in excluded if 0 <= k < r)] = False
        source = cls._serve(local, peer, mode, item_layer, item_expert, old.layers, excluded)
        src_slot = first[item_layer, torch.where(local, item_rank, source.clamp(min=0)), item_expert]
        if only is not None:  # this rank's changed slots, and the items it obtains or serves
            where, wanted = where[where[:, 1] == only], wanted[where[:, 1] == only]
            keep = (item_rank == only) | (source == only)
            item_layer, item_rank, item_expert = item_layer[keep], item_rank[keep], item_expert[keep]
            local, source, src_slot = local[keep], source[keep], src_slot[keep]

        layers = old.layers
        for (li, k, slot), x in zip(where.tolist(), wanted.tolist()):
            ranks[k].changed.setdefault(layers[li], {})[slot] = x
        for li, k, x, is_local, src, slot in zip(item_layer.tolist(), item_rank.tolist(),
                                                  item_expert.tolist(), local.tolist(),
                                                  source.tolist(), src_slot.tolist()):
            layer = layers[li]
            if only is not None and k != only:  # an expert this rank serves to rank k
                ranks[src].sends.setdefault(k, []).append((layer, slot))
                continue
            if is_local:
                f = Fetch(layer, x, "local", k, slot)
            elif src < 0:
                f = Fetch(layer, x, "disk")
            else:
                f = Fetch(layer, x, "peer", src, slot)
                ranks[src].sends.setdefault(k, []).append((layer, slot))
                ranks[k].recvs.setdefault(src, []).append((layer, x))
            ranks[k].fetch.setdefault(layer, {})[x] = f
        return ranks

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
        if not multi:  # (always so with 2 ranks) no choice to balance
            return source
        served_before = torch.zeros(n_items, n_ranks, dtype=torch.long)
        served_before[single, source[single]] = 1
        served_before = (served_before.cumsum(0) - served_before)[multi].tolist()
        extra = [0] * n_ranks
        for j, i in enumerate(multi):
            cands = peer[i].nonzero().flatten().tolist()
            src = min(cands, key=lambda k: (served_before[j][k] + extra[k], k))
            extra[src] += 1
            source[i] = src
        return source

    def summary(self) -> str:
        parts = [f"r{p.rank}: {p.slots_changed} slots, {p.count('local')} local / "
                 f"{p.count('peer')} p2p / {p.count('disk')} disk" for p in self.ranks]
        return f"[{self.mode}] " + "; ".join(parts)
