"""The backup's plan kept with a kept reload plan, and its first piece begun before the read.

A repeated full reload plans its backup copies once (`backup_plan.kept_plan`): the plan holds
the tensors it copies, so it is reused only while every captured tensor is the same
object over the same memory. On a GPU the first piece is queued before the read
(`Backup.begin`); a reload that fails before its commit waits for it (`Backup.settle`).
"""

from __future__ import annotations

import threading

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.backup as bk
import fp8_reload.reload.backup_plan as bplan
import fp8_reload.reload.transaction as tx
from fp8_reload.reload.backup_plan import piece_bytes

from .conftest import mix_checkpoints, unchanged
from .test_review_s17 import _setup, deferred  # noqa: F401  (a fixture)


@pytest.fixture
def plans(monkeypatch) -> list:
    """One entry per backup plan made (`backup_plan.plan_copies` called)."""
    made, real = [], bplan.plan_copies
    monkeypatch.setattr(bplan, "plan_copies", lambda *a: made.append(1) or real(*a))
    return made


def _layer(model):
    return next(m for _, m in model.named_modules() if isinstance(m, fr.FusedMoE))


def _files_change_at_the_end(monkeypatch) -> list:
    """While armed (`[True]`), the stamps read after the writes differ: every write and all
    processing are done, and the reload is rolled back (`CorruptCheckpointError`)."""
    armed, calls, real = [True], [], tx.checkpoint_stamp
    monkeypatch.setattr(tx, "checkpoint_stamp",
                        lambda ckpt: (real(ckpt), armed[0] and (calls.append(1) or len(calls))))
    return armed


@pytest.mark.parametrize("backup", ["host", "device"])
def test_a_repeated_full_reload_plans_its_backup_once(ckpts, plans, backup):
    """Kept per parse, as the reload's plan is: each checkpoint's is made once."""
    model = fr.load_model(ckpts["fp8", 0])
    for k in (1, 1, 0, 1, 0):
        fr.update_weights_from_disk(model, ckpts["fp8", k], backup=backup)
    assert len(plans) == 2
    fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [2]}))
    assert len(plans) == 3  # (a filtered reload's plan is its own)
    fr.update_weights_from_disk(model, ckpts["fp8", 1], backup=backup)
    assert len(plans) == 3 and not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])),
                                                     fr.snapshot(model))


@pytest.mark.parametrize("change", ["buffer replaced", "buffer viewed anew"])
def test_a_tensor_replaced_between_reloads_is_backed_up_where_it_now_is(ckpts, monkeypatch, plans, change):
    """The reload plan is kept (buffers are not part of it), the backup's plan is not: the
    rollback restores the buffer the module holds now, not the one it held before."""
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # (both parses' plans kept)
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    layer = _layer(model)
    old = layer.w13_input_scale_per_expert
    layer.w13_input_scale_per_expert = (old.clone() if change == "buffer replaced"
                                        else old.view(-1, 1)[:, 0])  # (same memory, another view)
    before = fr.snapshot(model)
    armed = _files_change_at_the_end(monkeypatch)
    with pytest.raises(fr.CorruptCheckpointError):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert len(plans) == 3 and not unchanged(model, before)
    armed[0] = False
    kept = layer.w13_input_scale_per_expert.clone()
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # (the rollback had bytes to undo)
    assert not layer.w13_input_scale_per_expert.equal(kept)


@pytest.mark.parametrize("how", ["full, registered", "full, ring", "filtered, registered"])
def test_the_weights_are_taken_first_only_when_the_reload_is_the_transfer(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                           tmp_path, how):
    """A full reload from registered shards takes the weights lock (and synchronizes the
    device) before the backup begins: nothing to read on the host, both directions of the
    link start at once. Otherwise the lock waits for the reads, and `begin` queues the first
    piece before it: the synchronization under the lock (here: running the deferred
    stream) finds that queued, and nothing else."""
    _setup(monkeypatch, registered=how.endswith("registered"))
    model = fr.load_model(ckpts["fp8", 0])
    log, sync, begin = [], tx.synchronize, bk.Backup.begin
    queued = deferred.todo
    monkeypatch.setattr(tx, "synchronize", lambda *a: log.append(("sync", len(queued))) or sync(*a))
    monkeypatch.setattr(bk.Backup, "begin", lambda self: log.append(("begin", len(queued))) or begin(self))
    flt = fr.generate_weight_name_filter({1: [2], 2: [5]}) if how.startswith("filtered") else None
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    (saved,) = deferred.made
    assert len(log) == 3 and log[2][0] == "sync"  # (the drain's, last)
    if how == "full, registered":
        assert log[:2] == [("sync", 0), ("begin", 0)]
    else:
        assert log[:2] == [("begin", 0), ("sync", min(saved.marks) + 1)] and saved.small
    want = ckpts["fp8", 1] if flt is None else mix_checkpoints(ckpts["fp8", 0], ckpts["fp8", 1],
                                                               tmp_path / "mixed", flt)
    assert not fr.compare_states(fr.snapshot(fr.load_model(want)), fr.snapshot(model))


def test_a_read_failing_after_the_first_piece_settles_it(ckpts, deferred, monkeypatch):  # noqa: F811
    """The read fails once the first piece is queued: nothing was written, the copy is
    waited for (it writes into the arena the next reload reuses), the next reload works."""
    _setup(monkeypatch, registered=True)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)

    def prepare(*a, **kw):
        assert len(deferred.todo) > deferred.done == 0  # (queued, not run)
        raise OSError(5, "injected read error")

    real = tx.prepare
    monkeypatch.setattr(tx, "prepare", prepare)
    with pytest.raises(fr.ReloadError, match="injected"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert deferred.done == len(deferred.todo) > 0 and not unchanged(model, before)
    monkeypatch.setattr(tx, "prepare", real)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))


@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
def test_the_pieces_queued_before_the_small_copies_share_their_event(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                      registered):
    """Two layers, one expert each, a piece each: the first piece is queued by `begin`, the
    second as the commit starts, both before the small tensors' cat, without events of their
    own: `_finish` gives every piece queued so far the one recorded after the cat (the
    second layer's scales are in it). Then the rollback undoes every write."""
    _setup(monkeypatch, registered, chunk=1 << 20)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    flt = fr.generate_weight_name_filter({1: [2], 2: [5]})
    monkeypatch.setattr(tx, "process_modules", lambda *a: 1 / 0)
    with pytest.raises(fr.CommitError, match="ZeroDivision"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    (saved,) = deferred.made
    first, second = sorted(saved.marks)[:2]
    assert saved.recorded[first] is saved.recorded[second] and not unchanged(model, before)


@pytest.mark.parametrize("registered", [True, False], ids=["lock first", "lock after the read"])
@pytest.mark.parametrize("where", ["prepare", "_take_lock"])
def test_a_ctrl_c_before_the_commit_leaves_no_copy_running_and_no_lock_held(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                            registered, where):
    """KeyboardInterrupt in the read (the weights already taken when every shard is
    registered) or while the lock is awaited (before the backup begins when every shard is
    registered, after it otherwise): it propagates as is, the queued copies are waited
    for, the lock is free (a forward gets in), and the next reload goes through."""
    _setup(monkeypatch, registered=registered)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    real = getattr(tx, where)
    monkeypatch.setattr(tx, where, lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    begun = [saved for saved in deferred.made if saved.begun]
    assert len(begun) == (0 if where == "_take_lock" and registered else 1)
    assert all(not saved.started for saved in begun) and deferred.done == len(deferred.todo)
    assert not unchanged(model, before)
    entered = threading.Event()

    def forward():
        with model.weights_lock.read():
            entered.set()

    threading.Thread(target=forward, daemon=True).start()
    assert entered.wait(timeout=10), "the weights lock was left held"
    monkeypatch.setattr(tx, where, real)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))


@pytest.mark.parametrize("share", ["none", "a third", "all"])
@pytest.mark.parametrize("device", ["emulated", "cuda"])
def test_a_host_backup_keeps_its_first_pieces_beside_the_weights(ckpts, request, monkeypatch, share, device):
    """`backup.ON_DEVICE`: of a GPU model's host backup, the first copies the commit waits for
    (up to that many bytes) are made beside the weights, the rest into the pinned arena. A
    commit failing once every write is done restores from both; the
    next reload equals a fresh load; the report says how much was beside the weights."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("a GPU model's backup (on CPU: emulated with a deferred backup stream)")
    side = request.getfixturevalue("deferred") if device == "emulated" else None
    if side is not None:
        _setup(monkeypatch, registered=True)
    made, real = [], bk.capture_backup
    monkeypatch.setattr(tx, "capture_backup", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    monkeypatch.setattr(bk, "ON_DEVICE", 0)
    model = fr.load_model(ckpts["fp8", 0], device="cuda" if side is None else "cpu")
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    sizes = [piece_bytes(tensor, run) for _, tensor, run, _ in made[-1].todo]
    assert made[-1].device_bytes == 0 and len(sizes) > 3
    monkeypatch.setattr(bk, "ON_DEVICE", {"none": 0, "a third": sum(sizes) // 3, "all": sum(sizes)}[share])
    before = fr.snapshot(model)
    process = tx.process_modules
    monkeypatch.setattr(tx, "process_modules", lambda *a: 1 / 0)
    with pytest.raises(fr.CommitError, match="ZeroDivision") as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 0])
    saved = made[-1]
    n = {"none": 0, "all": len(sizes)}.get(share, saved.on_device)
    assert saved.on_device == n and saved.device_bytes == sum(sizes[:n]) <= bk.ON_DEVICE
    if share == "a third":
        assert 0 < n < len(sizes) and sum(sizes[:n + 1]) > bk.ON_DEVICE
    assert info.value.report.backup_device_bytes == saved.device_bytes
    for k, (_, _, copy) in enumerate(saved.big):
        if side is None:
            assert copy.is_cuda == (k < n) and (k < n or copy.is_pinned()), k
        else:  # (beside the weights: not carved out of the arena)
            inside = copy.untyped_storage().data_ptr() == saved.arena.buffer.untyped_storage().data_ptr()
            assert inside == (k >= n), k
    assert not unchanged(model, before)
    monkeypatch.setattr(tx, "process_modules", process)
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0])
    assert report.backup_device_bytes == made[-1].device_bytes == sum(sizes[:n])
    fresh = fr.load_model(ckpts["fp8", 0], device="cuda" if side is None else "cpu")
    assert not fr.compare_states(fr.snapshot(fresh), fr.snapshot(model))


def test_a_device_without_room_for_the_first_pieces_backs_them_up_to_the_host(ckpts, deferred, monkeypatch):  # noqa: F811
    """The device memory `ON_DEVICE` asks for only makes a reload faster: where it cannot be
    had (out of memory), every copy goes to the pinned arena and the reload goes on, its
    rollback and its result as without it."""
    _setup(monkeypatch, registered=True)
    monkeypatch.setattr(bk, "ON_DEVICE", 1 << 30)
    asked = []

    def full(self, nbytes):
        asked.append(nbytes)
        raise torch.cuda.OutOfMemoryError("injected: no device memory left")

    monkeypatch.setattr(bk.staging.DeviceArena, "reset", full)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    process = tx.process_modules
    monkeypatch.setattr(tx, "process_modules", lambda *a: 1 / 0)
    with pytest.raises(fr.CommitError, match="ZeroDivision") as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    (saved,) = deferred.made
    assert asked and saved.on_device == saved.device_bytes == info.value.report.backup_device_bytes == 0
    arena = saved.arena.buffer.untyped_storage().data_ptr()
    assert all(copy.untyped_storage().data_ptr() == arena for _, _, copy in saved.big)
    assert not unchanged(model, before)
    monkeypatch.setattr(tx, "process_modules", process)
    report = fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert report.backup_device_bytes == 0 < report.backup_bytes and len(asked) == 2
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))
