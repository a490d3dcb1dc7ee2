"""Which shards a reload registers for DMA (`reload.to_device.registered_files`).

The policy is host-side bookkeeping and runs on CPU with the driver call replaced: a
shard is registered the second time reloads read from it under the same stamps; a
reload that reads little of its shards (an EPLB step) registers at most
`REGISTER_STEP` bytes of them, or one shard larger than that; a reload reading most of
a shard always may (it pays about a read of the file anyway); direct I/O registers nothing. On CUDA, the real
registration, the bytes it moves and that it runs outside the weights lock are covered
by `test_stream.py`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import fp8_reload as fr
import fp8_reload.checkpoint.registered as registered_mod
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.to_device as to_device
from fp8_reload.checkpoint.staging import held


class _Calls(list):
    pass


class _Registration(SimpleNamespace):
    """A registration as `RegisteredFile` keeps it; `release` records itself."""

    def release(self):
        self.log.append(self.path.name)


@pytest.fixture
def driver(monkeypatch):
    """The driver's registration replaced by a record of the names registered (in order;
    `paths`: their whole paths); `released`: those unregistered since; `refuse`: paths
    the driver refuses."""
    calls = _Calls()
    calls.paths, calls.released, calls.refuse = [], [], set()

    def register(path):
        if str(path) in calls.refuse:
            return None
        calls.append(path.name)
        calls.paths.append(str(path))
        size = path.stat().st_size
        return _Registration(path=path, stamp=registered_mod.file_stamp(path), size=size, log=calls.released,
                             view=SimpleNamespace(numel=lambda: size))

    monkeypatch.setattr(registered_mod, "register", register)
    monkeypatch.setattr(to_device, "REGISTER", "auto")
    return calls


def _reads(ckpt, share: float) -> dict:
    """A reload reading `share` of every shard's bytes."""
    return {f: int(share * ckpt.parsed_stamp(f)[2]) for f in sorted(ckpt.shard_files)}


@pytest.fixture
def sharded(tmp_path, tiny_cfg):
    ckpt = fr.Checkpoint(fr.write_checkpoint(tmp_path / "ckpt", tiny_cfg, seed=0, kind="fp8"))
    assert len(ckpt.shard_files) >= 3
    return SimpleNamespace(ckpt=ckpt, model=SimpleNamespace(), sizes=sorted(
        ckpt.parsed_stamp(f)[2] for f in ckpt.shard_files))


def test_filtered_reloads_register_their_shards_the_second_time(driver, sharded):
    ckpt, model = sharded.ckpt, sharded.model
    assert to_device.registered_files(model, ckpt, _reads(ckpt, 0.05)) == {}
    assert driver == []
    got = to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))
    assert sorted(got) == sorted(ckpt.shard_files) and len(driver) == len(ckpt.shard_files)
    again = to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))
    assert again == got and len(driver) == len(ckpt.shard_files)  # kept, not registered again
    held(model)["registered"].release()


def test_a_step_registers_at_most_REGISTER_STEP_bytes_of_shards_it_reads_little_of(
        driver, sharded, monkeypatch):
    ckpt, model = sharded.ckpt, sharded.model
    monkeypatch.setattr(to_device, "REGISTER_STEP", sharded.sizes[-1])  # one shard per step
    n = len(ckpt.shard_files)
    counts = [len(to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))) for _ in range(n + 1)]
    assert counts == list(range(n + 1))
    assert sorted(driver) == sorted(ckpt.shard_files)


def test_a_reload_reading_most_of_its_shards_registers_them_whatever_the_step(
        driver, sharded, monkeypatch):
    ckpt, model = sharded.ckpt, sharded.model
    monkeypatch.setattr(to_device, "REGISTER_STEP", 0)
    to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))  # an EPLB step first
    assert to_device.registered_files(model, ckpt, _reads(ckpt, 0.05)) == {}  # 0: no shard
    assert len(to_device.registered_files(model, ckpt, _reads(ckpt, 1.0))) == len(ckpt.shard_files)


def _steps(tmp_path, tiny_cfg, n=3) -> list:
    return [fr.Checkpoint(fr.write_checkpoint(tmp_path / f"step{i}", tiny_cfg, seed=i, kind="fp8"))
            for i in range(n)]


def _size(ckpt) -> int:
    return sum(ckpt.parsed_stamp(f)[2] for f in ckpt.shard_files)


def _twice(model, ckpt, share=1.0) -> dict:
    """Two reloads' reads of `ckpt` (registered the second time): what the second reads from."""
    to_device.registered_files(model, ckpt, _reads(ckpt, share))
    return to_device.registered_files(model, ckpt, _reads(ckpt, share))


def test_registrations_used_longest_ago_make_room_within_the_budget(driver, tmp_path, tiny_cfg,
                                                                   monkeypatch):
    """Once the budget was full no shard was registered again until `release_staging`,
    and a removed checkpoint's pages stayed pinned: now the files changed or gone, then
    those used longest ago, are dropped to make room, and unregistered only when the
    transaction asks (`release_dropped`: under the weights lock, the device idle)."""
    model, steps = SimpleNamespace(), _steps(tmp_path, tiny_cfg)
    monkeypatch.setattr(to_device, "_register_budget", lambda: 2 * _size(steps[0]))  # two checkpoints
    for ckpt in steps:
        assert len(_twice(model, ckpt)) == len(ckpt.shard_files)
    shards = held(model)["registered"]
    assert sorted(shards.files) == sorted(str(c.path / f) for c in steps[1:] for f in c.shard_files)
    assert driver.released == [] and len(shards.dropped) == len(steps[0].shard_files)  # not yet
    shards.release_dropped()
    assert sorted(driver.released) == sorted(steps[0].shard_files) and shards.dropped == []
    gone = steps[1].path / sorted(steps[1].shard_files)[0]
    os.unlink(gone)  # a file removed is dropped at the next registration, whatever the budget
    monkeypatch.setattr(to_device, "_register_budget", lambda: 10 * _size(steps[0]))
    _twice(model, steps[0])
    assert str(gone) not in shards.files and len(shards.files) == 3 * len(steps[0].shard_files) - 1
    fr.release_staging(model)
    assert len(driver.released) == len(driver)  # every registration made, unregistered once


def test_a_use_protects_a_checkpoint_from_eviction(driver, tmp_path, tiny_cfg, monkeypatch):
    """(Review, helper 34: the test above passed with `current()` recording no use.)"""
    s0, s1, s2 = _steps(tmp_path, tiny_cfg)
    model = SimpleNamespace()
    monkeypatch.setattr(to_device, "_register_budget", lambda: 2 * _size(s0))
    _twice(model, s0)
    _twice(model, s1)
    to_device.registered_files(model, s0, _reads(s0, 1.0))  # s0 used again: the newest now
    _twice(model, s2)
    files = held(model)["registered"].files
    assert {str(s0.path / f) for f in s0.shard_files} <= set(files)
    assert not any(k.startswith(str(s1.path)) for k in files)


def test_a_reload_never_evicts_its_own_registrations(driver, tmp_path, tiny_cfg, monkeypatch):
    """(Review, helper 34.) This reload's oldest registration is not the one to go."""
    s0, s1 = _steps(tmp_path, tiny_cfg, 2)
    model, names = SimpleNamespace(), sorted(s0.shard_files)
    monkeypatch.setattr(to_device, "_register_budget", lambda: 10 * _size(s0))
    _twice(model, s0)
    shards = held(model)["registered"]
    for f in names[:-1]:
        shards.drop(s0.path / f)  # s0's last shard alone stays: the oldest registration
    _twice(model, s1)
    monkeypatch.setattr(to_device, "_register_budget", lambda: s0.parsed_stamp(names[-1])[2] + _size(s1))
    assert names[-1] in to_device.registered_files(model, s0, _reads(s0, 1.0))
    assert driver.paths.count(str(s0.path / names[-1])) == 1  # kept, not evicted and registered again


@pytest.mark.parametrize("budget", ["larger file", "0", "-1"])
def test_nothing_is_evicted_for_a_file_that_would_not_fit_anyway(driver, tmp_path, tiny_cfg, monkeypatch,
                                                                 budget):
    """Review (helper 34): a file larger than the budget, or a budget of 0 or less, released
    every other registration and then registered nothing."""
    a, b = _steps(tmp_path, tiny_cfg, 2)
    model = SimpleNamespace()
    monkeypatch.setenv("FP8_RELOAD_REGISTER_BUDGET", str(10 * _size(a)))
    _twice(model, a)
    files = held(model)["registered"].files
    before = set(files)
    smallest = min(b.parsed_stamp(f)[2] for f in b.shard_files)
    monkeypatch.setenv("FP8_RELOAD_REGISTER_BUDGET", str(smallest - 1) if budget == "larger file" else budget)
    assert _twice(model, b) == {}
    assert set(files) == before and held(model)["registered"].dropped == []


def test_a_refused_file_evicts_nothing(driver, tmp_path, tiny_cfg, monkeypatch):
    """Review (helper 34): each reload of a checkpoint the driver refuses made room for it
    first, so alternating it with another registered the other again every time."""
    a, b = _steps(tmp_path, tiny_cfg, 2)
    model = SimpleNamespace()
    monkeypatch.setattr(to_device, "_register_budget", lambda: _size(a) + 1)  # a fits, not a and b
    driver.refuse = {str(b.path / f) for f in b.shard_files}
    _twice(model, a)
    assert _twice(model, b) == {}  # (a refusal is known once the driver was asked)
    _twice(model, a)
    asked = len(driver)
    for _ in range(3):
        assert _twice(model, b) == {}
        _twice(model, a)
    assert len(driver) == asked


@pytest.mark.parametrize("how", ["a stat fails once", "the file changes"])
def test_making_room_never_drops_a_file_this_reload_reads(driver, tmp_path, tiny_cfg, monkeypatch, how):
    """Review (helper 34): the stale check of `make_room` dropped (then released) a file
    already handed to this reload, whose commit then read a released mapping; a change is
    caught by the stamps after the reload (CorruptCheckpointError), a failed stat not at all."""
    (ckpt,) = _steps(tmp_path, tiny_cfg, 1)
    model = SimpleNamespace()
    monkeypatch.setattr(to_device, "_register_budget", lambda: 10 * _size(ckpt))
    _twice(model, ckpt)
    shards = held(model)["registered"]
    first, last = (ckpt.path / f for f in (sorted(ckpt.shard_files)[0], sorted(ckpt.shard_files)[-1]))
    shards.drop(last)  # this reload registers it again: room is made, after `first` was handed out
    shards.release_dropped()
    driver.released.clear()
    real, seen = registered_mod.file_stamp, []

    def stamp(path):
        if str(path) == str(first):
            seen.append(path)
            if len(seen) == 2:  # after `current()` handed it out
                if how == "a stat fails once":
                    return None
                os.chmod(first, 0o644 if os.stat(first).st_mode & 0o777 != 0o644 else 0o640)
        return real(path)

    monkeypatch.setattr(registered_mod, "file_stamp", stamp)
    out = to_device.registered_files(model, ckpt, _reads(ckpt, 1.0))
    assert first.name in out and shards.dropped == [] and driver.released == []


def test_direct_reads_and_never_register_nothing(driver, sharded, monkeypatch):
    ckpt, model = sharded.ckpt, sharded.model
    monkeypatch.setattr(chunks_mod, "READ_IO", "direct")
    for _ in range(3):
        assert to_device.registered_files(model, ckpt, _reads(ckpt, 1.0)) == {}
    monkeypatch.setattr(chunks_mod, "READ_IO", "buffered")
    monkeypatch.setattr(to_device, "REGISTER", "never")
    for _ in range(3):
        assert to_device.registered_files(model, ckpt, _reads(ckpt, 1.0)) == {}
    assert driver == []


def test_a_shard_larger_than_the_step_is_registered_one_per_step(driver, sharded, monkeypatch):
    """Review (helper 31): a shard over `REGISTER_STEP` was never registered by steps."""
    ckpt, model = sharded.ckpt, sharded.model
    monkeypatch.setattr(to_device, "REGISTER_STEP", 1)  # every shard is larger
    n = len(ckpt.shard_files)
    counts = [len(to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))) for _ in range(n + 1)]
    assert counts == list(range(n + 1))


def test_release_staging_forgets_the_reads_counted(driver, sharded):
    """Review (helper 31): the counts outlived `release_staging`, and the next step after
    it registered again at once, as if the checkpoint had been read since."""
    ckpt, model = sharded.ckpt, sharded.model
    to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))
    assert len(to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))) == len(ckpt.shard_files)
    fr.release_staging(model)
    assert to_device.registered_files(model, ckpt, _reads(ckpt, 0.05)) == {}
    assert len(driver) == len(ckpt.shard_files)


def test_read_counts_stay_bounded_as_versions_and_paths_come_and_go(driver, tmp_path, tiny_cfg,
                                                                   monkeypatch):
    """Review (helper 32): counts keyed by (path, stamps) piled up one per shard per RL
    step (each version rewritten over the same files, read once). One count per path
    now, started over by a new stamp, and at most `KEEP_COUNTS` paths."""
    model, path = SimpleNamespace(), tmp_path / "ckpt"
    for step in range(6):
        fr.write_checkpoint(path, tiny_cfg, seed=step, kind="fp8")
        ckpt = fr.Checkpoint(path)
        assert to_device.registered_files(model, ckpt, _reads(ckpt, 0.05)) == {}  # each read once
    shards = held(model)["registered"]
    assert len(shards.reads) == len(ckpt.shard_files) and driver == []
    monkeypatch.setattr(type(shards), "KEEP_COUNTS", 2)
    to_device.registered_files(model, ckpt, _reads(ckpt, 0.05))
    assert len(shards.reads) == 2


@pytest.mark.parametrize("where", ["between pieces", "in the driver call"])
def test_an_interrupted_registration_leaves_no_piece_pinned(tmp_path, monkeypatch, where):
    """Review (helper 33): a shard is registered in pieces, with a pause between them; an
    exception there (Ctrl-C, a server's SIGTERM) left the pieces done pinned, and their
    mapping was then unmapped while registered."""
    import types

    path = tmp_path / "shard"
    path.write_bytes(bytes(5 * registered_mod._PAGE + 123))
    pinned, calls, armed = set(), [], [True]

    def host_register(ptr, nbytes, flags=0):
        calls.append(ptr)
        if armed[0] and where == "in the driver call" and len(calls) == 3:
            raise KeyboardInterrupt
        pinned.add(ptr)
        return True

    def sleep(_):
        if where == "between pieces" and len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(registered_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(registered_mod, "host_register", host_register)
    monkeypatch.setattr(registered_mod, "host_unregister", pinned.discard)
    monkeypatch.setattr(registered_mod, "PIECE_BYTES", registered_mod._PAGE)
    monkeypatch.setattr(registered_mod, "time", types.SimpleNamespace(sleep=sleep))
    with pytest.raises(KeyboardInterrupt):
        registered_mod.register(path)
    assert len(calls) >= 2 and not pinned
    armed[0] = False
    monkeypatch.setattr(registered_mod, "time", types.SimpleNamespace(sleep=lambda _: None))
    reg = registered_mod.register(path)  # uninterrupted: six pieces, released together
    assert len(reg._pieces) == 6 == len(pinned)
    reg.release()
    assert not pinned


_FORK = """
import os, sys
import fp8_reload.checkpoint.registered as reg
reg.torch.cuda.is_available = lambda: True
reg.host_register = lambda ptr, n, flags=0: True
def unregister(ptr):
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
reg.host_unregister = unregister
shard = reg.register(reg.Path(sys.argv[1]))
if os.fork() == 0:
    sys.exit(0)  # the child leaves through the interpreter: finalizers run
os.wait()
print(os.getpid())
shard.release()
"""


def test_a_forked_child_does_not_unregister_its_parents_shards(tmp_path):
    """Review (helper 33): since the registrations go through ctypes, a forked child
    exiting (or collecting the model) unregistered its parent's shards with the driver."""
    import subprocess
    import sys

    shard, log = tmp_path / "shard", tmp_path / "unregistered"
    shard.write_bytes(bytes(3 * registered_mod._PAGE))
    parent = subprocess.run([sys.executable, "-c", _FORK, str(shard), str(log)], check=True,
                            capture_output=True, text=True).stdout.split()[-1]
    assert log.read_text().split() == [parent]
