"""What each rank of `fp8-reload rebalance` runs (picklable for spawn, importable under torchrun).

Per (checkpoint kind, mode): load the rank's share under a round-robin placement;
draw a skewed (Zipf) routing for the rank's own tokens in every MoE layer and
all-reduce its per-expert counts (EPLB's statistics); run the expert-parallel
forward on that routing; rebalance to the balancer's placement for those counts;
check the rank's state against a fresh load under the new placement; run the
same forward again. Both forwards are compared with the single-device forward
of the same checkpoint, and report tokens and MoE time per rank.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checkpoint import Checkpoint, ensure_checkpoint
from ..expert_parallel import (
    EPForwardStats,
    Placement,
    balance_placement,
    default_slots_per_rank,
    ep_moe_forward,
    load_rank_model,
    owned_tokens,
    rebalance,
    routing_load,
    skewed_routing,
    warm_up_p2p,
)
from ..expert_parallel.group import comm_device
from ..reload import load_model
from ..state import compare_states, object_serial, snapshot
from ..testing.numeric import calc_diff


@dataclass
class DemoSpec:
    """What each rank of `fp8-reload rebalance` runs."""

    checkpoints: dict  # kind -> checkpoint dir (written by each node's first rank if missing)
    preset: str
    num_layers: int | None
    modes: list
    slots_per_rank: int | None = None
    exclude_sources: tuple = ()  # applied to hybrid runs
    seed: int = 0
    alpha: float = 1.2
    check: bool = True
    tokens: int = 256  # per rank
    moe_backend: str | None = None
    forward_bound: float = 4e-3


def param_ids(model) -> dict[str, int]:
    return {n: object_serial(p) for n, p in model.named_parameters()}


def progress(rank: int, text: str) -> None:
    """One line on stderr from rank 0: where a run of several seconds stands."""
    if rank == 0:
        print(f"[fp8-reload rebalance] {text}", file=sys.stderr, flush=True)


def demo_rank(rank: int, world: int, device: torch.device, spec: DemoSpec) -> list[dict]:
    """One rank of the command; returns every rank's rows (all-gathered) for rank 0 to print."""
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # each node writes its own copy
        for kind, path in spec.checkpoints.items():
            progress(rank, f"checkpoint {kind}: {path}")
            ensure_checkpoint(path, spec.preset, spec.num_layers, kind, seed=spec.seed)
    warm_up_p2p()  # also a barrier: the checkpoints exist from here on
    rows, steps = [], len(spec.checkpoints) * len(spec.modes)
    for kind, path in spec.checkpoints.items():
        cfg = Checkpoint(path).config
        full = load_model(path, device=device) if spec.check else None
        x, routing = _workload(cfg, spec, rank, world, device)
        for mode in spec.modes:
            t0 = time.perf_counter()
            rows.append(_one_run(rank, world, device, spec, path, cfg, full, x, routing, kind, mode))
            progress(rank, f"step {len(rows)}/{steps}: {kind} {mode} done in "
                           f"{time.perf_counter() - t0:.1f} s")
        del full
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    return [r for per_rank in gathered for r in per_rank]


def _workload(cfg, spec: DemoSpec, rank: int, world: int, device):
    """This rank's block of a global batch, and a skewed routing of it per MoE layer."""
    g = torch.Generator().manual_seed(spec.seed)
    batch = torch.randn(spec.tokens * world, cfg.hidden_size, generator=g).to(torch.bfloat16)
    x = batch[owned_tokens(batch.shape[0], world, rank)].to(device)
    routing = {}
    for layer in cfg.moe_layers:
        w, ids = skewed_routing(x.shape[0], cfg.num_experts, cfg.top_k, layer, seed=spec.seed,
                                alpha=spec.alpha, rank=rank)
        routing[layer] = (w.to(device), ids.to(device))
    return x, routing


def _forwards(model, full, x, routing, spec: DemoSpec) -> tuple[dict, float]:
    """The EP forward of every MoE layer (after one untimed warm-up pass): {layer: stats},
    and its worst calc_diff against the single-device block (0 when not checked)."""
    for layer, r in routing.items():
        ep_moe_forward(model, layer, x, r, backend=spec.moe_backend)
    stats, worst = {}, 0.0
    for layer, r in routing.items():
        stats[layer] = EPForwardStats()
        y = ep_moe_forward(model, layer, x, r, backend=spec.moe_backend, stats=stats[layer])
        if full is not None:
            ref = full.model.layers[layer].mlp(x, backend=spec.moe_backend, routing=r)
            worst = max(worst, calc_diff(y, ref))
    return stats, worst


def forward_fields(stats: dict, when: str) -> dict:
    """Per-layer and total (token, expert) pairs computed here and their MoE seconds."""
    tokens = [s.rows_computed for s in stats.values()]
    moe = [s.seconds.get("moe", 0.0) for s in stats.values()]
    return {f"tokens_{when}": sum(tokens), f"moe_s_{when}": sum(moe),
            f"tokens_{when}_by_layer": tokens, f"moe_s_{when}_by_layer": moe}


def _one_run(rank, world, device, spec: DemoSpec, path, cfg, full, x, routing, kind, mode) -> dict:
    comm = comm_device(device, None)
    slots = spec.slots_per_rank or default_slots_per_rank(cfg.num_experts, world)
    start = Placement.round_robin(cfg.moe_layers, cfg.num_experts, world, slots)
    model = load_rank_model(path, start, rank, device)
    load = torch.stack([routing_load(routing[layer][1], cfg.num_experts) for layer in start.layers])
    load = load.to(comm)
    dist.all_reduce(load)  # EPLB sums the ranks' statistics
    load = load.cpu()
    before, diff_before = _forwards(model, full, x, routing, spec)
    new = balance_placement(load, start) if rank == 0 else None
    ids = param_ids(model)
    exclude = spec.exclude_sources if mode == "hybrid" else ()
    dist.barrier()
    t0 = time.perf_counter()
    report = rebalance(model, new, mode=mode, exclude_sources=exclude)
    dist.barrier()
    wall = time.perf_counter() - t0
    after, diff_after = _forwards(model, full, x, routing, spec)
    worst = max(diff_before, diff_after)
    row = {"kind": kind, "mode": mode, "rank": rank, "world": world, "device": str(device),
           "wall_s": wall, "report": report, "placement": model.placement, "start": start,
           "load": load, "layers": len(start.layers), "experts": cfg.num_experts, "slots": slots,
           "tokens_per_rank": x.shape[0], "top_k": cfg.top_k, "moe_backend": spec.moe_backend or "torch",
           **forward_fields(before, "before"), **forward_fields(after, "after")}
    if spec.check:
        fresh = load_rank_model(path, model.placement, rank, device)
        row["diffs"] = compare_states(snapshot(model), snapshot(fresh))
        row["identity_kept"] = param_ids(model) == ids
        row["forward_calc_diff"] = worst
        row["forward_matches"] = worst <= spec.forward_bound
        del fresh
    del model
    return row
