"""Host staging for reloads onto a GPU: pinned, reused, filled by parallel reads.

safetensors hands out tensors backed by the file's memory map: the bytes are
read only when the host-to-device copy touches them, page fault by page fault,
and the copy from pageable memory runs through the driver's own bounce buffer.
For a GPU target we instead read each selected tensor with `os.preadv` straight
into one pinned buffer (threads in parallel; the GIL is released while the
kernel copies), so every host-to-device copy is a single asynchronous DMA. The
buffer is kept on the model and grows to the largest reload seen, so steady
state reloads allocate nothing. Backups of the slices a reload overwrites go to
a second pinned buffer the same way (device-to-host DMA, stream ordered before
the writes).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import torch

from .errors import CheckpointError

ALIGN = 64  # every staged tensor starts on a 64-byte boundary (any dtype can view it)
READ_THREADS = int(os.environ.get("FP8_RELOAD_READ_THREADS", "8"))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PinnedArena:
    """A grow-only pinned host buffer handed out in aligned slices, reset per use."""

    def __init__(self, pin: bool = True):
        self.pin = pin and torch.cuda.is_available()
        self.buffer: Optional[torch.Tensor] = None
        self.used = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reset(self, nbytes: int) -> None:
        """Make room for `nbytes` (aligned pieces included) and start handing out from 0."""
        if nbytes > self.capacity:
            self.buffer = None  # release the old one first: pinned memory is precious
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        start = self.used
        self.used = _align(start + nbytes)
        if self.used > self.capacity:
            raise RuntimeError("PinnedArena overflow: reset() was given too small a size")
        return self.buffer[start:start + nbytes]

    def release(self) -> None:
        self.buffer, self.used = None, 0


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return raw.view(dtype).view(tuple(shape))


def _read_exact(fd: int, dst: torch.Tensor, offset: int, where: str) -> None:
    mv = memoryview(dst.numpy()).cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{where}: file ended after {done} of {len(mv)} bytes (truncated?)")
        done += n


def read_into_arena(ckpt, names: Iterable[str], arena: PinnedArena,
                    stats: Optional[dict] = None) -> list[tuple[str, torch.Tensor]]:
    """Read `names` of checkpoint `ckpt` into `arena` (reset to fit); returns typed views.

    Tensors come back in file/offset order. Raises `CheckpointError` on I/O errors.
    """
    infos = sorted((ckpt.info(n) for n in names), key=lambda i: (i.file, i.offset))
    arena.reset(sum(_align(i.nbytes) for i in infos))
    slots = [arena.take(i.nbytes) for i in infos]
    files = sorted({i.file for i in infos})
    fds = {}
    try:
        for f in files:
            try:
                fds[f] = os.open(ckpt.path / f, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{ckpt.path / f}: cannot open: {e.strerror}") from None

        def work(k: int) -> None:
            info = infos[k]
            where = f"{ckpt.path / info.file}: tensor {info.name!r}"
            try:
                _read_exact(fds[info.file], slots[k], info.offset, where)
            except OSError as e:
                raise CheckpointError(f"{where}: read failed: {e.strerror}") from None

        if len(infos) > 1 and READ_THREADS > 1:
            with ThreadPoolExecutor(min(READ_THREADS, len(infos))) as pool:
                list(pool.map(work, range(len(infos))))
        else:
            for k in range(len(infos)):
                work(k)
    finally:
        for fd in fds.values():
            os.close(fd)
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + sum(i.nbytes for i in infos)
        stats["files_opened"] = stats.get("files_opened", 0) + len(files)
    return [(i.name, typed_view(s, i.dtype, i.shape)) for i, s in zip(infos, slots)]
