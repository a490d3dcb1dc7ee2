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

from types import SimpleNamespace

import pytest

import fp8_reload as fr
import fp8_reload.checkpoint.registered as registered_mod
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.to_device as to_device
from fp8_reload.checkpoint.staging import held


@pytest.fixture
def driver(monkeypatch):
    """The driver's registration replaced by a record of the paths registered."""
    calls = []

    def register(path):
        calls.append(path.name)
        size = path.stat().st_size
        return SimpleNamespace(path=path, stamp=registered_mod.file_stamp(path),
                               view=SimpleNamespace(numel=lambda: size), release=lambda: None)

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


def test_registrations_used_longest_ago_make_room_within_the_budget(driver, tmp_path, tiny_cfg,
                                                                   monkeypatch):
    """Once the budget was full no shard was registered again until `release_staging`,
    and a removed checkpoint's pages stayed pinned: now the files changed or gone, then
    those used longest ago, are released to make room."""
    import os

    released = []
    real = registered_mod.register  # (the fixture's record of the driver)

    def register(path):
        reg = real(path)
        reg.release = lambda: released.append(path)
        return reg

    monkeypatch.setattr(registered_mod, "register", register)
    model, steps = SimpleNamespace(), []
    for step in range(3):
        steps.append(fr.Checkpoint(fr.write_checkpoint(tmp_path / f"step{step}", tiny_cfg, seed=step,
                                                       kind="fp8")))
    one = sum(steps[0].parsed_stamp(f)[2] for f in steps[0].shard_files)
    monkeypatch.setattr(to_device, "_register_budget", lambda: 2 * one)  # two checkpoints' worth
    for ckpt in steps:
        for _ in range(2):  # registered the second time
            got = to_device.registered_files(model, ckpt, _reads(ckpt, 1.0))
        assert len(got) == len(ckpt.shard_files)
    files = held(model)["registered"].files
    assert sorted(files) == sorted(str(c.path / f) for c in steps[1:] for f in c.shard_files)
    assert sorted(p.name for p in released) == sorted(steps[0].shard_files)
    gone = steps[1].path / sorted(steps[1].shard_files)[0]
    os.unlink(gone)  # a file removed is released at the next registration, whatever the budget
    monkeypatch.setattr(to_device, "_register_budget", lambda: 10 * one)
    for _ in range(2):
        to_device.registered_files(model, steps[0], _reads(steps[0], 1.0))
    assert str(gone) not in files and gone in released and len(files) == 3 * len(steps[0].shard_files) - 1


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
