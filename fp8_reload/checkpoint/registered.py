"""Shard files the GPU's copy engine reads straight from the page cache.

A shard is memory-mapped and its pages registered with the CUDA driver
(`cudaHostRegister`, read-only): a host-to-device copy from that mapping is then
one DMA from the page cache at the link's speed, with no CPU copy and no staging
buffer. Registering costs about as much as reading the file once (the pages are
faulted in and pinned), so it is done for files that are reloaded again and again,
and kept while their stamps (size, mtime, ctime, inode) are unchanged.

Registering as a reload streams a file (pin a piece, queue its copies, pin the next)
does not pay: on an idle device a piece pins in ~1.4 ms per 64 MiB, but with the
reload's copies, scatters and backup running it took 3.5-4.5 ms, and a first reload
that did so took 193-209 ms against 105-120 ms through the readers' ring
(`gpu/first_reload_probe.py`, `gpu/stream_register_probe.py`,
`results/h200/reload-engine/*-72d364f.txt`).

What it holds: the files' pages stay resident and locked while registered (one
checkpoint's size of host memory, shared with the page cache, not a copy), within a
budget; files changed or gone, then those used longest ago, are dropped to make room
(`make_room`), and unregistered under the weights lock once the device is idle
(`release_dropped`: the driver's unregister waits for the whole device). `release` (and
`fr.release_staging(model)`) gives them back.

What it costs the process's other threads: while the driver pins pages it holds every
other CUDA call of the process (~22-25 ms per GiB on an H200 host, `gpu/register_probe.py`),
forwards included, whatever the GIL does. A file is therefore registered in pieces of
``FP8_RELOAD_REGISTER_PIECE`` bytes (default 64 MiB: no wait of another thread's step
over 2.3 ms, against 6.7 ms with 256 MiB pieces), with the other threads let in between;
a copy never crosses two pieces (`to_device`: the driver would see pageable memory).

Safety: the CPU never reads a mapping (a file truncated under it would fault the
process); only the DMA engine does, and a pinned page outlives a truncation. A
writer that changes a file is caught by its stamp, checked before and after each
reload: the reload then fails and is rolled back.
"""

from __future__ import annotations

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
from ..knobs import env_int
from .files import stamp

# cudaHostRegisterReadOnly: the driver pins the pages for reading only (the mapping is
# PROT_READ; the device never writes them).
_REGISTER_READ_ONLY = 0x08
_PAGE = mmap.PAGESIZE
PIECE_BYTES = env_int("FP8_RELOAD_REGISTER_PIECE", 64 << 20, minimum=1)
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
    view: torch.Tensor  # uint8 over the whole file, in registered (DMA-able) host memory
    _map: mmap.mmap
    piece: int  # bytes per registration: view[k * piece:(k + 1) * piece] is the k-th
    _pieces: list[int]  # their addresses

    @property
    def size(self) -> int:
        return self.view.numel()

    def __post_init__(self):
        # a registration must end before its mapping does, or the next mapping at the same
        # address cannot be registered: unregistered when this object goes, if not before
        self._unregister = weakref.finalize(self, _unregister, self._pieces, os.getpid())

    def release(self) -> None:
        if self._map is None:
            return
        self._unregister()
        self.view = None
        self._map.close()
        self._map = None


def register(path: Path) -> RegisteredFile | None:
    """Map and register `path`; None when this host cannot (no CUDA, a driver that
    refuses read-only registration, a file that is not a regular file)."""
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
    base, done, whole = view.data_ptr(), [], False
    try:
        for off in range(0, st.st_size, piece):
            if done:  # the other threads' CUDA calls, held while the driver pinned, go now
                time.sleep(_BETWEEN_PIECES)
            if not host_register(base + off, min(piece, st.st_size - off), _REGISTER_READ_ONLY):
                break
            done.append(base + off)
        else:
            whole = True
    finally:  # refused, or interrupted (a signal between pieces): no piece stays pinned
        if not whole:  # once its mapping is gone
            _unregister(done, os.getpid())
            mapped.close()
    return RegisteredFile(Path(path), stamp(st), view, mapped, piece, done) if whole else None


class RegisteredShards:
    """The registered shards a model reloads from, by path (`staging.holder` keeps it on
    the model, so `release_staging` gives them back)."""

    KEEP_COUNTS = 4096  # paths whose reads are counted

    def __init__(self):
        self.files: dict[str, RegisteredFile] = {}
        self.refused: set[tuple] = set()  # (path, stamp) registration failed for: not retried
        self.reads: dict[str, tuple] = {}  # path: (stamp, reloads that read it under that stamp)
        self.dropped: list[RegisteredFile] = []  # out of use, unregistered by `release_dropped`

    def current(self, path) -> RegisteredFile | None:
        """`path` registered, if its stamp still matches; a changed file is dropped."""
        key = str(path)
        reg = self.files.get(key)
        if reg is None:
            return None
        if reg.stamp != file_stamp(path):
            self.drop(key)  # its pages are not this file's any more
            return None
        self.files[key] = self.files.pop(key)  # (most recently used last)
        return reg

    def get(self, path) -> RegisteredFile | None:
        """`path` registered: the current registration, or a new one (None if refused)."""
        reg = self.current(path)
        if reg is not None:
            return reg
        if self.refused_now(path):
            return None
        reg = register(Path(path))
        if reg is None:
            self.refused.add((str(path), file_stamp(path)))
            return None
        self.files[str(path)] = reg
        return reg

    def refused_now(self, path) -> bool:
        return (str(path), file_stamp(path)) in self.refused

    def drop(self, path) -> None:
        """Stop using `path`'s registration; it is unregistered by `release_dropped`."""
        reg = self.files.pop(str(path), None)
        if reg is not None:
            self.dropped.append(reg)

    def release_dropped(self) -> None:
        """Unregister what `drop` set aside. The driver's unregister waits for every kernel
        queued on the device and holds the process's other CUDA calls meanwhile (review,
        helper 34: 451-489 ms with a forward's worth of matmuls queued): the reload calls
        this under the weights lock, once the device is idle."""
        while self.dropped:
            self.dropped.pop().release()

    def make_room(self, nbytes: int, budget: int, keep: set[str]) -> bool:
        """Whether `nbytes` more fit in `budget`, after dropping the files changed or gone
        since they were registered, then those used longest ago; never one of `keep` (this
        reload's), and nothing when even that would not make room. Without it a full
        budget stayed full (nothing registered again until `release_staging`) and a
        deleted checkpoint's pages stayed pinned."""
        for key, reg in list(self.files.items()):
            if key not in keep and reg.stamp != file_stamp(key):
                self.drop(key)
        if sum(f.size for k, f in self.files.items() if k in keep) + nbytes > budget:
            return False
        for key in list(self.files):  # (least recently used first)
            if self.nbytes() + nbytes <= budget:
                break
            if key not in keep:
                self.drop(key)
        return True

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
        self.dropped += self.files.values()
        self.files.clear()
        self.release_dropped()
        self.refused.clear()
        self.reads.clear()
