"""Synthetic expert-parallel workloads: skewed expert loads and routings, controlled moves.

Real EPLB statistics are skewed: a few experts of each layer take most tokens,
and which ones differs per layer. Zipf(alpha) over a per-layer random order of
the experts models that (`zipf_popularity`); `synthetic_load` draws per-expert
counts from it, `skewed_routing` draws a router's top-k choices, and
`move_experts` builds a placement that moves an exact number of experts (the
benchmarks' control variable).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .placement import Placement


def synthetic_load(layers: Sequence[int], num_experts: int, seed: int = 0, alpha: float = 1.2,
                   tokens: int = 8192) -> torch.Tensor:
    """Skewed per-expert token counts [layers, experts]: Zipf(alpha) over a
    per-layer random order of experts, plus multinomial sampling noise.

    Deterministic in (seed, layers, num_experts): ranks draw with their own seed
    and sum (all-reduce) the counts, as EPLB's statistics are gathered.
    """
    rows = []
    for layer in layers:
        p, g = zipf_popularity(layer, num_experts, seed, alpha)
        counts = torch.bincount(torch.multinomial(p, tokens, replacement=True, generator=g),
                                minlength=num_experts)
        rows.append(counts.to(torch.float64))
    return torch.stack(rows)


def zipf_popularity(layer: int, num_experts: int, seed: int, alpha: float
                    ) -> tuple[torch.Tensor, torch.Generator]:
    """Zipf(alpha) weights [experts] over a random order of the experts that depends only on
    (seed, layer): every rank sees the same hot experts, as a real model's gate would give.
    Returns the weights and the generator that drew the order (to draw samples on)."""
    g = torch.Generator().manual_seed(seed * 100_003 + int(layer))
    order = torch.randperm(num_experts, generator=g)
    p = torch.empty(num_experts, dtype=torch.float64)
    p[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** alpha
    return p, g


def move_experts(old: Placement, per_layer: int, seed: int = 0) -> Placement:
    """A placement that differs from `old` in exactly `2 * per_layer` physical slots
    of each layer: `per_layer` disjoint pairs of slots on different ranks, holding
    different experts, swap contents (each pair moves two experts across ranks).

    The benchmarks use it to control how many experts a rebalance moves.
    """
    if per_layer == 0:
        return old
    if old.ep_size < 2:
        raise ValueError("moving experts across ranks needs ep_size >= 2")
    g = torch.Generator().manual_seed(seed)
    rows = old.table.clone()
    s = old.slots_per_rank
    for i in range(len(old.layers)):
        row = rows[i]
        used: set[int] = set()
        order = torch.randperm(old.num_physical, generator=g).tolist()
        pairs = 0
        for a in order:
            if pairs == per_layer:
                break
            if a in used:
                continue
            partner = next((b for b in order if b not in used and b != a and b // s != a // s
                            and int(row[b]) != int(row[a])
                            and int(row[b]) not in row[(a // s) * s:(a // s + 1) * s].tolist()
                            and int(row[a]) not in row[(b // s) * s:(b // s + 1) * s].tolist()),
                           None)
            if partner is None:
                continue
            row[a], row[partner] = int(row[partner]), int(row[a])
            used.update((a, partner))
            pairs += 1
        if pairs < per_layer:
            raise ValueError(f"cannot move {per_layer} expert pairs in layer {old.layers[i]} "
                             f"({pairs} possible)")
    return Placement(old.layers, old.num_experts, old.ep_size, s, rows)


def skewed_routing(num_tokens: int, num_experts: int, top_k: int, layer: int, seed: int = 0,
                   alpha: float = 1.2, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output for `num_tokens` tokens of one rank, skewed over experts:
    (weights float32 [tokens, top_k] summing to 1 per token, expert ids int64 [tokens, top_k]).

    Each token picks `top_k` distinct experts with probabilities Zipf(alpha) over the
    order `zipf_popularity(layer, ..., seed)` gives, so every rank has the same hot
    experts; `rank` only changes which tokens draw what. Deterministic in all arguments.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts}], got {top_k}")
    p, _ = zipf_popularity(layer, num_experts, seed, alpha)
    g = torch.Generator().manual_seed((seed * 100_003 + int(layer)) * 1_009 + 7919 * (rank + 1))
    if num_tokens == 0:
        return torch.empty(0, top_k), torch.empty(0, top_k, dtype=torch.long)
    ids = torch.multinomial(p.expand(num_tokens, -1), top_k, replacement=False, generator=g)
    w = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float64) + 0.25
    return (w / w.sum(1, keepdim=True)).to(torch.float32), ids


def routing_load(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [experts] (float64): EPLB's statistic of one layer."""
    return torch.bincount(topk_ids.reshape(-1).cpu(), minlength=num_experts).to(torch.float64)
