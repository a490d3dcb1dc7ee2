"""Pinned host memory for reloads onto a GPU: staging reads and rollback backups.

A host-to-device copy from pageable memory runs through the driver's bounce
buffer and blocks; from pinned memory it is one asynchronous DMA (measured on
the H200: 18 vs 55 GB/s one-shot, 6 GB/s per tensor from pageable). A reload onto
a GPU therefore reads every selected tensor (`Checkpoint.read(into=arena)`,
parallel positional reads) into one pinned arena, and backs up the slices it will
overwrite into a second one (device-to-host DMA, stream-ordered before the
writes). Both arenas live on the model and grow to the largest reload seen, so
steady-state reloads allocate nothing; `release_staging(model)` frees them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import ReloadError
from ..knobs import env_int
from .header import forget_parsed

ALIGN = 64  # every staged tensor starts on a 64-byte boundary (any dtype can view it)
# a page-cache read is a CPU copy: one thread per core this process may run on but the one
# queueing the chunks, up to 16 (the H200 host's 16 cores read 1.74 GiB from the page cache in
# 43-56 ms with 16 threads)
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
# (each is a reader process: hundreds took seconds to start)
READ_THREADS = env_int("FP8_RELOAD_READ_THREADS", min(16, max(2, _CORES - 1)), minimum=1, maximum=256)
PIECE_BYTES = 8 << 20  # one positional read: enough to keep a thread busy, small enough to share a tensor


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that started it, pool)
_pool_lock = threading.Lock()


def reader_pool() -> ThreadPoolExecutor:
    """The `READ_THREADS` reader threads every reload shares (never shut down; a caller
    waits for what it submitted). Started once per process:
    starting them anew per reload costs a reload of a few experts more than its reads.
    A forked child starts its own (the parent's threads do not exist there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(max(1, READ_THREADS),
                                                     thread_name_prefix="fp8_reload-reader"))
        return _pool[1]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PinnedArena:
    """A grow-only pinned host buffer handed out in aligned slices, reset per use."""

    device = None  # (`DeviceArena`)

    def __init__(self, pin: bool = True):
        self.pin = pin and torch.cuda.is_available()
        self.buffer: torch.Tensor | None = None
        self.used = 0
        self.borrower: tuple[threading.Thread, threading.Event] | None = None  # (`lend`)

    def lend(self, thread: threading.Thread, done: threading.Event) -> None:
        """`thread` fills the arena until `done` is set: a `reset` from any other thread
        waits for that first (a reload interrupted while it read must not meet the next)."""
        self.borrower = (thread, done)

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reset(self, nbytes: int) -> None:
        """Make room for `nbytes` (aligned pieces included) and start handing out from 0."""
        if self.borrower is not None and self.borrower[0] is not threading.current_thread():
            self.borrower[1].wait()
            self.borrower = None
        if nbytes > self.capacity or self.buffer is None:
            self.buffer = None  # release the old one first: pinned memory is precious
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin, device=self.device)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        start = self.used
        self.used = _align(start + nbytes)
        if self.used > self.capacity:
            raise RuntimeError("PinnedArena overflow: reset() was given too small a size")
        return self.buffer[start:start + nbytes]

    def release(self) -> None:
        self.buffer, self.used = None, 0


class DeviceArena(PinnedArena):
    """The same in the memory of `device` (a GPU model's host backup keeps its first pieces
    there, `reload.backup.ON_DEVICE`); held by its user, not by the model."""

    def __init__(self, device):
        super().__init__(pin=False)
        self.device = device


def held(model) -> dict:
    """What the model holds for its reloads ({name: object with `release()`}): pinned
    arenas, the streaming ring, registered shards, device scratch."""
    return model.__dict__.setdefault("_pinned_arenas", {})


def holder(model, which: str, make):
    """The model's `which`, made by `make()` on first use."""
    things = held(model)
    if which not in things:
        things[which] = make()
    return things[which]


def arena(model, which: str) -> PinnedArena:
    """The model's reusable arena `which` ("staging" or "backup"), created on first use."""
    return holder(model, which, PinnedArena)


def release_staging(model) -> None:
    """Give back what reloads hold between calls: pinned staging, backup and ring
    memory, registered shards, device scratch, and where tensors land (views of the
    Parameters' memory, kept from `load_model` on: memory a Parameter was moved off
    stays allocated while they hold it), and the process's parsed shard headers (shared
    by every model: theirs are parsed again). The next reload re-allocates and re-plans.
    Waits for a reload of `model` running in another thread (it uses them); refused from
    inside a forward of `model`, where that reload may be waiting for this very forward."""
    weights = getattr(model, "weights_lock", None)
    if weights is not None and weights.held_for_reading:
        raise ReloadError("release_staging: cannot run inside a forward of the same model (a "
                          "reload waiting for that forward would never let it finish); nothing "
                          "was released")
    lock = getattr(model, "reload_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        for thing in held(model).values():
            thing.release()
    forget_parsed()


def aligned(nbytes: int) -> int:
    return _align(nbytes)


def typed_slice(arena_: PinnedArena, dtype: torch.dtype, shape) -> torch.Tensor:
    """A `dtype` tensor of `shape` carved out of the arena."""
    n = 1
    for d in shape:
        n *= d
    raw = arena_.take(n * torch.empty((), dtype=dtype).element_size())
    return raw.view(dtype).view(tuple(shape))
