"""Reliability under concurrency: reloads serialize, forwards never see a half-written
layer and keep running while a reload reads the checkpoint, and a reload from inside a
forward or from inside a reload is refused, never deadlocked."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.stream as stream_mod
from fp8_reload.checkpoint import Checkpoint
from fp8_reload.layers import expert_of

from .conftest import DEVICES, WAIT, WRITE_POINT, mix_checkpoints, tokens, unchanged
from .threads import start as start_thread

KINDS = ["fp8", "bf16"]


# ==========================================================================
# Concurrency
# ==========================================================================

class Gate:
    """Pauses the `at`-th call of `owner.attr` (after running it) until opened."""

    def __init__(self, monkeypatch, owner, attr, at=1):
        self.reached, self.open = threading.Event(), threading.Event()
        self.calls = 0
        orig = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.calls += 1
            if self.calls == at:
                self.reached.set()
                assert self.open.wait(WAIT), "gate never opened"
            return out

        monkeypatch.setattr(owner, attr, wrapper)


@pytest.fixture(scope="module")
def outputs(ckpts, tiny_cfg):
    """outputs(device): input and forward outputs of fresh seed-0 and seed-1 fp8 models."""
    cache = {}

    def get(device="cpu"):
        if device not in cache:
            x = tokens(tiny_cfg).to(device)
            cache[device] = (x, fr.load_model(ckpts["fp8", 0], device=device)(x),
                             fr.load_model(ckpts["fp8", 1], device=device)(x))
        return cache[device]
    return get


@pytest.mark.parametrize("device", DEVICES)
def test_forward_waits_for_a_commit_and_never_sees_a_half_written_model(ckpts, outputs, monkeypatch,
                                                                       device, engine):
    x, y0, y1 = outputs(device)
    model = fr.load_model(ckpts["fp8", 0], device=device)
    gate = Gate(monkeypatch, *WRITE_POINT[engine], at=40)  # mid-commit
    reload_t, reload_r = start_thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    assert gate.reached.wait(WAIT)

    # The control: the model *is* half-written now, and a forward that bypassed the
    # lock would return a mix of old and new weights.
    torn = model.model(x)
    assert not torch.equal(torn, y0) and not torch.equal(torn, y1)

    fwd_t, fwd_r = start_thread(model, x)
    fwd_t.join(0.3)
    assert fwd_t.is_alive(), "a forward ran while weights were being written"
    gate.open.set()
    reload_t.join(WAIT)
    fwd_t.join(WAIT)
    assert "error" not in reload_r and "error" not in fwd_r
    assert torch.equal(fwd_r["value"], y1)


def test_forwards_keep_running_while_a_reload_reads_the_checkpoint(ckpts, outputs, monkeypatch, engine):
    """Why a reader/writer rule: what a reload reads before it writes does not stall
    serving; only the in-place commit does. (Staged: every tensor is read first.
    Streaming: the scales and loader-bound tensors; the bulk streams under the lock,
    at the link's speed, see docs/how-it-works.md.)"""
    x, y0, y1 = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    reached, release = threading.Event(), threading.Event()
    orig, orig_scalars = Checkpoint.read, stream_mod.read_scalars

    def slow_read(self, names, stats=None, into=None):
        for i, item in enumerate(orig(self, names, stats, into=into)):
            if i == 1:
                reached.set()
                assert release.wait(WAIT)
            yield item

    def slow_scalars(*args, **kwargs):
        reached.set()
        assert release.wait(WAIT)
        return orig_scalars(*args, **kwargs)

    if engine == "staged":
        monkeypatch.setattr(Checkpoint, "read", slow_read)
    else:
        monkeypatch.setattr(stream_mod, "read_scalars", slow_scalars)
    reload_t, reload_r = start_thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    assert reached.wait(WAIT)
    fwd_t, fwd_r = start_thread(model, x)
    fwd_t.join(WAIT)
    assert not fwd_t.is_alive() and torch.equal(fwd_r["value"], y0)
    release.set()
    reload_t.join(WAIT)
    assert "error" not in reload_r
    assert torch.equal(model(x), y1)


def test_a_waiting_reload_is_not_starved_by_new_forwards(ckpts, outputs, monkeypatch):
    """Writer preference: once a commit waits, forwards that arrive later queue behind it."""
    x, y0, y1 = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    inside, leave = threading.Event(), threading.Event()

    def hold(module, args, out):
        if threading.current_thread().name == "slow-forward":
            inside.set()
            assert leave.wait(WAIT)

    model.model.register_forward_hook(hold)
    slow = threading.Thread(target=model, args=(x,), name="slow-forward", daemon=True)
    slow.start()
    assert inside.wait(WAIT)
    reload_t, reload_r = start_thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    deadline = time.monotonic() + WAIT
    while model.weights_lock._writers_waiting == 0:  # the commit is queued
        assert time.monotonic() < deadline
        time.sleep(0.005)
    late_t, late_r = start_thread(model, x)
    late_t.join(0.2)
    assert late_t.is_alive(), "a new forward overtook the waiting reload"
    leave.set()
    for t in (slow, reload_t, late_t):
        t.join(WAIT)
    assert "error" not in reload_r
    assert torch.equal(late_r["value"], y1)


def test_two_reloads_serialize(ckpts, tmp_path, monkeypatch, engine):
    model = fr.load_model(ckpts["fp8", 0])
    order = []
    owner, attr = WRITE_POINT[engine]
    orig = getattr(owner, attr)

    def traced(self, *args, **kwargs):
        order.append(threading.current_thread().name)
        time.sleep(0.001)  # widen the window for interleaving
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(owner, attr, traced)
    start = threading.Barrier(2)
    specs = {"A": {1: [0, 1, 2]}, "B": {2: [3, 4, 5]}}

    def reload(spec):
        start.wait(WAIT)
        return fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(spec))

    threads = [threading.Thread(target=reload, args=(specs[n],), name=n, daemon=True) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert sorted(runs) == ["A", "B"], f"commits interleaved: {runs}"
    chosen = {(layer, e) for spec in specs.values() for layer, es in spec.items() for e in es}
    mixed = mix_checkpoints(ckpts["fp8", 0], ckpts["fp8", 1], tmp_path / "mixed",
                            lambda n: expert_of(n) in chosen)
    assert fr.compare_states(fr.snapshot(fr.load_model(mixed)), fr.snapshot(model)) == []


@pytest.mark.parametrize("device", DEVICES)
def test_many_forwards_during_many_reloads_see_old_or_new_never_a_mix(ckpts, outputs, monkeypatch,
                                                                     device, engine):
    x, y0, y1 = outputs(device)
    model = fr.load_model(ckpts["fp8", 0], device=device)
    owner, attr = WRITE_POINT[engine]
    orig = getattr(owner, attr)

    def slow(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        time.sleep(0.0002)  # let forwards queue up against the commit
        return out

    monkeypatch.setattr(owner, attr, slow)
    stop = threading.Event()
    seen = {"old": 0, "new": 0, "mixed": 0}
    reloading = threading.Event()
    during = [0]

    def forwards():
        while not stop.is_set():
            issued_during = reloading.is_set()
            y = model(x)
            key = "old" if torch.equal(y, y0) else "new" if torch.equal(y, y1) else "mixed"
            seen[key] += 1
            during[0] += issued_during

    workers = [threading.Thread(target=forwards, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        for i in range(8):
            reloading.set()
            fr.update_weights_from_disk(model, ckpts["fp8", (i + 1) % 2])
            reloading.clear()
            time.sleep(0.01)
    finally:
        stop.set()
        for w in workers:
            w.join(WAIT)
    assert seen["mixed"] == 0, seen
    assert during[0] > 0 and seen["old"] > 0 and seen["new"] > 0, (seen, during)


def reload_from_every_forward(model, path, errors: list):
    """A forward hook on `model` that asks for a full reload from `path` and keeps the
    `ReloadError` it gets in `errors`; returns its handle."""

    def reload_hook(module, args, out):
        try:
            fr.update_weights_from_disk(model, path)
        except fr.ReloadError as e:
            errors.append(e)

    return model.model.register_forward_hook(reload_hook)


def test_a_reload_from_inside_a_forward_is_refused_not_deadlocked(ckpts, outputs):
    x, y0, _ = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    errors = []
    handle = reload_from_every_forward(model, ckpts["fp8", 1], errors)
    t, r = start_thread(model, x)
    t.join(WAIT)
    handle.remove()
    assert not t.is_alive(), "deadlocked"
    assert len(errors) == 1 and "inside a forward" in str(errors[0])
    assert unchanged(model, before) == []


# ---------------------------------------------------------------- reload from a forward,
# while another reload runs: every interleaving raises, none deadlocks

INTERLEAVINGS = ["other-reload-reading", "other-reload-waiting-to-commit", "other-reload-committing"]


@pytest.mark.parametrize("when", INTERLEAVINGS)
def test_a_reload_from_a_forward_raises_whatever_another_reload_is_doing(ckpts, outputs, monkeypatch,
                                                                          when, engine):
    """Thread R reloads the model; thread F runs a forward whose hook asks for a reload
    of the same model. Before the fix, F waited for the reload lock that R held while R
    waited for F's forward to end. Now F's request raises at once, F's forward and R's
    reload both finish, and the model ends up as R left it."""
    x, _, y1 = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    in_hook, go = threading.Event(), threading.Event()
    errors: list = []

    def hook(module, args, out):
        if threading.current_thread().name != "F":
            return
        in_hook.set()
        assert go.wait(WAIT)
        try:
            fr.update_weights_from_disk(model, ckpts["fp8", 1])
        except fr.ReloadError as e:
            errors.append(e)

    model.model.register_forward_hook(hook)

    def start_forward():
        t = threading.Thread(target=model, args=(x,), name="F", daemon=True)
        t.start()
        return t

    if when == "other-reload-reading":  # R holds the reload lock, reading; F then runs
        reading, resume = threading.Event(), threading.Event()

        def pause():
            if threading.current_thread().name == "R" and not reading.is_set():
                reading.set()
                assert resume.wait(WAIT)

        if engine == "staged":  # every tensor is read before the lock
            orig = Checkpoint.read

            def slow_read(self, names, stats=None, into=None):
                for i, item in enumerate(orig(self, names, stats, into=into)):
                    if i == 1:
                        pause()
                    yield item

            monkeypatch.setattr(Checkpoint, "read", slow_read)
        else:  # the streaming engine reads the scales before the lock
            orig_scalars = stream_mod.read_scalars

            def slow_scalars(*args, **kwargs):
                pause()
                return orig_scalars(*args, **kwargs)

            monkeypatch.setattr(stream_mod, "read_scalars", slow_scalars)
        reload_t = threading.Thread(target=fr.update_weights_from_disk, args=(model, ckpts["fp8", 1]),
                                    name="R", daemon=True)
        reload_t.start()
        assert reading.wait(WAIT)
        fwd = start_forward()
        go.set()
        fwd.join(WAIT)
        assert not fwd.is_alive(), "deadlock: the forward's reload waited for the reload lock"
        resume.set()
    elif when == "other-reload-waiting-to-commit":  # F in a forward; R queues for the commit
        fwd = start_forward()
        assert in_hook.wait(WAIT)
        reload_t = threading.Thread(target=fr.update_weights_from_disk, args=(model, ckpts["fp8", 1]),
                                    name="R", daemon=True)
        reload_t.start()
        deadline = time.monotonic() + WAIT
        while model.weights_lock._writers_waiting == 0:
            assert time.monotonic() < deadline, "the reload never queued for the commit"
            time.sleep(0.005)
        go.set()
        fwd.join(WAIT)
        assert not fwd.is_alive(), "deadlock: the forward's reload waited for the reload lock"
    else:  # R commits; F's forward waits for it, then its hook asks for a reload
        gate = Gate(monkeypatch, *WRITE_POINT[engine], at=40)
        reload_t = threading.Thread(target=fr.update_weights_from_disk, args=(model, ckpts["fp8", 1]),
                                    name="R", daemon=True)
        reload_t.start()
        assert gate.reached.wait(WAIT)
        go.set()
        fwd = start_forward()
        fwd.join(0.2)
        assert fwd.is_alive() and not in_hook.is_set(), "a forward ran during the commit"
        gate.open.set()
        fwd.join(WAIT)
        assert not fwd.is_alive()
    reload_t.join(WAIT)
    assert not reload_t.is_alive()
    assert len(errors) == 1 and "inside a forward" in str(errors[0]), errors
    assert torch.equal(model(x), y1)  # R's reload went through; F's request changed nothing


def test_a_reload_from_inside_a_reload_on_the_same_thread_is_refused(ckpts, monkeypatch, engine):
    """A loader (or a hook it runs) calling back into update_weights_from_disk would
    re-enter the transaction half-way on the same thread (the reload lock is
    re-entrant): refused, and the outer reload rolls back and raises that refusal."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    owner, attr = WRITE_POINT[engine]
    orig = getattr(owner, attr)
    inner = []

    def calls_back(self, *args, **kwargs):
        if not inner:
            try:
                fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter({1: [0]}))
            except fr.ReloadError as e:
                inner.append(e)
                raise
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(owner, attr, calls_back)
    with pytest.raises(fr.ReloadError) as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert inner and "already running on this thread" in str(inner[0])
    assert info.value is inner[0] or info.value.__cause__ is inner[0]
    assert unchanged(model, before) == []
    monkeypatch.undo()
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # nothing left held
