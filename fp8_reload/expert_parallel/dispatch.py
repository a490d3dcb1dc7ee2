"""Which physical replica computes each routed token, and which tokens a rank owns.

With data-parallel attention every rank holds its own tokens: rank ``r`` owns a
contiguous block of the global batch (`owned_tokens`). The gate sends each
token to ``top_k`` logical experts; a (token, expert) pair must then be
computed by one physical replica of that expert. The policy
(`choose_replicas`) is deterministic and needs no communication:

* a pair goes to a replica on the token's own rank when that rank holds the
  expert (no transfer at all); if it holds several, the token's index picks one
  round-robin;
* otherwise to replica ``(rank + token index) mod replicas`` of the expert, its
  replicas taken in physical-slot order: the pairs spread evenly over them.

When the ranks hold equally many tokens drawn from one routing distribution and
no rank holds two replicas of an expert (the balancer avoids it), every replica
of an expert then receives the same share of its tokens in expectation: tokens
of the holding ranks stay home, the others spread evenly. That is the even
split `Placement.rank_load` and `balance_placement` assume, so the measured
tokens per rank follow the balancer's prediction.

The lookup tables are built once per (placement, layer, rank, device) and
cached on the placement, so choosing replicas is a few gathers on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import Placement


def owned_tokens(num_tokens: int, world: int, rank: int) -> slice:
    """Rank `rank`'s contiguous block of a global batch of `num_tokens` (sizes differ by <= 1)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    return slice(rank * num_tokens // world, (rank + 1) * num_tokens // world)


@dataclass(frozen=True)
class ReplicaTables:
    """One layer's replicas, as gather tables on one device.

    ``replicas[e, i]`` is the i-th physical slot holding expert ``e`` (``count[e]``
    of them, the rest padding); ``local[e, i]`` / ``local_count[e]`` the same for the
    slots on one rank.
    """

    replicas: torch.Tensor  # [E, max replicas] int64 physical slots
    count: torch.Tensor  # [E] int64
    local: torch.Tensor  # [E, max local replicas] int64 physical slots on the rank
    local_count: torch.Tensor  # [E] int64


def _group(slots: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Physical `slots` grouped by their expert in slot order: ([E, width] table, [E] counts)."""
    count = torch.bincount(experts, minlength=num_experts)
    width = max(1, int(count.max())) if experts.numel() else 1
    order = torch.argsort(experts, stable=True)
    by_expert, slots = experts[order], slots[order]
    start = torch.cumsum(count, 0) - count
    pos = torch.arange(by_expert.numel()) - start[by_expert]
    table = torch.zeros(num_experts, width, dtype=torch.long)
    table[by_expert, pos] = slots
    return table, count


def replica_tables(placement: Placement, layer: int, rank: int, device) -> ReplicaTables:
    """The tables of `layer` as seen from `rank`, on `device` (cached on the placement)."""
    device = torch.device(device)

    def build() -> ReplicaTables:
        row = placement.row(layer)
        physical = torch.arange(row.numel())
        replicas, count = _group(physical, row, placement.num_experts)
        mine = physical // placement.slots_per_rank == rank
        local, local_count = _group(physical[mine], row[mine], placement.num_experts)
        return ReplicaTables(*(t.to(device) for t in (replicas, count, local, local_count)))

    return placement.derived(("replicas", layer, rank, str(device)), build)


def choose_replicas(placement: Placement, layer: int, rank: int, topk_ids: torch.Tensor
                    ) -> torch.Tensor:
    """Physical slot [tokens, top_k] computing each (token, expert) pair of `rank`'s tokens.

    `topk_ids` are logical experts of `layer` for the tokens `rank` owns, row i being
    the rank's i-th token; the policy is the module docstring's.
    """
    t = replica_tables(placement, layer, rank, topk_ids.device)
    ids = topk_ids.long()
    token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    n_local = t.local_count[ids]
    home = t.local[ids, token % n_local.clamp(min=1)]
    anywhere = t.replicas[ids, (rank + token) % t.count[ids]]
    return torch.where(n_local > 0, home, anywhere)
