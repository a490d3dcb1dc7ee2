"""Shard files the GPU's copy engine reads straight from the page cache.

A shard is memory-mapped and its pages registered with the CUDA driver
(`cudaHostRegister`, read-only): a host-to-device copy from that mapping is then
one DMA from the page cache at the link's speed, with no CPU copy and no staging
buffer. Registering a page-cached file costs about as much as copying it (the driver
pins its pages, ~18-25 ms per GiB on an H200 host), but it is CPU work, and the copies
out of a piece already pinned run meanwhile: a reload that registers as it streams
(`RegisteredFile.ensure`, chunk by chunk) moves a file at ~85% of the link's speed on
its first read (`gpu/stream_register_probe.py`). The registration is kept while the
file's stamps (size, mtime, ctime, inode) are unchanged, for the reloads after it.

What it holds: the files' pages stay resident and locked while registered (one
checkpoint's size of host memory, shared with the page cache, not a copy), within a
budget; files used longest ago are released to make room (`make_room`).
`release` (and `fr.release_staging(model)`) gives them back.

What it costs the process's other threads: while the driver pins pages it holds every
other CUDA call of the process, forwards included, whatever the GIL does
(`gpu/register_probe.py`). A file is therefore registered in pieces of
``FP8_RELOAD_REGISTER_PIECE`` bytes (default 64 MiB, ~1.5 ms), and a copy never crosses
two pieces (`to_device`: the driver would see pageable memory).

Safety: the CPU never reads a mapping (a file truncated under it would fault the
process); only the DMA engine does, and a pinned page outlives a truncation. A
writer that changes a file is caught by its stamp, checked before and after each
reload: the reload then fails and is rolled back.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import host_register, host_unregister
from .files import stamp

# cudaHostRegisterReadOnly: the driver pins the pages for reading only (the mapping is
# PROT_READ; the device never writes them).
_REGISTER_READ_ONLY = 0x08
_PAGE = mmap.PAGESIZE
PIECE_BYTES = int(os.environ.get("FP8_RELOAD_REGISTER_PIECE", 64 << 20))
_BETWEEN_PIECES = 1e-4  # s


def file_stamp(path) -> tuple | None:
    """`files.stamp` of `path`, None when it cannot be stat'ed."""
    try:
        return stamp(os.stat(path))
    except OSError:
        return None


def _unregister(ptrs: list[int], pid: int) -> None:
    if os.getpid() != pid:  # a forked child: the registrations are its parent's
        return
    for ptr in ptrs:
        host_unregister(ptr)


@dataclass
class RegisteredFile:
    path: Path
    stamp: tuple
    view: torch.Tensor  # uint8 over the whole file: DMA-able where its pieces are registered
    _map: mmap.mmap
    piece: int  # bytes per registration: view[k * piece:(k + 1) * piece] is the k-th
    _pieces: list[int]  # the addresses of those registered so far, in order
    refused: bool = False  # the driver refused a piece: no more are tried

    def __post_init__(self):
        # a registration must end before its mapping does, or the next mapping at the same
        # address cannot be registered: unregistered when this object goes, if not before
        self._unregister = weakref.finalize(self, _unregister, self._pieces, os.getpid())

    @property
    def size(self) -> int:
        return self.view.numel()

    @property
    def complete(self) -> bool:
        return len(self._pieces) * self.piece >= self.size

    def ensure(self, end: int, pause: float = 0.0) -> bool:
        """Register the pieces that hold bytes ``[0, end)``; False when the driver refuses
        one. `pause`: seconds between two pieces, for the other threads' CUDA calls (held
        while the driver pins). A reload streaming the file calls this chunk by chunk: the
        copies queued out of one piece run while the next is pinned."""
        base, size = self.view.data_ptr(), self.size
        while len(self._pieces) * self.piece < min(end, size):
            if self.refused:
                return False
            off = len(self._pieces) * self.piece
            if pause and off:
                time.sleep(pause)
            if not host_register(base + off, min(self.piece, size - off), _REGISTER_READ_ONLY):
                self.refused = True
                return False
            self._pieces.append(base + off)
        return True

    def resident(self, samples: int = 64) -> bool:
        """Whether the file's pages are in the page cache, by `samples` pages spread over it
        (`mincore`): registering a page that is not reads it from disk inside the driver,
        one page fault at a time, with the process's other CUDA calls held."""
        return pages_resident(self.view.data_ptr(), self.size, samples)

    def release(self) -> None:
        if self._map is None:
            return
        self._unregister()
        self.view = None
        self._map.close()
        self._map = None


@functools.cache
def _mincore():
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


def pages_resident(base: int, size: int, samples: int = 64) -> bool:
    """Whether `samples` pages spread over the mapping ``[base, base + size)`` (page
    aligned) are all in memory; False when this host cannot tell."""
    mincore = _mincore()
    pages = -(-size // _PAGE)
    if mincore is None or pages == 0:
        return False
    flag = ctypes.c_ubyte()
    for k in sorted({i * (pages - 1) // max(1, samples - 1) for i in range(samples)}):
        if mincore(base + k * _PAGE, _PAGE, ctypes.byref(flag)) != 0 or not flag.value & 1:
            return False
    return True


def map_file(path: Path) -> RegisteredFile | None:
    """`path` mapped, nothing registered yet (`RegisteredFile.ensure` registers); None when
    this host cannot register it (no CUDA, a file that is not a regular file)."""
    if not torch.cuda.is_available():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        # shared and read-only: the page cache's own pages, nothing copied on write
        mapped = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is, on purpose
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(mapped, dtype=torch.uint8)
    piece = max(_PAGE, PIECE_BYTES // _PAGE * _PAGE)  # pieces never share a page
    return RegisteredFile(Path(path), stamp(st), view, mapped, piece, [])


def register(path: Path) -> RegisteredFile | None:
    """Map and register the whole of `path` now, a piece at a time (`map_file`); None when
    this host cannot or the driver refuses, with no piece left pinned."""
    reg = map_file(path)
    if reg is None:
        return None
    whole = False
    try:
        whole = reg.ensure(reg.size, _BETWEEN_PIECES)
    finally:  # refused, or interrupted (a signal between pieces): no piece stays pinned
        if not whole:  # once its mapping is gone
            reg.release()
    return reg if whole else None


class RegisteredShards:
    """The registered shards a model reloads from, by path (`staging.holder` keeps it on
    the model, so `release_staging` gives them back)."""

    KEEP_COUNTS = 4096  # paths whose reads are counted

    def __init__(self):
        self.files: dict[str, RegisteredFile] = {}
        self.refused: set[tuple] = set()  # (path, stamp) registration failed for: not retried
        self.reads: dict[str, tuple] = {}  # path: (stamp, reloads that read it under that stamp)

    def current(self, path) -> RegisteredFile | None:
        """`path` registered whole, if its stamp still matches. A changed file is released,
        and so is one a reload left part registered (the driver refused a piece, or the
        reload was interrupted: it has finished with the device since)."""
        key = str(path)
        reg = self.files.get(key)
        if reg is None:
            return None
        if not reg.complete or reg.stamp != file_stamp(path):
            if reg.refused:
                self.refused.add((key, reg.stamp))
            self.drop(key)  # its pages are not this file's any more, or not all pinned
            return None
        self.files[key] = self.files.pop(key)  # (most recently used last)
        return reg

    def get(self, path, now: bool = True) -> RegisteredFile | None:
        """`path` registered: the current registration, or a new one (None if refused).
        `now`: every piece at once; otherwise mapped only, for a reload to register as it
        streams the file (`RegisteredFile.ensure`)."""
        reg = self.current(path)
        if reg is not None:
            return reg
        if (str(path), file_stamp(path)) in self.refused:
            return None
        reg = register(Path(path)) if now else map_file(Path(path))
        if reg is None:
            self.refused.add((str(path), file_stamp(path)))
            return None
        self.files[str(path)] = reg
        return reg

    def drop(self, path) -> None:
        reg = self.files.pop(str(path), None)
        if reg is not None:
            reg.release()

    def make_room(self, nbytes: int, budget: int, keep: set[str]) -> bool:
        """Whether `nbytes` more fit in `budget`, after releasing the files changed or gone
        since they were registered, then those used longest ago outside `keep` (RL weight
        sync reads each step's checkpoint from new files: the old ones would stay pinned)."""
        for key, reg in list(self.files.items()):
            if reg.stamp != file_stamp(key):
                self.drop(key)
        for key in list(self.files):
            if self.nbytes() + nbytes <= budget:
                break
            if key not in keep:
                self.drop(key)
        return self.nbytes() + nbytes <= budget

    def count_read(self, path, stamp: tuple) -> int:
        """One more reload reads `path` under `stamp`: how many have (a new stamp starts
        over). Paths counted longest ago are forgotten beyond `KEEP_COUNTS` (RL weight
        sync may write each step's checkpoint to a new directory)."""
        key = str(path)
        old = self.reads.pop(key, None)
        n = old[1] + 1 if old is not None and old[0] == stamp else 1
        self.reads[key] = (stamp, n)  # (most recent last)
        while len(self.reads) > self.KEEP_COUNTS:
            self.reads.pop(next(iter(self.reads)))
        return n

    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def release(self) -> None:
        for f in self.files.values():
            f.release()
        self.files.clear()
        self.refused.clear()
        self.reads.clear()
