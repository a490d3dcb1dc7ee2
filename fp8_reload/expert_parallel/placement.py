"""Expert-parallel placement: which logical expert each physical slot holds.

`ep_size` ranks each hold `slots_per_rank` physical expert slots per MoE layer;
physical slot ``p`` lives on rank ``p // slots_per_rank`` at local slot
``p % slots_per_rank``. There are at least as many physical slots as logical
experts, so the spare ones hold redundant copies of hot experts (EPLB's
"redundant experts"). A `Placement` is the per-layer physical -> logical table
every rank agrees on; a rank's `FusedMoE` loads only the experts of its own
slots (`expert_slots_for`).

The balancer (`balance_placement`) is the greedy global policy of DeepSeek's
EPLB, written here from its description: give extra replicas, one at a time, to
the expert with the highest load per replica; then bin-pack the replicas onto
ranks, heaviest first, each onto the least-loaded rank that still has a free
slot (and does not already hold that expert, when it can). Ties go to the rank
that already held the expert, and each rank keeps its experts in the slots they
occupied, so a rebalance moves as few experts as the new balance allows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class Placement:
    """Physical -> logical expert table for each MoE layer of an expert-parallel model.

    `table[i, p]` is the logical expert held by physical slot ``p`` of MoE layer
    ``layers[i]``. Every physical slot holds an expert and every logical expert
    has at least one replica (a fresh load then defines every byte of a rank).
    """

    layers: tuple[int, ...]
    num_experts: int
    ep_size: int
    slots_per_rank: int
    table: torch.Tensor  # [len(layers), ep_size * slots_per_rank] int64, CPU
    # Values derived from the (immutable) table, computed once: dispatch tables, fingerprint.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # The table's bytes as built: the dataclass is frozen, its tensor is not (see `check_unedited`).
    _built: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        # its own copy: a caller's tensor edited later must not change a placement in use
        object.__setattr__(self, "table", torch.tensor(self.table, dtype=torch.long, device="cpu")
                           if not isinstance(self.table, torch.Tensor) else
                           self.table.detach().to("cpu", torch.long, copy=True).contiguous())
        self.validate()
        object.__setattr__(self, "_built", self.table.numpy().tobytes())

    def __getstate__(self):  # derived values may live on a GPU: never pickle them
        return {k: v for k, v in self.__dict__.items() if k != "_derived"}

    def __setstate__(self, state):
        self.__dict__.update(state, _derived={})
        if "_built" not in state:  # (pickled before placements kept their bytes)
            self.__dict__["_built"] = self.table.numpy().tobytes()

    def derived(self, key, build: Callable):
        """`build()`, computed once per placement and `key` (placements are immutable)."""
        try:
            return self._derived[key]
        except KeyError:
            self.check_unedited()  # a value built from an edited table would describe other slots
            value = self._derived[key] = build()
            return value

    def check_unedited(self, what: str = "the placement") -> None:
        """ValueError if `table` was changed in place since it was built.

        A placement describes what the ranks' slots hold; its tensor can still be written
        (``p.table[0, 0] = 3``), and ranks that cached its fingerprint or dispatch tables
        would then act on different layouts. Build a new Placement instead."""
        t = self.table  # (a new shape, dtype or layout over the same bytes is an edit too)
        if (t.dtype != torch.long or t.device.type != "cpu" or not t.is_contiguous()
                or tuple(t.shape) != (len(self.layers), self.num_physical)
                or t.numpy().tobytes() != self._built):
            raise ValueError(f"{what}'s table was changed in place after it was built; a "
                             f"Placement is immutable: build a new one (Placement(..., table=...)) "
                             f"for another layout")

    def fingerprint(self) -> int:
        """A 63-bit digest of layout and table (as built): ranks compare it to agree on a placement."""
        value = self._derived.get("fingerprint")  # (of the bytes as built: no edit check)
        if value is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(repr((self.layers, self.num_experts, self.ep_size, self.slots_per_rank)).encode())
            h.update(self._built)
            value = self._derived["fingerprint"] = int.from_bytes(h.digest(), "little") & (2**63 - 1)
        return value

    # ----- construction -----
    @classmethod
    def round_robin(cls, layers: Iterable[int], num_experts: int, ep_size: int,
                    slots_per_rank: int | None = None) -> Placement:
        """The static start layout: physical slot p holds expert p mod num_experts.

        Experts are split into contiguous blocks across ranks and the spare slots
        wrap around to the first experts. `slots_per_rank` defaults to
        ``ceil(num_experts / ep_size)`` (no redundancy beyond rounding).
        """
        layers = tuple(layers)
        s = slots_per_rank if slots_per_rank is not None else default_slots_per_rank(
            num_experts, ep_size, redundant=0)  # (0 is refused by `validate`, not replaced)
        row = torch.arange(ep_size * s) % num_experts
        return cls(layers, num_experts, ep_size, s, row.repeat(len(layers), 1))

    @classmethod
    def from_rank_slots(cls, num_experts: int, slots: Mapping[int, Sequence[Sequence[int]]]
                        ) -> Placement:
        """From ``{layer: [[experts of rank 0's slots], [rank 1's], ...]}``."""
        layers = tuple(sorted(slots))
        if not layers:
            raise ValueError("from_rank_slots needs at least one layer")
        per_rank = [len(r) for r in slots[layers[0]]]
        for layer in layers:  # every layer alike: the table is read back by these sizes
            sizes = [len(r) for r in slots[layer]]
            if len(set(sizes)) != 1 or sizes != per_rank:
                raise ValueError(f"every rank of every layer needs the same number of slots: layer "
                                 f"{layers[0]} has {per_rank}, layer {layer} {sizes}")
        table = torch.tensor([[e for rank in slots[layer] for e in rank] for layer in layers])
        return cls(layers, num_experts, len(per_rank), per_rank[0], table)

    def validate(self) -> None:
        p = self.ep_size * self.slots_per_rank
        if self.ep_size < 1 or self.slots_per_rank < 1:
            raise ValueError("ep_size and slots_per_rank must be >= 1")
        if len(set(self.layers)) != len(self.layers):  # a row per layer: another would never be read
            raise ValueError(f"layers {list(self.layers)} name a layer twice")
        if self.table.shape != (len(self.layers), p):
            raise ValueError(f"table has shape {tuple(self.table.shape)}, expected "
                             f"({len(self.layers)}, {p}) = (layers, ep_size * slots_per_rank)")
        if p < self.num_experts:
            raise ValueError(f"{self.ep_size} ranks x {self.slots_per_rank} slots = {p} physical "
                             f"slots cannot hold {self.num_experts} experts")
        if self.table.numel() and (int(self.table.min()) < 0 or int(self.table.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        if self.table.numel():
            held = self.replicas()
            for i in (held == 0).any(1).nonzero().flatten().tolist():
                missing = (held[i] == 0).nonzero().flatten().tolist()
                raise ValueError(f"layer {self.layers[i]}: experts {missing} have no replica")

    def check_fits(self, config) -> None:
        """ValueError unless this placement is one of `config`'s experts and MoE layers (a
        slot of an expert the checkpoint lacks would keep whatever its memory held)."""
        moe = list(config.moe_layers)
        if self.num_experts != config.num_experts or sorted(self.layers) != sorted(moe):
            raise ValueError(f"the placement places {self.num_experts} experts in MoE layers "
                             f"{list(self.layers)}; the checkpoint has {config.num_experts} experts "
                             f"in MoE layers {moe}")

    # ----- queries -----
    @property
    def num_physical(self) -> int:
        return self.ep_size * self.slots_per_rank

    def row(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s physical -> logical row (every per-layer query reads it)."""
        self.check_unedited()
        try:
            return self.table[self.layers.index(layer)]
        except ValueError:
            raise KeyError(f"layer {layer} is not an MoE layer of this placement "
                           f"(layers {list(self.layers)})") from None

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """Logical expert of each local slot of `rank` in `layer`."""
        s = self.slots_per_rank
        return self.row(layer)[rank * s:(rank + 1) * s].tolist()

    def local_slots(self, layer: int, rank: int) -> dict[int, list[int]]:
        """``{logical expert: [local slots]}`` of `rank` in `layer` (FusedMoE's `expert_slots`)."""
        out: dict[int, list[int]] = {}
        for slot, e in enumerate(self.rank_experts(layer, rank)):
            out.setdefault(e, []).append(slot)
        return out

    def expert_slots_for(self, rank: int) -> Callable[[int], dict[int, list[int]]]:
        """`layer_id -> {logical: [local slots]}` for `load_model(..., expert_slots=...)`."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.ep_size})")
        return lambda layer_id: self.local_slots(layer_id, rank)

    def model_kwargs(self, rank: int) -> dict:
        """The FusedMoE keyword arguments that load `rank`'s share of the experts."""
        return {"num_local_experts": self.slots_per_rank, "expert_slots": self.expert_slots_for(rank)}

    def logical_to_physical(self, layer: int) -> dict[int, list[int]]:
        """``{logical expert: [physical slots]}``: the dispatch map of `layer`."""
        out: dict[int, list[int]] = {}
        for p, e in enumerate(self.row(layer).tolist()):
            out.setdefault(e, []).append(p)
        return out

    def replicas(self) -> torch.Tensor:
        """[layers, num_experts] replica count of each logical expert."""
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.long)
        return counts.scatter_add_(1, self.table, torch.ones_like(self.table))

    def rank_load(self, load: torch.Tensor) -> torch.Tensor:
        """[layers, ep_size] load each rank serves when tokens split evenly over replicas."""
        load = _as_load(load, self)
        per_replica = load / self.replicas().to(load.dtype)
        per_slot = per_replica.gather(1, self.table)
        return per_slot.view(len(self.layers), self.ep_size, self.slots_per_rank).sum(-1)

    def imbalance(self, load: torch.Tensor) -> torch.Tensor:
        """[layers] max rank load / mean rank load (1.0 is perfect balance)."""
        r = self.rank_load(load)
        mean = r.mean(dim=1)
        return torch.where(mean > 0, r.amax(dim=1) / mean.clamp(min=1e-30), torch.ones_like(mean))

    def moved_slots(self, other: Placement) -> int:
        """Physical slots whose expert differs between two placements of one layout."""
        self._check_same_layout(other)
        return int((self.table != other.table).sum())

    def _check_same_layout(self, other: Placement) -> None:
        mine = (self.layers, self.num_experts, self.ep_size, self.slots_per_rank)
        theirs = (other.layers, other.num_experts, other.ep_size, other.slots_per_rank)
        if mine != theirs:
            raise ValueError(f"placements of different layouts: (layers, experts, ep_size, "
                             f"slots_per_rank) {mine} vs {theirs}")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.layers, self.num_experts, self.ep_size, self.slots_per_rank, self._built) == \
            (other.layers, other.num_experts, other.ep_size, other.slots_per_rank, other._built)

    def __hash__(self):  # (of the table as built, as `fingerprint`)
        return hash((self.layers, self.num_experts, self.ep_size, self.slots_per_rank, self._built))

    def describe(self, rank: int | None = None) -> str:
        lines = []
        for layer in self.layers:
            ranks = range(self.ep_size) if rank is None else [rank]
            cells = " | ".join(f"r{r}: {self.rank_experts(layer, r)}" for r in ranks)
            lines.append(f"layer {layer}: {cells}")
        return "\n".join(lines)


def default_slots_per_rank(num_experts: int, ep_size: int, redundant: int = 1) -> int:
    """Slots per rank that hold every expert plus `redundant` spare slots per rank."""
    return math.ceil(num_experts / ep_size) + redundant


def _as_load(load, placement: Placement) -> torch.Tensor:
    load = torch.as_tensor(load, dtype=torch.float64).cpu()
    if load.dim() == 1:
        load = load.expand(len(placement.layers), -1)
    if load.shape != (len(placement.layers), placement.num_experts):
        raise ValueError(f"load has shape {tuple(load.shape)}, expected "
                         f"({len(placement.layers)}, {placement.num_experts}) = (layers, experts)")
    if bool((load < 0).any()) or not bool(torch.isfinite(load).all()):
        raise ValueError("load must be finite and non-negative")
    return load


# --------------------------------------------------------------------------
# Balancer
# --------------------------------------------------------------------------

def replicate(load: Sequence[float], num_physical: int, max_replicas: int) -> list[int]:
    """Replica count per expert: one each, then each spare slot to the expert with
    the highest load per replica (lowest id on ties), at most `max_replicas` each."""
    n = len(load)
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} experts")
    if n * max_replicas < num_physical:
        raise ValueError(f"{num_physical} slots need more than {max_replicas} replicas per expert")
    count = [1] * n
    for _ in range(num_physical - n):
        best = max((e for e in range(n) if count[e] < max_replicas),
                   key=lambda e: (load[e] / count[e], -e))
        count[best] += 1
    return count


def pack(load: Sequence[float], count: Sequence[int], ep_size: int, slots_per_rank: int,
         previous: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Greedy bin-packing of replicas onto ranks; returns each rank's local slots.

    Replicas (weight ``load[e] / count[e]``) go heaviest first to the rank with the
    least load among those with a free slot, preferring ranks that do not hold
    the expert yet; ties prefer the rank that held the expert in `previous`.
    Each rank then keeps its experts in the slots they already occupied.
    """
    items = sorted(((load[e] / count[e], e) for e in range(len(load)) for _ in range(count[e])),
                   key=lambda t: (-t[0], t[1]))
    held_before = [set(r) for r in previous] if previous is not None else [set() for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    chosen: list[list[int]] = [[] for _ in range(ep_size)]
    for weight, e in items:
        free = [r for r in range(ep_size) if len(chosen[r]) < slots_per_rank]
        best = min(free, key=lambda r: (e in chosen[r], rank_load[r], e not in held_before[r], r))
        chosen[best].append(e)
        rank_load[best] += weight
    if previous is None:
        return [sorted(c) for c in chosen]
    return [keep_slots(previous[r], chosen[r]) for r in range(ep_size)]


def keep_slots(old: Sequence[int], new_experts: Iterable[int]) -> list[int]:
    """Assign the multiset `new_experts` to slots, leaving experts where they were.

    A slot keeps its expert if the rank still holds (a replica of) it; freed
    slots take the remaining experts in ascending order, lowest slot first.
    """
    remaining: dict[int, int] = {}
    for e in new_experts:
        remaining[e] = remaining.get(e, 0) + 1
    if sum(remaining.values()) != len(old):
        raise ValueError(f"{sum(remaining.values())} experts for {len(old)} slots")
    slots: list[int | None] = [None] * len(old)
    for s, e in enumerate(old):
        if remaining.get(e, 0):
            slots[s] = e
            remaining[e] -= 1
    rest = iter(sorted(e for e, n in remaining.items() for _ in range(n)))
    return [e if e is not None else next(rest) for e in slots]


def balance_placement(load, old: Placement) -> Placement:
    """The rebalanced placement for per-expert `load` ([layers, experts] or [experts]).

    Same layout as `old` (layers, ranks, slots per rank); see the module docstring
    for the policy. A layer the policy cannot improve (its busiest rank would not
    get lighter) keeps its old placement.
    """
    load = _as_load(load, old)
    s, r = old.slots_per_rank, old.ep_size
    cap = max(r, math.ceil(old.num_physical / old.num_experts))
    rows = []
    for i, layer in enumerate(old.layers):
        weights = load[i].tolist()
        count = replicate(weights, old.num_physical, max_replicas=cap)
        previous = [old.rank_experts(layer, k) for k in range(r)]
        per_rank = pack(weights, count, r, s, previous)
        rows.append([e for rank in per_rank for e in rank])
    new = Placement(old.layers, old.num_experts, r, s, torch.tensor(rows))
    # A layer keeps its old placement unless the new one lowers its busiest rank's load:
    # moving experts for no gain only costs transfer time.
    worse = new.rank_load(load).amax(1) >= old.rank_load(load).amax(1)
    if bool(worse.any()):
        table = torch.where(worse[:, None], old.table, new.table)
        new = Placement(old.layers, old.num_experts, r, s, table)
    return new
