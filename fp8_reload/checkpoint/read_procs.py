"""Reader processes for a reload's ring: page-cache reads that share no GIL with the thread
landing the chunks.

With reader threads, every call of the landing thread that lets the GIL go (a copy, an
event, a launch) waited for readers to give it back: on the H200 host a chunk took 1.2 ms
of host time to land with 15 readers running, 0.4 ms with none. Processes read into
shared memory (`SharedBuffer`, a memfd mapped by both sides) and answer over a socket
(`read_worker` says the protocol); the landing thread blocks only on those answers.

``FP8_RELOAD_READERS``: ``processes`` (default where Linux gives memfd and descriptor
passing) or ``threads`` (`staging.reader_pool`). The processes start once per process
(tens of milliseconds: they import the standard library only) and exit with it.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import mmap
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch

from ..device import host_register, host_unregister
from ..errors import ReloadError
from ..knobs import env_choice
from .staging import READ_THREADS

READERS = env_choice("FP8_RELOAD_READERS", "processes", ("processes", "threads"))
WORKER = Path(__file__).with_name("read_worker.py")
# Reads asked of one process and not yet answered, at most: each message waits in a socket
# buffer of finite size, and a process whose answers nobody reads stops reading requests.
MAX_IN_FLIGHT = 64
_keys = itertools.count(1)
_failed: list[str] = []  # why the processes could not start here (then threads read)


def shareable() -> bool:
    """Whether a `SharedBuffer` can be made here (a ring for reader threads is one too: its
    slots start on page boundaries, as O_DIRECT reads need, where pinned tensors may not)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def supported() -> bool:
    return (READERS == "processes" and not _failed and shareable() and hasattr(socket, "send_fds")
            and bool(sys.executable))


class SharedBuffer:
    """`nbytes` of shared memory, as a uint8 tensor here; reader processes map it too.
    `pin()` registers it with the CUDA driver (a host-to-device copy from it is one DMA)."""

    def __init__(self, nbytes: int):
        self.key = next(_keys)
        self.pid = os.getpid()  # a forked child must not write it (it is shared) nor unregister it
        self.nbytes = nbytes
        self.fd = os.memfd_create("fp8_reload-ring", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.tensor = torch.frombuffer(mmap.mmap(self.fd, nbytes), dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> bool:
        self.pinned = host_register(self.tensor.data_ptr(), self.nbytes)
        return self.pinned

    def release(self) -> None:
        """Unregistered now; unmapped when the last view of it goes."""
        if self.pinned and self.pid == os.getpid():
            host_unregister(self.tensor.data_ptr())
            self.pinned = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tensor = None


class ReaderProcs:
    """`n` reader processes. Pieces of a chunk go to them in turns; each answers in the order
    it was asked, so waiting for chunk k reads each one's answers up to k."""

    def __init__(self, n: int):
        from . import read_worker as w  # (the protocol's message layouts)

        self.w = w
        self.pid = os.getpid()
        self.socks: list[socket.socket] = []
        self.procs: list[subprocess.Popen] = []
        for _ in range(n):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.procs.append(subprocess.Popen([sys.executable, "-I", str(WORKER), str(theirs.fileno())],
                                               pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL))
            theirs.close()
            self.socks.append(ours)
        # per process, in the order asked: [req, chunk, piece, answer or None]; the answers
        # come in that order, so the unanswered ones (`owed`) are the last of its deque
        self.pending: list[collections.deque] = [collections.deque() for _ in range(n)]
        self.owed = [0] * n
        self.between = False
        self.mapped: set[int] = set()
        self.req = itertools.count()
        self.broken = False
        self.busy = threading.Lock()  # one ring at a time: answers are matched in order
        self.dropped: list[int] = []  # buffers to unmap (`forget`)
        for i in range(n):  # each one runs (else: OSError, and threads read instead)
            req = next(self.req)
            self._send(i, self.w.KEY.pack(b"P", req))
            self._asked(i, [req, -1, (0, "a check"), None])
        self.wait(-1)

    def _send(self, i: int, msg: bytes, fds=()) -> None:
        try:
            if fds:
                socket.send_fds(self.socks[i], [msg], list(fds))
            else:
                self.socks[i].send(msg)
        except OSError as e:
            raise self._died(i, e) from None

    def _died(self, i: int, why=None) -> ReloadError:
        self.broken = True
        code = self.procs[i].poll()
        return ReloadError(f"reader process {self.procs[i].pid} stopped (exit status {code}"
                           f"{': ' + str(why) if why else ''}); the next reload starts new ones")

    def unmap_dropped(self) -> None:
        """Every process unmaps the buffers `forget` dropped (with `busy` held)."""
        while self.dropped:
            key = self.dropped.pop()
            if key in self.mapped:
                for i in range(len(self.socks)):
                    self._send(i, self.w.KEY.pack(b"U", key))
                self.mapped.discard(key)

    def attach(self, buf: SharedBuffer) -> None:
        """Every process maps `buf` (and unmaps the buffers dropped since)."""
        self.unmap_dropped()
        if buf.key not in self.mapped:
            for i in range(len(self.socks)):
                self._send(i, self.w.MAP.pack(b"M", buf.key, buf.nbytes), [buf.fd])
            self.mapped.add(buf.key)

    def open_files(self, handles: dict) -> dict:
        """{name: key} of the open shards `handles` ({name: file}), handed to every process."""
        keys = {name: next(_keys) for name in handles}
        for i in range(len(self.socks)):
            for name, f in handles.items():
                self._send(i, self.w.KEY.pack(b"O", keys[name]), [f.fileno()])
        return keys

    def close_files(self, keys: dict) -> None:
        for i in range(len(self.socks)):
            for key in keys.values():
                self._send(i, self.w.KEY.pack(b"C", key))

    def submit(self, chunk: int, pieces: list[tuple]) -> None:
        """Ask for `pieces` ((file key, offset, n, buffer key, at, what) each) of `chunk`."""
        for j, (fkey, off, n, mkey, at, what) in enumerate(pieces):
            i = j % len(self.socks)
            if self.owed[i] >= MAX_IN_FLIGHT:
                self._answer(i)
            req = next(self.req)
            self.between = True  # a request sent and not yet written down: `alive` says no
            self._send(i, self.w.READ.pack(b"R", req, fkey, off, n, mkey, at))
            self._asked(i, [req, chunk, (n, what), None])
            self.between = False

    def _asked(self, i: int, entry: list) -> None:
        self.pending[i].append(entry)
        self.owed[i] += 1

    def _answer(self, i: int) -> None:
        """Receive process `i`'s next answer: its oldest request not answered yet."""
        owed, todo = self.owed[i], self.pending[i]
        if not 0 < owed <= len(todo) or todo[len(todo) - owed][3] is not None:  # (cut short
            raise self._died(i, "its requests' bookkeeping was cut short")  # between two steps)
        entry = todo[len(todo) - owed]
        try:
            answer = self.socks[i].recv(64)
        except OSError as e:
            raise self._died(i, e) from None
        if not answer:
            raise self._died(i)
        _, req, err, got = self.w.ANSWER.unpack(answer)
        if req != entry[0]:
            raise self._died(i, f"answered request {req}, expected {entry[0]}")
        entry[3] = (err, got)
        self.owed[i] -= 1

    def wait(self, chunk: int) -> list[tuple]:
        """Wait for every piece asked for up to `chunk`; the failed ones: ((n, what), errno, got)."""
        failed = []
        for i, todo in enumerate(self.pending):
            while todo and todo[0][1] <= chunk:
                if todo[0][3] is None:
                    self._answer(i)
                _, _, piece, (err, got) = todo.popleft()
                if err or got != piece[0]:
                    failed.append((piece, err, got))
        return failed

    def drain(self) -> None:
        """Wait for every read asked for (a failed reload's buffers must not be written later)."""
        if not self.broken:
            try:
                self.wait(sys.maxsize)
            except ReloadError:
                pass

    def alive(self) -> bool:
        """Usable: none broken or gone, and no answer owed from an earlier ring (an interrupt
        between a send and its bookkeeping would pair later answers with the wrong reads)."""
        return (not self.broken and not self.between and not any(self.pending) and not any(self.owed)
                and all(p.poll() is None for p in self.procs))

    def abandon(self) -> None:
        """After an interrupt mid-protocol: no answer can be trusted to match its read. The
        processes are closed (they exit before the shared ring is used again); the next
        reload starts new ones."""
        self.broken = True
        self.close()

    def close(self) -> None:
        for s in self.socks:  # shut down, not only closed: a forked child may hold a copy
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


_pool: ReaderProcs | None = None
_lock = threading.Lock()


def pool() -> ReaderProcs | None:
    """The process's reader processes (`READ_THREADS` of them), started on first use and again
    after one stopped or in a forked child; None where they are not `supported`."""
    global _pool
    if not supported():
        return None
    with _lock:
        ours = _pool if _pool is not None and _pool.pid == os.getpid() else None
        # a ring streaming through them (another thread's reload) owes answers, which reads
        # as not `alive`: judged only when free, else that reload would lose its readers
        # mid-stream (the caller, not getting `busy` either, reads with threads)
        if ours is not None and not ours.busy.acquire(blocking=False):
            return ours
        try:
            if ours is None or not ours.alive():
                if ours is not None:
                    ours.close()
                _pool = None
                try:
                    _pool = ReaderProcs(max(1, READ_THREADS))
                except (OSError, ReloadError) as e:  # no process could start or answer here
                    _failed.append(f"{type(e).__name__}: {e}")
                    return None
            return _pool
        finally:
            if ours is not None:
                ours.busy.release()


def forget(buf: SharedBuffer) -> None:
    """`buf` is going (its ring was released or collected): unregistered, and unmapped by the
    reader processes now, or, while a ring streams through them (this may run inside the
    collector, in that very thread), when it is done."""
    buf.release()
    procs = _pool
    if procs is not None and procs.pid == os.getpid():
        procs.dropped.append(buf.key)
        if procs.busy.acquire(blocking=False):
            try:
                if procs.alive():
                    procs.unmap_dropped()
            except ReloadError:
                pass  # (a process gone: the next reload starts new ones)
            finally:
                procs.busy.release()


@atexit.register
def _stop() -> None:
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


def _in_child() -> None:
    """A forked child closes its copies of the parent's sockets: else the parent's reader
    processes would not see their sockets close when the parent is done with them."""
    global _pool
    if _pool is not None:
        for s in _pool.socks:
            s.close()
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
