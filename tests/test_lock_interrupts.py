"""A Ctrl-C wherever it can land in the weights lock's bookkeeping leaves no lock behind.

Python hands a signal to its handler at a function's start (and at a few other points),
so a KeyboardInterrupt can come between a count taken and the `try` that gives it back,
or inside a condition's `__exit__` (review, helper 46: a forward interrupted there left
every later reload waiting forever). These tests send a real SIGINT at every Python call
the lock makes (`sys.settrace`), one run per call, and then require: the lock idle, a
reload on another thread done in time, the model whole.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
import fp8_reload.interrupts as interrupts
import fp8_reload.locks as locks

from .conftest import WAIT, tokens

WATCHED = {Path(locks.__file__).resolve(), Path(interrupts.__file__).resolve()}
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
    n, interrupted = 0, 0
    while True:
        n += 1
        tracer, seen = _sigint_at_call(n)
        sys.settrace(tracer)
        try:
            if what == "forward":
                model(x)
            else:
                fr.update_weights_from_disk(model, ckpts["fp8", n % 2])
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        assert _idle(model.weights_lock) == [], (what, n)
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


@pytest.mark.parametrize("at", ["clear_kernel_caches", "_give_back"])
def test_a_ctrl_c_once_the_commit_is_over_leaves_the_new_weights_named(ckpts, at):
    """After the drain the reload has happened: a Ctrl-C then (kernel caches cleared, the
    weights lock given back) reaches the caller, and the model holds the new weights, every
    Parameter kept, `checkpoint_path` naming them (review, helper 46: it named the old)."""
    model = fr.load_model(ckpts["fp8", 0], device="cpu")
    ids = {name: p for name, p in model.named_parameters()}

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == at:
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
