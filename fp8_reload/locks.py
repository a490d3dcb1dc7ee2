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

from .interrupts import sigint_deferred

# How often a wait for the lock looks whether a Ctrl-C came meanwhile (it is held back
# while the lock's own counts change; see `WeightsLock`).
_POLL_S = 0.05


class WeightsLock:
    """Reader/writer lock with writer preference and per-thread re-entry.

    Its counts change with Ctrl-C held back (`sigint_deferred`): a KeyboardInterrupt
    can land at any Python call, and one landing between a count taken and the `try`
    that gives it back (or inside the condition's own `__exit__`) would leave every
    later reload, or every forward, waiting forever. A Ctrl-C during a wait for the
    lock ends the wait (within `_POLL_S`) with nothing taken, then is raised."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads holding read access
        self._writer = None  # ident of the thread holding write access
        self._write_depth = 0
        self._writers_waiting = 0
        self._local = threading.local()

    def _read_depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _wait_for(self, free, stop: list) -> bool:
        """Under the condition: wait until `free()`, or a Ctrl-C held back (`stop`)."""
        while not free():
            if stop:
                return False
            self._cond.wait(_POLL_S)
        return True

    def _take(self, taking, held: list) -> None:
        """`taking(stop)` under the condition with Ctrl-C held back; `held` gets a token
        once it took the lock, inside the hold (a Ctrl-C raised as the hold ends finds it
        there), and the release clears it (giving back twice gives back once)."""
        stop: list = []
        with sigint_deferred(then=lambda: stop.append(True)), self._cond:
            if taking(stop):
                held.append(True)

    def _give_back(self, held: list, release) -> None:
        """`release()` under the condition with Ctrl-C held back, if `held` still holds its
        token. The caller calls it again when a Ctrl-C cut it short (any Python call can
        take one as it starts, before the hold is in place): the second call gives back
        what the first did not, or nothing."""
        with sigint_deferred(), self._cond:
            if held:
                held.clear()
                release()
                self._cond.notify_all()

    def _take_read(self, stop: list) -> bool:
        if not self._wait_for(lambda: self._writer is None and not self._writers_waiting, stop):
            return False
        self._readers += 1
        return True

    def _take_write(self, stop: list) -> bool:
        self._writers_waiting += 1
        try:
            if not self._wait_for(lambda: self._writer is None and not self._readers, stop):
                return False
        finally:
            self._writers_waiting -= 1
            self._cond.notify_all()  # (forwards held back by this waiting writer)
        self._writer = threading.get_ident()
        self._write_depth = 1
        return True

    def _release_read(self) -> None:
        self._readers -= 1

    def _release_write(self) -> None:
        self._writer = None
        self._write_depth = 0

    @contextmanager
    def read(self):
        depth = self._read_depth()
        held: list = []
        try:  # (entered before the count is taken: a Ctrl-C after it still gives it back)
            if depth == 0 and self._writer != threading.get_ident():
                self._take(self._take_read, held)
            self._local.depth = depth + 1
            yield
        finally:
            self._local.depth = depth
            if held:
                try:
                    self._give_back(held, self._release_read)
                except BaseException:  # (see _give_back)
                    self._give_back(held, self._release_read)
                    raise

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
        held: list = []
        try:
            self._take(self._take_write, held)
            yield
        finally:
            if held:
                try:
                    self._give_back(held, self._release_write)
                except BaseException:  # (see _give_back)
                    self._give_back(held, self._release_write)
                    raise

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
