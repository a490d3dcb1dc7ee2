"""Which shards a reload registers for DMA (`reload.to_device.registered_files`).

The policy is host-side bookkeeping and runs on CPU with the driver call replaced: a
shard is registered the second time reloads read from it under the same stamps; a
reload that reads little of its shards (an EPLB step) registers at most
`REGISTER_STEP` bytes of them; a reload reading most of a shard always may (it pays
about a read of the file anyway); direct I/O registers nothing. On CUDA, the real
registration and the bytes it moves are covered by `test_stream.py`.
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


def _reads(ckpt, share: float) -> list:
    """One chunk per shard reading `share` of its bytes."""
    return [SimpleNamespace(file=f, nbytes=int(share * ckpt.parsed_stamp(f)[2]))
            for f in sorted(ckpt.shard_files)]


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
    assert to_device.registered_files(model, ckpt, _reads(ckpt, 0.05)) == {}  # step of 0
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
