"""Ways to move a checkpoint's tensors into preallocated GPU tensors, for side-by-side timing.

Each `load_*` writes every selected tensor of a checkpoint into the matching tensor of
`dst` ({name: device tensor}, what a reload writes into) and returns the bytes moved;
the caller times it. The field's loaders (InstantTensor, fastsafetensors,
safetensors) are optional: `available(io)` says whether one is installed. The two
limits are measured, not quoted: `PinnedCopy` (one host-to-device DMA of the same
number of bytes) and `page_cache_read` (16 threads of positional reads into one
pinned buffer).

`evict` drops files from the page cache (`posix_fadvise(DONTNEED)`) for cold runs;
`resident_fraction` says how much of them is there (`mincore`); `touch` gives them new stamps
(a first reload) and `wait_settled` waits until they count as at rest again.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from ..checkpoint.files import SETTLED_NS
from ..reload.chunks import DIRECT_ALIGN

LIBRARIES = {"instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors",
             "safetensors": "safetensors"}


def available(io: str) -> bool:
    module = LIBRARIES.get(io)
    return module is None or importlib.util.find_spec(module) is not None


def shard_files(path) -> list[str]:
    ckpt = Checkpoint(path)
    return [str(ckpt.path / f) for f in sorted(set(ckpt.weight_map.values()))]


def touch(files) -> None:
    """New stamps for `files` (as a rewritten checkpoint has): the next reload of them is a
    first reload (parsed, planned, values checked, nothing registered)."""
    for f in files:
        st = os.stat(f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))


def wait_settled(files) -> None:
    """Sleep until every file last changed more than `SETTLED_NS` ago. A reload of a file
    changed more recently reads its scales and checks its values again, as a first reload
    does: a "repeated" reload timed sooner after `touch` is not one."""
    newest = max((max(st.st_mtime_ns, st.st_ctime_ns) for st in map(os.stat, files)), default=0)
    wait = newest + SETTLED_NS - time.time_ns()
    if wait > 0:
        time.sleep(wait / 1e9 + 0.05)


def evict(files) -> None:
    """Drop `files` from the page cache (pages pinned by someone are kept by the kernel)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files) -> float:
    """Share of the pages of `files` in the page cache (`mincore` on a mapping of each);
    -1 where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return -1.0
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = os.path.getsize(f)
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return -1.0
            pages = -(-size // page)
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return -1.0
            resident += sum(v & 1 for v in vec)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else -1.0


def device_targets(path, names, device) -> dict[str, torch.Tensor]:
    """Empty device tensors for `names` (shapes and dtypes from the headers)."""
    ckpt = Checkpoint(path)
    return {n: torch.empty(ckpt.info(n).shape, dtype=ckpt.info(n).dtype, device=device) for n in names}


def pinned(nbytes: int, align: int = 1) -> torch.Tensor:
    """A pinned host buffer with its pages touched (not timed later), starting at a
    multiple of `align` bytes (torch's pinned allocator hands out small blocks at 512)."""
    buf = torch.empty(nbytes + align - 1, dtype=torch.uint8, pin_memory=True)
    buf.fill_(1)
    skip = -buf.data_ptr() % align
    return buf[skip:skip + nbytes]


class PinnedCopy:
    """The host-to-device limit: `nbytes` from one pinned buffer in one copy."""

    def __init__(self, nbytes: int, device):
        self.src = pinned(nbytes)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> int:
        self.dst.copy_(self.src, non_blocking=True)
        torch.cuda.synchronize(self.dst.device)
        return self.src.numel()


class DuplexCopy(PinnedCopy):
    """The limit of a reload that backs up to host memory while it writes: `nbytes` each
    way at once, host to device and device to host, one pinned buffer each, two streams."""

    def __init__(self, nbytes: int, device):
        super().__init__(nbytes, device)
        self.old = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.back = pinned(nbytes)
        self.streams = [torch.cuda.Stream(device) for _ in range(2)]

    def __call__(self) -> int:
        with torch.cuda.stream(self.streams[0]):
            self.dst.copy_(self.src, non_blocking=True)
        with torch.cuda.stream(self.streams[1]):
            self.back.copy_(self.old, non_blocking=True)
        torch.cuda.synchronize(self.dst.device)
        return self.src.numel()


def page_cache_read(files, buffer: torch.Tensor, threads: int = 16, chunk: int = 64 << 20,
                    direct: bool = False) -> int:
    """The read limit: every byte of `files`, `chunk` per positional read, `threads` at a
    time, into `buffer` (pinned, at least the files' total size). `direct`: with O_DIRECT
    (the disk's limit, page cache bypassed), each file at a block boundary of `buffer`
    (`direct_bytes(files)` of it) and its last partial block read buffered."""
    align = DIRECT_ALIGN if direct else 1
    jobs, at = [], 0
    for f in files:
        size = os.path.getsize(f)
        whole = size - size % align
        jobs += [(f, off, min(chunk, whole - off), at + off, direct) for off in range(0, whole, chunk)]
        if whole < size:
            jobs.append((f, whole, size - whole, at + whole, False))
        at += -(-size // align) * align
    if buffer.numel() < at or buffer.data_ptr() % align:
        raise ValueError(f"buffer of {buffer.numel()} bytes at {buffer.data_ptr():#x}: {at} bytes needed"
                         + (f", aligned to {align}" if direct else ""))
    flags = {False: os.O_RDONLY, True: os.O_RDONLY | getattr(os, "O_DIRECT", 0)}
    fds = {(f, d): os.open(f, flags[d]) for f in files for d in {False, direct}}
    view = memoryview(buffer.numpy())
    try:
        def read(job):
            f, off, n, to, d = job
            got = 0
            while got < n:
                step = os.preadv(fds[f, d], [view[to + got:to + n]], off + got)
                if step <= 0:
                    raise OSError(f"{f}: read stopped at byte {off + got}")
                got += step

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(os.path.getsize(f) for f in files)


def direct_bytes(files) -> int:
    """Buffer bytes `page_cache_read(files, direct=True)` fills."""
    return sum(-(-os.path.getsize(f) // DIRECT_ALIGN) * DIRECT_ALIGN for f in files)


def load_instanttensor(files, dst: dict, direct: bool = False) -> int:
    """InstantTensor 0.2: its buffered backend (page cache) or, with `direct`, its
    default (direct I/O where the file system allows); only `dst`'s names read."""
    from instanttensor import BackendPolicy, safe_open

    device = next(iter(dst.values())).device
    kwargs = {} if direct else {"backend": BackendPolicy.BUFFERED}
    moved = 0
    with safe_open(files, framework="pt", device=device.index or 0, copy=False,
                   tensor_filter=list(dst), tensor_name_match_mode="exact", **kwargs) as f:
        for name, tensor in f.tensors():
            dst[name].copy_(tensor)
            moved += tensor.numel() * tensor.element_size()
    torch.cuda.synchronize(device)
    return moved


def load_fastsafetensors(files, dst: dict) -> int:
    """fastsafetensors 0.5 without GDS (`nogds=True`), page cache kept."""
    from fastsafetensors import SafeTensorsFileLoader

    device = next(iter(dst.values())).device
    loader = SafeTensorsFileLoader(None, device=str(device), nogds=True, disable_cache=False)
    moved = 0
    try:
        loader.add_filenames({0: list(files)})
        keep = set(dst)
        loader.set_tensor_filter(lambda n: n in keep)
        buffer = loader.copy_files_to_device()
        try:
            for name, t in dst.items():
                src = buffer.get_tensor(name)
                t.copy_(src)
                moved += t.numel() * t.element_size()
        finally:
            torch.cuda.synchronize(device)
            buffer.close()
    finally:
        loader.close()
    return moved


def load_safetensors(files, dst: dict) -> int:
    """safetensors `safe_open(device="cuda")`, one `get_tensor` per name."""
    from safetensors import safe_open

    device = next(iter(dst.values())).device
    moved = 0
    for f in files:
        with safe_open(f, framework="pt", device=str(device)) as handle:
            for name in handle.keys():
                if name in dst:
                    t = handle.get_tensor(name)
                    dst[name].copy_(t)
                    moved += t.numel() * t.element_size()
    torch.cuda.synchronize(device)
    return moved


def total_bytes(files) -> int:
    return sum(Path(f).stat().st_size for f in files)
