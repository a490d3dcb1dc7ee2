"""The concurrency rule between forwards and reloads.

Forwards are readers, the commit of a reload is the writer:

* any number of forwards run at once (they only read weights);
* a reload reads and validates the checkpoint while forwards keep running, and
  takes the lock exclusively only to write (load + post-process, or roll back),
  so a forward sees either all of the old weights or all of the new ones. A full
  reload from registered shards reads nothing on the host before it writes: it
  takes the lock once planned (~1 ms in), so that its backup's and its writes'
  copies start at once, not after a device synchronization that would wait for
  the first of them;
* writer preference: once a commit waits, new forwards queue behind it, so a
  steady stream of forwards cannot starve a reload (the commit waits only for
  the forwards already running);
* reloads serialize among themselves on `FP8MoEModel.reload_lock`.

On a GPU a forward returns once its kernels are queued. The reload therefore
synchronizes the device after taking the lock (kernels of forwards on any
stream finish before weights change) and again before releasing it.

Re-entry: a thread holding the lock for a forward may run nested forwards;
the committing thread may run forwards (it sees its own writes). A reload from
inside a forward of the same model would deadlock and raises instead: the
reload asks `held_for_reading` before it takes the model's reload lock, since
waiting for that lock (held by another reload, itself waiting for this forward
to finish) would deadlock just as surely as waiting for the write lock.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class WeightsLock:
    """Reader/writer lock with writer preference and per-thread re-entry."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads holding read access
        self._writer = None  # ident of the thread holding write access
        self._write_depth = 0
        self._writers_waiting = 0
        self._local = threading.local()

    def _read_depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextmanager
    def read(self):
        depth = self._read_depth()
        counted = depth == 0 and self._writer != threading.get_ident()
        if counted:
            with self._cond:
                while self._writer is not None or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if counted:
                with self._cond:
                    self._readers -= 1
                    if self._readers == 0:
                        self._cond.notify_all()

    @contextmanager
    def write(self):
        me = threading.get_ident()
        if self._writer == me:
            self._write_depth += 1
            try:
                yield
            finally:
                self._write_depth -= 1
            return
        if self._read_depth():
            raise RuntimeError("cannot write the weights from inside a forward of the same "
                               "model (it would wait for itself)")
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer is not None or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = me
            self._write_depth = 1
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._write_depth = 0
                self._cond.notify_all()

    @property
    def held_for_reading(self) -> bool:
        """Whether the calling thread is inside a forward (holds read access) and not
        the writer: it must not wait for anything that waits for the write lock."""
        return self._read_depth() > 0 and self._writer != threading.get_ident()

    @property
    def readers(self) -> int:
        """Forwards running now (for tests and diagnostics)."""
        return self._readers

    @property
    def writing(self) -> bool:
        return self._writer is not None
