"""The ring's reader processes (`checkpoint.read_procs`): what a reload reads through them
equals a fresh load, and what goes wrong on their side (a shard cut short under them, a
process killed) fails the reload cleanly, restores the model, and leaves the next reload
working. The thread readers, their fallback, are held to the same."""

from __future__ import annotations

import os
import signal

import pytest

import fp8_reload as fr
from fp8_reload.checkpoint import read_procs
from fp8_reload.checkpoint.staging import release_staging
from fp8_reload.errors import CorruptCheckpointError, ReloadError
from fp8_reload.reload import ring as ring_mod

from .conftest import unchanged

pytestmark = pytest.mark.skipif(not read_procs.supported(),
                                reason="reader processes need Linux's memfd and descriptor passing")


def _spy(monkeypatch, name: str) -> list:
    calls, real = [], getattr(ring_mod, name)
    monkeypatch.setattr(ring_mod, name, lambda *a: calls.append(a) or real(*a))
    return calls


def _same_as_fresh(model, path) -> list:
    return fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model))


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_a_reload_read_by_processes_equals_a_fresh_load(ckpts, monkeypatch, kind):
    used = _spy(monkeypatch, "_through_processes")
    model = fr.load_model(ckpts[kind, 0])
    fr.update_weights_from_disk(model, ckpts[kind, 1])
    assert used and not _same_as_fresh(model, ckpts[kind, 1])
    fr.update_weights_from_disk(model, ckpts[kind, 0], fr.generate_weight_name_filter({1: [0, 3]}))
    fr.update_weights_from_disk(model, ckpts[kind, 0])
    assert not _same_as_fresh(model, ckpts[kind, 0])
    procs = read_procs.pool()
    assert all(p.poll() is None for p in procs.procs) and not any(procs.pending)


def test_threads_read_when_processes_are_off_or_busy(ckpts, monkeypatch):
    threads = _spy(monkeypatch, "_through_threads")
    model = fr.load_model(ckpts["fp8", 0])
    procs = read_procs.pool()
    with procs.busy:  # another ring of this process is using them
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert len(threads) == 1 and not _same_as_fresh(model, ckpts["fp8", 1])
    monkeypatch.setattr(read_procs, "READERS", "threads")
    release_staging(model)  # its ring was shared memory: the next one is not
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    assert len(threads) == 2 and not _same_as_fresh(model, ckpts["fp8", 0])


def test_a_shard_cut_short_under_the_readers_fails_the_reload_and_restores(ckpts, tmp_path, monkeypatch):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(ckpts["fp8", 1], path)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    real = ring_mod._through_processes

    def cut_then_read(ckpt, chunks, *rest):
        shard = ckpt.path / chunks[-1].file
        os.truncate(shard, chunks[-1].spans[0][0] + 1)  # after the plan checked its size
        return real(ckpt, chunks, *rest)

    monkeypatch.setattr(ring_mod, "_through_processes", cut_then_read)
    with pytest.raises(CorruptCheckpointError, match="truncated while reading"):
        fr.update_weights_from_disk(model, path)
    assert unchanged(model, before) == []
    monkeypatch.setattr(ring_mod, "_through_processes", real)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # the readers still work
    assert not _same_as_fresh(model, ckpts["fp8", 1])


def test_a_reader_process_killed_mid_reload_fails_it_cleanly_and_new_ones_start(ckpts, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 0])  # the pool is up
    before = fr.snapshot(model)
    procs = read_procs.pool()
    real = procs.wait

    def kill_then_wait(chunk):
        victim = procs.procs[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        return real(chunk)

    monkeypatch.setattr(procs, "wait", kill_then_wait)
    with pytest.raises(ReloadError, match="reader process .* stopped"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert unchanged(model, before) == [] and procs.broken
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert read_procs.pool() is not procs and not _same_as_fresh(model, ckpts["fp8", 1])


def test_a_released_ring_is_unmapped_by_the_readers_at_once(ckpts):
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    key = ring_mod.ring_for(model, 1, pin=False).shared.key
    procs = read_procs.pool()
    assert key in procs.mapped
    release_staging(model)
    assert key not in procs.mapped and not procs.dropped
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    key = ring_mod.ring_for(model, 1, pin=False).shared.key
    assert key in procs.mapped
    with procs.busy:  # a ring streaming meanwhile (the collector may run inside it): later
        release_staging(model)
        assert key in procs.dropped and key in procs.mapped
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # the next use through them unmaps it
    assert key not in procs.mapped and not procs.dropped


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_any_ring_size_lands_the_right_bytes(ckpts, monkeypatch, slots):
    """One slot: the next chunk may be read only once this one is landed (it was landed from
    a slot still holding the chunk before it)."""
    import fp8_reload.reload.chunks as chunks_mod

    monkeypatch.setattr(chunks_mod, "RING_SLOTS", slots)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)  # many chunks
    used = _spy(monkeypatch, "_through_processes")
    model = fr.load_model(ckpts["fp8", 0])
    for seed in (1, 0, 1):
        fr.update_weights_from_disk(model, ckpts["fp8", seed])
        assert not _same_as_fresh(model, ckpts["fp8", seed])
    assert used


def test_a_forked_child_does_not_write_its_parents_ring(ckpts):
    """Shared memory stays shared across fork: a child that reloads gets a ring of its own
    (here the fork is told by the buffer's pid), and leaves the parent's registered."""
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    ring = ring_mod.ring_for(model, 1, pin=False)
    parents = ring.shared
    parents.pid = -1  # made by another process
    mine = ring_mod.ring_for(model, 1, pin=False)
    assert mine.shared is not None and mine.shared.key != parents.key and parents.fd >= 0
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    assert not _same_as_fresh(model, ckpts["fp8", 0])


def test_closing_reaches_the_processes_while_a_forked_child_holds_the_sockets(ckpts):
    procs = read_procs.ReaderProcs(2)
    copies = [os.dup(s.fileno()) for s in procs.socks]  # what a forked child inherits
    try:
        procs.close()
        assert all(p.wait(timeout=2) == 0 for p in procs.procs)
    finally:
        for fd in copies:
            os.close(fd)


def test_a_process_dead_between_reloads_is_replaced_before_the_next(ckpts):
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    procs = read_procs.pool()
    procs.procs[-1].kill()
    procs.procs[-1].wait()
    fr.update_weights_from_disk(model, ckpts["fp8", 0])  # no spurious failure
    assert read_procs.pool() is not procs and not _same_as_fresh(model, ckpts["fp8", 0])


def test_many_small_pieces_to_one_process_do_not_fill_its_socket(ckpts, monkeypatch):
    """Thousands of reads asked of one process before any answer is read would fill both
    directions of its socket (a hang): at most `MAX_IN_FLIGHT` stay unanswered."""
    import fp8_reload.reload.chunks as chunks_mod

    def hang(*_):
        raise TimeoutError("the reload hung")

    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", 32)
    monkeypatch.setattr(chunks_mod, "MIN_PIECE_BYTES", 32)
    monkeypatch.setattr(read_procs, "MAX_IN_FLIGHT", 2)
    used = _spy(monkeypatch, "_through_processes")
    model = fr.load_model(ckpts["fp8", 0])
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert used and not _same_as_fresh(model, ckpts["fp8", 1])
    assert all(len(todo) == 0 for todo in read_procs.pool().pending)


def test_processes_that_cannot_start_leave_the_reads_to_threads(ckpts, monkeypatch, tmp_path):
    monkeypatch.setattr(read_procs, "_pool", None)
    monkeypatch.setattr(read_procs, "_failed", [])
    monkeypatch.setattr(read_procs, "WORKER", tmp_path / "missing.py")  # python exits at once
    threads = _spy(monkeypatch, "_through_threads")
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert threads and read_procs._failed and not read_procs.supported()
    assert not _same_as_fresh(model, ckpts["fp8", 1])


class _InterruptAtLastAnswer:
    """A socket whose `recv` is interrupted (as by Ctrl-C) right after the last answer its
    process owes came in: nothing more will ever arrive on it."""

    def __init__(self, procs, i: int):
        self.procs, self.i, self.sock = procs, i, procs.socks[i]

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def recv(self, n):
        answer = self.sock.recv(n)
        if sum(entry[3] is None for entry in self.procs.pending[self.i]) == 1:
            raise KeyboardInterrupt
        return answer


def test_an_interrupt_inside_the_exchange_abandons_the_processes(ckpts, monkeypatch):
    """Ctrl-C between receiving a process's last answer and recording it: waiting for that
    answer again hung; broken out of, later answers were paired with the wrong reads (wrong
    bytes, reported as a success). Now the processes are abandoned, the model restored, and
    the next reloads are right."""
    import fp8_reload.reload.chunks as chunks_mod

    hung = []

    def hang(*_):
        hung.append(True)
        raise TimeoutError("the reload hung")

    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    before = fr.snapshot(model)
    procs = read_procs.pool()
    procs.socks[0] = _InterruptAtLastAnswer(procs, 0)
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        with pytest.raises(KeyboardInterrupt):
            fr.update_weights_from_disk(model, ckpts["fp8", 1])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not hung and procs.broken and unchanged(model, before) == []
    fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter({1: [0, 3], 2: [5]}))
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert read_procs.pool() is not procs and not _same_as_fresh(model, ckpts["fp8", 1])


def test_release_staging_waits_for_a_reload_of_that_model_in_another_thread(ckpts):
    """It emptied the ring under a running reload (failed reloads: `k % len(ring.buffers)`)."""
    import threading
    import time

    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    done = []
    with model.reload_lock:  # a reload of this model is running
        worker = threading.Thread(target=lambda: (release_staging(model), done.append(time.monotonic())))
        worker.start()
        time.sleep(0.2)
        assert not done
        released_at = time.monotonic()
    worker.join(5)
    assert done and done[0] >= released_at


@pytest.mark.parametrize("at", ["self._asked(i, [req, chunk", "self.owed[i] += 1", "self.owed[i] -= 1"],
                         ids=["sent-not-written-down", "queued-not-counted", "answered-not-counted"])
def test_an_exception_between_two_steps_of_the_bookkeeping_retires_the_processes(tmp_path, at):
    """An exception (a signal handler's, say) raised between two steps of a request's
    bookkeeping leaves the processes unusable (`alive()` false: the next reload starts new
    ones), or fails loudly: never a later answer paired with another read."""
    import sys
    import threading

    src = read_procs.__file__
    line = next(n for n, text in enumerate(open(src), 1) if at in text)

    def trace(frame, event, arg):
        if frame.f_code.co_filename != src:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line:
                sys.settrace(None)
                raise TimeoutError("injected")
            return local
        return local

    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 16))
    procs = read_procs.ReaderProcs(2)
    buf = read_procs.SharedBuffer(1 << 16)
    try:
        with open(path, "rb") as f:
            procs.attach(buf)
            keys = procs.open_files({"x": f})
            pieces = [(keys["x"], 64 * j, 64, buf.key, 64 * j, f"p{j}") for j in range(2)]
            sys.settrace(trace)
            try:
                procs.submit(0, pieces)
                procs.wait(0)
            except TimeoutError:
                pass
            finally:
                sys.settrace(None)
                threading.settrace(None)
            try:
                procs.drain()
            except ReloadError:
                pass
            assert not procs.alive()
    finally:
        procs.close()
        buf.release()
