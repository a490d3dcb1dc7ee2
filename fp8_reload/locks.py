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

Ctrl-C: Python runs a signal's handler at the start of any Python function, so a
KeyboardInterrupt can land between a `with` body and the code that gives a lock
back when that code is Python (a `@contextmanager`'s frames, an `__exit__`):
the lock then stayed taken while the exception's traceback lived (a notebook
keeps it), and every reload waited for that forward forever. Each access is
therefore a `_Hold`, an `RLock` given back by RLock's own `__exit__`, in C: no
Python frame starts between the body and the release. Whoever waits for an
access waits on its hold, so the release wakes them without running Python. A
reload holds its write access (`commit_hold`) in a `with` from its start and
takes it only for the commit.

A forward that meets no write registers with no lock at all (`_try_forward`), so a Ctrl-C,
even one a tracer delivers between two lines, can leave no lock of this module taken; the
rest of the bookkeeping runs with Ctrl-C held back. A write waits at most `WRITE_WAIT_S`
for the forwards it found running.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time

from .interrupts import sigint_deferred
from .knobs import env_int

# How long one wait lasts before it looks whether a Ctrl-C came meanwhile (held back
# while the lock's bookkeeping changes; see `_Hold`).
_POLL_S = 0.05
# How long a write waits for the forwards running when it asked (they hold the lock for as
# long as they launch kernels: milliseconds on a GPU). A forward that waits for a forward
# of the same model on another thread (a micro-batch handed to a pool, `asyncio.to_thread`)
# never ends while a write waits, since the inner one queues behind the write: the write
# then gives up, with an error, and both forwards go on.
WRITE_WAIT_S = env_int("FP8_RELOAD_WRITE_WAIT_S", 60, minimum=1)


class _Hold(_thread.RLock):
    """One thread's read or write access, given back by RLock's own `__exit__` (C). It
    counts once `registered` by the lock; while its RLock is held it stays taken."""

    def __init__(self, lock: WeightsLock, write: bool):
        self._weights_lock, self._write, self.registered = lock, write, False
        self.thread: threading.Thread | None = None  # the thread that took it (`take`)

    def take(self) -> None:
        """Wait for this access's turn and register it (the caller holds the RLock)."""
        deadline = time.monotonic() + WRITE_WAIT_S  # (once: a Ctrl-C held back does not renew it)
        self.thread = threading.current_thread()
        while not self.registered:  # (a Ctrl-C whose handler did not raise: wait again)
            self._weights_lock._take(self, self._write, deadline)


class _Entering(_Hold):
    """Taken by `with` itself: `__enter__` holds the RLock, then waits its turn, giving it
    back if anything interrupts it before the body starts; entered again by its owner (a
    nested forward, a writer's re-entry) it only counts a level more."""

    def __enter__(self):
        depth = self._recursion_count()  # this thread's levels before this call
        try:  # (acquiring an owned or fresh RLock never waits: a Ctrl-C comes after it)
            self.acquire()
            if not depth:
                if self.registered:  # given back since: an access is entered once
                    raise RuntimeError("this weights-lock access was used already; ask for a new one")
                self.take()
            return self  # (in the `try`: a tracer's Ctrl-C at this line gives the level back)
        except BaseException:
            if self._recursion_count() > depth:  # (a tracer's Ctrl-C may come before it)
                self.release()  # the level this call took
            raise


def _refuse_abandoned(hold: _Hold) -> None:
    """RuntimeError if `hold` is taken by a thread that has ended: no one can give it back
    (a generator suspended inside an access's `with`, its thread gone), so a write would wait
    `WRITE_WAIT_S` each time, then fail with the wrong reason, and a forward behind an
    abandoned write would wait forever. (A thread started by `_thread.start_new_thread`
    always counts as alive: such waits go on as before.)"""
    thread = hold.thread
    if thread is None or thread.is_alive():
        return
    if hold.acquire(timeout=_POLL_S):  # given back (another waiter may hold it an instant)
        hold.release()
        return
    raise _abandoned(hold)


def _abandoned(hold: _Hold) -> RuntimeError:
    what, blocked = (("a write's", "no forward or write of them can run") if hold._write else
                     ("a forward's", "the weights cannot be written"))
    return RuntimeError(
        f"{what} access to the weights is held by thread {hold.thread.name!r}, which ended "
        f"without giving it back (a generator suspended inside the access, left by its "
        f"thread?); {blocked} while it is held")


def _given_back(hold: _Hold) -> bool:
    """Whether `hold` is free: never taken again once given back."""
    if hold._is_owned() or not hold.acquire(blocking=False):
        return False
    hold.release()
    return True


class WeightsLock:
    """Reader/writer lock with writer preference and per-thread re-entry (see the module)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        # forwards' holds: registered ones, and given back ones until pruned (each thread forgets
        # its own as it registers the next: `_mine`). Changed in place, outside the condition
        # too (`_try_forward`): one set operation at a time, which the interpreter makes atomic
        self._readers: set[_Hold] = set()
        self._writer: _Hold | None = None
        self._writers_waiting = 0
        self._local = threading.local()  # .hold: this thread's forward; .mine: see `_mine`

    def _prune(self) -> None:
        """Under the condition: forget holds given back."""
        for hold in list(self._readers):  # (a copy: forwards register meanwhile)
            if _given_back(hold):
                self._readers.discard(hold)
        if self._writer is not None and _given_back(self._writer):
            self._writer = None

    def _wait_on(self, busy: _Hold | None) -> None:
        """Under the condition: wait (at most `_POLL_S`) for `busy` to be given back, or
        for a notification when there is no hold to wait on."""
        if busy is None:
            self._cond.wait(_POLL_S)
            return
        if busy._is_owned():  # (a caller's bug, not a wait: it would never end)
            if busy.thread is not None and busy.thread is not threading.current_thread():
                raise _abandoned(busy)  # (an ended thread's, whose id this thread has now)
            raise RuntimeError("the weights lock would wait for this thread's own access")
        self._cond.release()
        try:
            if busy.acquire(timeout=_POLL_S):
                busy.release()
        finally:
            self._cond.acquire()

    def _a_forward(self) -> _Hold | None:
        """A registered forward's hold to wait on (not one passing through `_try_forward`,
        which may withdraw and then wait itself, holding its RLock: a 50 ms stall each)."""
        return next((h for h in list(self._readers) if h.registered), None)

    def _try_forward(self, hold: _Hold) -> bool:
        """Register a forward's `hold` at once if no write runs or waits (nearly always), with
        no lock and no Ctrl-C held back (swapping the SIGINT handler each way was ~20 of the
        ~22 us a forward's access cost on the main thread). The hold is added first, then the
        waiting count read, then the writer; a writer counts itself waiting, looks at the
        forwards, sets itself as the writer and only then stops counting. So a writer that
        missed the hold was counted when the forward read the count, or was set by then: one
        of the two sees the other (the forward withdraws; review s28, helper 63: reading the
        writer first let both in, between the writer's set and its count's drop). A
        KeyboardInterrupt landing anywhere here leaves at most a hold its caller gives back at
        once (`_Entering`), forgotten later: no lock to leave taken, even under a tracer."""
        self._readers.add(hold)
        if self._writers_waiting or self._writer is not None:  # (a given-back writer too: pruned
            self._readers.discard(hold)                        # on the slower path)
            return False
        hold.registered = True
        self._mine(hold)
        return True

    def _mine(self, hold: _Hold) -> None:
        """Note `hold` as this thread's, forgetting the ones this thread gave back since: what
        forwards leave behind is bounded by the threads, between prunes."""
        live = []
        for earlier in getattr(self._local, "mine", ()):
            if earlier._is_owned():
                live.append(earlier)  # (still running: a nested or interleaved access)
            else:
                self._readers.discard(earlier)
        live.append(hold)
        self._local.mine = live

    def _take(self, hold: _Hold, write: bool, deadline: float) -> None:
        """Register `hold` once its turn comes (a forward that need not wait: `_try_forward`),
        with Ctrl-C held back: one ends the wait within `_POLL_S`, nothing registered, and is
        raised as the hold ends. A write waits until `deadline`, then gives up."""
        if not write and self._try_forward(hold):
            return
        stop: list = []
        with sigint_deferred(then=lambda: stop.append(True)), self._cond:
            self._writers_waiting += write
            if not write:  # a writer may be waiting on this hold's withdrawn try: no need now
                self._cond.notify_all()
            try:
                while not stop:
                    self._prune()
                    if self._writer is None and not (self._readers if write else self._writers_waiting):
                        if write:
                            self._writer = hold
                        else:
                            self._readers.add(hold)
                            self._mine(hold)
                        hold.registered = True
                        return
                    if write and time.monotonic() > deadline:
                        raise RuntimeError(
                            f"forwards of this model still ran after {WRITE_WAIT_S} s "
                            "(FP8_RELOAD_WRITE_WAIT_S); a forward that waits for a forward of the "
                            "same model on another thread never ends while a write waits")
                    busy = self._writer or (self._a_forward() if write else None)
                    if busy is not None:
                        _refuse_abandoned(busy)
                    self._wait_on(busy)
            finally:
                if write:
                    self._writers_waiting -= 1
                    self._cond.notify_all()  # (forwards held back by this waiting writer)

    def _writer_is_me(self) -> bool:
        writer = self._writer  # (an ended writer's thread id may be this thread's now)
        return writer is not None and writer.thread is threading.current_thread() and writer._is_owned()

    def read(self):
        """A forward's access: `with lock.read(): ...`."""
        if self._writer_is_me():
            return contextlib.nullcontext()  # the committing thread sees its own writes
        hold = getattr(self._local, "hold", None)
        if hold is None or not hold._is_owned():
            hold = self._local.hold = _Entering(self, write=False)
        return hold

    def write(self):
        """Write access taken by `with lock.write(): ...`."""
        self._refuse_inside_forward()
        return self._writer if self._writer_is_me() else _Entering(self, write=True)

    def commit_hold(self) -> _Hold:
        """Write access for a reload: `with hold:` holds it from the start (nothing is taken
        yet), `hold.take()` takes it when the commit comes, and the `with`'s end (C) gives
        it back, whatever interrupts the reload in between."""
        self._refuse_inside_forward()
        if self._writer_is_me():  # a reload inside this thread's own write (a rebalance's disk read)
            return self._writer
        return _Hold(self, write=True)

    def _refuse_inside_forward(self) -> None:
        if self.held_for_reading:
            raise RuntimeError("cannot write the weights from inside a forward of the same "
                               "model (it would wait for itself)")

    @property
    def held_for_reading(self) -> bool:
        """Whether the calling thread is inside a forward (holds read access) and not
        the writer: it must not wait for anything that waits for the write lock."""
        mine = getattr(self._local, "mine", ())  # (every access it entered: `read()` objects
        return any(h._is_owned() for h in mine) and not self._writer_is_me()  # may interleave)

    @property
    def readers(self) -> int:
        """Forwards running now (for tests and diagnostics)."""
        with sigint_deferred(), self._cond:  # (pruning holds a given-back hold an instant)
            self._prune()
            return len(self._readers)

    @property
    def writing(self) -> bool:
        with sigint_deferred(), self._cond:
            self._prune()
            return self._writer is not None
