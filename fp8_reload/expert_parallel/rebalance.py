"""Expert-parallel rebalance across torch.distributed ranks.

Each rank holds its share of the experts (a `Placement`, loaded with
`load_rank_model`). `rebalance(model, new)` moves every rank to a new placement:

1. **Agree.** One all-gather: every rank checks it holds the same old placement
   and takes rank 0's (new, mode, exclusions). Every rank then computes the
   same `RebalancePlan` (index tensors, a fixed cost per rebalance).
2. **Plan.** Per rank: the local slots whose expert changes and, per layer,
   each logical expert the rank must obtain and from where: a *local* copy
   (the rank already holds it in another slot), a *peer* that holds it (P2P),
   or *disk*. ``p2p`` takes everything from peers, ``disk`` everything the
   rank lacks from the checkpoint, ``hybrid`` from peers when a usable peer
   holds it and from disk otherwise (`exclude_sources` marks peers that must
   not serve, e.g. ones being drained or replaced, as in Elastic EP).
3. **Exchange.** A slot's complete post-processed state is one row of bytes:
   FP8 ``w13``/``w2`` weights, ``w13_weight_scale[s]`` (both columns),
   ``w2_weight_scale[s]`` and, for FP8 checkpoints, the raw per-expert input
   scales (``w*_input_scale_per_expert[s]``). Each pair of ranks exchanges one
   packed buffer per direction in one `batch_isend_irecv`; disk experts are
   read meanwhile with a filtered `update_weights_from_disk` through the new
   slot maps.
4. **Commit.** Rows are written in place into the existing Parameters of the
   changed slots (objects and loader attributes kept), the layer-max input
   scales are recomputed from the raw per-expert scales exactly as a fresh
   load does, `weights_version` is bumped and forward caches dropped.
5. **Finish together.** Ranks all-gather their outcome. If any rank failed,
   every rank restores its changed slots (from the rows it sent, or a backup of
   the others taken before the commit) and raises `RebalanceError`; the model
   and placement are as before.

No host-device sync between the agreement and the outcome but the one the
weights lock needs; staging and commit are one gather / scatter per parameter
kind and layer (`transfer.Transfer`), straight between Parameters and buffers.
After a successful rebalance each rank's state equals a fresh `load_model` of
that rank under the new placement, bit for bit (tests check it on every rank).
Works with ``gloo`` on CPU and ``nccl`` on GPUs.
"""


from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..device import synchronize
from ..kernels.scales import clear_kernel_caches
from ..layers import FP8MoEModel
from ..reload import ReloadReport, generate_weight_name_filter, update_weights_from_disk
from .group import comm_device, failed_ranks, gather_rows, global_rank
from .placement import Placement
from .plan import MODES, RebalancePlan
from .slots import (
    RebalanceError,
    moe_layer_map,
    pack_slots,
    refresh_merged_input_scales,
    row_bytes,
    write_slots,
)
from .transfer import Transfer


@dataclass
class RebalanceReport:
    """What one rank did in one rebalance. `seconds` holds per-phase wall times."""

    rank: int
    mode: str
    slots_changed: int = 0
    experts_local: int = 0
    experts_p2p: int = 0
    experts_disk: int = 0
    experts_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    bytes_disk: int = 0  # bytes read from the checkpoint
    seconds: dict[str, float] = field(default_factory=dict)
    disk_report: ReloadReport | None = None

    def summary(self) -> str:
        mib = 2.0 ** 20
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        return (f"rank {self.rank} [{self.mode}]: {self.slots_changed} slots changed "
                f"({self.experts_local} local, {self.experts_p2p} p2p, {self.experts_disk} disk), "
                f"sent {self.bytes_sent / mib:.2f} MiB, received {self.bytes_received / mib:.2f} MiB, "
                f"read {self.bytes_disk / mib:.2f} MiB ({phases})")


def _mark(seconds: dict, name: str, t0: float) -> float:
    """Add the host time since `t0` to phase `name`. No device sync: a phase's device work
    shows where the host waits for it (the weights lock's device sync, the outcome)."""
    t = time.perf_counter()
    seconds[name] = seconds.get(name, 0.0) + t - t0
    return t


def _agree(old: Placement, new: Placement | None, mode: str, exclude_sources, group,
           device, holds_rank: bool) -> tuple[Placement, str, frozenset]:
    """Rank 0's (new placement, mode, exclusions) on every rank, once every rank is known to
    hold the same old placement (and its own share of it: `holds_rank`).

    One all-gather of one int64 row per rank (placement fingerprint, ok, then rank 0's
    status, mode, exclusion mask and new table) and one device->host copy, whatever the
    model size. Nothing is pickled.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    status = _request_status(old, new, mode) if rank == 0 else 0
    ask = status == 1
    head = [old.fingerprint(), int(holds_rank and old.ep_size == world), status,
            MODES.index(mode) if ask else 0]
    skip = set(exclude_sources)
    head += [int(ask and k in skip) for k in range(world)]
    table = new.table.reshape(-1) if ask else torch.zeros(old.table.numel(), dtype=torch.long)
    every = gather_rows(torch.cat([torch.tensor(head, dtype=torch.long), table]), group, device)
    n = len(head)
    heads = every[:, :n].tolist()
    if any(h[0] != heads[0][0] or not h[1] for h in heads):
        raise RebalanceError("ranks disagree on the current placement (or a rank holds another "
                             "rank's share, or ep_size is not the world size); nothing was changed")
    status, mode_index, excluded = heads[0][2], heads[0][3], heads[0][4:]
    if status != 1:
        raise RebalanceError(_REFUSED[status] + "; nothing was changed")
    if rank != 0:
        table = every[0, n:].view_as(old.table).clone()
        new = Placement(old.layers, old.num_experts, old.ep_size, old.slots_per_rank, table)
    return new, MODES[mode_index], frozenset(k for k, x in enumerate(excluded) if x)


_REFUSED = {0: "rank 0 passed no new placement",
            -1: "rank 0's new placement has another layout (layers, experts, ranks or slots "
                "per rank) than the current one",
            -2: f"cannot plan the rebalance: rank 0 asked for an unknown rebalance mode; choose "
                f"one of {', '.join(MODES)}"}


def _request_status(old: Placement, new: Placement | None, mode: str) -> int:
    if new is None:
        return 0
    try:
        old._check_same_layout(new)
    except ValueError:
        return -1
    return 1 if mode in MODES else -2


def rebalance(model: FP8MoEModel, new: Placement | None, *, mode: str = "p2p",
              checkpoint=None, exclude_sources: Iterable[int] = (), group=None) -> RebalanceReport:
    """Move this rank of an expert-parallel model to placement `new`; collective.

    Every rank of `group` calls it; rank 0's `new`, `mode` and `exclude_sources`
    are used (other ranks may pass ``new=None``). `checkpoint` (default: the path
    the model was loaded from) serves the experts taken from disk. Returns this
    rank's report. Raises `RebalanceError` on every rank if any rank failed,
    after every rank restored its old state.

    Forwards of this rank keep running while the plan is made and the outgoing
    experts are packed; from the first write (disk reads, new slot maps) to the
    end (commit, or roll back) the rebalance holds the weights lock exclusively,
    so a forward sees the old placement and weights or the new ones, never a mix.
    """
    old: Placement | None = getattr(model, "placement", None)
    if old is None:
        raise RebalanceError("the model has no placement: load it with load_rank_model")
    if model.mode.name != "fixed":
        raise RebalanceError(f"rebalance needs processing='fixed' (in-place, scoped); the model "
                             f"uses {model.mode.name!r}")
    layers = moe_layer_map(model)
    device = next(iter(layers.values())).w13_weight.device
    comm = comm_device(device, group)
    rank = dist.get_rank(group)
    report = RebalanceReport(rank=rank, mode=mode)
    sec = report.seconds
    t_start = t = time.perf_counter()

    with model.reload_lock:
        new, mode, excluded = _agree(old, new, mode, exclude_sources, group, comm,
                                     holds_rank=getattr(model, "ep_rank", rank) == rank)
        t = _mark(sec, "agree", t)
        report.mode = mode
        try:  # every rank has the same inputs, so every rank fails here alike
            plan = RebalancePlan.build(old, new, mode, excluded)
        except ValueError as e:
            raise RebalanceError(f"cannot plan the rebalance: {e}; nothing was changed") from e
        mine = plan.ranks[rank]
        by_index = [layers[lid] for lid in old.layers]  # the plan's layer indices
        moves = Transfer(mine, lambda li: row_bytes(by_index[li]), old.num_experts, device)
        report.slots_changed = mine.slots_changed
        report.experts_local, report.experts_p2p, report.experts_disk = (
            mine.count("local"), mine.count("peer"), mine.count("disk"))
        report.experts_sent = mine.sends_to.shape[0]
        t = _mark(sec, "plan", t)

        error: BaseException | None = None
        send = {p: torch.empty(n, dtype=torch.uint8, device=comm) for p, (n, _) in moves.sends.items()}
        recv = {p: torch.empty(n, dtype=torch.uint8, device=comm) for p, (n, _) in moves.recvs.items()}
        try:  # first: the exchange starts sooner
            for peer, (_, runs) in moves.sends.items():
                _pack(by_index, moves, runs, send[peer])
        except Exception as e:  # still take part in the exchange, then fail together
            error = e
        works = _post_exchange(send, recv, group)
        report.bytes_sent = sum(b.numel() for b in send.values())
        report.bytes_received = sum(b.numel() for b in recv.values())
        backup = local = None
        try:  # backups and local copies while the exchange is in flight
            backup = _pack(by_index, moves, moves.backup[1], _empty(moves.backup[0], device))
            local = _pack(by_index, moves, moves.local[1], _empty(moves.local[0], device))
            report.bytes_local = local.numel()
        except Exception as e:
            error = error or e
        t = _mark(sec, "stage", t)

        with ExitStack() as held:
            # From here the model changes: running forwards finish, new ones wait.
            try:
                held.enter_context(model.weights_lock.write())
                locked = True
            except RuntimeError as e:  # called from inside a forward of this model
                error, locked = error or e, False
            t = _mark(sec, "wait", t)
            synchronize(device)  # forwards' kernels on any stream (and the exchange) finish
            t = _mark(sec, "exchange", t)
            written = False
            if locked and error is None:
                written = True
                error = _write(model, by_index, moves, mine, new, rank, checkpoint, works, recv,
                               local, report, t)
            else:  # write nothing, but let the exchange finish before failing together
                with suppress(Exception):  # already failing: the first error is reported
                    _wait(works)
            t = time.perf_counter()
            failed = failed_ranks(error, group, comm)  # its host copy waits for the commit
            if failed:
                if written:
                    _restore(model, by_index, moves, send, backup, old, rank)
                t = _mark(sec, "rollback", t)
                here = f"; here: {type(error).__name__}: {error}" if error is not None else ""
                raise RebalanceError(f"rebalance failed on rank(s) {failed}; every rank rolled "
                                     f"back to the old placement{here}") from error
            model.placement = new
            _mark(sec, "outcome", t)
    sec["total"] = time.perf_counter() - t_start
    return report


def _empty(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _pack(by_index, moves: Transfer, runs, buf: torch.Tensor) -> torch.Tensor:
    """Gather each run's slots straight into its segment of `buf`."""
    for run in runs:
        pack_slots(by_index[run.li], moves.idx(run.index), out=buf[run.offset:run.offset + run.nbytes])
    return buf


def _scatter(by_index, moves: Transfer, runs, bufs) -> None:
    """Write each (source, run) from its segment of ``bufs[source]`` into its slots."""
    for source, run in runs:
        write_slots(by_index[run.li], moves.idx(run.index),
                    bufs[source][run.offset:run.offset + run.nbytes], moves.idx(run.rows))


def _post_exchange(send_bufs, recv_bufs, group) -> list:
    """One `batch_isend_irecv` of every peer buffer, both directions; returns the works."""
    ops = []
    for peer in sorted(set(send_bufs) | set(recv_bufs)):
        if peer in send_bufs:
            ops.append(dist.P2POp(dist.isend, send_bufs[peer], global_rank(group, peer), group))
        if peer in recv_bufs:
            ops.append(dist.P2POp(dist.irecv, recv_bufs[peer], global_rank(group, peer), group))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


def _write(model, by_index, moves: Transfer, mine, new: Placement, rank: int, checkpoint, works,
           recv, local, report: RebalanceReport, t: float) -> BaseException | None:
    """Under the write lock: new slot maps and disk experts, then every received and local
    row into its slots (one scatter per parameter kind, source and layer). Returns the
    first error."""
    sec, error = report.seconds, None
    try:
        for li in moves.changed_layers:
            layer = by_index[li]
            layer.expert_slots = new.local_slots(layer.layer_id, rank)
        wanted = mine.disk_experts()
        if wanted:
            path = checkpoint if checkpoint is not None else model.checkpoint_path
            rep = update_weights_from_disk(model, path, generate_weight_name_filter(wanted))
            report.disk_report = rep
            report.bytes_disk = rep.bytes_read
    except Exception as e:
        error = e
    t = _mark(sec, "disk", t)
    try:
        _wait(works)
    except Exception as e:
        error = error or e
    t = _mark(sec, "exchange", t)
    try:
        if error is None:
            _scatter(by_index, moves, moves.scatters, {**recv, rank: local})
            _refresh(model, by_index, moves)
    except Exception as e:
        error = e
    _mark(sec, "commit", t)
    return error


def _refresh(model, by_index, moves: Transfer) -> None:
    """After changed slots were written: merged input scales as a fresh load sets them,
    a new weights version, no stale kernel caches."""
    for li in moves.changed_layers:
        refresh_merged_input_scales(by_index[li])
        by_index[li].weights_version += 1
    if moves.changed_layers:
        clear_kernel_caches(model)


def _restore(model, by_index, moves: Transfer, send, backup, old: Placement, rank: int) -> None:
    """The changed slots' old rows back (from the send buffers, or the backup), old slot maps."""
    with torch.no_grad():
        for li in moves.changed_layers:
            layer = by_index[li]
            layer.expert_slots = old.local_slots(layer.layer_id, rank)
            layer.loaded_experts.clear()
            layer.staged.clear()
        _scatter(by_index, moves, moves.restores, send)
        _scatter(by_index, moves, [(None, run) for run in moves.backup[1]], {None: backup})
        _refresh(model, by_index, moves)
    synchronize(model)
