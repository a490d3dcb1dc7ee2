"""The ring: buffers that readers fill with a reload's chunks while the caller lands them.

`stream_through_ring` reads each chunk (`chunks.Chunk`) in pieces, one reader each, into a
slot of a ring of `chunks.RING_SLOTS` buffers, and hands it to `land` once read whole; a
slot is refilled only once what was landed from it has run (the event `land` returned).
A chunk larger than a slot goes in parts of a slot each (a GPU reload's: `chunks.PART_BYTES`).

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
from ..device import use_in_this_thread
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


def ring_for(model, nbytes: int, pin: bool, part_bytes: int = 0) -> Ring:
    """The model's reusable ring: slots of `part_bytes` (a chunk read and landed in parts of
    that size), or with none, grown to hold chunks of `nbytes`."""
    things = held(model)
    ring = things.get("ring")
    inherited = ring is not None and ring.shared is not None and ring.shared.pid != os.getpid()
    if inherited:  # a forked child: that memory is its parent's too (shared); it is left to it
        ring.shared, ring.buffers = None, []
    slot_bytes = ch.round_up(part_bytes or max(nbytes, ch.CHUNK_BYTES), ch.DIRECT_ALIGN)  # (blocks)
    fits = ring is not None and (ring.buffers[0].numel() == slot_bytes if part_bytes and ring.buffers
                                 else ring.fits(nbytes))
    if not fits or len(ring.buffers) != ch.RING_SLOTS:
        if ring is not None:
            ring.release()  # pinned memory is precious: the old one goes first
        ring = things["ring"] = Ring(ch.RING_SLOTS, slot_bytes, pin,
                                     shared=read_procs.shareable())
    return ring


def _reads(chunk: ch.Chunk, size: int) -> list[tuple[int, int, int, bool]]:
    """(file offset, bytes, buffer offset, direct) of each range `chunk` reads from its file
    of `size` bytes. An aligned chunk's spans are read in whole blocks (direct), but for a
    last partial block of the file, read buffered: a direct read's length is whole blocks,
    and where one would end past the end of the file is the system's call."""
    a = chunk.align
    if a == 1:
        return [(off, n, at, False) for off, n, at in chunk.spans]
    out = []
    for off, n, at in chunk.spans:
        lo, end = off - off % a, min(ch.round_up(off + n, a), size - size % a)
        if end > lo:
            out.append((lo, end - lo, at - off + lo, True))
        tail = max(end, off)
        if tail < off + n:
            out.append((tail, off + n - tail, at - off + tail, False))
    return out


def _pieces(chunk: ch.Chunk, size: int, part: tuple[int, int] | None = None) -> list[tuple]:
    """(file offset, bytes, offset in the part's buffer, direct) of each reader's piece of
    `chunk` (of the bytes ``[lo, hi)`` of its buffer: `part`; the whole chunk without),
    in pieces that share it among the readers. Part bounds are whole blocks, so pieces of
    direct ranges stay whole blocks."""
    lo, hi = part or (0, chunk.buffer_bytes)
    piece = ch.round_up(ch.piece_bytes(chunk.nbytes if part is None else hi - lo), chunk.align)
    out = []
    for off, n, at, direct in _reads(chunk, size):
        start, end = max(at, lo), min(at + n, hi)
        out += [(off + p - at, min(piece, end - p), p - lo, direct) for p in range(start, end, piece)]
    return out


def parts_of(chunks: list[ch.Chunk], part_bytes: int) -> list[tuple[int, int, int]]:
    """(chunk index, first byte, bytes) of each part of each chunk's buffer, in order: a
    chunk is read and landed in parts of `part_bytes` (whole blocks) at most."""
    return [(k, lo, min(part_bytes, c.buffer_bytes - lo)) for k, c in enumerate(chunks)
            for lo in range(0, c.buffer_bytes, part_bytes)]


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


def _piece_plan(ckpt: Checkpoint, chunk: ch.Chunk, handles: dict, stats: dict, part: tuple | None) -> list:
    """(key in `handles`, file offset, bytes, offset in the slot) of each piece of `chunk`'s
    `part` (`_pieces`)."""
    out = []
    for off, n, at, direct in _pieces(chunk, ckpt.parsed_stamp(chunk.file)[2], part):
        key = (chunk.file, "direct") if direct and (chunk.file, "direct") in handles else chunk.file
        if key != chunk.file:
            stats["bytes_direct"] = stats.get("bytes_direct", 0) + n
        out.append((key, off, n, at))
    return out


def stream_through_ring(ckpt: Checkpoint, chunks: list[ch.Chunk], ring: Ring, land: Callable, stats: dict,
                        reading: Callable[[], None] | None = None) -> None:
    """Read `chunks` through `ring` and hand each, in order, to `land(chunk, buffer, lo,
    last)` in parts of at most a slot: the bytes ``[lo, lo + len(buffer))`` of the chunk's
    buffer, `last` for its last part (a chunk that fits a slot comes whole: ``lo = 0``,
    `last`). `land` queues what it does and returns an event (`.synchronize()`) after which
    the buffer may be refilled, or None when it has finished with it. `reading()` (work
    that would otherwise wait for the reads: queueing the backup) runs once the first reads
    are under way where reader threads read: queued between parts, each call of it would
    cost several times more host time there (the threads hold the GIL). Reader processes
    share no GIL: there it is left to `land`, a part at a time, and the first parts land
    without waiting for all of it (on the H200 host, a first reload of v2-lite:4 took a
    median 74.4 ms against 78.5, `gpu/ring_probe.py --ahead`)."""
    if not chunks:
        return
    handles: dict = {}
    procs = read_procs.pool() if ring.shared is not None else None
    mine = procs is not None and procs.busy.acquire(blocking=False)  # else: threads
    parts = parts_of(chunks, ring.buffers[0].numel())
    try:
        for f in sorted({c.file for c in chunks}):  # still the parsed files (Checkpoint.open_shard)
            handles[f], _ = ckpt.open_shard(f)
        stats["files_opened"] = stats.get("files_opened", 0) + len(handles)
        _open_direct(ckpt, chunks, ring, handles)
        through = _through_processes if mine else _through_threads
        through(ckpt, chunks, parts, ring, land, stats, reading, handles, procs)
    finally:
        if mine:
            procs.busy.release()
        for h in handles.values():  # (the direct ones too)
            h.close()
        for event in ring.events:  # the next user of the ring starts from drained buffers
            if event is not None:
                event.synchronize()
        ring.events = [None] * len(ring.buffers)


def _part(chunks, parts, q: int) -> tuple:
    """(chunk, its part's bounds for `_piece_plan`: None for the whole chunk) of part `q`."""
    k, lo, n = parts[q]
    chunk = chunks[k]
    return chunk, None if lo == 0 and n == chunk.buffer_bytes else (lo, lo + n)


def _landed(ring: Ring, q: int, chunks, parts, land, stats: dict) -> None:
    k, lo, n = parts[q]
    chunk, slot = chunks[k], q % len(ring.buffers)
    last = q + 1 == len(parts) or parts[q + 1][0] != k
    ring.events[slot] = land(chunk, ring.buffers[slot][:n], lo, last)
    if last:
        stats["bytes_read"] = stats.get("bytes_read", 0) + chunk.nbytes


def _through_threads(ckpt, chunks, parts, ring, land, stats, reading, handles, _procs) -> None:
    slots = len(ring.buffers)
    paths = {c.file: ckpt.path / c.file for c in chunks}

    def read_piece(q: int, key, off: int, n: int, at: int) -> None:
        slot = q % slots
        event = ring.events[slot]
        if event is not None:
            use_in_this_thread(event)
            event.synchronize()  # what was landed from this slot has been copied out
            ring.events[slot] = None  # (the part's other readers need not ask again)
        read_into(handles[key], paths[chunks[parts[q][0]].file], off, ring.views[slot][at:at + n],
                  what=f"bytes {off}..{off + n}")

    def submit(q: int) -> list:
        chunk, part = _part(chunks, parts, q)
        plan = _piece_plan(ckpt, chunk, handles, stats, part)
        return [pool.submit(read_piece, q, *piece) for piece in plan]

    pool = reader_pool()
    pending: dict[int, list] = {}
    try:
        for q in range(min(slots, len(parts))):
            pending[q] = submit(q)
        if reading is not None:
            reading()
        for q in range(len(parts)):
            with trace.range("fp8_reload/chunk_read", payload=parts[q][2]):
                t0 = time.perf_counter()
                for f in pending[q]:
                    f.result()
                stats["read_wait"] = stats.get("read_wait", 0.0) + time.perf_counter() - t0
                del pending[q]  # kept until read whole: a failure waits for its other pieces
            _landed(ring, q, chunks, parts, land, stats)
            if q + slots < len(parts):
                pending[q + slots] = submit(q + slots)
    finally:  # a failure: reads not started are dropped, those in flight finish
        for fs in pending.values():  # before their buffers go
            for f in fs:
                f.cancel()
            wait(fs)


def _through_processes(ckpt, chunks, parts, ring, land, stats, _reading, handles, procs) -> None:
    """The reader processes' way: once part q is landed, part q + slots - 1 is asked for
    (with one slot, q + 1), after the copy out of its slot has run: that copy was queued a
    part earlier, so it has mostly run by then. An interrupt (KeyboardInterrupt, SystemExit)
    anywhere in the exchange abandons the processes: no later answer could be trusted."""
    keys: dict = {}
    try:
        procs.attach(ring.shared)
        keys = procs.open_files(handles)
        _ask_and_land(ckpt, chunks, parts, ring, land, stats, procs, keys)
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


def _ask_and_land(ckpt, chunks, parts, ring, land, stats, procs, keys: dict) -> None:
    slots = len(ring.buffers)
    mkey, size = ring.shared.key, ring.buffers[0].numel()

    def submit(q: int) -> None:
        slot = q % slots
        event = ring.events[slot]
        if event is not None:
            event.synchronize()
            ring.events[slot] = None
        chunk, part = _part(chunks, parts, q)
        procs.submit(q, [(keys[key], off, n, mkey, slot * size + at, f"bytes {off}..{off + n}")
                         for key, off, n, at in _piece_plan(ckpt, chunk, keys, stats, part)])

    asked = min(slots, len(parts))
    for q in range(asked):
        submit(q)
    for q in range(len(parts)):
        with trace.range("fp8_reload/chunk_read", payload=parts[q][2]):
            t0 = time.perf_counter()
            failed = procs.wait(q)
            stats["read_wait"] = stats.get("read_wait", 0.0) + time.perf_counter() - t0
        if failed:
            (n, what), err, got = failed[0]
            path = ckpt.path / chunks[parts[q][0]].file
            raise read_failure(path, what, got, n, OSError(err, _strerror(err)) if err else None)
        _landed(ring, q, chunks, parts, land, stats)
        # the next part whose slot's last copy was queued a part ago (one slot: this one)
        while asked < len(parts) and asked <= q + max(1, slots - 1):
            submit(asked)
            asked += 1


def _strerror(err: int) -> str:
    try:
        return os.strerror(err)
    except ValueError:
        return f"error {err}"
