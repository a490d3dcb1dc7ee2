"""Step 1 of a rebalance: every rank agrees on rank 0's request, or every rank refuses it.

A rank with a local problem (no placement, another processing mode, another rank's
share) votes no instead of raising before the collective, where its peers would wait
for it forever; rank 0 checks its own request the same way and sends a refusal code.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from .group import global_rank
from .placement import Placement
from .plan import MODES
from .slots import RebalanceError

_NONE = 2**63 - 1  # a rank that passed no new placement: neutral in a MIN vote


def agree(old: Placement, new: Placement | None, mode: str, exclude_sources, group,
           device, problem: str | None) -> tuple[Placement, str, frozenset]:
    """Rank 0's (new placement, mode, exclusions) on every rank, once every rank is known to
    hold the same old placement (and its own share of it) and no rank has a local `problem`
    (no placement, another processing mode): such a rank votes no instead of raising
    before the collective, where its peers would wait for it forever. Ranks other than 0
    that pass a `new` must pass rank 0's.

    Two collectives: an all-reduce of each rank's old and new placement fingerprints (min
    of x and -x: all equal iff min == max) and a broadcast of one int64 tensor (status, mode,
    exclusion mask, new table), sized by the table: the fixed-size vote comes first.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if problem is None and rank != 0 and new is not None and not isinstance(new, Placement):
        problem = f"the new placement must be a Placement, got {type(new).__name__}"
    problem = problem or _edited(old, "this rank's current placement (model.placement)")
    if rank != 0 and isinstance(new, Placement):
        problem = problem or _edited(new, "the new placement passed on this rank")
    fp = old.fingerprint() if problem is None else 0
    nfp = new.fingerprint() if problem is None and isinstance(new, Placement) else _NONE
    ok = int(problem is None and old.ep_size == world)
    votes = torch.tensor([fp, -fp, ok, nfp, -nfp if nfp != _NONE else _NONE], dtype=torch.int64,
                         device=device)
    _collective(dist.all_reduce, votes, op=dist.ReduceOp.MIN, group=group)
    low, neg_high, all_ok, new_low, new_neg_high = votes.tolist()
    if low != -neg_high or not all_ok:
        here = f"; here: {problem}" if problem is not None else ""
        raise RebalanceError("ranks disagree on the current placement (or a rank holds another "
                             "rank's share, has no placement, is not processing='fixed' or has "
                             "undefined weights, or ep_size is not the world size); nothing was "
                             f"changed{here}")
    if new_low != _NONE and new_low != -new_neg_high:
        raise RebalanceError("ranks passed different new placements (ranks other than 0 may "
                             "pass None, or rank 0's new placement); nothing was changed")
    cells = old.table.numel()
    payload = torch.zeros(2 + world + cells, dtype=torch.int64)
    if rank == 0:
        try:
            status, excluded = _request_status(old, new, mode, exclude_sources, world)
        except Exception:  # a malformed request: refused on every rank below, none waits
            status = -4
        payload[0] = status
        if status == 1:
            payload[1] = MODES.index(mode)
            payload[2:2 + world][excluded] = 1
            payload[2 + world:] = new.table.reshape(-1)
    payload = payload.to(device)
    _collective(dist.broadcast, payload, src=global_rank(group, 0), group=group)
    payload = payload.cpu()
    status = int(payload[0])
    if status != 1:
        raise RebalanceError(_REFUSED[status] + "; nothing was changed")
    excluded = frozenset(payload[2:2 + world].nonzero().flatten().tolist())
    if rank != 0:
        table = payload[2 + world:].view_as(old.table)
        new = Placement(old.layers, old.num_experts, old.ep_size, old.slots_per_rank, table)
    return new, MODES[int(payload[1])], excluded


_REFUSED = {0: "rank 0 passed no new placement",
            -1: "rank 0's new placement has another layout (layers, experts, ranks or slots "
                "per rank) than the current one",
            -2: f"cannot plan the rebalance: rank 0 asked for an unknown rebalance mode; choose "
                f"one of {', '.join(MODES)}",
            -3: "rank 0's exclude_sources name ranks outside the group (ranks lie in "
                "[0, world size))",
            -4: "rank 0's request is malformed (new must be a Placement, mode a string, "
                "exclude_sources integer ranks)",
            -5: "rank 0's new placement's table was changed in place after it was built (a "
                "Placement is immutable: build a new one)"}


def _edited(placement: Placement, what: str) -> str | None:
    try:
        placement.check_unedited(what)
    except ValueError as e:
        return str(e)
    return None


def _collective(collective, tensor, **kw) -> None:
    """`collective(tensor, **kw)`; a failed group (a rank gone or never arriving: the group's timeout)
    becomes a RebalanceError: nothing was changed on any rank yet."""
    try:
        collective(tensor, **kw)
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError, timeouts)
        raise RebalanceError(f"the ranks could not agree on the request (a rank left the group or "
                             f"did not take part: {type(e).__name__}: {e}); nothing was "
                             f"changed") from e


def _request_status(old: Placement, new: Placement | None, mode: str, exclude_sources,
                    world: int) -> tuple[int, list[int]]:
    """(status code of `_REFUSED`, or 1: valid; the excluded ranks)."""
    if new is None:
        return 0, []
    if not isinstance(new, Placement) or not isinstance(mode, str):
        return -4, []
    if _edited(new, "the new placement"):
        return -5, []
    try:
        old._check_same_layout(new)
    except ValueError:
        return -1, []
    if mode not in MODES:
        return -2, []
    excluded = sorted({operator.index(k) for k in exclude_sources})
    if any(not 0 <= k < world for k in excluded):
        return -3, []
    return 1, excluded
