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


