"""Review s6: writers that change a shard while a reload reads it, on CPU, real files.

A writer that rewrites a shard in place at the same size and then puts its mtime back
(``rsync -c --inplace`` with times kept, ``cp --preserve=timestamps`` over the file,
``os.utime``) leaves size and mtime as they were; only the ctime moves. A reload that
read part of the shard before the rewrite and part after holds a mix of two versions:
it must be refused, as a rewrite that moves the mtime is. A writer that renames a new
version over the shard moves the ctime of the file being read too (it is unlinked),
but leaves its bytes intact: that read stays good.
"""

from __future__ import annotations

import importlib
import os
import shutil

import pytest

import fp8_reload as fr
from fp8_reload.checkpoint import Checkpoint

from . import bad_checkpoints as bad
from .conftest import copy_checkpoint

# Where each engine reads a shard's bytes: (module, function); the file path is args[1].
READ_POINT = {"staged": ("fp8_reload.checkpoint.reader", "_read_tensor"),
              "stream": ("fp8_reload.reload.chunks", "read_span")}


def after_first_read_of(monkeypatch, engine: str, shard, action) -> list:
    """Run `action()` once, right after `engine` first reads bytes of `shard`."""
    module = importlib.import_module(READ_POINT[engine][0])
    real = getattr(module, READ_POINT[engine][1])
    done: list = []

    def read(*args, **kwargs):
        out = real(*args, **kwargs)
        if args[1] == shard and not done:
            action()
            done.append(True)
        return out

    monkeypatch.setattr(module, READ_POINT[engine][1], read)
    return done


@pytest.fixture
def two_versions(ckpts, tmp_path):
    """(checkpoint dir at version B, the shard holding `bad.WEIGHT`, its version A): the
    two versions of the shard have the same size and header, other values."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    other = ckpts["fp8", 0] / shard.name
    assert bad.split_safetensors(other)[0] == bad.split_safetensors(shard)[0]
    assert other.read_bytes() != shard.read_bytes()
    return path, shard, other


def test_an_in_place_rewrite_with_its_mtime_put_back_is_refused(ckpts, two_versions, monkeypatch,
                                                                engine):
    path, shard, other = two_versions

    def rewrite_keeping_mtime():
        st = os.stat(shard)
        with open(shard, "r+b") as f:  # same inode, same size, new values
            f.write(other.read_bytes())
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(shard).st_mtime_ns == st.st_mtime_ns

    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    done = after_first_read_of(monkeypatch, engine, shard, rewrite_keeping_mtime)
    with pytest.raises(fr.CorruptCheckpointError, match="changed"):
        fr.update_weights_from_disk(model, path)
    assert done
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    monkeypatch.undo()
    fr.update_weights_from_disk(model, path)  # the writer is done: the file as it is now
    assert fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model)) == []


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_the_reader_refuses_a_torn_read_that_kept_size_and_mtime(two_versions, monkeypatch,
                                                                 parallel):
    from fp8_reload.checkpoint import PinnedArena

    path, shard, other = two_versions

    def rewrite_keeping_mtime():
        st = os.stat(shard)
        with open(shard, "r+b") as f:
            f.write(other.read_bytes())
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

    ckpt = Checkpoint(path)
    done = after_first_read_of(monkeypatch, "staged", shard, rewrite_keeping_mtime)
    into = PinnedArena(pin=False) if parallel else None
    with pytest.raises(fr.CorruptCheckpointError, match="changed while it was being read"):
        list(ckpt.read(ckpt.names, {}, into=into))
    assert done


def test_a_new_version_renamed_in_while_the_old_is_read_leaves_the_old_read_good(
        ckpts, two_versions, tmp_path, monkeypatch):
    """The staged reader reads on from the file it opened: its bytes are intact, only
    its ctime moved (unlinked). The reload is consistent: the version it planned."""
    path, shard, other = two_versions
    expected = fr.snapshot(fr.load_model(path))

    def rename_new_version():
        shutil.copy(other, tmp_path / "partial")
        os.replace(tmp_path / "partial", shard)

    monkeypatch.setattr(importlib.import_module("fp8_reload.reload.transaction"), "ENGINE", "staged")
    model = fr.load_model(ckpts["fp8", 0])
    done = after_first_read_of(monkeypatch, "staged", shard, rename_new_version)
    fr.update_weights_from_disk(model, path)
    assert done
    assert fr.compare_states(expected, fr.snapshot(model)) == []


def test_a_header_of_millions_of_metadata_entries_is_refused_before_parsing(ckpts, tmp_path):
    """The tensor-entry bound counts objects ('{'); `__metadata__` is one object however
    many members it has: 7 million of them (97 MB, under the 100 MB limit) took 10 s and
    1.3 GB to parse, the reload lock held. Members are bounded too, before any parsing."""
    import time

    from fp8_reload.checkpoint.header import MAX_HEADER_MEMBERS

    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    header, data = bad.split_safetensors(shard)
    header["__metadata__"] = {f"{i:x}": "" for i in range(MAX_HEADER_MEMBERS + 1)}
    bad.join_safetensors(shard, header, data)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    t0 = time.perf_counter()
    with pytest.raises(fr.CorruptCheckpointError, match="JSON members") as info:
        fr.update_weights_from_disk(model, path)
    assert time.perf_counter() - t0 < 1.0
    assert str(shard) in str(info.value)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="registers shards with CUDA")
def test_a_version_renamed_in_after_the_plan_is_not_read_through_its_registration(two_versions,
                                                                                 monkeypatch):
    """GPU: the shards of a checkpoint reloaded twice are registered for DMA. A writer that
    renames a new version of one in between the plan (its header parsed) and the copies
    must not have that file read at the plan's offsets through a fresh registration: the
    reload is refused and rolled back, as the ring path refuses it."""
    import fp8_reload.reload.to_device as to_device
    import fp8_reload.reload.transaction as transaction

    path, shard, other = two_versions
    model = fr.load_model(path, device="cuda")
    for _ in range(3):  # read twice: registered from then on
        fr.update_weights_from_disk(model, path)
    before = fr.snapshot(model)
    real = to_device.registered_files

    def renamed_first(model_, ckpt, read):
        staged = shard.with_name(shard.name + ".new")
        shutil.copyfile(other, staged)
        os.replace(staged, shard)
        return real(model_, ckpt, read)

    # (the transaction registers before the weights lock, where it looks the function up)
    monkeypatch.setattr(transaction, "registered_files", renamed_first)
    with pytest.raises(fr.ReloadError, match="changed"):
        fr.update_weights_from_disk(model, path)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_the_parsed_header_cache_stays_bounded_under_concurrent_parses(ckpts, monkeypatch):
    """Reloads of several models parse at once: the cache of parsed headers evicts under
    a lock (an unlocked `next(iter(...))` could see the dict change size) and keeps its bound."""
    import json
    import struct
    import threading

    from fp8_reload.checkpoint import header

    monkeypatch.setattr(header, "_PARSED", {})
    monkeypatch.setattr(header, "PARSED_KEEP", 8)
    shard = bad.shard_of(ckpts["fp8", 0], bad.WEIGHT)
    raw = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + hlen])
    size = len(raw)
    errors = []

    def parse(worker):
        mine = dict(meta)
        try:
            for i in range(200):  # each a distinct header: every call past 8 evicts
                mine["__metadata__"] = {"v": f"{worker}-{i}"}
                text = json.dumps(mine, separators=(",", ":")).encode()
                text += b" " * (hlen - len(text))
                assert len(text) == hlen, "metadata pushed the header past its length"
                header.parse_shard_header(shard, shard.name, size, raw[:8] + text)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=parse, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(header._PARSED) <= 8
