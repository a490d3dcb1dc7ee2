"""Cutting a reload into chunks (read through `ring`), its scales, and advice to the kernel.

A reload's tensors are read in file order, in big contiguous spans (the tensors of
one shard are adjacent), never one call per tensor. Each chunk (about `CHUNK_BYTES`,
one file) is read by several readers at once, `PIECE_BYTES` at most each, into a slot
of a ring of `RING_SLOTS` buffers (`ring.stream_through_ring`).

Tunables (environment, read at import): ``FP8_RELOAD_CHUNK_BYTES`` (default 64 MiB),
``FP8_RELOAD_RING_SLOTS`` (4), ``FP8_RELOAD_PART_BYTES`` (16 MiB; 0: a slot per chunk): a GPU
reload's ring slots for an FP8 checkpoint (bf16 chunks, quantized in the stream, land whole:
in parts they were slower), a chunk read and copied to the device a part at a time (the ring is
64 MiB of pinned memory; small enough to stay in the CPU's cache between the readers' writes
and the copy's reads: a ring of 4 x 64 MiB slots moved the same bytes at 53% of the
host-to-device limit beside a device-to-host copy, 4 x 16 MiB at 88%, `gpu/ring_probe.py`),
``FP8_RELOAD_READ_THREADS`` (`staging.READ_THREADS`), ``FP8_RELOAD_READERS``
(`checkpoint.read_procs`), ``FP8_RELOAD_IO``: ``buffered`` (default) or ``direct``.

``direct`` reads the ring's chunks with O_DIRECT, past the page cache, at the disk's
speed: for a checkpoint read once (an RL step's new weights, a model larger than the
page cache), whose pages would only push others out. It leaves nothing cached, so a
checkpoint reloaded again (EPLB) is read from the disk again: there, ``buffered`` (the
first reload fills the cache, the next ones read it at memory speed) is the better
choice. A chunk read direct lays each span in its buffer at its file offset's place
within a block (`DIRECT_ALIGN`), so reads start, end and land on block boundaries;
files that refuse O_DIRECT (tmpfs) are read buffered.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass, field

import torch

from ..checkpoint.files import open_shard, read_span
from ..checkpoint.reader import Checkpoint
from ..checkpoint.staging import PIECE_BYTES, READ_THREADS
from ..checkpoint.values import invalid_tensor_error
from ..errors import InvalidTensorError, ReloadError
from ..knobs import env_choice, env_int
from .targets import Target

CHUNK_BYTES = env_int("FP8_RELOAD_CHUNK_BYTES", 64 << 20, minimum=1, maximum=1 << 36)  # (a ring of
RING_SLOTS = env_int("FP8_RELOAD_RING_SLOTS", 4, minimum=1, maximum=1024)  # them is shared memory)
PART_BYTES = env_int("FP8_RELOAD_PART_BYTES", 16 << 20)  # (0: a slot per chunk)
READ_IO = env_choice("FP8_RELOAD_IO", "buffered", ("buffered", "direct"))
DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and addresses in whole logical blocks (512 or 4096)
MIN_PIECE_BYTES = 1 << 20
WINDOW_SLACK = 8  # a registered chunk moves as one window while its gaps are <= 1/8 of its bytes


def piece_bytes(nbytes: int) -> int:
    """Pieces of a chunk of `nbytes`: every reader takes one. A filtered reload's
    chunks are an expert each (~8 MiB at v2-lite size): in `PIECE_BYTES` pieces one or
    two threads read each, and its reads took 3x the page cache's time."""
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-nbytes // max(1, READ_THREADS))))


@dataclass
class Chunk:
    file: str
    targets: list[Target]
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (file offset, nbytes, buffer offset)
    align: int = 1  # > 1: every span's buffer offset is its file offset modulo this (read direct)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.spans)

    @property
    def extent(self) -> int:
        """Bytes of buffer the spans cover (gaps included)."""
        return self.spans[-1][2] + self.spans[-1][1]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of buffer its reads fill (the extent, to a whole block when aligned)."""
        return round_up(self.extent, self.align)

    def offset_of(self, target: Target) -> int:
        """Where `target`'s bytes start in the chunk's buffer."""
        for off, n, at in self.spans:
            if off <= target.info.offset < off + n:
                return at + target.info.offset - off
        raise AssertionError(f"tensor {target.info.name!r} outside its chunk")

    def source(self, buf: torch.Tensor, target: Target) -> torch.Tensor:
        """`target`'s tensor inside `buf` (a buffer this chunk was read into). Spans keep
        their file offset's place in a block or window (direct reads, registered shards),
        and a header of odd length (the format allows one) puts every 2- and 4-byte tensor
        at an odd offset, which torch cannot view as that dtype: such a tensor comes as an
        aligned copy of its bytes, made on the current stream."""
        at = self.offset_of(target)
        info = target.info
        raw = buf[at:at + info.nbytes]
        if raw.storage_offset() % info.dtype.itemsize:
            raw = raw.clone()
        return raw.view(info.dtype).view(tuple(info.shape))

    def moved(self, by: int) -> Chunk:
        """The chunk in its buffer less the first `by` bytes (each span's place `by` less): a
        layout in device memory, which no read fills (alignment 1)."""
        return Chunk(self.file, self.targets, [(o, n, at - by) for o, n, at in self.spans])

    @functools.cached_property
    def first_quant(self) -> Target | None:
        """Its first quantized (bf16) target, None without one (found once: a kept plan keeps
        its chunks, and every reload lands them)."""
        return next((t for t in self.targets if t.kind == "quant"), None)

    @functools.cached_property
    def window(self) -> tuple[Chunk, int | None, int | None]:
        """`registered_window` of it, worked out once (a kept plan keeps its chunks)."""
        return registered_window(self)

    def quant_lead(self) -> int:
        """How far past 16 bytes its first quantized (bf16) tensor sits in its buffer, where
        the buffer holds that many bytes before its first span (else 0). Direct reads lay
        a chunk on its file's alignment: with a header that puts the data 8 bytes past 16,
        every bf16 weight was 8 bytes off in device memory, which sends the quantization
        to its element-wise variant (and a compile of it, ~0.8 s, on its first use)."""
        lead = 0 if self.first_quant is None else self.offset_of(self.first_quant) % 16
        return lead if lead <= self.spans[0][2] else 0


def registered_window(chunk: Chunk) -> tuple[Chunk, int | None, int | None]:
    """How a chunk of a registered file moves: as `(chunk, start, end)`, one DMA of the file's
    bytes ``[start, end)`` where the gaps are small (a full reload's: scales read before the
    lock), else its spans alone, each to its place in the chunk's buffer (a filtered
    reload's, mostly gaps). Either puts a bf16 chunk's first quantized tensor on 16 bytes of
    device buffer, as the ring puts a chunk that starts with one (on the file's alignment,
    where a header made it 8 mod 16, they sat 8 bytes off: `Chunk.quant_lead`; compiled
    anew at a second reload, 876 ms on the H200); other chunks keep the file's alignment."""
    start, end = chunk.spans[0][0], chunk.spans[-1][0] + chunk.spans[-1][1]
    start -= (start - (0 if chunk.first_quant is None else chunk.first_quant.info.offset)) % 16
    if end - start > chunk.extent + chunk.extent // WINDOW_SLACK:
        lead = chunk.quant_lead()  # (spans laid for direct reads: on the file's alignment)
        return (chunk.moved(lead) if lead else chunk), None, None
    return Chunk(chunk.file, chunk.targets, [(o, n, o - start) for o, n, _ in chunk.spans]), start, end


def unit_of(t: Target):
    """Targets that must share a chunk: the pieces of one bf16 expert, the shards of one bf16
    linear (quantized together)."""
    return (t.module_name, tuple(t.slots)) if t.kind == "quant" else id(t)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def make_chunks(targets: list[Target], chunk_bytes: int | None = None,
                align: int | None = None) -> list[Chunk]:
    """Cut the targets (in file order) into chunks of at most `chunk_bytes` (default
    `CHUNK_BYTES`) or one unit, one file each, never splitting a unit (one that does not
    fit whole starts a chunk); adjacent tensors share one span (one read, one copy).
    `align` > 1 (default: `DIRECT_ALIGN` when `READ_IO` is direct) lays the spans for
    direct reads: each at its file offset modulo `align`, past the whole blocks of the one
    before."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if align is None:
        align = DIRECT_ALIGN if READ_IO == "direct" else 1
    unit_bytes: dict = {}
    for t in targets:
        unit_bytes[unit_of(t)] = unit_bytes.get(unit_of(t), 0) + t.info.nbytes
    chunks: list[Chunk] = []
    current, last_unit = None, None
    for t in targets:
        info, unit = t.info, unit_of(t)
        fits = current is not None and current.file == info.file and (
            unit == last_unit or current.nbytes + unit_bytes[unit] <= chunk_bytes)
        if not fits:
            current = Chunk(info.file, [], align=align)
            chunks.append(current)
        current.targets.append(t)
        end = current.spans[-1] if current.spans else None
        if end is not None and end[0] + end[1] == info.offset:
            current.spans[-1] = (end[0], end[1] + info.nbytes, end[2])
        else:
            start = current.buffer_bytes if current.spans else 0
            current.spans.append((info.offset, info.nbytes, start + info.offset % align))
        last_unit = unit
    return chunks


ADVICE_GAP = 1 << 20  # bytes between ranges one advice may span
SCALAR_GAP = 4 << 10  # bytes between scales one read may span (safetensors keeps them together)


def near_runs(targets: list[Target], gap: int) -> dict[str, list[list]]:
    """{file: [[start, end, targets]]}: `targets` in file order, in runs that take in at
    most `gap` bytes no target of theirs holds (one read, or one advice, each)."""
    out: dict[str, list[list]] = {}
    for t in sorted(targets, key=lambda t: (t.info.file, t.info.offset)):
        lo, hi, runs = t.info.offset, t.info.offset + t.info.nbytes, out.setdefault(t.info.file, [])
        between = lo - runs[-1][1] if runs else -1
        if between >= 0 and runs[-1][3] + between <= gap:
            runs[-1][1] = hi
            runs[-1][2].append(t)
            runs[-1][3] += between
        else:
            runs.append([lo, hi, [t], 0])
    return {f: [r[:3] for r in runs] for f, runs in out.items()}


def advise_will_need(ckpt: Checkpoint, targets: list[Target]) -> None:
    """Ask the kernel to start reading the targets' byte ranges into the page cache now,
    so that a cold file is (partly) cached by the time the commit streams it. Only the
    ranges read (a filtered reload's few experts, not the span from its first to its
    last byte), each once per parsed checkpoint: advising cached pages again still walks
    them, milliseconds per GiB that a repeated reload would pay for nothing. Direct
    reads (`READ_IO`) take no advice: it would fill the page cache they keep clear."""
    if not hasattr(os, "posix_fadvise") or READ_IO == "direct":
        return
    for fname, runs in near_runs(targets, ADVICE_GAP).items():
        todo = [(lo, hi) for lo, hi, _ in runs if (fname, lo, hi) not in ckpt.advised]
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
    """The values of the 0-dim float32 targets, one positional read per run of near
    ones; with `check`, each must be finite and positive. Values are kept with the parsed
    checkpoint (which lives while the files' stamps are unchanged) when their shard was
    settled when parsed (`Checkpoint.settled`): a repeated reload reads none of them
    again. From a shard still fresh then they are read each time, as its weights are."""
    known = ckpt.scalars
    fresh: dict[str, float] = {}
    todo = [t for t in targets if t.info.name not in known]
    for fname, its in near_runs(todo, SCALAR_GAP).items():
        path = ckpt.path / fname
        # kept only from a shard settled when parsed: a fresh one rewritten in place
        # within its timestamp tick keeps its stamp, and its new scales must be read
        into = known if ckpt.settled(fname) else fresh
        handle, _ = ckpt.open_shard(fname)
        with handle:
            for lo, hi, inside in its:
                raw = read_span(handle, path, lo, hi - lo, what=f"scales at byte {lo}").numpy().tobytes()
                for t in inside:
                    (into[t.info.name],) = struct.unpack_from("<f", raw, t.info.offset - lo)
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
