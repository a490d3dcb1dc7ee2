"""Review s18: the kept backup plan, the backup begun before the read, the weights taken first.

Every test runs the GPU code path on CPU with the backup stream deferred (`deferred`), with
every shard "registered" (a full reload takes the weights lock right after planning) or
none (the lock after the read). Invariants: a failure leaves the model bit for bit as it
was (Parameter objects too), no queued backup copy left unrun, the weights lock free; a
success equals a fresh load.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.backup as bk
import fp8_reload.reload.backup_plan as bplan
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.transaction as tx
from fp8_reload.checkpoint.staging import release_staging

from .conftest import WAIT, mix_checkpoints, unchanged
from .test_concurrency import outputs, reload_from_every_forward  # noqa: F401  (a fixture)
from .test_review_s17 import _HostCopy, _setup, deferred  # noqa: F401  (a fixture)

# what a failure is injected into: transaction.py's names, Backup's methods, the drain's stamp check
PHASES = ["check_compatible", "capture_backup", "begin", "prepare", "registered_files", "_take_lock",
          "_drain_device", "commit", "process_modules", "stamp", "start_on_demand", "complete"]


def _lock_is_free(model) -> None:
    assert not model.weights_lock.writing and model.weights_lock.readers == 0
    entered = threading.Event()

    def forward():
        with model.weights_lock.read():
            entered.set()

    threading.Thread(target=forward, daemon=True).start()
    assert entered.wait(WAIT), "the weights lock was left held"


def _raise(exc, real=None):
    """Raises `exc` (after running `real`, when given: its work done, then the failure)."""
    def f(*a, **kw):
        if real is not None:
            real(*a, **kw)
        raise exc
    return f


def _inject(m, model, phase, exc, after: bool) -> None:
    if phase == "stamp":  # the files seem to change: found at the drain, every write done
        real, calls = tx.checkpoint_stamp, []
        m.setattr(tx, "checkpoint_stamp", lambda c: (real(c), calls.append(1) or len(calls)))
    elif phase in ("begin", "start_on_demand", "complete"):
        m.setattr(bk.Backup, phase, _raise(exc, getattr(bk.Backup, phase) if after else None))
    elif phase == "_take_lock" and not isinstance(exc, KeyboardInterrupt):  # (the lock's own error)
        m.setattr(type(model.weights_lock), "_take", _raise(RuntimeError("injected: lock")))
    else:
        m.setattr(tx, phase, _raise(exc, getattr(tx, phase) if after and phase in ("commit", "prepare")
                                    else None))


def _registered(monkeypatch) -> list:
    """`[True]`: every shard registered (the early lock for a full reload); `[False]`: none."""
    reg, files, now = [True], tx.registered_files, tx.registered_now
    monkeypatch.setattr(tx, "registered_files",
                        lambda m, c, r: {f: _HostCopy(c.path / f) for f in r} if reg[0] else files(m, c, r))
    monkeypatch.setattr(tx, "registered_now", lambda m, c, fs: set(fs) if reg[0] else now(m, c, fs))
    return reg


@pytest.mark.parametrize("seed", range(8))
def test_random_reload_sequences_keep_every_invariant(ckpts, deferred, monkeypatch, tmp_path, seed):  # noqa: F811
    """Two checkpoints alternated, full and filtered, early lock or not, host or device backup,
    postprocess_all on/off/default, `release_staging` and Parameters rebound to other memory
    between reloads (kept plans go stale), a failure (exception or Ctrl-C) at any phase."""
    rng = random.Random(seed)
    monkeypatch.setattr(bplan, "SMALL_BYTES", rng.choice([0, bplan.SMALL_BYTES, 1 << 40]))
    monkeypatch.setattr(bk, "LOOKAHEAD", rng.choice([0, 4096, 1 << 30]))
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", rng.choice([4096, 1 << 20]))
    reg = _registered(monkeypatch)
    kind = rng.choice(["fp8", "bf16"])
    model = fr.load_model(ckpts[kind, 0])
    fresh = {k: fr.snapshot(fr.load_model(ckpts[kind, k])) for k in (0, 1)}
    base, failed = 0, 0
    for step in range(14):
        reg[0], k = rng.random() < 0.6, rng.choice([0, 1])
        flt = None if rng.random() < 0.7 else fr.generate_weight_name_filter({1: [2], 2: [rng.randrange(8)]})
        if rng.random() < 0.1:
            release_staging(model)
        elif rng.random() < 0.15:
            p = rng.choice([p for p in model.parameters() if p.numel() > 1])
            p.data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype).copy_(p.data)
        phase = rng.choice(PHASES + [None] * 6)
        exc = rng.choice([KeyboardInterrupt(), RuntimeError("injected"), OSError(5, "injected")])
        before = fr.snapshot(model)
        ok = False
        with monkeypatch.context() as m:
            if phase is not None:
                _inject(m, model, phase, exc, after=rng.random() < 0.5)
            try:
                fr.update_weights_from_disk(model, ckpts[kind, k], flt, backup=rng.choice(["host", "device"]),
                                            postprocess_all=rng.choice([None, True, False]))
                ok = True
            except (fr.ReloadError, KeyboardInterrupt) as e:
                assert not isinstance(e, fr.RollbackError), e
        what = f"step {step}: {phase} {exc!r}, registered {reg[0]}, filtered {flt is not None}"
        _lock_is_free(model)
        assert deferred.done == len(deferred.todo), what  # (no copy left to run into an arena)
        assert ok == (phase is None), what
        if not ok:
            failed += 1
            assert not unchanged(model, before), what
        elif flt is None:
            base = k
            assert not fr.compare_states(fresh[k], fr.snapshot(model)), what
        elif base is not None:  # one filtered reload on a known state: the mix of the two
            want = mix_checkpoints(ckpts[kind, base], ckpts[kind, k], tmp_path / f"m{step}", flt)
            assert not fr.compare_states(fr.snapshot(fr.load_model(want)), fr.snapshot(model)), what
            base = None
    assert 0 < failed < 14


def _experts(model) -> list:
    return [m for _, m in model.named_modules() if isinstance(m, fr.FusedMoE)]


def _mutate(model, how: str) -> None:
    a, b = _experts(model)[:2]
    if how == "parameters swapped":  # two layers' w13 Parameters exchanged (same shapes)
        a._parameters["w13_weight"], b._parameters["w13_weight"] = b.w13_weight, a.w13_weight
    elif how == "data viewed anew":  # same memory, same view, new tensor objects: the plan is kept
        for p in a.parameters():
            p.data = p.data.as_strided(p.shape, p.stride())
    elif how == "data transposed":  # same pointer, other shape and strides, then back
        a.w2_weight.data = a.w2_weight.data.transpose(1, 2)
    elif how == "buffer re-registered":  # same tensor, last in the module's buffers now
        name = next(iter(a._buffers))
        a.register_buffer(name, a._buffers.pop(name))


@pytest.mark.parametrize("registered", [True, False], ids=["early lock", "late lock"])
@pytest.mark.parametrize("how", ["parameters swapped", "data viewed anew", "data transposed",
                                 "buffer re-registered"])
def test_a_kept_backup_plan_survives_modules_changed_between_reloads(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                     registered, how):
    """Both parses' plans kept, then a module changed: a reload failing at its end (every
    write and all processing done) restores every byte and object, the next one equals a
    fresh load. A transposed weight cannot load: the write fails, the commit is rolled back."""
    _setup(monkeypatch, registered)
    plans, real = [], bplan.plan_copies
    monkeypatch.setattr(bplan, "plan_copies", lambda *a: plans.append(1) or real(*a))
    model = fr.load_model(ckpts["fp8", 0])
    for k in (1, 0, 1):
        fr.update_weights_from_disk(model, ckpts["fp8", k])
    assert len(plans) == 2
    _mutate(model, how)
    before = fr.snapshot(model)
    with monkeypatch.context() as m:
        _inject(m, model, "stamp", None, False)
        with pytest.raises(fr.ReloadError) as info:
            fr.update_weights_from_disk(model, ckpts["fp8", 0])
    assert not unchanged(model, before) and deferred.done == len(deferred.todo)
    _lock_is_free(model)
    if how == "data transposed":  # (found writing: rolled back)
        assert isinstance(info.value, fr.CommitError) and "must match the size" in str(info.value)
        a = _experts(model)[0]
        a.w2_weight.data = a.w2_weight.data.transpose(1, 2)  # back: the pointer, shape, strides of before
    else:
        assert isinstance(info.value, fr.CorruptCheckpointError)
        assert len(plans) == (2 if how == "data viewed anew" else 3)  # (kept only while the key holds)
    for k in (1, 0):
        fr.update_weights_from_disk(model, ckpts["fp8", k])
        assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", k])), fr.snapshot(model))


def test_forwards_during_early_and_late_reloads_that_fail_or_not_never_see_a_mix(  # noqa: F811
        ckpts, deferred, monkeypatch, outputs):  # noqa: F811
    """Forwards on three threads while reloads (the early lock or not) succeed or fail in the
    read, at the lock or at the end: each forward sees the old or the new weights, none
    hangs, and the model ends with the last successful reload's weights."""
    x, y0, y1 = outputs()
    reg = _registered(monkeypatch)
    model = fr.load_model(ckpts["fp8", 0])
    stop, seen = threading.Event(), {"old": 0, "new": 0, "mixed": 0}

    def forwards():
        while not stop.is_set():
            y = model(x)
            seen["old" if torch.equal(y, y0) else "new" if torch.equal(y, y1) else "mixed"] += 1

    workers = [threading.Thread(target=forwards, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    want, rng = 0, random.Random(0)
    try:
        for i in range(16):
            reg[0], k = i % 2 == 0, rng.choice([0, 1])
            phase = [None, "prepare", "_take_lock", "stamp"][i % 4]
            with monkeypatch.context() as m:
                if phase is not None:
                    exc = KeyboardInterrupt() if i % 3 == 0 else OSError(5, "injected")
                    _inject(m, model, phase, exc, False)
                try:
                    fr.update_weights_from_disk(model, ckpts["fp8", k])
                    want = k
                except (fr.ReloadError, KeyboardInterrupt):
                    assert phase is not None
    finally:
        stop.set()
        for w in workers:
            w.join(WAIT)
    assert not any(w.is_alive() for w in workers), "a forward hung"
    assert seen["mixed"] == 0 and seen["old"] + seen["new"] > 0, seen
    assert torch.equal(model(x), (y0, y1)[want]) and deferred.done == len(deferred.todo)


@pytest.mark.parametrize("registered", [True, False], ids=["early lock", "late lock"])
def test_a_reload_from_inside_a_forward_is_refused_whatever_the_lock_order(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                          registered):
    """A forward hook asks for a full reload: refused (it would wait for itself), nothing
    queued, nothing written; a forward from another thread and a reload then go through."""
    _setup(monkeypatch, registered)
    model = fr.load_model(ckpts["fp8", 0])
    before, errors = fr.snapshot(model), []
    handle = reload_from_every_forward(model, ckpts["fp8", 1], errors)
    x = torch.zeros(2, 1, dtype=torch.long)
    done = threading.Thread(target=model, args=(x,), daemon=True)
    done.start()
    done.join(WAIT)
    handle.remove()
    assert not done.is_alive() and len(errors) == 1 and "inside a forward" in str(errors[0])
    assert not deferred.made and not unchanged(model, before)
    _lock_is_free(model)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))
