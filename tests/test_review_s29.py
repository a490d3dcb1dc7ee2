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


# (the generator, collected at the end, gives the access back from another thread: RLock refuses)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_access_left_by_an_ended_thread_fails_a_write_at_once_naming_it(ckpts, monkeypatch):
    monkeypatch.setattr(locks, "WRITE_WAIT_S", 3)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)

    def forward_across_a_yield():
        with model.weights_lock.read():
            yield

    left = []

    def batcher():  # starts a forward, keeps it (suspended inside the access), and ends
        g = forward_across_a_yield()
        next(g)
        left.append(g)

    worker = threading.Thread(target=batcher, name="batcher")
    worker.start()
    worker.join()
    assert left and model.weights_lock.readers == 1
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
