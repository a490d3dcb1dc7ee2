"""A Ctrl-C wherever it can land in the weights lock's bookkeeping leaves no lock behind.

Python hands a signal to its handler at a function's start (and at a few other points),
so a KeyboardInterrupt can come between a count taken and the `try` that gives it back,
or inside a condition's `__exit__` (review, helper 46: a forward interrupted there left
every later reload waiting forever). These tests send a real SIGINT at every Python call
the lock makes (`sys.settrace`), one run per call, and then require: the lock idle, a
reload on another thread done in time, the model whole.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
import fp8_reload.interrupts as interrupts
import fp8_reload.locks as locks

from .conftest import WAIT, tokens

# contextlib: a `@contextmanager`'s frames between a `with` body and its `finally` (review
# s27: a Ctrl-C there left a forward's read count, or a reload's locks, taken)
WATCHED = {Path(locks.__file__).resolve(), Path(interrupts.__file__).resolve(),
           Path(contextlib.__file__).resolve()}
pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signals reach the main thread only")


def _watched(code) -> bool:
    return Path(code.co_filename).resolve() in WATCHED


def _sigint_at_call(n: int):
    """A tracer that raises SIGINT at the `n`-th Python call of, or made by, a function of
    the lock (or of the Ctrl-C hold: a condition's `__enter__` counts), as a Ctrl-C typed
    then would; the count of calls seen."""
    seen = [0]

    def tracer(frame, event, arg):
        if event == "call" and (_watched(frame.f_code)
                                or (frame.f_back is not None and _watched(frame.f_back.f_code))):
            seen[0] += 1
            if seen[0] == n:
                signal.raise_signal(signal.SIGINT)
        return None

    return tracer, seen


def _idle(lock: locks.WeightsLock) -> list[str]:
    problems = []
    if lock.readers or lock.writing or lock._writers_waiting:
        problems.append(f"readers {lock.readers}, writing {lock.writing}, "
                        f"writers waiting {lock._writers_waiting}")
    if not lock._cond.acquire(timeout=WAIT):
        problems.append("its condition's lock is held")
    else:
        lock._cond.release()
    return problems


def _reload_in_thread(model, path) -> bool:
    done = threading.Event()

    def run():
        fr.update_weights_from_disk(model, path)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(WAIT)


@pytest.mark.parametrize("what", ["forward", "reload"])
def test_a_ctrl_c_at_any_call_of_the_lock_leaves_it_idle(ckpts, tiny_cfg, what):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    model = fr.load_model(ckpts["fp8", 0], device="cpu")
    x = tokens(tiny_cfg, n=4)
    want = fr.snapshot(fr.load_model(ckpts["fp8", 1], device="cpu"))
    n, interrupted, kept = 0, 0, []
    while True:
        n += 1
        tracer, seen = _sigint_at_call(n)
        sys.settrace(tracer)
        try:
            if what == "forward":
                model(x)
            else:
                fr.update_weights_from_disk(model, ckpts["fp8", n % 2])
        except KeyboardInterrupt as e:
            interrupted += 1
            kept.append(e)  # alive, as a notebook keeps the last one (with its frames)
        finally:
            sys.settrace(None)
        assert _idle(model.weights_lock) == [], (what, n)
        running = model.__dict__.get("_reload_running")
        assert not model.reload_lock._is_owned() and not (running and running._is_owned()), n
        if seen[0] < n:  # the run made fewer calls: every one has had its Ctrl-C
            break
    assert interrupted == n - 1, (interrupted, n)  # each Ctrl-C reached the caller
    assert _reload_in_thread(model, ckpts["fp8", 1]), "a reload after the Ctrl-Cs did not finish"
    assert fr.compare_states(want, fr.snapshot(model)) == []
    torch.testing.assert_close(model(x), fr.load_model(ckpts["fp8", 1], device="cpu")(x), rtol=0, atol=0)


def test_a_ctrl_c_while_a_forward_waits_for_a_commit_ends_the_wait(ckpts, tiny_cfg):
    """A forward queued behind a reload's commit takes a Ctrl-C within the poll, not once
    the commit is over, and takes nothing."""
    model = fr.load_model(ckpts["fp8", 0], device="cpu")
    writing, release = threading.Event(), threading.Event()

    def writer():
        with model.weights_lock.write():
            writing.set()
            release.wait(WAIT)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert writing.wait(WAIT)
    timer = threading.Timer(0.2, signal.raise_signal, args=(signal.SIGINT,))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model(tokens(tiny_cfg, n=4))
        assert model.weights_lock.readers == 0 and t.is_alive()  # cut short, not served
    finally:
        timer.cancel()
        release.set()
        t.join(WAIT)
    assert _idle(model.weights_lock) == []


# ("nullcontext.__exit__", -1): the last Python call of a reload on CPU, as the `with` of its
# locks ends (`current_cuda`'s exit; the locks are given back right after it, by C code)
@pytest.mark.parametrize("at", [("clear_kernel_caches", 1), ("nullcontext.__exit__", -1)])
def test_a_ctrl_c_once_the_commit_is_over_leaves_the_new_weights_named(ckpts, at):
    """After the drain the reload has happened: a Ctrl-C then (kernel caches cleared, the
    weights lock given back) reaches the caller, and the model holds the new weights, every
    Parameter kept, `checkpoint_path` naming them (review, helper 46: it named the old)."""
    model = fr.load_model(ckpts["fp8", 0], device="cpu")
    ids = {name: p for name, p in model.named_parameters()}

    name, nth = at
    calls = []
    if nth < 0:  # counted on a reload of another model like it
        other = fr.load_model(ckpts["fp8", 0], device="cpu")
        sys.settrace(lambda frame, event, arg: calls.append(1) if (
            event == "call" and frame.f_code.co_qualname == name) else None)
        try:
            fr.update_weights_from_disk(other, ckpts["fp8", 1])
        finally:
            sys.settrace(None)
        nth, calls = len(calls) + 1 + nth, []
        assert nth > 0

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_qualname == name:
            calls.append(1)
            if len(calls) == nth:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            fr.update_weights_from_disk(model, ckpts["fp8", 1])
    finally:
        sys.settrace(None)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1], device="cpu")),
                             fr.snapshot(model)) == []
    assert all(p is ids[name] for name, p in model.named_parameters())
    assert Path(model.checkpoint_path) == Path(ckpts["fp8", 1]).resolve()
    assert _idle(model.weights_lock) == []
    fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [0]}))


_STORM = r"""
import os, signal, sys, threading, time, random
import torch
import fp8_reload as fr

model = fr.load_model(sys.argv[1])
x = torch.randn(4, model.config.hidden_size).to(torch.bfloat16)
what = sys.argv[2]
kept, stop = [], [False]

go = threading.Event()

def ctrl_c():
    go.wait()  # (not before the loop below is ready for them)
    while not stop[0]:
        time.sleep(random.uniform(0, 0.002))
        os.kill(os.getpid(), signal.SIGINT)

def run(deadline):
    while time.time() < deadline:
        try:
            if what == "forward":
                model(x)
            elif what == "nested":  # a forward inside a forward: the same access again
                with model.weights_lock.read():
                    with model.weights_lock.read():
                        pass
            else:
                with model.weights_lock.read():
                    pass
        except KeyboardInterrupt as e:
            kept.append(e)  # as a notebook keeps the last one: its frames stay alive

threading.Thread(target=ctrl_c, daemon=True).start()
deadline = time.time() + float(sys.argv[3])
while True:
    try:
        go.set()
        run(deadline)
        break
    except KeyboardInterrupt as e:
        kept.append(e)
while True:
    try:
        stop[0] = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        break
    except KeyboardInterrupt as e:
        kept.append(e)
idle = model.weights_lock.readers, model.weights_lock.writing  # (before the reload: it writes)
done = threading.Event()
threading.Thread(target=lambda: (fr.update_weights_from_disk(model, sys.argv[1]), done.set()),
                 daemon=True).start()
print(len(kept), *idle, done.wait(10), model.weights_lock.held_for_reading)
"""


@pytest.mark.parametrize("what", ["bare", "nested", "forward"])
def test_real_ctrl_cs_at_random_never_leave_the_lock_taken(ckpts, what):
    """Review s27: real SIGINTs every ~1 ms against forwards, each KeyboardInterrupt kept
    alive. A `@contextmanager` lock left its read count taken when one landed in
    contextlib's frames (after its `__enter__` resumed the generator, or as its `__exit__`
    began): a reload on another thread then waited forever (after 2 to 46 Ctrl-Cs)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _STORM, str(ckpts["fp8", 0]), what, "3"],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    caught, *state = out.stdout.split()
    assert int(caught) > 50, out.stdout  # the storm reached the forwards
    assert state == ["0", "False", "True", "False"], out.stdout  # (held_for_reading: none)


def test_a_ctrl_c_as_the_diagnostics_prune_a_given_back_access_leaves_none_taken(monkeypatch):
    """Review s27: `readers` tries each finished forward's hold (acquire, then release); a
    Ctrl-C raised as that acquire returned left the hold owned by the caller for good."""
    lock = locks.WeightsLock()

    def one_forward():
        with lock.read():
            pass

    t = threading.Thread(target=one_forward)
    t.start()
    t.join(WAIT)
    real = locks._Hold.acquire

    def acquire(self, *a, **kw):
        got = real(self, *a, **kw)
        if got and kw.get("blocking") is False:
            signal.raise_signal(signal.SIGINT)  # pending as the C call returns
        return got

    monkeypatch.setattr(locks._Hold, "acquire", acquire)
    with pytest.raises(KeyboardInterrupt):
        _ = lock.readers  # (held back while it prunes, then raised)
    monkeypatch.undo()
    assert not any(h._is_owned() for h in lock._readers)
    assert _idle(lock) == []


def test_an_access_is_entered_once():
    lock = locks.WeightsLock()
    access = lock.read()
    with access:
        pass
    with pytest.raises(RuntimeError, match="used already"):
        with access:
            pass
    assert _idle(lock) == [] and not lock.held_for_reading


def test_an_uncontended_forward_swaps_no_signal_handler(monkeypatch):
    """Session 28: a forward that need not wait registers without holding Ctrl-C back
    (two SIGINT handler swaps were ~20 of the ~22 us a forward's access cost on the main
    thread); one that queues behind a writer still holds it back while it waits."""
    lock = locks.WeightsLock()
    swaps, real = [], signal.signal
    monkeypatch.setattr(signal, "signal", lambda *a: swaps.append(a[0]) or real(*a))
    with lock.read():
        with lock.read():  # nested: a level more of the same access
            pass
    assert swaps == []
    hold = lock.commit_hold()
    with hold:  # (a reload's write access: its wait holds Ctrl-C back)
        hold.take()
    assert swaps == [signal.SIGINT, signal.SIGINT]
    with lock.read():  # the writer's given-back access is pruned on this slower path
        pass
    assert len(swaps) == 4
    with lock.read():
        pass
    assert len(swaps) == 4 and _idle(lock) == []


def test_forwards_keep_one_entry_a_thread_and_a_writer_prunes_them():
    """Without pruning on the fast path, the lock keeps each thread's latest forward access
    only (a thread forgets its given-back ones as it registers the next), and a writer
    forgets them."""
    lock = locks.WeightsLock()

    def forwards(n=200):
        for _ in range(n):
            with lock.read():
                pass

    forwards()
    threads = [threading.Thread(target=forwards) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(lock._readers) == 5  # each thread's last
    assert lock.readers == 0 and not lock._readers  # (`readers` prunes)
    forwards(1)
    hold = lock.commit_hold()
    with hold:
        hold.take()
    assert not lock._readers and _idle(lock) == []


def test_two_accesses_asked_for_before_either_is_entered_both_count():
    """Attack s28 (helper 62): ``a = lock.read(); b = lock.read()``, then ``with a: with b:``;
    the second's registration replaced the first (a dict by thread): inside ``a`` the lock
    counted no forward, and a reload on another thread wrote under it."""
    lock = locks.WeightsLock()
    a, b = lock.read(), lock.read()
    wrote = threading.Event()

    def write():
        hold = lock.commit_hold()
        with hold:
            hold.take()
            wrote.set()

    with a:
        with b:
            pass
        assert lock.held_for_reading and lock.readers == 1
        writer = threading.Thread(target=write)
        writer.start()
        assert not wrote.wait(0.5)  # it waits for `a`
    writer.join(WAIT)
    assert wrote.is_set() and _idle(lock) == []


@pytest.mark.parametrize("forward", ["fast", "queued"])
def test_a_tracers_ctrl_c_at_any_line_of_the_lock_never_leaves_a_write_waiting_for_ever(
        monkeypatch, forward):
    """Attack s28 (helper 62): under a Python tracer (pdb, a profiler) a Ctrl-C can land at a
    `with`'s closing line, before its C `__exit__`: on the new fast path that left the lock's
    mutex taken, and every later forward and write waited forever. Now the fast path takes no
    lock, and whatever a tracer's Ctrl-C leaves (at worst this thread's access, owned), a
    write on another thread gets in or gives up within `WRITE_WAIT_S`."""
    monkeypatch.setattr(locks, "WRITE_WAIT_S", 1)
    n = 0
    while True:
        n += 1
        lock, seen = locks.WeightsLock(), [0]
        if forward == "queued":  # a writer waiting: the forward takes the slower path
            lock._writers_waiting += 1
            threading.Timer(0.05, lambda lk=lock: setattr(lk, "_writers_waiting", 0)).start()

        def tracer(frame, event, arg, n=n, seen=seen):
            if event == "line" and _watched(frame.f_code):
                seen[0] += 1
                if seen[0] == n:
                    signal.raise_signal(signal.SIGINT)
            return tracer

        sys.settrace(lambda f, e, a: tracer if _watched(f.f_code) else None)
        try:
            with lock.read():
                pass
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert lock._cond.acquire(timeout=WAIT), n  # never left taken
        lock._cond.release()
        done: list = []

        def write(lock=lock, done=done):
            hold = lock.commit_hold()
            try:
                with hold:
                    hold.take()
                done.append("wrote")
            except RuntimeError as e:  # a read access this tracer's Ctrl-C left owned
                done.append(str(e))

        writer = threading.Thread(target=write)
        writer.start()
        writer.join(WAIT)
        assert done and (done[0] == "wrote" or "FP8_RELOAD_WRITE_WAIT_S" in done[0]), (n, done)
        if seen[0] < n:
            break
    assert n > 5


def test_ctrl_cs_held_back_around_a_write_do_not_renew_its_wait(monkeypatch):
    """Attack s28 (helper 62): a rebalance holds Ctrl-C back around its write; each Ctrl-C
    ended the write's wait, which then began again with a new `WRITE_WAIT_S`: pressing
    Ctrl-C kept a stuck rebalance waiting. The deadline is now the first wait's."""
    import time

    monkeypatch.setattr(locks, "WRITE_WAIT_S", 1)
    lock = locks.WeightsLock()
    reading, leave = threading.Event(), threading.Event()

    def forward():
        with lock.read():
            reading.set()
            leave.wait(WAIT)

    stuck = threading.Thread(target=forward)
    stuck.start()
    reading.wait(WAIT)
    held, stop = [], threading.Event()

    def ctrl_cs():  # (for 4 s at most: a renewed wait then still ends, late, not never)
        while not stop.wait(0.3) and time.monotonic() - t0 < 4:
            signal.raise_signal(signal.SIGINT)

    presses = threading.Thread(target=ctrl_cs)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):  # (the held-back one, handed over at the end)
        with interrupts.sigint_deferred(then=lambda: held.append(time.monotonic() - t0)):
            presses.start()
            hold = lock.commit_hold()
            with pytest.raises(RuntimeError, match="FP8_RELOAD_WRITE_WAIT_S"):
                with hold:
                    hold.take()
            waited = time.monotonic() - t0
            stop.set()
            presses.join(WAIT)
    leave.set()
    stuck.join(WAIT)
    assert held and waited < 1.5, (waited, held)
    assert _idle(lock) == []


def test_a_forwards_lock_free_try_and_a_writer_never_both_get_in():
    """Review s28 (helper 63): the forward's try read the writer, then the waiting count; a
    writer that had missed the forward set itself (read: none yet) and stopped counting
    (read: 0) in between, and both went in. The thread switches are forced here at those
    points by properties that only pause (each at most 0.5 s), no logic changed."""
    import sys

    writer_looked, forward_read, count_dropped = threading.Event(), threading.Event(), threading.Event()
    forward: list = []

    class Paused(locks.WeightsLock):
        @property
        def _writer(self):
            if threading.current_thread() in forward and sys._getframe(1).f_code.co_name == "_try_forward":
                forward_read.set()
            return self.__dict__.get("_w")

        @_writer.setter
        def _writer(self, value):
            if value is not None and threading.current_thread() not in forward:
                writer_looked.set()  # it saw no forward, and sets itself now
                forward_read.wait(0.5)
            self.__dict__["_w"] = value

        @property
        def _writers_waiting(self):
            if threading.current_thread() in forward and sys._getframe(1).f_code.co_name == "_try_forward":
                forward_read.set()
                count_dropped.wait(0.5)
            return self.__dict__.get("_ww", 0)

        @_writers_waiting.setter
        def _writers_waiting(self, value):
            counted = self.__dict__.get("_ww", 0)
            self.__dict__["_ww"] = value
            if counted and not value and threading.current_thread() not in forward:
                count_dropped.set()  # (the writer's drop, not the constructor's 0)

    lock = Paused()
    inside = {"writer": threading.Event(), "forward": threading.Event()}
    both, leave = [], threading.Event()

    def write():
        hold = lock.commit_hold()
        with hold:
            hold.take()
            inside["writer"].set()
            both.append(inside["forward"].wait(1.0))
            leave.wait(WAIT)

    def read():
        writer_looked.wait(WAIT)
        with lock.read():
            inside["forward"].set()
            both.append(inside["writer"].is_set() and not leave.is_set())

    reader = threading.Thread(target=read)
    forward.append(reader)
    threads = [threading.Thread(target=write), reader]
    for t in threads:
        t.start()
    inside["writer"].wait(WAIT)
    time.sleep(1.2)
    leave.set()
    for t in threads:
        t.join(WAIT)
    assert both == [False, False], both  # the forward came in once the write was over
    assert _idle(lock) == []
