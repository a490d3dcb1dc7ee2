"""What the expert-parallel benchmarks run inside each rank of a `RankPool`.

* `filled_rank_model`: a rank's share of a model of any preset built in place on the
  device, every expert slot filled with bytes derived from (layer, expert), no
  checkpoint. A whole v2-lite (26 MoE layers, ~15 GiB in FP8) would take minutes to
  write to disk; a p2p rebalance moves bytes whatever they are, and
  `check_filled` proves afterwards that every slot holds its new expert's bytes.
* `contiguous_exchange`: the NCCL (or gloo) bound, one contiguous buffer each way
  between the ranks, timed like a rebalance (barrier, post, wait, device synchronized).
* `ep_forward_run`: the expert-parallel forward of every MoE layer on a skewed
  routing; tokens and MoE time per layer on this rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..device import synchronize
from ..expert_parallel import (
    EPForwardStats,
    Placement,
    ep_moe_forward,
    moe_layer_map,
    owned_tokens,
    skewed_routing,
    slot_tensors,
)
from ..expert_parallel.group import comm_device, global_rank
from ..expert_parallel.slots import refresh_merged_input_scales
from ..layers import FP8MoEModel
from ..processing import get_mode


def _expert_bytes(layer_id: int, expert: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """The fill of tensor `index` of one slot holding `expert` in `layer_id` (shape and dtype of
    `like`): pseudo-random bytes for weights, a positive float from (layer, expert) for scales."""
    if like.dtype == torch.float32:  # scales: finite and positive, distinct per expert
        return torch.full_like(like, 1.0 + 1e-3 * expert + 1e-6 * layer_id + 1e-8 * index)
    g = torch.Generator(device=like.device).manual_seed((layer_id * 4099 + expert) * 8 + index)
    raw = torch.randint(0, 256, (like.numel() * like.element_size(),), generator=g,
                        dtype=torch.uint8, device=like.device)
    return raw.view(like.dtype).view(like.shape)


def filled_rank_model(spec: str, placement: Placement, rank: int, device) -> FP8MoEModel:
    """Rank `rank`'s share of preset `spec` (``"v2-lite"``, ``"small:3"``) under `placement`,
    fixed mode, FP8 kind, its expert slots filled by `_expert_bytes` (a `RankPool` builder)."""
    cfg = MoEConfig.from_spec(spec)
    model = FP8MoEModel(cfg, get_mode("fixed"), "fp8", device=device, **placement.model_kwargs(rank))
    model.eval()
    model.placement, model.ep_rank, model.checkpoint_path = placement, rank, None
    with torch.no_grad():
        for lid, layer in moe_layer_map(model).items():
            for slot, expert in enumerate(placement.rank_experts(lid, rank)):
                for i, t in enumerate(slot_tensors(layer)):
                    t[slot].copy_(_expert_bytes(lid, expert, i, t[slot]))
        refresh_merged_input_scales(moe_layer_map(model).values())
    synchronize(device)
    return model


def check_filled(model: FP8MoEModel) -> list[str]:
    """Slots whose bytes are not their (layer, expert)'s fill under the model's placement."""
    bad = []
    rank = model.ep_rank
    for lid, layer in moe_layer_map(model).items():
        for slot, expert in enumerate(model.placement.rank_experts(lid, rank)):
            for i, t in enumerate(slot_tensors(layer)):
                got = t[slot:slot + 1]
                want = _expert_bytes(lid, expert, i, got)
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    bad.append(f"layer {lid} slot {slot} (expert {expert}) tensor {i}")
    return bad


def contiguous_exchange(model: FP8MoEModel, nbytes: int, repeat: int = 5,
                        warmup: int = 1) -> list[float]:
    """Seconds of each of `repeat` exchanges of one contiguous `nbytes` buffer with every peer,
    both directions in one `batch_isend_irecv` (after `warmup` untimed ones): what the
    rebalance's exchange would take if the experts were one block. Like a rebalance, a
    call allocates its buffers (uninitialized: only the transfer counts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(iter(moe_layer_map(model).values())).w13_weight.device
    comm = comm_device(device, None)
    peers = [p for p in range(world) if p != rank]
    send = {p: torch.empty(nbytes, dtype=torch.uint8, device=comm) for p in peers}
    recv = {p: torch.empty(nbytes, dtype=torch.uint8, device=comm) for p in peers}
    times = []
    for i in range(repeat + warmup):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        ops = [op for p in peers for op in (dist.P2POp(dist.isend, send[p], global_rank(None, p)),
                                            dist.P2POp(dist.irecv, recv[p], global_rank(None, p)))]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def skewed_workload(model: FP8MoEModel, tokens: int, seed: int = 0, alpha: float = 1.2):
    """This rank's block of a global batch of `tokens` per rank and its `skewed_routing` in
    every MoE layer, on the model's device (memoized on the model: built once per process)."""
    memo = model.__dict__.setdefault("_ep_bench_workloads", {})
    key = (tokens, seed, alpha)
    if key not in memo:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = model.config
        device = next(iter(moe_layer_map(model).values())).w13_weight.device
        g = torch.Generator().manual_seed(seed)
        batch = torch.randn(tokens * world, cfg.hidden_size, generator=g).to(torch.bfloat16)
        x = batch[owned_tokens(batch.shape[0], world, rank)].to(device)
        routing = {}
        for layer in model.placement.layers:
            w, ids = skewed_routing(x.shape[0], cfg.num_experts, cfg.top_k, layer, seed=seed,
                                    alpha=alpha, rank=rank)
            routing[layer] = (w.to(device), ids.to(device))
        memo[key] = (x, routing)
    return memo[key]


def ep_forward_once(model: FP8MoEModel, tokens: int, seed: int = 0, alpha: float = 1.2,
                    backend: str | None = None) -> None:
    """One expert-parallel forward of every MoE layer on the `skewed_workload` (device
    synchronized at the end): what a timed benchmark call runs."""
    x, routing = skewed_workload(model, tokens, seed, alpha)
    for layer, r in routing.items():
        ep_moe_forward(model, layer, x, r, backend=backend)
    synchronize(x.device)


def ep_forward_run(model: FP8MoEModel, tokens: int, seed: int = 0, alpha: float = 1.2,
                   backend: str | None = None, repeat: int = 3) -> dict:
    """The EP forward of every MoE layer on the `skewed_workload`: per layer the pairs this
    rank computed and the median MoE seconds over `repeat` forwards (after one warm-up),
    plus the median wall seconds of one whole forward over all layers."""
    rank = dist.get_rank()
    x, routing = skewed_workload(model, tokens, seed, alpha)
    device = x.device
    moe = {layer: [] for layer in routing}
    rows, walls = {}, []
    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for layer, r in routing.items():
            stats = EPForwardStats()
            ep_moe_forward(model, layer, x, r, backend=backend, stats=stats)
            rows[layer] = stats.rows_computed
            if i:
                moe[layer].append(stats.seconds["moe"])
        synchronize(device)
        if i:
            walls.append(time.perf_counter() - t0)
    return {"rank": rank, "rows": [rows[layer] for layer in routing],
            "moe_s": [statistics.median(moe[layer]) for layer in routing],
            "forward_s": statistics.median(walls), "layers": list(routing)}


def counted_rebalance(model: FP8MoEModel, new: Placement, mode: str = "p2p") -> dict:
    """One `rebalance` to `new` (rank 0's request) with every torch op it dispatches counted:
    on a CPU box the op count is the launch count a GPU would see, a proxy for host cost
    that wall times cannot give. Returns ``{"report", "ops": {aten op: count}}``."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from ..expert_parallel import rebalance

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with _Count() as count:
        report = rebalance(model, new if dist.get_rank() == 0 else None, mode=mode)
    return {"report": report, "ops": dict(count.ops)}
