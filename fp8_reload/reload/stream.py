"""The streaming reload of the fixed path: checkpoint bytes go straight to their parameters.

`prepare` (before the weights lock, nothing written) reads and checks what is small
or has no fast path: the scales (finite, positive), and the few tensors that go
through a module's Python `weight_loader`. `commit` (under the lock) writes the
scales, streams everything else chunk by chunk into its place (`targets` says where,
from the loaders' own rules), and runs the remaining loaders.

Values are checked where they land (FP8 NaN encodings, non-finite floats) the first
time a checkpoint's files are reloaded; a bad value raises `InvalidTensorError` and
the transaction restores its backup. Values once checked are not checked again while
the files' stamps are unchanged (the parsed checkpoint is reused only then), if their
shard was settled when parsed (`files.settled`): a fresh one can be rewritten in place
within one timestamp tick without its stamp moving.

On a GPU the copies run on side streams (`to_device`); each write waits for the backup
of what it overwrites (`wait_for(module, slot)` gives the event: a FusedMoE's slots are
backed up in pieces), so the backup's device-to-host copies and these host-to-device
copies share the link, one each way, the writes a piece behind the backup.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import trace
from ..checkpoint.reader import Checkpoint
from ..checkpoint.staging import aligned
from ..checkpoint.values import ValueCheck, invalid_tensor_error
from ..device import model_device, side_stream
from ..interrupts import sigint_deferred
from ..processing.ops import on_triton
from ..quant import has_bad_values
from . import chunks as _chunks
from .chunks import Chunk, advise_will_need, make_chunks, read_scalars
from .plan import tensor_where
from .ring import ring_for, stream_through_ring
from .targets import Target, mark_loaded


class Kinds:
    """`targets` by how they land: scales (read first), streamed (`commit` streams them from
    the files), the loaders'. Sorted once per kept plan (`prepare`'s memo): a full reload of
    v2-lite:4 has 1,824 targets, and each pass over them costs a repeated reload host time
    before its first copy."""

    def __init__(self, targets: list[Target]):
        self.scalars = [t for t in targets if t.kind == "scalar"]
        self.scalar_bytes = sum(t.info.nbytes for t in self.scalars)
        self.streamed = [t for t in targets if t.kind in ("copy", "quant")]
        loaders = [t for t in targets if t.kind == "loader"]
        self.loaders = [t.info.name for t in loaders]
        # where the loaders' tensors are checked when read into pinned memory (a GPU model)
        self.loader_device = next((p.device for t in loaders for p in t.module.parameters() if p.is_cuda),
                                  None)
        self.loader_bytes = sum(t.info.nbytes for t in loaders)
        self.loader_arena = sum(aligned(t.info.nbytes) for t in loaders)
        self.names = [t.info.name for t in targets]
        self.files = {t.info.file for t in targets}
        self.streamed_by_file: dict[str, int] = {}  # {file: bytes the commit streams from it}
        for t in self.streamed:
            self.streamed_by_file[t.info.file] = self.streamed_by_file.get(t.info.file, 0) + t.info.nbytes


def kinds_of(targets: list[Target], memo: dict) -> Kinds:
    """`targets` by kind, kept in `memo` (a kept plan's: `TargetCache.derived_of`)."""
    kinds = memo.get("kinds")
    if kinds is None:
        kinds = memo["kinds"] = Kinds(targets)
    return kinds


@dataclass
class Prepared:
    ckpt: Checkpoint
    targets: list[Target]
    scalar_values: list[float]
    loaded: list[tuple[str, torch.Tensor]]  # (name, host tensor) for the modules' own loaders
    check: bool  # values not yet known good under these files' stamps
    kinds: Kinds  # the targets by kind (kept with a kept plan)
    whole: bool = True  # no filter: the next reload most likely lands the same copies
    # the pinned arena `commit` reads the loaders' tensors into, on a thread of their own
    # while the rest streams (`LoaderRead`); None: `prepare` read them (`loaded`)
    loaders_into: object = None
    chunks: list[Chunk] | None = None  # the streamed targets in chunks (`make_chunks`)
    # on a GPU: the shards read from registered memory, registered by the transaction before
    # the weights lock (`to_device.registered_files`); none: everything through the ring
    registered: dict = field(default_factory=dict)

    @property
    def streamed(self) -> list[Target]:
        return self.kinds.streamed

    @property
    def loaders(self) -> list[str]:
        return self.kinds.loaders

    @property
    def staged_bytes(self) -> int:
        return self.kinds.loader_bytes


def _check_host(ckpt: Checkpoint, name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and has_bad_values(tensor):
        raise invalid_tensor_error(str(ckpt.path / ckpt.weight_map[name]), name, tensor)


def _read_checked(ckpt: Checkpoint, names: list[str], stats: dict, into, check: bool,
                  threads: int | None = None, stop: threading.Event | None = None,
                  on: torch.device | None = None) -> list:
    """The tensors `names`, read (into `into`, `threads` reads at a time) and, with `check`,
    their values checked: on device `on` if given (copied there a batch at a time, one
    launch each, one wait at the end), else on the host; with `stop`, no read starts once
    it is set. On the H200 host, torch's host reductions took 4-36 ms for a bf16 v2-lite:4's
    124 MB of loader tensors, before the first chunk of a first reload could stream."""
    loaded: list = []
    if not names:
        return loaded
    values = ValueCheck(on) if check and on is not None else None
    reads = ckpt.read(names, stats, into=into, threads=threads)
    try:
        for name, tensor in reads:
            if stop is not None and stop.is_set():
                break
            if values is not None:
                values.add(name, tensor)
            elif check:
                _check_host(ckpt, name, tensor)
            loaded.append((name, tensor))
    finally:
        reads.close()  # (the reads still running are waited for)
    if values is not None:
        values.raise_if_invalid(lambda name: tensor_where(ckpt, name))
    return loaded


class LoaderRead:
    """The tensors that take a Python loader, read (and checked) on a thread of their own
    while the commit streams the rest from registered shards: read before the weights lock
    they held up the stream (a bf16 checkpoint's linear weights, ~400 MB of v2-lite:4, 15 ms
    on the H200 host). Not beside the ring's readers: a first bf16 reload took 336 ms
    against 179 (median of 20, `results/h200/reload-engine/ab-164db82-vs-wip1.txt`). A
    failure is raised by `result`, inside the commit: the transaction rolls back. `THREADS`
    reads at a time: they have the stream's time to finish, and the stream's host-to-device
    copies read host memory too."""

    THREADS = 2

    def __init__(self, ckpt: Checkpoint, names: list[str], into, check: bool):
        self.stats: dict = {}
        self.loaded: list = []
        self.error: BaseException | None = None
        self.stop, self.done = threading.Event(), threading.Event()
        self.started, self.into = False, into
        self.thread = threading.Thread(target=self._run, args=(ckpt, names, into, check),
                                       name="fp8-reload-loaders", daemon=True)

    def start(self) -> None:
        """Start the reads (Ctrl-C held back: a thread started by an interrupted `start`
        would read on unseen)."""
        with sigint_deferred(then=self.stop.set):
            self.started = True
            if self.into is not None:
                self.into.lend(self.thread, self.done)
            try:
                self.thread.start()
            except Exception:  # no thread (a KeyboardInterrupt comes once it runs: it sets `done`)
                self.done.set()
                raise

    def _run(self, ckpt, names, into, check) -> None:
        try:
            self.loaded = _read_checked(ckpt, names, self.stats, into, check, self.THREADS, self.stop)
        except BaseException as e:  # (raised again on the commit's thread)
            self.error = e
        finally:
            self.done.set()

    def settle(self) -> None:
        """Wait until none of its reads runs: they write into the arena the next reload
        reuses. A Ctrl-C meanwhile starts no more reads and is handed on once they end (an
        event, not `join`: a join cut short by Ctrl-C leaves the thread marked stopped
        while it still runs; the arena's `reset` waits too, should one slip through)."""
        held_back = None
        while self.started and not self.done.is_set():
            try:
                with sigint_deferred(then=self.stop.set):
                    self.done.wait()
            except BaseException as e:  # (one that came before the handler was in place)
                self.stop.set()
                held_back = held_back or e
        if held_back is not None:
            raise held_back

    def result(self, stats: dict) -> list:
        """Wait for the reads; their tensors, what they counted added to `stats`."""
        self.settle()
        if self.error is not None:
            raise self.error
        for key, n in self.stats.items():
            stats[key] = stats.get(key, 0) + n
        return self.loaded


def prepare(ckpt: Checkpoint, targets: list[Target], stats: dict, into=None, whole: bool = True,
            registered: set[str] | frozenset = frozenset(), memo: dict | None = None) -> Prepared:
    """Read and check the scales and the tensors that take a Python loader (into `into`, a
    pinned arena, on a GPU). Nothing in the model is written. `registered`: the shards
    registered already (`to_device.registered_now`); when they are all the commit streams
    from, the loaders' tensors are read by `commit`, beside the stream. `memo`: where what
    derives from a kept plan's `targets` alone is kept (its chunks)."""
    memo = {} if memo is None else memo
    kinds = kinds_of(targets, memo)
    # a parse's `checked` names only grow: once they hold every target, they always will
    check = memo.get("all_checked") is not ckpt and not ckpt.checked.issuperset(kinds.names)
    if not check:
        memo["all_checked"] = ckpt
    scalars, streamed = kinds.scalars, kinds.streamed
    with trace.range("fp8_reload/scales_read", payload=4 * len(scalars)):
        values = read_scalars(ckpt, scalars, check)
    stats["bytes_read"] = stats.get("bytes_read", 0) + kinds.scalar_bytes
    # (a registered shard's pages are in the page cache, pinned: no read-ahead to ask for)
    if not kinds.files.issubset(registered):
        advise_will_need(ckpt, [t for t in streamed if t.info.file not in registered])
    prep = Prepared(ckpt, targets, values, [], check, kinds, whole)
    key = ("chunks", _chunks.CHUNK_BYTES, _chunks.READ_IO)  # (what `make_chunks` lays them out by)
    if key not in memo:
        memo[key] = make_chunks(streamed)
    prep.chunks = memo[key]
    if into is not None and registered and all(c.file in registered for c in prep.chunks):
        prep.loaders_into = into
        # (grown here, before the weights lock: pinning memory holds the process's CUDA calls)
        into.reset(kinds.loader_arena)
    else:  # (before the lock, on this thread: checked on the GPU, from the pinned arena)
        prep.loaded = _read_checked(ckpt, prep.loaders, stats, into, check,
                                    on=kinds.loader_device if into is not None else None)
    return prep


def _write_scalars(targets: list[Target], values: list[float]) -> None:
    # several checkpoint scales may land on one address (gate's and up's input scale of an
    # expert): the last in file order wins, as with the loaders, so one write per address
    last = {}
    for t, v in zip(targets, values):
        for view in t.views:
            last[view.data_ptr()] = (view, v)
    pairs = list(last.values())
    if not pairs:
        return
    if on_triton(pairs[0][0]):
        from ..kernels.triton.scatter import write_scalars_  # needs triton: imported on use

        write_scalars_([view for view, _ in pairs], [v for _, v in pairs])
        return
    for view, v in pairs:
        view.fill_(v)


def commit(model, prep: Prepared, stats: dict, wait_for=None, device=None, backup_ahead=None) -> set[str]:
    """Write every target into place; returns the names of the modules touched.

    `wait_for(module, slot=None)` gives the CUDA event after which `module` (that expert
    slot of it) may be overwritten (its backup is taken), or None; `backup_ahead()` queues
    every backup copy at once (see `to_device.commit_cuda`). `device`: the model's (looked
    up when not given).
    """
    streamed = prep.streamed
    scalars = [t for t in prep.targets if t.kind == "scalar"]
    # the model's device, not a target's: a filtered bf16 reload may hold only quant targets
    # and loaders, which have no views (taken for a CPU reload, it once wrote nothing at all
    # and reported success), and on a GPU the loaders must wait for the backup too
    device = device or model_device(model) or torch.device("cpu")
    loaders = prep.loaders if prep.loaders_into is not None else []
    if loaders and not all(t.info.file in prep.registered for t in streamed):
        # (a shard registered when planned is not any more: read them first, as the ring wants)
        prep.loaded, loaders = _read_checked(prep.ckpt, loaders, stats, prep.loaders_into, prep.check), []
    reading = LoaderRead(prep.ckpt, loaders, prep.loaders_into, prep.check) if loaders else None
    try:
        if reading is not None:
            reading.start()
        if device.type == "cuda":
            _commit_cuda(model, prep, streamed, scalars, device, wait_for, stats, backup_ahead)
        else:
            _write_scalars(scalars, prep.scalar_values)
            _commit_host(model, prep, streamed, stats)
    except BaseException:
        if reading is not None:
            reading.stop.set()  # (the reads still running finish; no more start)
        raise
    finally:  # (on a failure too: no read outlives the commit into the arena the next one reuses)
        if reading is not None:
            reading.settle()
    if reading is not None:
        prep.loaded = reading.result(stats)
    if prep.loaded:
        model.load_weights(prep.loaded)
    # kept only from shards settled when parsed: a fresh one rewritten in place within
    # its timestamp tick (same size and header) keeps its stamp and this parse, and its
    # new values must be checked (as its scales are read again, reload/chunks.py)
    if prep.check:  # (otherwise every target is in `checked` already)
        prep.ckpt.checked.update(t.info.name for t in prep.targets if prep.ckpt.settled(t.info.file))
    return mark_loaded(prep.targets)


def _commit_cuda(model, prep, streamed, scalars, device, wait_for, stats, backup_ahead) -> None:
    from .to_device import commit_cuda

    stream = side_stream(device, "copy")
    waited: set[int] = set()

    def writable(module, slots=()) -> None:  # their backup is taken: they may be overwritten
        if wait_for is None:
            return
        for slot in slots or (None,):
            event = wait_for(module, slot)
            if event is not None and id(event) not in waited:
                stream.wait_event(event)
                waited.add(id(event))

    stream.wait_stream(torch.cuda.current_stream(device))
    if streamed:
        commit_cuda(model, prep.ckpt, prep.chunks, writable, prep.check, stats, device,
                    keep_tables=prep.whole, backup_ahead=backup_ahead, registered=prep.registered)
    # the scales last: written first, they would make the copy stream wait for the backup
    # of every module before its first copy (nothing of the two directions would overlap)
    with torch.cuda.stream(stream):
        for t in scalars:
            writable(t.module)
        _write_scalars(scalars, prep.scalar_values)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    if prep.loaders and wait_for is not None:  # the loaders write on the current stream
        for t in prep.targets:
            event = wait_for(t.module) if t.kind == "loader" else None
            if event is not None:
                current.wait_event(event)


def _commit_host(model, prep: Prepared, streamed: list[Target], stats: dict) -> None:
    """CPU: the same chunks and ring, plain copies."""
    chunks = prep.chunks
    if not chunks:
        return
    if any(t.kind == "quant" for t in streamed):
        raise RuntimeError("bf16 experts are quantized in the stream only on a GPU")

    def land(chunk: Chunk, buf: torch.Tensor, lo: int, last: bool) -> None:
        assert lo == 0 and last  # (the ring's slots hold a chunk each)
        for t in chunk.targets:
            src = chunk.source(buf, t)
            if prep.check:
                _check_host(prep.ckpt, t.info.name, src)
            for view in t.views:
                view.copy_(src)

    ring = ring_for(model, max(c.buffer_bytes for c in chunks), pin=False)
    with trace.range("fp8_reload/ring", payload=sum(c.nbytes for c in chunks)):
        stream_through_ring(prep.ckpt, chunks, ring, land, stats)
