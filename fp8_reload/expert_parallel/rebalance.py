"""Expert-parallel rebalance across torch.distributed ranks.

Each rank holds its share of the experts (a `Placement`, loaded with
`load_rank_model`). `rebalance(model, new)` moves every rank to a new placement:

1. **Agree.** Rank 0 broadcasts (old, new, mode); every rank checks it holds
   the same old placement. Every rank then computes the same `RebalancePlan`.
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
   slot maps. Rows of every layer are packed and unpacked by a `RowMover`
   (`rows`): on a GPU a few multi-tensor copy launches per batch, whatever the layers.
4. **Commit.** Rows are written in place into the existing Parameters of the
   changed slots (objects and loader attributes kept), the layer-max input
   scales are recomputed from the raw per-expert scales exactly as a fresh
   load does, `weights_version` is bumped and forward caches dropped.
5. **Finish together.** Ranks all-gather their outcome. If any rank failed,
   every rank restores its changed slots (from the send buffers that hold
   their old rows, the rest from a backup taken before the commit) and raises
   `RebalanceError`; the model and placement are as before. A rank whose
   restore fails too is marked ``weights_undefined`` and named in every rank's
   error (`undo`).

After a successful rebalance each rank's state equals a fresh `load_model` of
that rank under the new placement, bit for bit (tests check it on every rank).
Works with ``gloo`` on CPU and ``nccl`` on GPUs.
"""


from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..device import current_cuda, synchronize
from ..interrupts import sigint_deferred
from ..kernels.scales import clear_kernel_caches
from ..layers import FP8MoEModel
from ..reload import ReloadReport, changed_since_read, generate_weight_name_filter, update_weights_from_disk
from .agree import agree
from .group import comm_device, failed_ranks, global_rank
from .placement import Placement
from .plan import RebalancePlan
from .slots import RebalanceError, moe_layer_map, refresh_merged_input_scales
from .transfer import Moves, RowMover, Run, plan_moves
from .undo import Undo, save_scales

_UNSET = object()  # (a model that has no `checkpoint_path` at all)


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


class _Timer:
    """Adds the time since `t0` to phase `name`. With `detail`, after the device finished
    (unless `sync` is False: posting asynchronous work); by default it never waits, so a
    phase's time is what the host spent queueing it, and only the total is the device's.
    A device fault the wait reveals is kept in `error` (this rank's failure at the next
    vote), never raised here: raised, it left this rank half moved and its peers waiting."""

    def __init__(self, seconds: dict, device: torch.device, detail: bool):
        self.seconds, self.device, self.detail = seconds, device, detail
        self.error: BaseException | None = None

    def mark(self, name: str, t0: float, sync: bool = True) -> float:
        if sync and self.detail:
            try:
                synchronize(self.device)
            except BaseException as e:
                self.error = self.error or e
        t = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + t - t0
        return t


def rebalance(model: FP8MoEModel, new: Placement | None, *, mode: str = "p2p",
              checkpoint=None, exclude_sources: Iterable[int] = (), group=None,
              phase_times: bool = False) -> RebalanceReport:
    """Move this rank of an expert-parallel model to placement `new`; collective.

    Every rank of `group` calls it; rank 0's `new`, `mode` and `exclude_sources`
    are used (other ranks may pass ``new=None``). `checkpoint` (default: the path
    the model was loaded from) serves the experts taken from disk. Returns this
    rank's report. Raises `RebalanceError` on every rank if any rank failed,
    after every rank restored its old state (the error names a rank that could not).

    Forwards of this rank keep running while the plan is made and the outgoing
    experts are packed; from the first write (disk reads, new slot maps) to the
    end (commit, or roll back) the rebalance holds the weights lock exclusively,
    so a forward sees the old placement and weights or the new ones, never a mix.

    `phase_times` waits for the device at the end of every phase, so `report.seconds`
    splits the device time by phase; by default the device is waited for only where the
    rebalance needs it (the weights lock, the outcome), and a phase's time is the host's.
    """
    old: Placement | None = getattr(model, "placement", None)
    problem = None
    if old is None:
        problem = "the model has no placement: load it with load_rank_model"
    elif model.mode.name != "fixed":
        problem = (f"rebalance needs processing='fixed' (in-place, scoped); the model "
                   f"uses {model.mode.name!r}")
    elif getattr(model, "weights_undefined", None):  # (its rows would go to peers as they are)
        problem = f"this rank's weights are undefined ({model.weights_undefined}); reload it fully first"
    if problem is not None and not dist.is_initialized():
        raise RebalanceError(problem)
    layers = moe_layer_map(model)
    device = next(iter(layers.values())).w13_weight.device
    comm = comm_device(device, group)
    rank = dist.get_rank(group)
    report = RebalanceReport(rank=rank, mode=mode)
    timer = _Timer(report.seconds, device, phase_times)
    t_start = t = time.perf_counter()

    # Ctrl-C is held from here to the end and turned into this rank's failure at the next vote,
    # so every rank rolls back (raised here, it left this rank half moved and its peers waiting
    # in the vote); it is raised once this rank is whole again. A KeyboardInterrupt raised by
    # code inside takes part in the votes the same way, then is raised as it came. The disk
    # read of a rebalance may point `checkpoint_path` at `checkpoint`: what the model was
    # loaded from stays.
    interrupted: list = []
    loaded_from = model.__dict__.get("checkpoint_path", _UNSET)
    with model.reload_lock, current_cuda(device), \
            sigint_deferred(then=lambda: interrupted.append(RebalanceError("interrupted (Ctrl-C)"))):
        if problem is None and getattr(model, "ep_rank", rank) != rank:
            problem = f"this rank holds rank {model.ep_rank}'s share"
        new, mode, excluded = agree(old, new, mode, exclude_sources, group, comm, problem)
        t = timer.mark("agree", t, sync=False)
        report.mode = mode
        # Planning allocates every buffer: a rank that fails here (whatever the error) would
        # leave its peers waiting in the exchange, so all vote first.
        error: BaseException | None = None
        try:
            mine = _plan(old, new, mode, excluded, rank, report)
            t = timer.mark("plan", t, sync=False)
            mover = RowMover(layers, device)
            moves = plan_moves(mover, mine, comm)
        except BaseException as e:
            error = e
        error = error or _first(interrupted)
        try:
            failed = failed_ranks(error, group, comm)
        except Exception as e:  # a rank left the group: nothing was changed anywhere yet
            error, failed = error or e, "unknown"
        if failed:
            _reraise_interrupt(error)
            if isinstance(error, _PlanError):  # the same inputs on every rank: the same error
                raise RebalanceError(str(error)) from error.__cause__
            here = f"; here: {type(error).__name__}: {error}" if error is not None else ""
            raise RebalanceError(f"rebalance failed on rank(s) {failed} while laying out its "
                                 f"buffers; nothing was changed{here}") from error
        t = timer.mark("plan", t, sync=False)
        try:
            mover.gather(moves.sends)  # first: the exchange starts sooner
            moves.to_wire()
        except BaseException as e:  # still take part in the exchange, then fail together
            error = e
        t = timer.mark("stage", t)
        works = []
        try:  # (a rank that cannot post leaves its peers' transfers to the group's timeout)
            works = _post_exchange(moves.wire_send, moves.wire_recv, group)
            report.bytes_sent = moves.payload(moves.sends, mover)
            report.bytes_received = moves.payload(moves.received, mover)
            report.bytes_local = moves.local_bytes
        except BaseException as e:
            error = error or e
        t = timer.mark("exchange", t, sync=False)  # posting; waiting is added below

        undo = Undo(model, layers, mover, moves, mine, old, rank)
        try:  # local copies and backups while the exchange is in flight
            mover.gather(moves.local + moves.backup)
            undo.scales = save_scales(layers, mine.changed)
        except BaseException as e:
            error = error or e
        t = timer.mark("stage", t)

        try:  # (entered by a plain `with`: given back by C code, see locks)
            access = model.weights_lock.commit_hold()
        except RuntimeError as e:  # called from inside a forward of this model
            error, access = error or e, None
        with access if access is not None else nullcontext():
            # From here the model changes: running forwards finish, new ones wait.
            locked = access is not None
            if locked:
                try:
                    access.take()
                except RuntimeError as e:  # (it would wait for this thread's own access)
                    error, locked = error or e, False
            try:
                synchronize(device)
            except BaseException as e:
                error = error or e
            t = timer.mark("wait", t)
            error = error or timer.error or _first(interrupted)
            touched = locked and error is None  # else nothing was written: nothing to restore
            if touched:
                error = _write(model, layers, mine, new, rank, checkpoint, works, mover, moves,
                               report, timer, t, error)
            else:  # write nothing, but let the exchange finish before failing together
                with suppress(Exception):  # already failing: the first error is reported
                    _wait(works)
            t = time.perf_counter()
            error = error or timer.error or _first(interrupted)
            try:
                failed = failed_ranks(error, group, comm)
            except Exception as e:  # the outcome vote itself failed (a rank left the group):
                error, failed = error or e, "unknown"  # every outcome is possible: roll back here
            if loaded_from is _UNSET:
                model.__dict__.pop("checkpoint_path", None)
            else:
                model.__dict__["checkpoint_path"] = loaded_from
            if failed:
                outcome = undo.roll_back_together(touched, error, group, comm,
                                                  vote=failed != "unknown")
                t = timer.mark("rollback", t)
                _reraise_interrupt(error)
                here = f"; here: {type(error).__name__}: {error}" if error is not None else ""
                where = (f"on rank(s) {failed}" if failed != "unknown" else
                         "(the ranks could not vote on its outcome)")
                raise RebalanceError(f"rebalance failed {where}; {outcome}{here}") from error
            model.placement = new
            timer.mark("outcome", t)
    report.seconds["total"] = time.perf_counter() - t_start
    return report


class _PlanError(ValueError):
    """The placements cannot be planned (alike on every rank)."""


def _plan(old: Placement, new: Placement, mode: str, excluded, rank: int,
          report: RebalanceReport) -> RebalancePlan:
    """This rank's plan, its counts into `report`."""
    try:
        mine = RebalancePlan.for_rank(old, new, mode, excluded, rank)
    except ValueError as e:
        raise _PlanError(f"cannot plan the rebalance: {e}; nothing was changed") from e
    report.slots_changed = mine.slots_changed
    report.experts_local, report.experts_p2p, report.experts_disk = (
        mine.count("local"), mine.count("peer"), mine.count("disk"))
    report.experts_sent = sum(len(v) for v in mine.sends.values())
    return mine


def _first(held: list):
    """The first Ctrl-C held back during the rebalance (as this rank's failure), or None."""
    return held[0] if held else None


def _reraise_interrupt(error) -> None:
    """A KeyboardInterrupt (or SystemExit) that failed this rank, raised as it came once every
    rank has voted and this one is whole again."""
    if error is not None and not isinstance(error, Exception):
        raise error


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


def _write(model, layers, mine, new: Placement, rank: int, checkpoint, works, mover: RowMover,
           moves: Moves, report: RebalanceReport, timer: _Timer, t: float, error
           ) -> BaseException | None:
    """Under the write lock: disk experts (through the new slot maps) while the exchange is
    in flight, then every received and local row into its slots. Returns the first error."""
    try:
        if error is None:
            for lid in mine.changed:  # the other layers' slots keep their experts
                layers[lid].expert_slots = new.local_slots(lid, rank)
            wanted = mine.disk_experts()
            if wanted:
                path = checkpoint if checkpoint is not None else model.checkpoint_path
                if path is None:
                    raise RebalanceError("experts come from disk, but the model has no checkpoint "
                                         "path: pass checkpoint=")
                if changed_since_read(model, path):  # its other experts are the old files' (s28)
                    raise RebalanceError(f"{path}: the checkpoint changed since this rank read it; "
                                         "experts read from it now would sit beside the old ones: "
                                         "reload it fully first, or move them from peers (p2p)")
                rep = update_weights_from_disk(model, path, generate_weight_name_filter(wanted))
                report.disk_report = rep
                report.bytes_disk = rep.bytes_read
        t = timer.mark("disk", t)
    except BaseException as e:
        error = e
    try:
        _wait(works)
    except BaseException as e:
        error = error or e
    t = timer.mark("exchange", t)
    error = error or timer.error
    try:
        if error is None:
            moves.from_wire()
            write_slots(mover, moves.local_in)
            write_slots(mover, moves.received)
            refresh_merged_input_scales([layers[lid] for lid in mine.changed])
            for lid in mine.changed:
                layers[lid].weights_version += 1
            if mine.changed:
                clear_kernel_caches(model)
            synchronize(model)
    except BaseException as e:
        error = e
    timer.mark("commit", t)
    return error


def write_slots(mover: RowMover, runs: list[Run]) -> None:
    """One batch of the commit's writes (every layer's local copies, then every received
    row): between two batches a layer is half moved, which the weights lock hides from
    forwards (the tests pause here to check it)."""
    mover.scatter(runs)
