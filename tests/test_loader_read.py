"""The tensors that take a Python loader (a bf16 checkpoint's linear weights) are read on a
thread of their own while a GPU commit streams the rest from registered shards
(`stream.LoaderRead`), and before the weights lock when the ring streams: either way the
reload is a fresh load bit for bit, a bad value or a failed read rolls it back, and no read
outlives the commit."""

from __future__ import annotations

import threading

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.stream as stream_mod
import fp8_reload.reload.to_device as to_device

from .conftest import copy_checkpoint, rewrite_tensor

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LINEAR = "model.layers.1.self_attn.q_proj.weight"  # a loader's tensor in a bf16 checkpoint


def _loader_names(path) -> list[str]:
    return [n for n in fr.Checkpoint(path).weight_map if "proj" in n and "experts." not in n]


def test_loader_read_gives_what_a_plain_read_gives_and_counts_its_bytes(ckpts):
    ckpt = fr.Checkpoint(ckpts["bf16", 1])
    names = _loader_names(ckpts["bf16", 1])
    want = dict(ckpt.read(names))
    stats = {"bytes_read": 7}
    got = dict(stream_mod.LoaderRead(ckpt, names, None, check=True).result(stats))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in names)
    assert stats["bytes_read"] == 7 + sum(ckpt.info(n).nbytes for n in names)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_read_into_an_arena_keeps_at_most_its_threads_reading(ckpts, monkeypatch, threads):
    import fp8_reload.checkpoint.reader as reader_mod
    from fp8_reload.checkpoint import PinnedArena

    lock, now, most = threading.Lock(), [0], [0]
    real = reader_mod._read_tensor

    def counting(*a, **k):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return real(*a, **k)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(reader_mod, "_read_tensor", counting)
    ckpt = fr.Checkpoint(ckpts["bf16", 1])
    names = _loader_names(ckpts["bf16", 1])
    want = dict(ckpt.read(names))
    got = dict(ckpt.read(names, into=PinnedArena(pin=False), threads=threads))
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in names)
    assert 1 <= most[0] <= threads


def test_loader_read_raises_a_bad_value_on_the_callers_thread(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    reading = stream_mod.LoaderRead(fr.Checkpoint(path), _loader_names(path), None, check=True)
    with pytest.raises(fr.InvalidTensorError, match="q_proj"):
        reading.result({})
    assert not reading.thread.is_alive()


@pytest.fixture
def spied(monkeypatch):
    """Every `LoaderRead` a reload makes."""
    made, real = [], stream_mod.LoaderRead

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(stream_mod, "LoaderRead", spy)
    return made


def _no_reader_left() -> bool:
    return not any(t.name == "fp8-reload-loaders" for t in threading.enumerate())


@CUDA
@pytest.mark.parametrize("register", ["always", "never"])
def test_a_gpu_reload_reads_loaders_beside_registered_shards_only(ckpts, spied, monkeypatch, register):
    monkeypatch.setattr(to_device, "REGISTER", register)
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert len(spied) == (1 if register == "always" else 0)
    fresh = fr.load_model(ckpts["bf16", 1], device="cuda")
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []
    assert _no_reader_left()


@CUDA
def test_a_bad_loader_value_read_beside_the_stream_rolls_back(ckpts, tmp_path, spied, monkeypatch):
    monkeypatch.setattr(to_device, "REGISTER", "always")  # registered at its first read: checked there
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([2]), float("inf")))
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    before = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError, match="q_proj"):
        fr.update_weights_from_disk(model, path)
    assert len(spied) == 1 and _no_reader_left()
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    fresh = fr.load_model(ckpts["bf16", 1], device="cuda")
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []


@CUDA
def test_a_loader_read_failing_beside_the_stream_rolls_back(ckpts, spied, monkeypatch):
    monkeypatch.setattr(to_device, "REGISTER", "always")
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    before = fr.snapshot(model)

    def failing(*a, **k):
        raise OSError(5, "injected: the disk went away")

    monkeypatch.setattr(stream_mod, "_read_checked", failing)
    with pytest.raises(fr.ReloadError, match="rolled back"):
        fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert len(spied) == 1 and _no_reader_left()
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
