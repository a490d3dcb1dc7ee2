"""The reload's backup: everything commit may change, copied first, restored on failure.

The copies are bounded by the reload: for a FusedMoE only the reloaded expert
slots of the two big weights, everything else of a touched module whole
(`backup_plan`). On a GPU model they go to a pinned host arena as async
device-to-host copies that the stream orders before the commit's writes, but for the
first pieces the commit writes (`ON_DEVICE` bytes), copied on the device. A
FusedMoE's slots are copied in pieces of about a chunk, in the order the commit
writes them, an event each: the writes of a slot wait for its piece only, so the
reload's host-to-device stream trails the backup's device-to-host one by a piece,
not by a layer. The first piece is queued before the reload reads (`begin`).
"""

from __future__ import annotations

from contextlib import nullcontext, suppress

import torch
from torch import nn

from ..checkpoint import staging
from ..device import copy_async, on_cuda, synchronize
from ..errors import RollbackError
from ..interrupts import sigint_deferred
from ..knobs import env_int
from ..layers import FusedMoE
from ..processing import reload_memory_bound
from ..quant import index_copy_
from .backup_plan import Pending, kept_plan, piece_of
from .filters import modules_by_name

_STATE_ATTRS = ("kernel_layout", "needs_processing", "weights_version")
# How far the backup's queued copies run ahead of what the commit has asked for (bytes):
# enough that the device-to-host stream never waits for the host.
LOOKAHEAD = 128 << 20
# "host": copies in CPU memory, but for `ON_DEVICE` bytes; "device": copies next to
# the weights (fast on a GPU, costs `backup_bytes` of device memory).
BACKUP_PLACES = ("host", "device")
# Of a host backup of a GPU model, the first pieces the commit writes, up to this many
# bytes, are copied on the device instead (`FP8_RELOAD_BACKUP_ON_DEVICE`; 0: none): their
# writes need not wait for the link's device-to-host direction, so the host-to-device
# copies start at once and the backup's copies through the link run that much ahead.
ON_DEVICE = env_int("FP8_RELOAD_BACKUP_ON_DEVICE", 256 << 20)


def device_memory_bound() -> int:
    """Device memory a reload may add above the loaded model with the default host backup:
    processing's chunks (`processing.reload_memory_bound`) and the backup's first pieces
    (`ON_DEVICE`). The asv suite records it beside the measured peaks."""
    return reload_memory_bound() + ON_DEVICE


def device_arena(nbytes: int, device) -> staging.DeviceArena | None:
    """`nbytes` of device memory for a host backup's first pieces, or None when the device
    has not that much free: the pinned arena takes them (a reload must not fail for want of
    memory that only makes it faster)."""
    near = staging.DeviceArena(device)
    try:
        near.reset(nbytes)
    except torch.cuda.OutOfMemoryError:
        return None
    return near


class Backup:
    """Everything commit and post-processing may change, bounded by the reload.

    Parameter objects (a failing upstream processing may have replaced them),
    each Parameter's `.data` tensor (rebinding), small per-module state, and
    copies of the bytes (`where`): for a FusedMoE only the expert slots being
    reloaded of the two big weights, everything else of a touched module whole.
    """

    def __init__(self, where: str = "host"):
        if where not in BACKUP_PLACES:
            raise ValueError(f"backup must be one of {', '.join(BACKUP_PLACES)}, got {where!r}")
        self.where = where
        self.modules: list[tuple[nn.Module, dict, dict, dict, dict]] = []
        # (tensor, [start, end) of its slots or None for all of it, the copy)
        self.big: list[tuple[torch.Tensor, tuple[int, int] | None, torch.Tensor]] = []
        # (small tensors of one dtype, their copies in one flat tensor): split on restore only
        self.small: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self.pending: list[Pending] = []  # what `capture` found to copy (`backup_plan`)
        self.nbytes = 0
        self.stream = None  # the side stream the copies ran on, if any
        self.events: dict[int, torch.cuda.Event] = {}  # id(module) -> its small copies are done
        # the big copies planned (`kept_plan`), queued up to `next`; the index of the copy
        # after which (id(module), slot or None for all of it) is backed up; their events
        self.todo, self.next, self.arena = [], 0, None
        self.on_device = 0  # the big copies before this index are kept on the device
        self.device_bytes = 0  # of `nbytes`, those kept next to the weights
        self.near = None  # the device arena of the big copies before `on_device`
        self.small_todo: dict = {}  # dtype -> the small tensors `_finish` copies together
        self.due: dict[tuple[int, int | None], int] = {}
        self.marks: set[int] = set()
        self.recorded: dict[int, torch.cuda.Event] = {}
        # (id(module), slot or None) -> when the commit first writes it (`targets.write_order`)
        self.written: dict[tuple[int, int | None], int] = {}
        self.planned: tuple = (None, None)  # (arena, stream) `start` runs the copies with
        # what `kept_plan` depends on, gathered by `capture` (`kept`: where it keeps the plan)
        self.key: list = []
        self.kept: dict | None = None
        self.begun = self.started = False
        self.on_demand = False  # `start` at the first `event_for` (or `complete`)
        self.origin = None  # the stream the copies follow, when started on demand

    def begin(self) -> None:
        """Plan the copies `capture_backup(..., start=False)` set up and, with a side stream,
        queue the first piece there now, before the reload reads: it only reads the weights,
        and a full reload with a host backup waits for the link's device-to-host direction
        (a device synchronization under the weights lock taken after it waits for it too:
        one piece, ~1 ms, about the host time from here to there)."""
        self.begun = True
        self._begin(*self.planned)

    def start(self) -> None:
        """Run the copies `capture_backup(..., start=False)` planned (those `begin` did not)."""
        self.started = True
        if not self.begun:
            self.begin()
        self._finish()

    def settle(self) -> None:
        """Wait for the copies queued so far: a reload failing before its commit leaves none
        running into the arena (`release_staging` may free it)."""
        if self.stream is not None:
            self.stream.synchronize()

    def start_on_demand(self) -> None:
        """Start when the commit first asks for an event (a side stream orders the copies before
        each write): its first host-to-device copies, queued before that, start the link while
        the host queues the backup, not after it. Begun, the next piece is queued now."""
        if self.planned[1] is None:  # no side stream: the writes are not told to wait
            self.start()
            return
        # what the copies must follow: the work queued before the commit, not the commit's own
        self.origin = torch.cuda.current_stream(self.planned[1].device)
        self.on_demand = True
        later = [k for k in self.marks if k >= self.next]
        if self.begun and later:  # the next piece now: the link's device-to-host direction runs
            self.stream.wait_stream(self.origin)  # on while the commit's first copies queue (its
            self._queue(min(later), ahead=0, record=False)  # events: `_finish`'s, as the first's)

    def _start_if_asked(self) -> None:  # (`start_on_demand` put the start off until now)
        if self.on_demand and not self.started:
            self.start()

    def run(self, arena=None, stream=None) -> None:
        """Make the copies planned by `capture`. Small tensors (scales), in one batched copy
        per dtype, and each module's reloaded slots of its big weights, one copy per run of
        adjacent slots (a view: no gather, no index to send to the device). With `arena`
        (host backups of a GPU model) they go into its pinned memory as async
        device-to-host copies. With `stream` they run there in the order the commit writes
        (`written`), an event per module or piece (`event_for`) telling the writes when
        they may start, and are queued as the commit asks for those events, `LOOKAHEAD`
        bytes ahead: the commit's first copies need not wait for the host to queue the
        whole backup. Otherwise the current stream orders them all, small ones first, now,
        before the writes."""
        self._begin(arena, stream)
        self._finish()

    def _begin(self, arena, stream) -> None:
        """`run`'s plan (kept with a kept reload plan: `capture_backup`'s memo); on a side stream
        its first piece (the link's device-to-host direction, which a full reload with a host
        backup waits for, starts first; its events are recorded by `_finish`)."""
        plan = kept_plan(self.kept, self.key, self.pending, self.written, by_piece=stream is not None)
        self.nbytes = sum(plan.sizes)
        if self.where == "device":
            self.device_bytes = self.nbytes
        elif arena is not None:  # (the big copies' sizes follow the small batches' in `sizes`)
            big, near = plan.sizes[len(plan.small):], 0
            while self.on_device < len(big) and near + staging.aligned(big[self.on_device]) <= ON_DEVICE:
                near += staging.aligned(big[self.on_device])
                self.on_device += 1
            self.near = device_arena(near, plan.big[0][1].device) if near else None
            if self.near is None:
                self.on_device = 0
            self.device_bytes = sum(big[:self.on_device])
            host = plan.sizes[:len(plan.small)] + big[self.on_device:]
            arena.reset(sum(staging.aligned(n) for n in host))
        self.arena, self.todo, self.next, self.small_todo = arena, plan.big, 0, plan.small
        if stream is not None:
            stream.wait_stream(self.origin or torch.cuda.current_stream(stream.device))
            self.stream, self.due, self.marks = stream, plan.due, plan.marks  # (only read)
            if plan.big:
                self._queue(min(self.marks), ahead=0, record=False)

    def _finish(self) -> None:
        """`run` after `_begin`: the small tensors' batched copies (after the first piece: their
        cat costs ~0.6 ms of host time on the H200, here after the commit's first copies in),
        then on a side stream one event for both and `LOOKAHEAD` bytes more, else every big
        copy."""
        stream = self.stream
        if stream is not None:  # what the copies follow: the work queued before the commit
            stream.wait_stream(self.origin or torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for tensors in self.small_todo.values():
                self.small.append((tensors, self._keep(torch.cat([t.reshape(-1) for t in tensors]),
                                                       self.arena, fresh=True)))
            if stream is not None:  # (the events of the pieces queued so far are this one: the
                first = torch.cuda.Event()  # small copies follow them, and a module's event
                first.record(stream)  # covers its small tensors too)
                self.events = {id(module): first for module, *_ in self.pending}
                self.recorded.update((k, first) for k in self.marks if k < self.next)
        self.pending = []
        self._queue(-1 if stream is not None else len(self.todo))

    def queue_all(self) -> None:
        """Queue every copy now, the writes still waiting for their own piece only: while the
        ring's first reads run, not between its parts, where reader threads make each
        queued copy cost several times more host time (reader processes: as asked)."""
        self._start_if_asked()
        self._queue(len(self.todo))

    def complete(self) -> None:
        """Queue all copies; the current stream waits for them (processing may write more)."""
        self.queue_all()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def _queue(self, upto: int, ahead: int | None = None, record: bool = True) -> None:
        """Queue the planned copies up to index `upto`, and `ahead` bytes beyond (default
        `LOOKAHEAD`); `record`: their events too (else the caller records them)."""
        ahead, queued = LOOKAHEAD if ahead is None else ahead, 0
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            while self.next < len(self.todo) and (self.next <= upto or queued < ahead):
                _, tensor, run, _ = self.todo[self.next]
                piece = piece_of(tensor, run)
                arena = self.arena if self.next >= self.on_device else self.near
                self.big.append((tensor, run, self._keep(piece, arena, fresh=False)))
                if self.next > upto:
                    queued += piece.numel() * piece.element_size()
                if record and self.next in self.marks:
                    self.recorded[self.next] = event = torch.cuda.Event()
                    event.record(self.stream)
                self.next += 1

    def _keep(self, src: torch.Tensor, arena, fresh: bool) -> torch.Tensor:
        """The backup copy of `src` (`fresh`: a new tensor nothing else holds): into `arena`
        (pinned host memory, or device memory: `ON_DEVICE`), else where the backup lives."""
        if arena is not None:
            copy = staging.typed_slice(arena, src.dtype, src.shape)
            copy_async(copy, src, torch.cuda.current_stream(src.device))
            return copy
        if self.where == "host":
            return src.to("cpu", copy=not fresh)
        return src if fresh else src.clone()

    @property
    def copies(self) -> list[tuple[torch.Tensor, tuple[int, int] | None, torch.Tensor]]:
        """Every copy as (tensor, [start, end) of its slots or None for all of it, the copy)."""
        out = []
        for tensors, flat in self.small:
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                out.append((t, None, piece.view(t.shape)))
        return out + self.big

    def event_for(self, module: nn.Module, slot: int | None = None):
        """The event after which `module` (with `slot`: that expert slot of it) may be
        overwritten, its copies queued now if they were not yet; None when the copies
        were ordered on the current stream (or not on a GPU) or `module` is not backed up."""
        self._start_if_asked()
        k = self.due.get((id(module), slot))
        if k is None:
            k = self.due.get((id(module), None))
        if k is None:
            return self.events.get(id(module))
        if k >= self.next:
            self._queue(k)
        return self.recorded[k]

    def capture(self, module: nn.Module, slots: list[int] | None) -> None:
        params = dict(module._parameters)
        buffers = dict(module._buffers)
        datas = {k: p.data for k, p in params.items() if p is not None}
        # (plain attributes live in the instance's dict: `hasattr` on a module that lacks one
        # goes through `Module.__getattr__` and a raised AttributeError, microseconds each)
        attrs = module.__dict__
        state = {k: attrs[k] for k in _STATE_ATTRS if k in attrs}
        if "staged" in attrs:  # {key: tensor} or {slot: {shard: tensor}}
            state["staged"] = {k: dict(v) if isinstance(v, dict) else v
                               for k, v in attrs["staged"].items()}
        if isinstance(module, FusedMoE):
            state["loaded_experts"] = set(module.loaded_experts)
        self.modules.append((module, params, buffers, datas, state))
        self.key.append((id(module), slots if slots is None else tuple(slots)))
        for name, p in params.items():
            if p is None:
                continue
            big = isinstance(module, FusedMoE) and name in ("w13_weight", "w2_weight")
            self.pending.append((module, datas[name], slots if big else None, big))
            self.key.append((name, id(p), p.data_ptr(), p.dtype, p.shape, p.stride()))
        for name, buf in buffers.items():
            if buf is not None:
                self.pending.append((module, buf, None, False))
                self.key.append((name, id(buf), buf.data_ptr(), buf.dtype, buf.shape, buf.stride()))

    def restore(self) -> None:
        """Objects and small state first (cannot fail), then the bytes."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        for module, params, buffers, datas, state in self.modules:
            for k, p in params.items():
                module._parameters[k] = p
                if p is not None:
                    p.data = datas[k]
            module._buffers.clear()
            module._buffers.update(buffers)
            for k, v in state.items():
                setattr(module, k, v)
        with torch.no_grad():
            for tensor, run, copy in self.copies:
                if run is None:
                    tensor.copy_(copy)
                else:
                    index_copy_(tensor, 0, torch.arange(*run, device=tensor.device), copy.to(tensor.device))


def capture_backup(model, names: list[str], process_all: bool, where: str = "host",
                   order: list[tuple[str, int | None]] | None = None, stream=None,
                   start: bool = True, memo: dict | None = None) -> Backup:
    """Back up what a reload of `names` may change. `order` is the order the commit
    writes in (`targets.write_order`: modules, and a FusedMoE's slots), so that with
    `stream` the backups it waits for finish first, a piece at a time.
    With ``start=False`` only the plan is made; `Backup.begin` queues the first piece and
    `Backup.start` the rest (the streaming reload starts them once forwards have drained, so
    that waiting for the forwards does not also wait for the whole backup). `memo`: where
    what derives from a kept plan's `names` is kept (`TargetCache.derived_of`): the slots
    backed up, the write order by module, the copies planned."""
    modules = modules_by_name(model)
    slots: dict[str, set[int]] | None = None if memo is None else memo.get("backup_slots")
    if slots is None:
        slots = {}
        for n in names:
            _, module_name, kw = model.resolve(n)
            s = slots.setdefault(module_name, set())
            if "expert_id" in kw:
                s.update(modules[module_name].local_slots(kw["expert_id"]))
        if memo is not None:
            memo["backup_slots"] = slots
    backup = Backup(where)
    backup.kept = memo
    targets = set(slots)
    if process_all:
        targets |= {name for name, _ in model.quantized_modules()}
    kept = None if memo is None else memo.get("backup_order")
    if kept is not None and kept[0] is order:
        rank, backup.written = kept[1:]
    else:
        rank = {}
        for k, (name, slot) in enumerate(order or ()):
            rank.setdefault(name, k)
            backup.written[id(modules[name]), slot] = k
        if memo is not None:  # (`kept_plan` knows a kept plan by its `written`)
            memo["backup_order"] = (order, rank, backup.written)
    for name in sorted(targets, key=lambda n: (rank.get(n, len(rank)), n)):
        module = modules[name]
        whole = (not isinstance(module, FusedMoE) or name not in slots or process_all
                 or len(slots[name]) == module.num_local_experts)
        backup.capture(module, None if whole else sorted(slots[name]))
    cuda = on_cuda(model)
    backup.planned = (staging.arena(model, "backup") if cuda and where == "host" else None,
                      stream if cuda else None)
    if start:
        backup.start()
    return backup


def roll_back(model, backup: Backup, fault: BaseException, ckpt, doing: str) -> None:
    """Restore the backup; RollbackError (and mark the model) if that fails too. The model is
    marked before a deferred Ctrl-C is handed on, so an interrupt arriving during a failing
    restore cannot leave undefined weights unmarked."""
    with sigint_deferred():
        try:
            backup.restore()
            synchronize(model)
        except BaseException as e:
            with suppress(Exception):  # queued copies read shards and staging: done before those go
                synchronize(model)
            reason = (f"reload from {ckpt.path} failed while {doing} ({type(fault).__name__}: "
                      f"{fault}) and restoring the backup failed too ({type(e).__name__}: {e})")
            model.weights_undefined = reason
            raise RollbackError(f"{reason}: the model's weights are undefined; reload it fully "
                                "(weight_name_filter=None) to repair it") from e
