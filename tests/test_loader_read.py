"""The tensors that take a Python loader (a bf16 checkpoint's linear weights) are read on a
thread of their own while a GPU commit streams the rest from registered shards
(`stream.LoaderRead`), and before the weights lock when the ring streams: either way the
reload is a fresh load bit for bit, a bad value or a failed read rolls it back, and no read
outlives the commit."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.stream as stream_mod
import fp8_reload.reload.targets as targets_mod
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as tx

from .conftest import copy_checkpoint, rewrite_tensor
from .test_review_s7 import gpu_path  # noqa: F401  (a fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LINEAR = "model.layers.1.self_attn.q_proj.weight"  # a loader's tensor in a bf16 checkpoint


def _loader_names(path) -> list[str]:
    return [n for n in fr.Checkpoint(path).weight_map if "proj" in n and "experts." not in n]


def test_loader_read_gives_what_a_plain_read_gives_and_counts_its_bytes(ckpts):
    ckpt = fr.Checkpoint(ckpts["bf16", 1])
    names = _loader_names(ckpts["bf16", 1])
    want = dict(ckpt.read(names))
    stats = {"bytes_read": 7}
    reading = stream_mod.LoaderRead(ckpt, names, None, check=True)
    reading.start()
    got = dict(reading.result(stats))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in names)
    assert stats["bytes_read"] == 7 + sum(ckpt.info(n).nbytes for n in names)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_read_into_an_arena_keeps_at_most_its_threads_reading(ckpts, monkeypatch, threads):
    import fp8_reload.checkpoint.reader as reader_mod
    from fp8_reload.checkpoint import PinnedArena

    lock, now, most = threading.Lock(), [0], [0]
    real = reader_mod._read_tensor

    pieces: dict = {}

    def counting(*a, **k):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            pieces.setdefault(a[2].name, []).append(a[4] if len(a) > 4 else None)  # the arena: (lo, hi)
        try:
            return real(*a, **k)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(reader_mod, "_read_tensor", counting)
    ckpt = fr.Checkpoint(ckpts["bf16", 1])
    names = _loader_names(ckpts["bf16", 1])
    want = dict(ckpt.read(names))
    most[0] = 0  # (the plain read above: one at a time)
    pieces.clear()
    monkeypatch.setattr(reader_mod, "PIECE_BYTES", 4096)  # tensors in several pieces
    got = dict(ckpt.read(names, into=PinnedArena(pin=False), threads=threads))
    assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in names)
    assert 1 <= most[0] <= threads
    if threads > 1:  # every tensor read in pieces that tile it
        for n in names:
            size = ckpt.info(n).nbytes
            assert sorted(pieces[n]) == [(lo, min(size, lo + 4096)) for lo in range(0, size, 4096)]


def test_loader_read_raises_a_bad_value_on_the_callers_thread(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    reading = stream_mod.LoaderRead(fr.Checkpoint(path), _loader_names(path), None, check=True)
    reading.start()
    with pytest.raises(fr.InvalidTensorError, match="q_proj"):
        reading.result({})
    assert not reading.thread.is_alive()


@pytest.fixture
def spied(monkeypatch):
    """Every `LoaderRead` a reload makes; the linears take their loaders (on a GPU they are
    quantized in the stream by default: FP8_RELOAD_STREAM_QUANT=experts)."""
    monkeypatch.setattr(targets_mod, "STREAM_QUANT", ("experts",))
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
    """Registered by the first reload (once its checks passed), read from by the second."""
    monkeypatch.setattr(to_device, "REGISTER", register)
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert spied == []
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert len(spied) == (1 if register == "always" else 0)
    fresh = fr.load_model(ckpts["bf16", 1], device="cuda")
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []
    assert _no_reader_left()


def _registered_already(monkeypatch):
    """The reload plans as if every shard were registered already (a shard rewritten within
    its timestamp tick keeps its stamp and registration, and its values are checked again);
    it registers them after its checks before the lock."""
    monkeypatch.setattr(to_device, "REGISTER", "always")
    monkeypatch.setattr(tx, "registered_now", lambda model, ckpt, files: set(files))


@CUDA
def test_a_bad_loader_value_read_beside_the_stream_rolls_back(ckpts, tmp_path, spied, monkeypatch):
    _registered_already(monkeypatch)
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
    _registered_already(monkeypatch)
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    before = fr.snapshot(model)

    def failing(*a, **k):
        raise OSError(5, "injected: the disk went away")

    monkeypatch.setattr(stream_mod, "_read_checked", failing)
    with pytest.raises(fr.ReloadError, match="rolled back"):
        fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert len(spied) == 1 and _no_reader_left()
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


# ---- the GPU path emulated on CPU (`test_review_s7.gpu_path`), every streamed shard
# "registered" (a host copy of the file stands in for the registered mapping) ----


class _HostCopy:
    def __init__(self, path):
        self.view = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        self.piece = None


@pytest.fixture
def registered(monkeypatch):
    """`registered[0]`: whether the next reloads find every shard registered."""
    on = [True]

    def registered_files(model, ckpt, read):
        return {f: _HostCopy(ckpt.path / f) for f in read} if on[0] else {}

    monkeypatch.setattr(tx, "registered_files", registered_files)
    monkeypatch.setattr(tx, "registered_now", lambda model, ckpt, files: set(files) if on[0] else set())
    monkeypatch.setattr(tx, "on_triton_device", lambda model: False)  # bf16 experts take loaders too
    return on


def test_ctrl_c_while_the_loaders_are_read_waits_for_their_reads(tmp_path, tiny_cfg, gpu_path, registered,  # noqa: F811
                                                                 monkeypatch):
    """Review (helper 36): a Ctrl-C landing while the commit waited for the loaders' thread
    left it reading into the staging arena after the rollback; the next reload, staging its
    own loaders' tensors there, loaded some of the interrupted checkpoint's bytes."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main, made, real_read = threading.main_thread().ident, [], stream_mod.LoaderRead

    def interrupted(*a, **k):  # a real SIGINT, while the commit streams or waits for the reads
        made.append(real_read(*a, **k))
        threading.Timer(0.15, signal.pthread_kill, (main, signal.SIGINT)).start()
        return made[-1]

    monkeypatch.setattr(stream_mod, "LoaderRead", interrupted)
    _interrupted_reload_leaves_no_read(tmp_path, tiny_cfg, monkeypatch, registered)
    assert made and made[0].done.is_set()


def test_loaders_read_beside_the_stream_report_what_they_read(ckpts, gpu_path, registered):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    beside = fr.update_weights_from_disk(model, ckpts["bf16", 1])
    registered[0] = False
    first = fr.update_weights_from_disk(model, ckpts["bf16", 0])
    # (every shard holds loader-bound tensors here; through the ring its readers open them too)
    assert beside.files_opened == len(set(fr.Checkpoint(ckpts["bf16", 1]).weight_map.values()))
    assert beside.bytes_read == first.bytes_read
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["bf16", 0])), fr.snapshot(model)) == []


def test_a_shard_no_longer_registered_at_the_commit_reads_the_loaders_first(ckpts, gpu_path, registered,  # noqa: F811
                                                                             spied, monkeypatch):
    """Planned with every shard registered (the loaders' arena lent for a read beside the
    stream), committed with none (a registration released in between): the shards stream
    through the ring, and the loaders are read first, as the ring wants, not beside it."""
    model = fr.load_model(ckpts["bf16", 0])
    monkeypatch.setattr(tx, "registered_files", lambda model, ckpt, read: {})
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert spied == []  # (no thread: read before the stream)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["bf16", 1])), fr.snapshot(model)) == []


def test_a_bad_scale_neither_counts_a_read_nor_registers(ckpts, tmp_path, gpu_path, monkeypatch):  # noqa: F811
    """Review (helper 36): registering came before the scales were read; two reloads failing
    on a NaN scale counted two reads of every shard and asked to register them all."""
    from fp8_reload.checkpoint.registered import RegisteredShards
    from fp8_reload.checkpoint.staging import holder

    counted = []
    real = to_device.registered_files
    monkeypatch.setattr(tx, "registered_files", lambda *a: counted.append(a) or real(*a))
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "bad")
    scale = next(n for n in fr.Checkpoint(path).weight_map if n.endswith("experts.5.up_proj.weight_scale"))
    rewrite_tensor(path, scale, lambda t: torch.full_like(t, float("nan")))
    model = fr.load_model(ckpts["fp8", 0])
    for _ in range(2):
        with pytest.raises(fr.InvalidTensorError, match="scale"):
            fr.update_weights_from_disk(model, path)
    assert counted == [] and holder(model, "registered", RegisteredShards).reads == {}


def _interrupted_reload_leaves_no_read(tmp_path, tiny_cfg, monkeypatch, registered):
    """Reload b (its reads slow) expecting a KeyboardInterrupt, then c through the ring:
    no read of b may end after the interrupt, and c lands as a fresh load."""
    import fp8_reload.checkpoint.reader as reader_mod

    a, b, c = (fr.write_checkpoint(tmp_path / f"bf16-{s}", tiny_cfg, seed=s, kind="bf16") for s in range(3))
    real, late = reader_mod._read_tensor, []

    def slow(handle, fpath, info, out=None, piece=None):
        if str(fpath).startswith(str(b)):
            time.sleep(0.05)
            late.append(time.monotonic())
        return real(handle, fpath, info, out=out, piece=piece)

    monkeypatch.setattr(reader_mod, "_read_tensor", slow)
    model = fr.load_model(a)
    before = fr.snapshot(model)
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, b)
    raised = time.monotonic()
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    registered[0] = False
    fr.update_weights_from_disk(model, c)
    assert not any(t > raised for t in late) and _no_reader_left()
    assert fr.compare_states(fr.snapshot(fr.load_model(c)), fr.snapshot(model)) == []


def test_ctrl_c_as_the_loaders_thread_starts(tmp_path, tiny_cfg, gpu_path, registered, monkeypatch):  # noqa: F811
    """Review (helper 37): `Thread.start` waits for the thread to run, and a Ctrl-C there
    left it running unseen (the commit had no handle on it yet)."""
    real_start = threading.Thread.start

    def start(self):
        real_start(self)
        if self.name == "fp8-reload-loaders":
            raise KeyboardInterrupt  # as if it arrived at the end of the wait

    monkeypatch.setattr(threading.Thread, "start", start)
    _interrupted_reload_leaves_no_read(tmp_path, tiny_cfg, monkeypatch, registered)


def test_ctrl_c_before_a_deferral_is_in_place(tmp_path, tiny_cfg, gpu_path, registered, monkeypatch):  # noqa: F811
    """Review (helper 37): a Ctrl-C landing as `sigint_deferred` is entered, before its
    handler is in place."""
    import fp8_reload.interrupts as interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_get, fired = signal.getsignal, []

    def getsignal(signum):
        if not fired:
            fired.append(signum)
            raise KeyboardInterrupt
        return real_get(signum)

    monkeypatch.setattr(interrupts.signal, "getsignal", getsignal)
    _interrupted_reload_leaves_no_read(tmp_path, tiny_cfg, monkeypatch, registered)
    assert fired


def test_an_arena_lent_to_a_thread_is_reset_by_another_only_once_it_is_done():
    from fp8_reload.checkpoint import PinnedArena

    arena, done = PinnedArena(pin=False), threading.Event()
    arena.reset(64)
    arena.lend(threading.Thread(target=lambda: None), done)
    waited = []
    other = threading.Thread(target=lambda: (arena.reset(64), waited.append(done.is_set())))
    other.start()
    time.sleep(0.2)
    assert other.is_alive()  # still waiting for the borrower
    done.set()
    other.join(5)
    assert waited == [True]


def test_a_bad_loader_value_on_the_ring_path_neither_counts_a_read_nor_registers(ckpts, tmp_path, gpu_path,  # noqa: F811
                                                                                  monkeypatch):
    """Review (helper 37): read before the lock (shards not registered yet), a bad loader
    value failed after the reads were counted; two such reloads would pin the shards."""
    from fp8_reload.checkpoint.registered import RegisteredShards
    from fp8_reload.checkpoint.staging import holder

    monkeypatch.setattr(to_device, "REGISTER", "auto")
    monkeypatch.setattr(tx, "on_triton_device", lambda model: False)
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    model = fr.load_model(ckpts["bf16", 0])
    for _ in range(2):
        with pytest.raises(fr.InvalidTensorError, match="q_proj"):
            fr.update_weights_from_disk(model, path)
    assert holder(model, "registered", RegisteredShards).reads == {}


# ---- where the loaders' tensors read before the lock are checked ----

def _no_host_check(monkeypatch):
    def host_check(*a, **k):
        raise AssertionError("a loader's tensor was checked on the host")

    monkeypatch.setattr(stream_mod, "has_bad_values", host_check)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_loader_tensors_read_into_pinned_memory_are_checked_on_the_given_device(ckpts, tmp_path, monkeypatch,
                                                                                bad):
    """`on`: the device the check runs on (a GPU reload's, from the pinned arena: host
    reductions of a bf16 checkpoint's loader tensors took 4-36 ms on the H200 host); the
    bad tensor is named, and the good ones come back as read."""
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    names = _loader_names(path)
    clean = dict(fr.Checkpoint(ckpts["bf16", 1]).read(names))
    _no_host_check(monkeypatch)
    cpu = torch.device("cpu")
    got = stream_mod._read_checked(fr.Checkpoint(ckpts["bf16", 1]), names, {}, None, True, on=cpu)
    assert sorted(n for n, _ in got) == sorted(names) and all(torch.equal(t, clean[n]) for n, t in got)
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([1]), bad))
    with pytest.raises(fr.InvalidTensorError, match=f"{LINEAR}.*{'NaN' if bad != bad else 'inf'}"):
        stream_mod._read_checked(fr.Checkpoint(path), names, {}, None, True, on=cpu)


@CUDA
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_a_first_gpu_reload_checks_its_loaders_tensors_on_the_gpu(ckpts, tmp_path, spied, monkeypatch, bad):
    """Through the ring (nothing registered): the loaders' tensors are read before the
    lock and checked on the model's GPU; a bad one rolls the reload back, by name."""
    monkeypatch.setattr(to_device, "REGISTER", "never")
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, LINEAR, lambda t: t.index_fill(0, torch.tensor([2]), bad))
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    before = fr.snapshot(model)
    _no_host_check(monkeypatch)
    with pytest.raises(fr.InvalidTensorError, match=LINEAR):
        fr.update_weights_from_disk(model, path)
    assert spied == [] and fr.compare_states(before, fr.snapshot(model), identity=True) == []
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    fresh = fr.load_model(ckpts["bf16", 1], device="cuda")
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []


def test_a_piece_cut_short_says_which_bytes_of_the_tensor(ckpts, tmp_path, monkeypatch):
    """Review (helper 44): a tensor read in pieces reported a short read in the piece's own
    counts ("got 36 of 64 bytes") with nothing to place them in the tensor."""
    import os

    import fp8_reload.checkpoint.reader as reader_mod
    from fp8_reload.checkpoint import PinnedArena

    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "c")
    ckpt = fr.Checkpoint(path)
    info = ckpt.info(LINEAR)
    real = reader_mod._read_tensor

    def cut_then_read(*a, **k):  # the file loses its end while the pieces are read
        os.truncate(path / info.file, info.offset + 5000)
        return real(*a, **k)

    monkeypatch.setattr(reader_mod, "PIECE_BYTES", 4096)
    monkeypatch.setattr(reader_mod, "_read_tensor", cut_then_read)
    second = rf"{LINEAR}' \(its bytes 4096 to 8192\).*got 904 of 4096"  # (the first piece is whole)
    with pytest.raises(fr.CorruptCheckpointError, match=second):
        list(ckpt.read([LINEAR], into=PinnedArena(pin=False), threads=None))
