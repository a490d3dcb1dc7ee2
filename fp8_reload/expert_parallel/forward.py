"""The expert-parallel MoE forward: route, dispatch through the placement, run, combine.

Every rank holds its own tokens (data-parallel attention, `dispatch.owned_tokens`)
and its physical expert slots (`load_rank_model`). One MoE layer, collectively:

1. **route**: the gate (replicated on every rank) picks ``top_k`` logical experts
   per token, or the caller passes the routing (benchmarks skew it);
2. **choose replicas**: each (token, expert) pair goes to one physical replica
   (`dispatch.choose_replicas`), read from the model's *current* placement, so
   after a rebalance tokens go where the experts now are;
3. **dispatch**: ranks exchange per-destination pair counts with their placement
   fingerprint (`all_to_all_single`), then the pairs' token rows travel with
   their local slot ids in one packed buffer per direction;
4. **run**: each rank computes the rows it received with its own `FusedMoE`
   through the normal backend (`run_moe`; ``topk_ids`` = the local slot, weight 1);
5. **combine**: outputs return by the reverse all-to-all and the token's rank
   sums them with the router weights in float32, then adds the shared experts
   (`MoEBlock.combine`), as the single-device block does.

Accuracy against the single-device forward of the same checkpoint: every pair
is computed by the same backend on the same expert bytes and weight scales, but
(a) an expert's output is rounded to bf16 before the router-weighted sum (the
single device sums in float32 and rounds once), (b) the sum's order differs and
(c) activations are quantized with the rank's own scales: the static input
scale of an FP8 checkpoint is the max over the experts the rank holds (what a
fresh load of the rank gives, as in sglang), the dynamic one the max over the
rows the rank received. (c) makes it a different activation-quantization run,
each within `MOE_LAYER_BOUND` of the float32 reference, so the two agree within
`CROSS_SCHEME_BOUND` (calc_diff); with activations unquantized (the float32
reference as backend) only (a) and (b) remain, within `SAME_SCHEME_BOUND`. The
tests check both on every rank.

Forwards and rebalances are collective: every rank issues them in the same
order (one thread per rank, an engine's step loop). A forward holds the model's
weights lock for reading from the placement lookup to the combine and a
rebalance commits under the write lock, so no forward on a rank ever sees a
half-moved layer; ranks holding different placements refuse the forward
together (`DispatchError`) instead of computing with mismatched slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..device import synchronize
from ..errors import ReloadError
from ..kernels import run_moe
from ..layers import FP8MoEModel, MoEBlock
from .dispatch import choose_replicas
from .group import comm_device, failed_ranks

_SLOT_BYTES = 4  # a row's local slot id travels as int32 beside the token's bf16 row


class DispatchError(ReloadError):
    """An expert-parallel forward could not run or failed; every rank raises it together."""


@dataclass
class EPForwardStats:
    """What one rank did in expert-parallel forwards; accumulates over calls.

    ``rows_computed`` counts the (token, expert) pairs this rank's experts computed
    (EPLB's "tokens per rank"); ``seconds["moe"]`` is the time of that local
    compute alone, the device synchronized before and after.
    """

    rank: int = -1
    forwards: int = 0
    pairs_routed: int = 0  # pairs of this rank's own tokens
    pairs_kept: int = 0  # of those, computed on this rank
    rows_computed: int = 0  # pairs this rank computed, from any rank
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def moe_block(model: FP8MoEModel, layer_id: int) -> MoEBlock:
    try:
        block = model.model.layers[layer_id].mlp
    except IndexError:
        raise DispatchError(f"the model has no layer {layer_id}") from None
    if not isinstance(block, MoEBlock):
        raise DispatchError(f"layer {layer_id} is not an MoE layer")
    return block


def local_expert_forward(model: FP8MoEModel, layer_id: int, rows: torch.Tensor,
                         slots: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """This rank's experts on `rows` [n, hidden] bf16: row i through local slot ``slots[i]``,
    weight 1; [n, hidden] bf16. Holds the weights lock for reading."""
    layer = moe_block(model, layer_id).experts
    with model.weights_lock.read():
        if rows.shape[0] == 0:
            return rows.new_empty(rows.shape)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return run_moe(layer, rows, ones, slots.reshape(-1, 1), backend=backend or layer.backend)


def ep_moe_forward(model: FP8MoEModel, layer_id: int, x: torch.Tensor,
                   routing: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                   backend: str | None = None, group=None,
                   stats: EPForwardStats | None = None) -> torch.Tensor:
    """MoE block `layer_id` on this rank's tokens `x` [n, hidden] bf16, experts dispatched
    across the ranks of `group` by the model's placement; collective. Returns [n, hidden]
    bf16, the single-device `MoEBlock.forward` within the bounds of the module docstring.

    `routing` (topk_weights [n, k], logical topk_ids [n, k]) replaces the gate. Ranks may
    hold different numbers of tokens, none included. Raises `DispatchError` on every rank
    if any rank cannot dispatch (no placement, another placement than its peers, bad
    routing: nothing is computed then) or its local experts fail.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = x.device
    comm = comm_device(device, group)
    timer = _Timer(stats, device)
    with model.weights_lock.read():
        try:
            # tokens travel as the bytes of bf16 rows: another dtype would be misread, not refused
            if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != model.config.hidden_size:
                raise DispatchError(f"the expert-parallel forward takes bf16 tokens [T, "
                                    f"{model.config.hidden_size}], got {x.dtype} {tuple(x.shape)}")
            if getattr(model, "weights_undefined", None):  # (a failed restore: never served)
                raise DispatchError(f"rank {rank}'s weights are undefined "
                                    f"({model.weights_undefined}); reload it fully")
            block = moe_block(model, layer_id)
            placement = _placement_of(model, rank, world)
            weights, ids = block.gate(x) if routing is None else routing
            ids = _check_routing(ids, weights, x, placement.num_experts)
            slot = choose_replicas(placement, layer_id, rank, ids).reshape(-1)
            dest = slot // placement.slots_per_rank
            order = torch.argsort(dest, stable=True)
            counts = torch.bincount(dest, minlength=world)
            fingerprint, lid, problem = placement.fingerprint(), int(layer_id), None
        except Exception as e:  # refused below, on every rank: none may wait for this one
            counts, fingerprint, lid, problem = torch.zeros(world, dtype=torch.long), 0, -1, e
        # what every rank must agree on travels with the counts: placement, layer, width
        header = torch.stack([counts.cpu(), torch.full((world,), fingerprint),
                              torch.full((world,), int(problem is None)),
                              torch.full((world,), lid),
                              torch.full((world,), model.config.hidden_size)], 1)
        theirs = torch.empty_like(header).to(comm)
        dist.all_to_all_single(theirs, header.to(comm), group=group)
        theirs = theirs.cpu()
        _refuse_unless_agreed(theirs, problem, layer_id)
        send_counts, recv_counts = counts.tolist(), theirs[:, 0].tolist()
        t = timer.mark("route")

        hidden = x.shape[1]
        token = torch.div(order, ids.shape[1], rounding_mode="floor")
        local_slot = (slot[order] % placement.slots_per_rank).to(torch.int32)
        packed = torch.cat([x.index_select(0, token).view(torch.uint8),
                            local_slot.view(torch.uint8).view(-1, _SLOT_BYTES)], 1).to(comm)
        received = torch.empty(sum(recv_counts), packed.shape[1], dtype=torch.uint8, device=comm)
        dist.all_to_all_single(received, packed, recv_counts, send_counts, group=group)
        rows = received[:, :2 * hidden].contiguous().view(torch.bfloat16).to(device)
        slots = received[:, 2 * hidden:].contiguous().view(torch.int32).reshape(-1).to(device)
        t = timer.mark("dispatch", t)

        try:
            y, problem = local_expert_forward(model, layer_id, rows, slots.long(), backend), None
        except Exception as e:  # e.g. a backend error: every rank must learn of it
            y, problem = rows, e
        t = timer.mark("moe", t)  # before waiting on the others: this rank's own time
        failed = failed_ranks(problem, group, comm)
        if failed:
            here = f"; here: {type(problem).__name__}: {problem}" if problem is not None else ""
            raise DispatchError(f"expert-parallel forward of layer {layer_id} failed in the local "
                                f"experts of rank(s) {failed}{here}") from problem

        back = torch.empty(order.numel(), 2 * hidden, dtype=torch.uint8, device=comm)
        dist.all_to_all_single(back, y.view(torch.uint8).to(comm), send_counts, recv_counts,
                               group=group)
        per_pair = torch.empty(order.numel(), hidden, dtype=torch.bfloat16, device=device)
        per_pair.index_copy_(0, order, back.to(device).view(torch.bfloat16))
        routed = (per_pair.float().view(*ids.shape, hidden) * weights.float().unsqueeze(2)).sum(1)
        routed = routed.to(torch.bfloat16)
        out = block.combine(x, routed) if x.shape[0] else routed  # no tokens: nothing to add
        timer.mark("combine", t)
    if stats is not None:
        stats.rank = rank
        stats.forwards += 1
        stats.pairs_routed += order.numel()
        stats.pairs_kept += send_counts[rank]
        stats.rows_computed += rows.shape[0]
    return out


def _placement_of(model: FP8MoEModel, rank: int, world: int):
    placement = getattr(model, "placement", None)
    if placement is None:
        raise DispatchError("the model has no placement: load it with load_rank_model")
    if placement.ep_size != world or getattr(model, "ep_rank", rank) != rank:
        raise DispatchError(f"rank {rank} holds rank {getattr(model, 'ep_rank', rank)}'s share of "
                            f"a {placement.ep_size}-rank placement in a group of {world}")
    return placement


def _check_routing(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, num_experts: int):
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise DispatchError(f"routing of shapes {tuple(weights.shape)} / {tuple(ids.shape)} does "
                            f"not fit {x.shape[0]} tokens")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise DispatchError(f"routed expert ids must lie in [0, {num_experts})")
    return ids.long()


def _refuse_unless_agreed(headers: torch.Tensor, problem, layer_id: int) -> None:
    """Every rank sees every rank's header row, so every rank decides alike."""
    failed = (headers[:, 2] == 0).nonzero().flatten().tolist()
    if failed:
        here = f"; here: {problem}" if problem is not None else ""
        raise DispatchError(f"expert-parallel forward of layer {layer_id} refused: rank(s) "
                            f"{failed} cannot dispatch{here}") from problem
    if len(set(headers[:, 1].tolist())) > 1:
        raise DispatchError(f"expert-parallel forward of layer {layer_id} refused: the ranks hold "
                            "different placements (a rebalance ran on some ranks only?)")
    for column, what in ((3, "layers"), (4, "hidden sizes")):
        if len(set(headers[:, column].tolist())) > 1:
            raise DispatchError(f"expert-parallel forward of layer {layer_id} refused: the ranks "
                                f"run different {what} ({headers[:, column].tolist()} by rank)")


class _Timer:
    """Per-phase times into `stats` (nothing when it is None), the device synchronized."""

    def __init__(self, stats: EPForwardStats | None, device: torch.device):
        self.stats, self.device = stats, device
        self.t0 = time.perf_counter()

    def mark(self, name: str, t0: float | None = None) -> float:
        if self.stats is None:
            return 0.0
        synchronize(self.device)
        t = time.perf_counter()
        self.stats.add(name, t - (self.t0 if t0 is None else t0))
        return t
