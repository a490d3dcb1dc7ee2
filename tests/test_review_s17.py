"""Review s17: the backup's first piece queued before its small copies, and the kept `Kinds`.

The GPU path runs on CPU with the backup's side stream *deferred*: a copy (or the small
tensors' cat) queued there runs only when another stream waits for an event recorded
after it, or for the whole stream, as a GPU is free to run it. A write ordered before
the backup of the bytes it overwrites then backs up the new bytes, and a rollback after
the commit leaves the model changed: `unchanged` catches what a position check might not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fp8_reload as fr
import fp8_reload.checkpoint.registered as registered_mod
import fp8_reload.reload.backup as bk
import fp8_reload.reload.backup_plan as bplan
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.stream as stream_mod
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as tx
from fp8_reload.checkpoint.staging import held, release_staging

from .conftest import mix_checkpoints, unchanged
from .test_review_s5 import EP


class _Cuda:
    type, index = "cuda", 0


class _Deferred:
    """The backup stream: its queue runs only as far as someone waits for."""

    device = torch.device("cpu")

    def __init__(self):
        self.todo, self.done, self.keeps, self.fail_keep, self.fail_cat, self.made = [], 0, 0, None, False, []

    def run(self, upto=None):
        while self.done < (len(self.todo) if upto is None else upto):
            self.done += 1
            self.todo[self.done - 1]()

    def wait_stream(self, other):  # (nothing is deferred on the streams it follows)
        pass

    def synchronize(self):
        self.run()


class _Now:
    """Every other stream: runs at once; waiting on the backup stream runs it that far."""

    device = torch.device("cpu")

    def __init__(self, side):
        self.side = side

    def wait_stream(self, other):
        if other is self.side:
            other.run()

    def wait_event(self, event):
        if event.stream is self.side:
            self.side.run(event.pos)


@pytest.fixture
def deferred(monkeypatch):
    """`update_weights_from_disk` on its GPU path (on-demand backup, `_commit_cuda`), the
    backup stream deferred. `side.fail_keep = n`: the n-th backup copy queued raises;
    `side.fail_cat`: the small tensors' cat raises; `side.made`: the backups."""
    side = _Deferred()
    now = _Now(side)

    class Event:
        def __init__(self, **kw):
            self.stream, self.pos = None, 0

        def record(self, stream=None):
            self.stream, self.pos = stream, len(side.todo)

        def synchronize(self):
            if self.stream is side:
                side.run(self.pos)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: now)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    for mod in (stream_mod, to_device):
        monkeypatch.setattr(mod, "side_stream", lambda device, role: now)
    monkeypatch.setattr(tx, "side_stream", lambda device, role: side if role == "backup" else now)
    monkeypatch.setattr(tx, "model_device", lambda model: _Cuda())
    monkeypatch.setattr(tx, "on_triton_device", lambda model: False)  # (bf16 experts: loaders)
    for mod in (tx, bk):
        monkeypatch.setattr(mod, "synchronize", lambda *a: side.run())
    monkeypatch.setattr(bk, "on_cuda", lambda model: True)
    monkeypatch.setattr(to_device, "REGISTER", "never")
    monkeypatch.setattr(bk, "ON_DEVICE", 0)  # (every big copy into the arena: as before it existed)
    ring_for, reserve, capture = to_device.ring_for, to_device.DeviceSlots.reserve, tx.capture_backup
    monkeypatch.setattr(to_device, "ring_for", lambda model, n, pin, *a: ring_for(model, n, False, *a))
    monkeypatch.setattr(to_device.DeviceSlots, "reserve", lambda self, n, device: reserve(self, n, "cpu"))
    monkeypatch.setattr(tx, "capture_backup", lambda *a, **kw:
                        side.made.append(capture(*a, **kw)) or side.made[-1])

    def keep(self, src, arena, fresh):  # queued: it reads `src` when it runs
        side.keeps += 1
        if side.fail_keep == side.keeps:
            raise RuntimeError("injected: a backup copy failed")
        if arena is not None:
            copy = bk.staging.typed_slice(arena, src.dtype, src.shape)
        elif fresh and self.where == "device":
            return src
        else:
            copy = torch.empty_like(src, device="cpu" if self.where == "host" else src.device)
        side.todo.append(lambda: copy.copy_(src))
        return copy

    class Torch:  # backup.py's torch: the small tensors' cat runs on the backup stream too
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def cat(tensors):
            if side.fail_cat:
                raise RuntimeError("injected: a small tensors' cat failed")
            out = tensors[0].new_empty(sum(t.numel() for t in tensors))
            side.todo.append(lambda: torch.cat(tensors, out=out))
            return out

    monkeypatch.setattr(bk.Backup, "_keep", keep)
    monkeypatch.setattr(bk, "torch", Torch())
    return side


class _HostCopy:  # a "registered" shard: its bytes in host memory, read by the direct path
    def __init__(self, path):
        self.view, self.piece = torch.from_numpy(np.fromfile(path, dtype=np.uint8)), None


def _setup(monkeypatch, registered, small=bplan.SMALL_BYTES, lookahead=0, chunk=4096):
    """Every shard "registered" (the commit's direct path: the backup starts at its first
    write, queued as the writes ask) or none (the ring: queued whole while it reads)."""
    monkeypatch.setattr(bplan, "SMALL_BYTES", small)
    monkeypatch.setattr(bk, "LOOKAHEAD", lookahead)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk)
    if registered:
        monkeypatch.setattr(tx, "registered_files", lambda m, c, r: {f: _HostCopy(c.path / f) for f in r})
        monkeypatch.setattr(tx, "registered_now", lambda model, ckpt, files: set(files))


def _quant(monkeypatch, kind: str) -> str:
    """"bf16-quant": bf16 experts quantized in the stream (Triton's interpreter on CPU)."""
    if kind == "bf16-quant":
        pytest.importorskip("triton")
        from fp8_reload.kernels.triton.runtime import INTERPRET

        if not INTERPRET:
            pytest.skip("compiled Triton cannot run CPU tensors")
        monkeypatch.setattr(tx, "on_triton_device", lambda model: True)
    return kind[:4]


def _fail_processing(monkeypatch):
    """Post-processing raises: every write of the commit is done, the rollback undoes them."""
    monkeypatch.setattr(tx, "process_modules", lambda *a: 1 / 0)


SPECS = {"full": None, "two-layers": {1: [0, 3], 2: [5, 7]}, "one-expert": {2: [7]},
         "attention-only": lambda n: ".layers.0.self_attn." in n, "layer-1": lambda n: ".layers.1." in n}
SMALL = bplan.SMALL_BYTES
KNOBS = [  # (SMALL_BYTES, LOOKAHEAD, CHUNK_BYTES, postprocess_all, backup)
    (SMALL, 0, 4096, False, "host"), (0, 0, 4096, False, "host"), (1 << 40, 0, 4096, True, "host"),
    (SMALL, 1 << 30, 1 << 20, True, "device"), (0, 4096, 8192, True, "device"),
    (1 << 40, 1 << 30, 1 << 20, False, "device")]


# (kind, redundant slots, spec): quantize-on-load ("q") in Triton's interpreter is slow, so
# only the expert filters attack it
CASES = [(kind, ep, spec) for kind, ep in [("fp8", False), ("fp8", True), ("bf16", False), ("bf16", True),
                                           ("bf16-quant", False)]
         for spec in SPECS if kind != "bf16-quant" or spec in ("two-layers", "one-expert")]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "small{}-ahead{}-chunk{}-all{:d}-{}".format(*k))
@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
@pytest.mark.parametrize("kind, ep, spec", CASES,
                         ids=[f"{k.replace('bf16-quant', 'q')}{'-ep' if e else ''}-{s}" for k, e, s in CASES])
def test_a_rollback_after_the_commit_restores_every_byte(ckpts, deferred, monkeypatch, tmp_path, knobs, spec,
                                                        registered, kind, ep):
    """Attacks the first piece's events (`first`, after the small cats): every write must
    wait for the backup of its bytes, small ones included (a one-expert reload's scales
    wait for its one piece; quantize-on-load writes a slot's small scales after its
    piece), with no small tensors (0), only small ones but the pieces (1 << 40), no big
    one at all (attention-only), a first piece that is not a FusedMoE's, any look-ahead,
    every module processed, redundant slots. Then a clean reload equals a fresh load."""
    small, lookahead, chunk, process_all, backup = knobs
    _setup(monkeypatch, registered, small, lookahead, chunk)
    kind, moe, flt = _quant(monkeypatch, kind), EP if ep else {}, SPECS[spec]
    flt = fr.generate_weight_name_filter(flt) if isinstance(flt, dict) else flt
    model = fr.load_model(ckpts[kind, 0], **moe)
    before = fr.snapshot(model)
    with monkeypatch.context() as m:
        _fail_processing(m)
        with pytest.raises(fr.CommitError, match="ZeroDivision"):
            fr.update_weights_from_disk(model, ckpts[kind, 1], flt, postprocess_all=process_all,
                                        backup=backup)
    assert deferred.done == len(deferred.todo) > 0
    assert not unchanged(model, before)
    fr.update_weights_from_disk(model, ckpts[kind, 1], flt, backup=backup)
    old, new = ckpts[kind, 0], ckpts[kind, 1]
    want = new if flt is None else mix_checkpoints(old, new, tmp_path / "m", flt)
    assert not fr.compare_states(fr.snapshot(fr.load_model(want, **moe)), fr.snapshot(model))


@pytest.mark.parametrize("where, small", [(w, s) for s in (bplan.SMALL_BYTES, 0)
                                          for w in ("keep1", "keep2", "cat", "keep9", "keep30")
                                          if w != "cat" or s])  # (no small tensors: no cat)
@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
@pytest.mark.parametrize("backup", ["host", "device"])
def test_a_backup_failing_while_it_starts_or_runs_restores_the_model(ckpts, deferred, monkeypatch, where,
                                                                    small, registered, backup):
    """The backup fails inside the first piece's copies (keep1, keep2: queued by `begin`
    before the commit, so nothing is written: a plain `ReloadError`), or later (the second
    piece, queued as the commit starts; the small tensors' cat and the rest, mid-commit):
    `copies` covers every write queued before; the model is as it was, and reloads again."""
    _setup(monkeypatch, registered, small)
    deferred.fail_cat, deferred.fail_keep = where == "cat", None if where == "cat" else int(where[4:])
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    with pytest.raises(fr.ReloadError, match="injected") as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1], backup=backup)
    (saved,) = deferred.made
    committed = isinstance(info.value, fr.CommitError)
    assert committed == (saved.started or saved.on_demand) and saved.begun  # (on demand: the 2nd piece)
    assert committed == (where != "keep1") or where == "keep2"  # (keep2: either)
    assert committed or "before anything was written" in str(info.value)
    assert not saved.recorded or where not in ("keep1", "cat")  # (before any event)
    assert deferred.done == len(deferred.todo)  # (settled: nothing queued is left running)
    assert not unchanged(model, before)
    deferred.fail_keep, deferred.fail_cat = None, False
    fr.update_weights_from_disk(model, ckpts["fp8", 1], backup=backup)
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))


def test_the_deferred_stream_catches_a_write_that_does_not_wait(ckpts, deferred, monkeypatch):
    """The harness has teeth: writes not told to wait for the backup (events dropped) are
    backed up after they ran, and the rollback leaves the model changed."""
    _setup(monkeypatch, True)
    real = bk.Backup.event_for
    monkeypatch.setattr(bk.Backup, "event_for", lambda self, *a: real(self, *a) and None)
    assert rolled_back_changed(ckpts, monkeypatch)


def rolled_back_changed(ckpts, monkeypatch) -> list:
    """A full reload of an fp8 model whose processing fails: what its rollback left changed."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    _fail_processing(monkeypatch)
    with pytest.raises(fr.CommitError, match="ZeroDivision"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    return unchanged(model, before)


# ---- the kept `Kinds` (files, streamed bytes per file) against the real registration policy ----


@pytest.fixture
def driver(deferred, monkeypatch):
    """`registered_files` / `registered_now` for real (REGISTER=always), the driver's call
    replaced by the file's bytes in host memory; returns [(Kinds, read, copy of read)] per
    reload that asked for registrations."""
    def register(path):
        view = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        return SimpleNamespace(path=path, stamp=registered_mod.file_stamp(path), size=view.numel(), view=view,
                               piece=None, release=lambda: None)

    monkeypatch.setattr(registered_mod, "register", register)
    monkeypatch.setattr(to_device, "REGISTER", "always")
    seen, kinds_of, registered_files = [], tx.kinds_of, tx.registered_files
    monkeypatch.setattr(tx, "kinds_of", lambda t, memo: seen.append([kinds_of(t, memo)]) or seen[-1][0])
    monkeypatch.setattr(tx, "registered_files",
                        lambda m, c, r: seen[-1].extend([r, dict(r)]) or registered_files(m, c, r))
    return seen


def _streamed_by_file(targets) -> dict:
    out: dict = {}
    for t in targets:
        if t.kind in ("copy", "quant"):
            out[t.info.file] = out.get(t.info.file, 0) + t.info.nbytes
    return out


def test_a_kept_plans_kinds_are_reused_unchanged_and_rebuilt_after_release(ckpts, driver):
    """The kept `streamed_by_file` is the dict handed to `registered_files` every reload:
    nothing may change it (a filtered reload between, registering); `release_staging`
    forgets it with the plan. Every reload equals a fresh load."""
    model = fr.load_model(ckpts["fp8", 0])
    for flt in [None, None, fr.generate_weight_name_filter({2: [7]}), None]:
        fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    full = [seen for k, seen in enumerate(driver) if k != 2]
    kinds = full[0][0]
    assert all(seen[0] is kinds and seen[1] is kinds.streamed_by_file for seen in full)
    assert driver[2][0] is not kinds and driver[2][1] is not kinds.streamed_by_file
    assert all(seen[2] == kinds.streamed_by_file for seen in full)
    assert kinds.streamed_by_file == _streamed_by_file(kinds.streamed)
    assert kinds.files == set(fr.Checkpoint(ckpts["fp8", 1]).weight_map.values())
    assert len(held(model)["registered"].files) == len(kinds.streamed_by_file)  # (read from them)
    release_staging(model)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert driver[-1][0] is not kinds and driver[-1][2] == kinds.streamed_by_file
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))


@pytest.mark.parametrize("how", ["new-values", "resharded"])
def test_a_checkpoint_rewritten_in_place_is_reloaded_from_its_new_files(ckpts, tiny_cfg, driver, tmp_path,
                                                                       how):
    """Attacks a stale kept `Kinds` or registration: the directory reloaded (and its shards
    registered) is rewritten under the same path, RL-style (same index, new values: the
    plan and its `Kinds` may stay) or with another sharding (same names, other files)."""
    path = tmp_path / "sync"
    shutil.copytree(ckpts["fp8", 0], path)
    model = fr.load_model(ckpts["fp8", 1])
    for _ in range(2):
        fr.update_weights_from_disk(model, path)
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 0])), fr.snapshot(model))
    if how == "new-values":  # each shard replaced by another (a new inode), as a writer renames
        for f in sorted(set(fr.Checkpoint(path).weight_map.values())):
            shutil.copy(ckpts["fp8", 1] / f, tmp_path / f)
            os.replace(tmp_path / f, path / f)
    else:
        shutil.rmtree(path)
        fr.write_checkpoint(path, tiny_cfg, seed=1, kind="fp8", min_shards=6)
    fr.update_weights_from_disk(model, path)
    kinds, read = driver[-1][0], driver[-1][1]
    files = set(fr.Checkpoint(path).weight_map.values())
    assert kinds.files == files and set(read) <= files and read == _streamed_by_file(kinds.streamed)
    assert (kinds is driver[0][0]) == (how == "new-values")
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))
