"""Leftovers of attack s28 on the reload path (CPU). Each case failed before its fix:

* a generator suspended inside ``with model.weights_lock.read()`` whose thread then ended
  kept that access held by no living thread: every reload waited `FP8_RELOAD_WRITE_WAIT_S`
  (60 s) and failed saying forwards still ran. It now fails at once, naming the thread.
"""

from __future__ import annotations

import threading
import time

import pytest

import fp8_reload as fr
from fp8_reload import locks


def _left_by_an_ended_thread(access, name: str) -> list:
    """A thread named `name` enters `access()` in a generator, keeps it suspended inside, and
    ends; returns the generator (kept alive: the access stays entered)."""
    def inside():
        with access():
            yield

    kept = []

    def run():
        g = inside()
        next(g)
        kept.append(g)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    return kept


# (the generator, collected at the end, gives the access back from another thread: RLock refuses)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_access_left_by_an_ended_thread_fails_a_write_at_once_naming_it(ckpts, monkeypatch):
    monkeypatch.setattr(locks, "WRITE_WAIT_S", 3)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    kept = _left_by_an_ended_thread(model.weights_lock.read, "batcher")
    assert kept and model.weights_lock.readers == 1
    t0 = time.monotonic()
    with pytest.raises(fr.ReloadError, match="held by thread 'batcher', which ended"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert time.monotonic() - t0 < 1.5
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    # a living thread's access is still waited for (and the write then goes in)
    lock, inside, leave = locks.WeightsLock(), threading.Event(), threading.Event()

    def forward():
        with lock.read():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=forward)
    t.start()
    inside.wait(5)
    threading.Timer(0.3, leave.set).start()
    with lock.write():
        assert lock.readers == 0
    t.join(5)


def test_two_writers_never_take_a_released_forward_of_an_ended_thread_for_an_abandoned_one():
    """Review (helper 65): a writer probing a given-back forward's hold held its RLock for an
    instant, and the other writer, seeing it taken and its thread ended, refused (~7% of
    writes in 20 s)."""
    lock = locks.WeightsLock()
    stop = time.monotonic() + 2.0
    refused, writes = [], [0]

    def writer():
        while time.monotonic() < stop:
            try:
                with lock.write():
                    writes[0] += 1
            except RuntimeError as e:
                refused.append(str(e))

    def forwards():
        def forward():
            with lock.read():
                time.sleep(0.0005)
        while time.monotonic() < stop:
            ts = [threading.Thread(target=forward) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    threads = [threading.Thread(target=writer) for _ in range(2)] + [threading.Thread(target=forwards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writes[0] > 100 and refused == [], (writes, refused[:1])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_forward_behind_a_write_left_by_an_ended_thread_fails_not_waits_forever():
    lock = locks.WeightsLock()
    kept = _left_by_an_ended_thread(lock.write, "leaver")
    out = []

    def forward():
        try:
            with lock.read():
                out.append("ran beside a write")
        except RuntimeError as e:
            out.append(str(e))

    f = threading.Thread(target=forward, daemon=True)
    f.start()
    f.join(5)
    assert not f.is_alive() and out, out
    assert "a write's access to the weights is held by thread 'leaver'" in out[0], out
    assert kept
