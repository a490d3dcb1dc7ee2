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
