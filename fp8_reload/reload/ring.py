"""The ring: buffers that readers fill with a reload's chunks while the caller lands them.

`stream_through_ring` reads each chunk (`chunks.Chunk`) in pieces, one reader each, into a
slot of a ring of `chunks.RING_SLOTS` buffers, and hands it to `land` once read whole; a
slot is refilled only once what was landed from it has run (the event `land` returned).

The readers are processes where the system allows (`checkpoint.read_procs`): the thread
landing the chunks then shares its GIL with nobody, and each of its calls costs what it
costs alone. Otherwise, or while another ring of this process uses them, reader threads
(`staging.reader_pool`). The ring is shared memory wherever Linux gives memfd (for
threads too: its slots start on page boundaries, as direct reads need), registered with
the CUDA driver for a GPU reload.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import wait

import torch

from .. import trace
from ..checkpoint import read_procs
from ..checkpoint.files import read_failure, read_into, reopen_direct
from ..checkpoint.reader import Checkpoint
from ..checkpoint.staging import held, reader_pool
from . import chunks as ch


class Ring:
    """`slots` buffers (pinned when `pin`; one shared-memory block when `shared`) that
    readers fill while the landed copies drain them; each slot remembers the event after
    which it may be refilled."""

    def __init__(self, slots: int, slot_bytes: int, pin: bool, shared: bool = False):
        self.shared = None
        if shared:
            buf = read_procs.SharedBuffer(slots * slot_bytes)
            if not pin or buf.pin():
                self.shared = buf
                self._forget = weakref.finalize(self, read_procs.forget, buf)
            else:
                buf.release()
        if self.shared is not None:
            whole = self.shared.tensor
            self.buffers = [whole[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]
        else:  # (pinned memory comes in whole pages; plain memory is aligned here, for direct reads)
            pad = 0 if pin else ch.DIRECT_ALIGN
            raw = [torch.empty(slot_bytes + pad, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
            self.buffers = [r[-r.data_ptr() % pad:][:slot_bytes] if pad else r for r in raw]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.aligned = all(b.data_ptr() % ch.DIRECT_ALIGN == 0 for b in self.buffers)
        self.events: list = [None] * slots

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def fits(self, nbytes: int) -> bool:
        return bool(self.buffers) and nbytes <= self.buffers[0].numel()

    def release(self) -> None:
        self.buffers, self.views, self.events = [], [], []
        if self.shared is not None:
            self._forget()
            self.shared = None


def ring_for(model, nbytes: int, pin: bool) -> Ring:
    """The model's reusable ring, grown to hold chunks of `nbytes`."""
    things = held(model)
    ring = things.get("ring")
    inherited = ring is not None and ring.shared is not None and ring.shared.pid != os.getpid()
    if inherited:  # a forked child: that memory is its parent's too (shared); it is left to it
        ring.shared, ring.buffers = None, []
    if ring is None or not ring.fits(nbytes) or len(ring.buffers) != ch.RING_SLOTS:
        if ring is not None:
            ring.release()  # pinned memory is precious: the old one goes first
        slot_bytes = ch.round_up(max(nbytes, ch.CHUNK_BYTES), ch.DIRECT_ALIGN)  # slots start on blocks
        ring = things["ring"] = Ring(ch.RING_SLOTS, slot_bytes, pin,
                                     shared=read_procs.shareable())
    return ring


def _pieces(chunk: ch.Chunk, size: int) -> list[tuple[int, int, int, bool]]:
    """(file offset, bytes, buffer offset, direct) of each reader's piece of `chunk`, whose
    file holds `size` bytes. An aligned chunk's spans are read in whole blocks (direct),
    but for a last partial block of the file, read buffered: a direct read's length is
    whole blocks, and where one would end past the end of the file is the system's call."""
    a = chunk.align
    piece = ch.round_up(ch.piece_bytes(chunk.nbytes), a)
    if a == 1:
        return [(off + p, min(piece, n - p), at + p, False) for off, n, at in chunk.spans
                for p in range(0, n, piece)]
    out = []
    for off, n, at in chunk.spans:
        lo, end = off - off % a, min(ch.round_up(off + n, a), size - size % a)
        out += [(p, min(piece, end - p), at - off + p, True) for p in range(lo, end, piece)]
        tail = max(end, off)
        if tail < off + n:
            out.append((tail, off + n - tail, at - off + tail, False))
    return out


def _open_direct(ckpt: Checkpoint, chunks: list[ch.Chunk], ring: Ring, handles: dict) -> None:
    """Add to `handles` ((file, "direct"): the same open shard again, with O_DIRECT) for
    the aligned chunks' files that allow it; the others are read buffered (a warning says
    so, once per checkpoint directory)."""
    for f in sorted({c.file for c in chunks if c.align > 1}):
        handle = reopen_direct(handles[f]) if ring.aligned else None
        if handle is not None:
            handles[f, "direct"] = handle
        elif ckpt.path not in _REFUSED:
            _REFUSED.add(ckpt.path)
            why = "the file system refuses O_DIRECT" if ring.aligned else "ring buffers not block-aligned"
            warnings.warn(f"{ckpt.path / f}: {why}: read through the page cache", RuntimeWarning,
                          stacklevel=4)


_REFUSED: set = set()


def _piece_plan(ckpt: Checkpoint, chunk: ch.Chunk, handles: dict, stats: dict) -> list[tuple]:
    """(key in `handles`, file offset, bytes, buffer offset) of each piece of `chunk`."""
    out = []
    for off, n, at, direct in _pieces(chunk, ckpt.parsed_stamp(chunk.file)[2]):
        key = (chunk.file, "direct") if direct and (chunk.file, "direct") in handles else chunk.file
        if key != chunk.file:
            stats["bytes_direct"] = stats.get("bytes_direct", 0) + n
        out.append((key, off, n, at))
    return out


def stream_through_ring(ckpt: Checkpoint, chunks: list[ch.Chunk], ring: Ring,
                        land: Callable[[ch.Chunk, torch.Tensor], object], stats: dict,
                        reading: Callable[[], None] | None = None) -> None:
    """Read `chunks` through `ring` and hand each, in order, to `land(chunk, buffer)`,
    which queues what it does and returns an event (`.synchronize()`) after which the
    buffer may be refilled, or None when it has finished with it. `reading()` runs once
    the first reads are under way (work that would otherwise wait for them)."""
    if not chunks:
        return
    handles: dict = {}
    procs = read_procs.pool() if ring.shared is not None else None
    mine = procs is not None and procs.busy.acquire(blocking=False)  # else: threads
    try:
        for f in sorted({c.file for c in chunks}):  # still the parsed files (Checkpoint.open_shard)
            handles[f], _ = ckpt.open_shard(f)
        stats["files_opened"] = stats.get("files_opened", 0) + len(handles)
        _open_direct(ckpt, chunks, ring, handles)
        through = _through_processes if mine else _through_threads
        through(ckpt, chunks, ring, land, stats, reading, handles, procs)
    finally:
        if mine:
            procs.busy.release()
        for h in handles.values():  # (the direct ones too)
            h.close()
        for event in ring.events:  # the next user of the ring starts from drained buffers
            if event is not None:
                event.synchronize()
        ring.events = [None] * len(ring.buffers)


def _landed(ring: Ring, k: int, chunk, land, stats: dict) -> None:
    slot = k % len(ring.buffers)
    ring.events[slot] = land(chunk, ring.buffers[slot])
    stats["bytes_read"] = stats.get("bytes_read", 0) + chunk.nbytes


def _through_threads(ckpt, chunks, ring, land, stats, reading, handles, _procs) -> None:
    slots = len(ring.buffers)
    paths = {c.file: ckpt.path / c.file for c in chunks}

    def read_piece(k: int, key, off: int, n: int, at: int) -> None:
        slot = k % slots
        event = ring.events[slot]
        if event is not None:
            event.synchronize()  # what was landed from this slot has been copied out
            ring.events[slot] = None  # (the chunk's other readers need not ask again)
        read_into(handles[key], paths[chunks[k].file], off, ring.views[slot][at:at + n],
                  what=f"bytes {off}..{off + n}")

    def submit(k: int) -> list:
        return [pool.submit(read_piece, k, *piece) for piece in _piece_plan(ckpt, chunks[k], handles, stats)]

    pool = reader_pool()
    pending: dict[int, list] = {}
    try:
        for k in range(min(slots, len(chunks))):
            pending[k] = submit(k)
        if reading is not None:
            reading()
        for k, chunk in enumerate(chunks):
            with trace.range("fp8_reload/chunk_read", payload=chunk.nbytes):
                t0 = time.perf_counter()
                for f in pending[k]:
                    f.result()
                stats["read_wait"] = stats.get("read_wait", 0.0) + time.perf_counter() - t0
                del pending[k]  # kept until read whole: a failure waits for its other pieces
            _landed(ring, k, chunk, land, stats)
            if k + slots < len(chunks):
                pending[k + slots] = submit(k + slots)
    finally:  # a failure: reads not started are dropped, those in flight finish
        for fs in pending.values():  # before their buffers go
            for f in fs:
                f.cancel()
            wait(fs)


def _through_processes(ckpt, chunks, ring, land, stats, reading, handles, procs) -> None:
    """The reader processes' way: once chunk k is landed, chunk k + slots - 1 is asked for
    (with one slot, k + 1), after the copy out of its slot has run: that copy was queued a
    chunk earlier, so it has mostly run by then. An interrupt (KeyboardInterrupt, SystemExit)
    anywhere in the exchange abandons the processes: no later answer could be trusted."""
    keys: dict = {}
    try:
        procs.attach(ring.shared)
        keys = procs.open_files(handles)
        _ask_and_land(ckpt, chunks, ring, land, stats, reading, procs, keys)
    except BaseException as e:
        if not isinstance(e, Exception):
            procs.abandon()
        raise
    finally:  # a failure: every read asked for finishes before the ring is used again
        try:
            procs.drain()
            if not procs.broken:
                procs.close_files(keys)
                procs.unmap_dropped()  # rings collected meanwhile (`read_procs.forget`)
        except BaseException:
            procs.abandon()
            raise


def _ask_and_land(ckpt, chunks, ring, land, stats, reading, procs, keys: dict) -> None:
    slots = len(ring.buffers)
    mkey, size = ring.shared.key, ring.buffers[0].numel()

    def submit(k: int) -> None:
        slot = k % slots
        event = ring.events[slot]
        if event is not None:
            event.synchronize()
            ring.events[slot] = None
        procs.submit(k, [(keys[key], off, n, mkey, slot * size + at, f"bytes {off}..{off + n}")
                         for key, off, n, at in _piece_plan(ckpt, chunks[k], keys, stats)])

    asked = min(slots, len(chunks))
    for k in range(asked):
        submit(k)
    if reading is not None:
        reading()
    for k, chunk in enumerate(chunks):
        with trace.range("fp8_reload/chunk_read", payload=chunk.nbytes):
            t0 = time.perf_counter()
            failed = procs.wait(k)
            stats["read_wait"] = stats.get("read_wait", 0.0) + time.perf_counter() - t0
        if failed:
            (n, what), err, got = failed[0]
            path = ckpt.path / chunk.file
            raise read_failure(path, what, got, n, OSError(err, _strerror(err)) if err else None)
        _landed(ring, k, chunk, land, stats)
        # the next chunk whose slot's last copy was queued a chunk ago (one slot: this one)
        while asked < len(chunks) and asked <= k + max(1, slots - 1):
            submit(asked)
            asked += 1


def _strerror(err: int) -> str:
    try:
        return os.strerror(err)
    except ValueError:
        return f"error {err}"
