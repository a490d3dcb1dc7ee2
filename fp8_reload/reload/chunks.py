"""Cutting a reload into chunks, and the reader threads that fill a ring of buffers with them.

A reload's tensors are read in file order, in big contiguous spans (the tensors of
one shard are adjacent), never one call per tensor. Each chunk (about `CHUNK_BYTES`,
one file) is read by several threads at once, `PIECE_BYTES` each, into a slot of a
ring of `RING_SLOTS` buffers; while the next chunks are read, the caller lands the
ready one (copies it to its parameters). A slot is refilled only once what was
landed from it has run (the event `land` returned).

Tunables (environment, read at import): ``FP8_RELOAD_CHUNK_BYTES`` (default 64 MiB),
``FP8_RELOAD_RING_SLOTS`` (4: the ring is 256 MiB of pinned memory on a GPU host),
``FP8_RELOAD_READ_THREADS`` (`staging.READ_THREADS`).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field

import torch

from .. import trace
from ..checkpoint.files import open_shard, read_into, read_span
from ..checkpoint.reader import Checkpoint
from ..checkpoint.staging import READ_THREADS, held, reader_pool
from ..checkpoint.values import invalid_tensor_error
from ..errors import InvalidTensorError, ReloadError
from .targets import Target

CHUNK_BYTES = int(os.environ.get("FP8_RELOAD_CHUNK_BYTES", 64 << 20))
RING_SLOTS = int(os.environ.get("FP8_RELOAD_RING_SLOTS", 4))
PIECE_BYTES = 8 << 20  # one positional read: enough to keep a thread busy, small enough to share a chunk
MIN_PIECE_BYTES = 1 << 20


def piece_bytes(nbytes: int) -> int:
    """Pieces of a chunk of `nbytes`: every reader thread takes one. A filtered reload's
    chunks are an expert each (~8 MiB at v2-lite size): in `PIECE_BYTES` pieces one or
    two threads read each, and its reads took 3x the page cache's time."""
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-nbytes // max(1, READ_THREADS))))


@dataclass
class Chunk:
    file: str
    targets: list[Target]
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (file offset, nbytes, buffer offset)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.spans)

    @property
    def extent(self) -> int:
        """Bytes of buffer the spans cover (gaps included)."""
        return self.spans[-1][2] + self.spans[-1][1]

    def offset_of(self, target: Target) -> int:
        """Where `target`'s bytes start in the chunk's buffer."""
        for off, n, at in self.spans:
            if off <= target.info.offset < off + n:
                return at + target.info.offset - off
        raise AssertionError(f"tensor {target.info.name!r} outside its chunk")

    def source(self, buf: torch.Tensor, target: Target) -> torch.Tensor:
        """`target`'s tensor inside `buf` (a buffer this chunk was read into)."""
        at = self.offset_of(target)
        info = target.info
        return buf[at:at + info.nbytes].view(info.dtype).view(tuple(info.shape))


def unit_of(t: Target):
    """Targets that must share a chunk: the pieces of one bf16 expert (quantized together)."""
    return (t.module_name, tuple(t.slots)) if t.kind == "quant" else id(t)


def make_chunks(targets: list[Target], chunk_bytes: int | None = None) -> list[Chunk]:
    """Cut the targets (in file order) into chunks of about `chunk_bytes` (default
    `CHUNK_BYTES`), one file each, never splitting a unit; adjacent tensors share one
    span (one read, one copy)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    chunks: list[Chunk] = []
    current, last_unit = None, None
    for t in targets:
        info, unit = t.info, unit_of(t)
        fits = current is not None and current.file == info.file and (
            unit == last_unit or current.nbytes + info.nbytes <= chunk_bytes)
        if not fits:
            current = Chunk(info.file, [])
            chunks.append(current)
        current.targets.append(t)
        end = current.spans[-1] if current.spans else None
        if end is not None and end[0] + end[1] == info.offset:
            current.spans[-1] = (end[0], end[1] + info.nbytes, end[2])
        else:
            current.spans.append((info.offset, info.nbytes, current.nbytes))
        last_unit = unit
    return chunks


ADVICE_GAP = 1 << 20  # ranges closer than this are advised as one


def advise_will_need(ckpt: Checkpoint, targets: list[Target]) -> None:
    """Ask the kernel to start reading the targets' byte ranges into the page cache now,
    so that a cold file is (partly) cached by the time the commit streams it. Only the
    ranges read (a filtered reload's few experts, not the span from its first to its
    last byte), each once per parsed checkpoint: advising cached pages again still walks
    them, milliseconds per GiB that a repeated reload would pay for nothing."""
    if not hasattr(os, "posix_fadvise"):
        return
    ranges: dict[str, list[list[int]]] = {}
    for t in sorted(targets, key=lambda t: (t.info.file, t.info.offset)):
        runs = ranges.setdefault(t.info.file, [])
        lo, hi = t.info.offset, t.info.offset + t.info.nbytes
        if runs and lo - runs[-1][1] <= ADVICE_GAP:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    for fname, runs in ranges.items():
        todo = [(lo, hi) for lo, hi in runs if (fname, lo, hi) not in ckpt.advised]
        if not todo:
            continue
        try:
            with open_shard(ckpt.path / fname) as handle:
                for lo, hi in todo:
                    os.posix_fadvise(handle.fileno(), lo, hi - lo, os.POSIX_FADV_WILLNEED)
                    ckpt.advised.add((fname, lo, hi))
        except OSError:
            pass  # advice only: the reads themselves report real errors


def read_scalars(ckpt: Checkpoint, targets: list[Target], check: bool) -> list[float]:
    """The values of the 0-dim float32 targets, one positional read per run of adjacent
    ones; with `check`, each must be finite and positive. Values are kept with the parsed
    checkpoint (which lives while the files' stamps are unchanged) when their shard was
    settled when parsed (`Checkpoint.settled`): a repeated reload reads none of them
    again. From a shard still fresh then they are read each time, as its weights are."""
    known = ckpt.scalars
    fresh: dict[str, float] = {}
    todo = sorted((t for t in targets if t.info.name not in known),
                  key=lambda t: (t.info.file, t.info.offset))
    for chunk in make_chunks(todo, 1 << 40):
        path = ckpt.path / chunk.file
        # kept only from a shard settled when parsed: a fresh one rewritten in place
        # within its timestamp tick keeps its stamp, and its new scales must be read
        into = known if ckpt.settled(chunk.file) else fresh
        handle, _ = ckpt.open_shard(chunk.file)
        inside = iter(chunk.targets)  # in offset order, as the spans: one pass over both
        t = next(inside, None)
        with handle:
            for off, n, _ in chunk.spans:
                raw = read_span(handle, path, off, n, what=f"scales at byte {off}").numpy().tobytes()
                while t is not None and t.info.offset < off + n:
                    (into[t.info.name],) = struct.unpack_from("<f", raw, t.info.offset - off)
                    t = next(inside, None)
    values = [fresh[n] if n in fresh else known[n] for n in (t.info.name for t in targets)]
    if check:
        for t, v in zip(targets, values):
            if not (v > 0 and v != float("inf")):  # False for NaN too
                raise InvalidTensorError(f"{ckpt.path / t.info.file}: tensor {t.info.name!r}: scale "
                                         f"must be finite and positive, got {v}")
    return values


def invalid_value(ckpt: Checkpoint, name: str, others: int = 0) -> InvalidTensorError:
    """The error for a tensor found bad where it landed: its values described from a
    fresh read of it (the rare path; the landed bytes may be gone)."""
    try:
        tensor = next(iter(ckpt.read([name])))[1]
    except ReloadError:
        tensor = None
    return invalid_tensor_error(str(ckpt.path / ckpt.weight_map[name]), name, tensor, others)


class Ring:
    """`slots` buffers (pinned when `pin`) that reader threads fill while the landed
    copies drain them; each slot remembers the event after which it may be refilled."""

    def __init__(self, slots: int, slot_bytes: int, pin: bool):
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.events: list = [None] * slots

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def fits(self, nbytes: int) -> bool:
        return bool(self.buffers) and nbytes <= self.buffers[0].numel()

    def release(self) -> None:
        self.buffers, self.views, self.events = [], [], []


def ring_for(model, nbytes: int, pin: bool) -> Ring:
    """The model's reusable ring, grown to hold chunks of `nbytes`."""
    things = held(model)
    ring = things.get("ring")
    if ring is None or not ring.fits(nbytes) or len(ring.buffers) != RING_SLOTS:
        if ring is not None:
            ring.release()  # pinned memory is precious: the old one goes first
        ring = things["ring"] = Ring(RING_SLOTS, max(nbytes, CHUNK_BYTES), pin)
    return ring


def stream_through_ring(ckpt: Checkpoint, chunks: list[Chunk], ring: Ring,
                        land: Callable[[Chunk, torch.Tensor], object], stats: dict,
                        reading: Callable[[], None] | None = None) -> None:
    """Read `chunks` through `ring` and hand each, in order, to `land(chunk, buffer)`,
    which queues what it does and returns an event (`.synchronize()`) after which the
    buffer may be refilled, or None when it has finished with it. `reading()` runs once
    the first reads are under way (work that would otherwise wait for them)."""
    if not chunks:
        return
    slots = len(ring.buffers)
    handles: dict = {}
    paths = {c.file: ckpt.path / c.file for c in chunks}

    def read_piece(k: int, off: int, n: int, at: int) -> None:
        slot = k % slots
        event = ring.events[slot]
        if event is not None:
            event.synchronize()  # what was landed from this slot has been copied out
            ring.events[slot] = None  # (the chunk's other readers need not ask again)
        read_into(handles[chunks[k].file], paths[chunks[k].file], off, ring.views[slot][at:at + n],
                  what=f"bytes {off}..{off + n}")

    def submit(pool, k: int) -> list:
        piece = piece_bytes(chunks[k].nbytes)
        return [pool.submit(read_piece, k, off + p, min(piece, n - p), at + p)
                for off, n, at in chunks[k].spans for p in range(0, n, piece)]

    try:
        for f in sorted({c.file for c in chunks}):  # still the parsed files (Checkpoint.open_shard)
            handles[f], _ = ckpt.open_shard(f)
        stats["files_opened"] = stats.get("files_opened", 0) + len(handles)
        pool = reader_pool()
        pending: dict[int, list] = {}
        try:
            for k in range(min(slots, len(chunks))):
                pending[k] = submit(pool, k)
            if reading is not None:
                reading()
            for k, chunk in enumerate(chunks):
                with trace.range("fp8_reload/chunk_read", payload=chunk.nbytes):
                    t0 = time.perf_counter()
                    for f in pending[k]:
                        f.result()
                    stats["read_wait"] = stats.get("read_wait", 0.0) + time.perf_counter() - t0
                    del pending[k]  # kept until read whole: a failure waits for its other pieces
                slot = k % slots
                ring.events[slot] = land(chunk, ring.buffers[slot])
                stats["bytes_read"] = stats.get("bytes_read", 0) + chunk.nbytes
                if k + slots < len(chunks):
                    pending[k + slots] = submit(pool, k + slots)
        finally:  # a failure: reads not started are dropped, those in flight finish
            for fs in pending.values():  # before their buffers go
                for f in fs:
                    f.cancel()
                wait(fs)
    finally:
        for h in handles.values():
            h.close()
        for event in ring.events:  # the next user of the ring starts from drained buffers
            if event is not None:
                event.synchronize()
        ring.events = [None] * len(ring.buffers)
