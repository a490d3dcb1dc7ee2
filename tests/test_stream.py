"""The streaming reload engine (`reload/stream.py`, `chunks.py`, `to_device.py`).

Small chunks, pieces and rings force many chunks, several reads per chunk and slots
refilled many times over, so the pipeline's bookkeeping is exercised on a tiny model;
every result is checked bit for bit against a fresh load and against the staged
engine, with every Parameter the same object.
"""

from __future__ import annotations

import struct

import pytest
import torch

import fp8_reload as fr
import fp8_reload.checkpoint.files as files_mod
import fp8_reload.checkpoint.header as header_mod
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as transaction_mod
from fp8_reload.checkpoint.staging import held
from fp8_reload.layers import EXPERT_RE
from fp8_reload.reload.chunks import make_chunks
from fp8_reload.reload.plan import open_checkpoint, plan_reload
from fp8_reload.reload.targets import plan_targets

from .conftest import copy_checkpoint, mix_checkpoints, raising_on_call, rewrite_tensor, tokens
from .test_review_s7 import _cpu_tensors_reach_triton, gpu_path  # noqa: F401  (a fixture)

KINDS = ["fp8", "bf16"]
SPEC = {1: [0, 3], 2: [5, 7]}


@pytest.fixture(params=["whole", "parts"])
def tiny_ring(monkeypatch, request):
    """Chunks of at most 4 KiB (one unit may exceed it), read in 1 KiB pieces, through
    a ring of 2 slots: hundreds of chunks, every slot refilled over and over. "parts": on
    a GPU, chunks of 16 KiB read and copied in parts of 4 KiB, a slot each."""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096 if request.param == "whole" else 16384)
    monkeypatch.setattr(chunks_mod, "PART_BYTES", 0 if request.param == "whole" else 4096)
    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", 1024)
    monkeypatch.setattr(chunks_mod, "RING_SLOTS", 2)


def _expected(ckpts, kind, spec, tmp_path, device):
    if spec is None:
        return fr.snapshot(fr.load_model(ckpts[kind, 1], device=device))
    chosen = {(layer, e) for layer, es in spec.items() for e in es}

    def key(name):
        m = EXPERT_RE.match(name)
        return None if m is None else (int(name.split(".")[2]), int(m.group(2)))

    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed", lambda n: key(n) in chosen)
    return fr.snapshot(fr.load_model(mixed, device=device))


@pytest.mark.parametrize("register", ["never", "always"])
@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
@pytest.mark.parametrize("kind", KINDS)
def test_streamed_reload_equals_a_fresh_load(ckpts, tmp_path, tiny_ring, monkeypatch, device, kind, spec,
                                             register):
    if register == "always" and device == "cpu":
        pytest.skip("registration is a CUDA path; the CPU run covers the ring")
    monkeypatch.setattr(to_device, "REGISTER", register)
    _reload_twice_and_compare(ckpts, tmp_path, device, kind, spec)


@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
@pytest.mark.parametrize("kind", KINDS)
def test_shards_registered_in_pieces_reload_bit_for_bit(ckpts, tmp_path, monkeypatch, kind, spec):
    """A shard is registered in pieces (the driver holds other threads' CUDA calls while
    it pins one); copies are cut where two meet. Pieces of one page: every chunk and
    span crosses several."""
    import fp8_reload.checkpoint.registered as registered_mod

    if not torch.cuda.is_available():
        pytest.skip("registration is a CUDA path")
    monkeypatch.setattr(to_device, "REGISTER", "always")
    monkeypatch.setattr(registered_mod, "PIECE_BYTES", 1)  # (rounded up to a page)
    monkeypatch.setattr(registered_mod, "_BETWEEN_PIECES", 0)
    pieces = []
    real = registered_mod.register

    def counted(path):
        reg = real(path)
        pieces.append(len(reg._pieces))
        return reg

    monkeypatch.setattr(registered_mod, "register", counted)
    _reload_twice_and_compare(ckpts, tmp_path, "cuda", kind, spec)
    assert pieces and min(pieces) > 1


def test_copies_from_a_registered_file_are_cut_where_its_pieces_meet(monkeypatch):
    """(Host-side bookkeeping of the above; on CPU the copies are plain.)"""
    cuts = []
    monkeypatch.setattr(to_device, "copy_async", lambda dst, src, stream: (cuts.append(src.numel()),
                                                                          dst.copy_(src)))
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(70, dtype=torch.uint8)
    to_device._from_host(dst, src[25:95], None, base=25, piece=32)  # file bytes 25..95
    assert cuts == [7, 32, 31] and torch.equal(dst, src[25:95])
    cuts.clear()
    to_device._from_host(dst, src[:70], None, base=0, piece=None)  # pinned ring memory: one copy
    assert cuts == [70]


def _data_at(path, residue: int) -> None:
    """Every shard of `path` rewritten with its data starting at `residue` modulo 16 (the
    header's JSON padded with spaces, as the format allows)."""
    for shard in path.glob("*.safetensors"):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8:8 + n].rstrip(b" ")
        header += b" " * ((residue - 8 - len(header)) % 16)
        shard.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


@pytest.mark.parametrize("kind", KINDS)
def test_a_registered_window_puts_bf16_weights_on_16_bytes(ckpts, tmp_path, kind):
    """A full reload's chunk of a registered shard is one DMA of its file window. The window
    used to start on the file's 16 bytes: where a header's length put the data 8 bytes off,
    every bf16 weight landed 8 bytes off too (through the ring: aligned), the quantization
    took its element-wise variant and compiled it anew at the second reload (876 ms on the
    H200). Now a bf16 chunk's window starts where its weights land on 16 bytes; an FP8
    chunk's keeps the file's alignment."""
    path = copy_checkpoint(ckpts[kind, 1], tmp_path / "data-at-8")
    _data_at(path, 8)
    model = fr.load_model(ckpts[kind, 0])
    _, targets = plan_reload(model, open_checkpoint(model, path), None, True, model.mode.expand_units)
    quantized = 0
    for chunk in make_chunks([t for t in targets if t.kind in ("copy", "quant")]):
        window, start, end = chunks_mod.registered_window(chunk)
        assert chunk.window is chunk.window and chunk.window[1:] == (start, end)  # (worked out once)
        assert start is not None and start <= chunk.spans[0][0] < start + 16  # one DMA, nothing lost
        assert end == chunk.spans[-1][0] + chunk.spans[-1][1]
        assert [(o, n) for o, n, _ in window.spans] == [(o, n) for o, n, _ in chunk.spans]
        for t in chunk.targets:
            assert window.offset_of(t) == t.info.offset - start
            if t.kind == "quant":
                quantized += 1
                assert t.info.offset % 16 == 8 and window.offset_of(t) % 16 == 0
        if not any(t.kind == "quant" for t in chunk.targets):
            assert start % 16 == 0
    assert quantized > 0 if kind == "bf16" else quantized == 0


def _aligned_launches(ckpts, tmp_path, monkeypatch, device, io, spec):
    from fp8_reload.kernels.triton import requant

    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "data-at-8")
    _data_at(path, 8)
    monkeypatch.setattr(chunks_mod, "READ_IO", io)
    aligned, launch = [], requant._launch
    monkeypatch.setattr(requant, "_launch", lambda kernel, compiled, sub, grid, args, dev, fast=(): (
        aligned.append(args[-1]), launch(kernel, compiled, sub, grid, args, dev, fast)))
    model = fr.load_model(ckpts["bf16", 0], device=device)
    expected = _expected(ckpts, "bf16", spec, tmp_path, device)  # (the same tensors as `path`'s)
    aligned.clear()
    fr.update_weights_from_disk(model, path, None if spec is None else fr.generate_weight_name_filter(spec))
    assert fr.compare_states(expected, fr.snapshot(model)) == []
    assert aligned and all(a is True for a in aligned), (io, spec, aligned)
    return model


WAYS = [("ring", "buffered"), ("direct", "direct"), ("registered", "buffered"), ("registered", "direct")]


@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
@pytest.mark.parametrize("how,io", WAYS, ids=["ring", "direct", "registered", "registered-direct"])
def test_bf16_weights_8_bytes_past_16_in_their_files_are_quantized_aligned(ckpts, tmp_path, monkeypatch,
                                                                          how, io, spec):
    """(CUDA) A bf16 checkpoint whose data starts 8 bytes past 16 reloaded through the ring,
    with direct reads (laid on the file's alignment: `Chunk.quant_lead`) and from registered
    shards (one window, or a filtered reload's spans) equals a fresh load, and every
    quantization launch is of the aligned variant."""
    if not torch.cuda.is_available():
        pytest.skip("a CUDA path (the emulated one below runs on CPU)")
    monkeypatch.setattr(to_device, "REGISTER", "always" if how == "registered" else "never")
    model = _aligned_launches(ckpts, tmp_path, monkeypatch, "cuda", io, spec)
    shards = held(model).get("registered")
    assert bool(shards and shards.files) == (how == "registered")


@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
@pytest.mark.parametrize("how,io", WAYS, ids=["ring", "direct", "registered", "registered-direct"])
def test_bf16_weights_8_bytes_past_16_are_quantized_aligned_on_the_emulated_gpu_path(
        ckpts, tmp_path, monkeypatch, gpu_path, how, io, spec):  # noqa: F811
    """(The same on CPU: registered shards are a host copy of each file, `test_loader_read`.)"""
    _cpu_tensors_reach_triton("bf16")
    if how == "registered":
        from .test_loader_read import _HostCopy

        monkeypatch.setattr(transaction_mod, "registered_files",
                            lambda model, ckpt, read: {f: _HostCopy(ckpt.path / f) for f in read})
        monkeypatch.setattr(transaction_mod, "registered_now", lambda model, ckpt, files: set(files))
    _aligned_launches(ckpts, tmp_path, monkeypatch, "cpu", io, spec)


def test_a_filtered_reload_from_registered_shards_moves_only_what_it_reads(ckpts, monkeypatch):
    """Registered shards are copied from the page cache: a full reload's chunk in one DMA of
    its window (small gaps: the scales read before the lock), a filtered reload's spans
    alone. Copying a filtered chunk's whole window (review, helper 12) moved the
    unselected experts between its spans too, and grew the device slot to that window.
    (FP8: bf16 experts take their loaders, not this path.)"""
    if not torch.cuda.is_available():
        pytest.skip("registration is a CUDA path")
    monkeypatch.setattr(to_device, "REGISTER", "always")
    host_to_device, real = [], to_device.copy_async

    def spy(dst, src, stream):
        if src.device.type == "cpu":
            host_to_device.append(src.numel() * src.element_size())
        return real(dst, src, stream)

    monkeypatch.setattr(to_device, "copy_async", spy)
    model = fr.load_model(ckpts["fp8", 0], device="cuda")
    flt = fr.generate_weight_name_filter(SPEC)
    for flt_, what in ((None, "full"), (flt, "filtered")):
        host_to_device.clear()
        report = fr.update_weights_from_disk(model, ckpts["fp8", 1], flt_)
        assert 0 < sum(host_to_device) <= report.bytes_read * 9 // 8, (what, sum(host_to_device),
                                                                      report.bytes_read)


def test_shards_are_registered_before_the_weights_lock(ckpts, monkeypatch):
    """Registering faults a shard's pages in (up to `REGISTER_STEP` bytes per reload):
    done under the weights lock (review, helper 31), it stalled every forward for it."""
    import fp8_reload.checkpoint.registered as registered_mod

    if not torch.cuda.is_available():
        pytest.skip("registration is a CUDA path")
    monkeypatch.setattr(to_device, "REGISTER", "auto")
    model = fr.load_model(ckpts["fp8", 0], device="cuda")
    writing, real = [], registered_mod.register

    def spy(path):
        writing.append(model.weights_lock.writing)
        return real(path)

    monkeypatch.setattr(registered_mod, "register", spy)
    flt = fr.generate_weight_name_filter(SPEC)
    for _ in range(2):  # registered the second time
        fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    assert writing and not any(writing)
    assert held(model)["registered"].files
    fr.release_staging(model)


def test_registrations_dropped_are_unregistered_under_the_weights_lock(ckpts, monkeypatch):
    """The driver's unregister waits for the whole device and holds the process's other
    CUDA calls meanwhile (review, helper 34: 451-489 ms behind a forward's queued
    kernels): registrations dropped to make room are unregistered under the weights lock,
    once the device is idle, not in the read phase beside running forwards."""
    import fp8_reload.checkpoint.registered as registered_mod

    if not torch.cuda.is_available():
        pytest.skip("registration is a CUDA path")
    monkeypatch.setattr(to_device, "REGISTER", "auto")
    sizes = [sum(c.parsed_stamp(f)[2] for f in c.shard_files)
             for c in (fr.Checkpoint(ckpts["fp8", s]) for s in (0, 1))]
    monkeypatch.setattr(to_device, "_register_budget", lambda: max(sizes) + 1)  # one checkpoint's worth
    model = fr.load_model(ckpts["fp8", 0], device="cuda")
    writing, real = [], registered_mod.host_unregister
    monkeypatch.setattr(registered_mod, "host_unregister",
                        lambda ptr: (writing.append(model.weights_lock.writing), real(ptr)))
    for seed in (1, 0):
        for _ in range(2):  # registered the second time; seed 0's make room: seed 1's dropped
            fr.update_weights_from_disk(model, ckpts["fp8", seed])
    assert writing and all(writing)
    assert all(str(ckpts["fp8", 0]) in k for k in held(model)["registered"].files)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 0], device="cuda")),
                             fr.snapshot(model)) == []
    fr.release_staging(model)


@pytest.mark.parametrize("in_stream", [("experts", "linears"), ("experts",), ()],
                         ids=["in-stream", "experts-only", "loaders"])
@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
def test_bf16_quantized_inside_the_stream_equals_a_fresh_load(ckpts, tmp_path, tiny_ring, monkeypatch, spec,
                                                              in_stream):
    """bf16 experts and linears quantized from a device slot (the default on a GPU), the
    experts alone (FP8_RELOAD_STREAM_QUANT=experts), or everything through its loader
    (FP8_RELOAD_STREAM_QUANT=0). A filtered reload whose targets were all quantized
    in the stream once took the host path (no target had a view to tell the device by) and
    wrote nothing."""
    import fp8_reload.reload.targets as targets_mod

    if not torch.cuda.is_available():
        pytest.skip("quantizing inside the stream is a CUDA path (CPU experts take their loaders)")
    monkeypatch.setattr(targets_mod, "STREAM_QUANT", in_stream)
    _reload_twice_and_compare(ckpts, tmp_path, "cuda", "bf16", spec)


def test_experts_to_quantize_in_the_stream_are_never_dropped_on_the_host(ckpts):
    """Quant targets (bf16 experts, no view) are a GPU path: the host commit refuses them
    instead of reporting a reload that wrote nothing."""
    from fp8_reload.device import model_device
    from fp8_reload.reload.stream import commit, prepare

    model = fr.load_model(ckpts["bf16", 0])
    ckpt = fr.Checkpoint(ckpts["bf16", 1])
    names = [n for n in ckpt.names if fr.generate_weight_name_filter({1: [0]})(n)]
    targets = plan_targets(model, [ckpt.info(n) for n in names], quantize_on_device=True)
    assert targets and {t.kind for t in targets} == {"quant"} and all(not t.views for t in targets)
    assert all(t.module.w13_weight.device == model_device(model) for t in targets)  # where commit looks
    prep = prepare(ckpt, targets, {})
    with pytest.raises(RuntimeError, match="only on a GPU"):
        commit(model, prep, {})


def _reload_twice_and_compare(ckpts, tmp_path, device, kind, spec):
    model = fr.load_model(ckpts[kind, 0], device=device)
    before = fr.snapshot(model)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    expected = _expected(ckpts, kind, spec, tmp_path, device)
    for _ in range(2):  # the second time: values already checked, shards maybe registered
        report = fr.update_weights_from_disk(model, ckpts[kind, 1], flt)
        after = fr.snapshot(model)
        assert fr.compare_states(expected, after) == []
        assert after.ids == before.ids  # every Parameter the same object
    assert report.bytes_read == sum(fr.Checkpoint(ckpts[kind, 1]).info(n).nbytes
                                    for n in fr.Checkpoint(ckpts[kind, 1]).names if flt is None or flt(n))
    fr.release_staging(model)  # registrations, rings and parsed headers given back; the next
    assert not header_mod._PARSED  # reload rebuilds them
    fr.update_weights_from_disk(model, ckpts[kind, 0])
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts[kind, 0], device=device)),
                             fr.snapshot(model)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_and_staged_engines_agree(ckpts, tiny_ring, monkeypatch, device, kind):
    got = {}
    for engine in ("staged", "stream"):
        monkeypatch.setattr(transaction_mod, "ENGINE", engine)
        model = fr.load_model(ckpts[kind, 0], device=device)
        fr.update_weights_from_disk(model, ckpts[kind, 1], fr.generate_weight_name_filter(SPEC))
        fr.update_weights_from_disk(model, ckpts[kind, 1])
        got[engine] = (fr.snapshot(model), model(tokens(model.config).to(device)))
    assert fr.compare_states(got["staged"][0], got["stream"][0]) == []
    assert torch.equal(got["staged"][1], got["stream"][1])


def test_chunks_are_one_file_each_merge_adjacent_tensors_and_never_split_an_expert(ckpts, monkeypatch):
    import fp8_reload.reload.targets as targets_mod

    monkeypatch.setattr(targets_mod, "STREAM_QUANT", ("experts", "linears"))
    ckpt = fr.Checkpoint(ckpts["bf16", 0])
    model = fr.load_model(ckpts["bf16", 0])
    targets = plan_targets(model, [ckpt.info(n) for n in ckpt.names], quantize_on_device=True)
    assert {t.kind for t in targets} == {"copy", "quant", "loader"}
    # a loader only for what has no plain destination (bf16 linear weights, quantized on
    # load) and for an expert whose pieces straddle two shards (quantized together)
    files_of = {}
    for t in targets:
        files_of.setdefault((t.module_name, tuple(t.slots)), set()).add(t.info.file)
    for t in targets:
        if ".mlp.experts." in t.info.name:
            split = len(files_of[(t.module_name, tuple(t.slots))]) > 1
            assert t.kind == ("loader" if split else "quant"), t.info.name
        elif t.kind == "loader":
            assert t.info.dtype == torch.bfloat16 and t.info.name.endswith("proj.weight"), t.info.name
    assert any(t.kind == "loader" and ".mlp.experts." in t.info.name for t in targets)
    chunks = make_chunks(targets, chunk_bytes=3000)
    assert len(chunks) > 10
    assert [t for c in chunks for t in c.targets] == targets  # file order, each once
    for c in chunks:
        assert {t.info.file for t in c.targets} == {c.file}
        assert sum(t.info.nbytes for t in c.targets) == c.nbytes == c.extent  # no gaps in these files
        assert len(c.spans) == 1  # the tensors of a shard are adjacent: one read per chunk
        buf = torch.arange(c.nbytes, dtype=torch.int64).to(torch.uint8)
        for t in c.targets:
            assert c.source(buf, t).numel() * t.info.dtype.itemsize == t.info.nbytes
    experts = {}
    for k, c in enumerate(chunks):
        for t in c.targets:
            if t.kind == "quant":
                experts.setdefault((t.module_name, tuple(t.slots)), set()).add(k)
    assert experts and all(len(ks) == 1 for ks in experts.values())
    # without a device to quantize on, bf16 experts take their loader
    on_cpu = plan_targets(model, [ckpt.info(n) for n in ckpt.names], quantize_on_device=False)
    assert {t.kind for t in on_cpu} == {"copy", "loader"}
    assert [t.info.name for t in on_cpu if t.kind == "loader"] == \
        [t.info.name for t in targets if t.kind in ("loader", "quant")]


@pytest.mark.parametrize("gap", [0, 4, 100, 1 << 20])
def test_near_runs_take_in_at_most_gap_bytes_no_target_holds(gap):
    """What one read of scales (or one advice) spans: every target once, in file order, a
    run never taking in more than `gap` bytes between its targets (in all, not per gap)."""
    from fp8_reload.checkpoint.header import TensorInfo
    from fp8_reload.reload.targets import Target

    g = torch.Generator().manual_seed(gap)
    targets, at = [], {"a": 0, "b": 0}
    for k in range(200):
        f = "ab"[k % 2]
        at[f] += int(torch.randint(0, 60, (1,), generator=g))  # gaps of 0-59 bytes
        targets.append(Target(TensorInfo(f"t{k}", f, torch.float32, (), at[f], 4), "scalar"))
        at[f] += 4
    runs = chunks_mod.near_runs(targets[::-1], gap)  # (any order in)
    assert sorted(runs) == ["a", "b"]
    seen = []
    for f, its in runs.items():
        for lo, hi, inside in its:
            assert all(t.info.file == f for t in inside)
            assert [t.info.offset for t in inside] == sorted(t.info.offset for t in inside)
            assert lo == inside[0].info.offset and hi == inside[-1].info.offset + 4
            assert hi - lo - 4 * len(inside) <= gap
            seen += inside
        assert all(b[0] > a[1] for a, b in zip(its, its[1:]))
    assert sorted(t.info.name for t in seen) == sorted(t.info.name for t in targets)
    if gap >= 60 * 200:
        assert [len(its) for its in runs.values()] == [1, 1]


def test_chunk_spans_skip_tensors_not_selected():
    from fp8_reload.checkpoint.header import TensorInfo
    from fp8_reload.reload.targets import Target

    def target(offset, nbytes):
        return Target(TensorInfo(f"t{offset}", "a", torch.uint8, (nbytes,), offset, nbytes), "copy")

    chunks = make_chunks([target(0, 10), target(10, 6), target(40, 4), target(44, 4)], chunk_bytes=100)
    assert len(chunks) == 1
    c = chunks[0]
    assert c.spans == [(0, 16, 0), (40, 8, 16)] and c.nbytes == c.extent == 24
    assert [c.offset_of(t) for t in c.targets] == [0, 10, 16, 20]


def _poke_nan(path, name):
    def nan_at_first(t):
        raw = t.contiguous().view(torch.uint8).clone()
        raw.view(-1)[0] = 0x7F  # e4m3 NaN / top byte of a bf16 NaN (little endian: byte 1)
        if t.dtype == torch.bfloat16:
            raw.view(-1)[1] = 0x7F
            raw.view(-1)[0] = 0xC0
        return raw.view(t.dtype).view(t.shape)
    rewrite_tensor(path, name, nan_at_first)


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_in_a_streamed_weight_is_refused_and_rolled_back(ckpts, tmp_path, tiny_ring, device, kind):
    bad = copy_checkpoint(ckpts[kind, 1], tmp_path / "bad")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    _poke_nan(bad, name)
    model = fr.load_model(ckpts[kind, 0], device=device)
    before = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError, match=f"{name}.*NaN"):
        fr.update_weights_from_disk(model, bad)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    fr.update_weights_from_disk(model, ckpts[kind, 1])  # the model still reloads
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts[kind, 1], device=device)),
                             fr.snapshot(model)) == []


def test_values_are_checked_once_while_the_files_are_unchanged(ckpts, tmp_path, monkeypatch):
    import fp8_reload.reload.stream as stream_mod

    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    # the files at rest (settled when parsed): only then are checked values kept
    monkeypatch.setattr(files_mod, "SETTLED_NS", 0)
    model = fr.load_model(ckpts["fp8", 0])
    calls = []
    orig = stream_mod.has_bad_values
    monkeypatch.setattr(stream_mod, "has_bad_values", lambda t: calls.append(1) or orig(t))
    fr.update_weights_from_disk(model, path)
    first = len(calls)
    fr.update_weights_from_disk(model, path)
    assert first > 0 and len(calls) == first  # unchanged files: nothing checked again
    _poke_nan(path, "model.layers.1.mlp.experts.0.gate_proj.weight")  # a new stamp
    with pytest.raises(fr.InvalidTensorError):
        fr.update_weights_from_disk(model, path)


def test_a_file_changed_while_streaming_rolls_the_reload_back(ckpts, tmp_path, monkeypatch,
                                                              rewrite_mid_stream):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    rewrite_mid_stream(path)
    with pytest.raises(fr.CorruptCheckpointError, match="changed while they were read"):
        fr.update_weights_from_disk(model, path)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    monkeypatch.undo()
    fr.update_weights_from_disk(model, path)  # re-planned from the new stamps
    assert fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model)) == []


def test_scales_landing_on_one_address_keep_the_last_in_file_order(device):
    """Gate's and up's input scale of an expert share one slot: the later one wins (the
    loaders' rule), also when all scales are written in one launch on the GPU."""
    from fp8_reload.checkpoint.header import TensorInfo
    from fp8_reload.reload.stream import _write_scalars
    from fp8_reload.reload.targets import Target

    dst = torch.zeros(4, device=device)
    views = [dst[k % 4] for k in range(64)]
    targets = [Target(TensorInfo(f"s{k}", "a", torch.float32, (), 4 * k, 4), "scalar", [v])
               for k, v in enumerate(views)]
    _write_scalars(targets, [float(k) for k in range(64)])
    assert dst.tolist() == [60.0, 61.0, 62.0, 63.0]


def test_a_moe_layer_is_backed_up_in_pieces_in_the_order_it_is_written(ckpts, monkeypatch):
    """With a stream, a FusedMoE's slots are copied a piece at a time in the order the
    commit writes them (then any others), each piece both weights, its slots named on its
    last copy: each write waits for its own piece, not for the whole layer."""
    import fp8_reload.reload.backup as backup_mod
    import fp8_reload.reload.backup_plan as backup_plan

    model = fr.load_model(ckpts["fp8", 0])
    layer = next(m for _, m in model.named_modules() if isinstance(m, fr.FusedMoE))
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    per_slot = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 2 * per_slot)  # two slots a piece
    assert layer.num_local_experts == 8
    backup = backup_mod.Backup()
    for k, slot in enumerate([5, 4, 0, 1, 7]):  # the rest (2, 3, 6) come after, in order
        backup.written[id(layer), slot] = k
    pieces = backup_plan.pieces(layer, [w13, w2], None, backup.written)
    assert [piece for piece, _ in pieces] == [[5, 4], [0, 1], [7, 2], [3, 6]]
    copies = [c for _, cs in pieces for c in cs]
    assert [ends for *_, ends in copies if ends] == [[4, 5], [0, 1], [2, 7], [3, 6]]
    # each piece: both weights, one copy per run of adjacent slots
    assert [(t is w13, run) for _, t, run, _ in copies] == [
        (True, (4, 6)), (False, (4, 6)), (True, (0, 2)), (False, (0, 2)),
        (True, (2, 3)), (True, (7, 8)), (False, (2, 3)), (False, (7, 8)),
        (True, (3, 4)), (True, (6, 7)), (False, (3, 4)), (False, (6, 7))]
    # a filtered backup: only its slots, still in the order written
    filtered = backup_plan.pieces(layer, [w13, w2], [1, 5, 6], backup.written)
    assert [piece for piece, _ in filtered] == [[5, 1], [6]]


def test_the_backup_follows_the_order_the_commit_writes_in(ckpts):
    """`write_order`: streamed targets first in file order (the scales, written last,
    after them), a FusedMoE by its slots, each unit once."""
    from fp8_reload.reload.plan import open_checkpoint, plan_reload
    from fp8_reload.reload.targets import write_order

    model = fr.load_model(ckpts["fp8", 0])
    ckpt = open_checkpoint(model, ckpts["fp8", 0])
    _, targets = plan_reload(model, ckpt, None, False, model.mode.expand_units)
    order = write_order(targets)
    assert len(order) == len(set(order))
    streamed = [t for t in targets if t.kind in ("copy", "quant")]
    first = list(dict.fromkeys((t.module_name, s) for t in streamed for s in (t.slots or (None,))))
    assert order[:len(first)] == first
    assert {u for t in targets for u in ((t.module_name, s) for s in (t.slots or (None,)))} == set(order)


def test_a_failure_half_way_through_the_writes_restores_after_the_queued_ones(ckpts, monkeypatch):
    """The reload fails after some chunks' copies are queued on the side streams: the
    restore runs after them (not under them), and the model is exactly as before."""
    if not torch.cuda.is_available():
        pytest.skip("the side streams are a CUDA path")
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    model = fr.load_model(ckpts["fp8", 0], device="cuda")
    before = fr.snapshot(model)
    monkeypatch.setattr(to_device, "_write_out", raising_on_call(
        to_device._write_out, 6, RuntimeError("injected: the device went away")))
    with pytest.raises(fr.CommitError, match="injected"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_a_parse_made_while_its_files_were_fresh_settles_once_they_have(ckpts, tmp_path, monkeypatch):
    """Files reloaded right after they were written (fresh when parsed: a same-tick
    rewrite would keep their stamps) have their values checked and scales read on every
    reload; once a reload finds them settled (stamp unchanged, old enough, header bytes
    the same), what it reads is kept, and the reloads after it check nothing again."""
    import fp8_reload.reload.stream as stream_mod

    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    calls = []
    orig = stream_mod.has_bad_values
    monkeypatch.setattr(stream_mod, "has_bad_values", lambda t: calls.append(1) or orig(t))
    monkeypatch.setattr(files_mod, "SETTLED_NS", 10**18)  # every file fresh
    for _ in range(2):
        before = len(calls)
        fr.update_weights_from_disk(model, path)
        assert len(calls) > before  # fresh: checked every time
    monkeypatch.setattr(files_mod, "SETTLED_NS", 0)  # now they have settled
    fr.update_weights_from_disk(model, path)  # finds them settled: what it reads is kept
    before = len(calls)
    fr.update_weights_from_disk(model, path)
    assert len(calls) == before
    assert fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model)) == []
    # a NaN written in since (new stamps: a new parse, whose values are checked again)
    kept = fr.snapshot(model)
    _poke_nan(path, "model.layers.2.mlp.experts.5.down_proj.weight")
    with pytest.raises(fr.InvalidTensorError, match="NaN"):
        fr.update_weights_from_disk(model, path)
    assert fr.compare_states(kept, fr.snapshot(model), identity=True) == []


def test_every_reader_thread_takes_a_piece_of_a_small_chunk():
    """A filtered reload's chunk is one expert: cut for every reader thread (never below
    1 MiB), where 8 MiB pieces left it to one or two threads; a full reload's 64 MiB
    chunks keep their 8 MiB pieces."""
    threads = chunks_mod.READ_THREADS
    big = chunks_mod.piece_bytes(64 << 20)
    assert big == min(chunks_mod.PIECE_BYTES, max(1 << 20, -(-(64 << 20) // threads)))
    assert chunks_mod.piece_bytes(8 << 20) == max(1 << 20, -(-(8 << 20) // threads))
    assert chunks_mod.piece_bytes(100) == 1 << 20


def test_a_filtered_reload_keeps_no_copy_table():
    """Copy tables are kept for the next full reload, which lands the same copies; a
    filtered reload's differ from one rebalance to the next (kept, they piled up: the
    soak's live tensors grew on the H200)."""
    pytest.importorskip("triton")
    tables = to_device.RowTables()
    copies = (0, 1024, 64)
    first = tables.get(0, copies, "cpu", keep=False)
    assert first.rows == 1 and tables.tables == {}
    kept = tables.get(0, copies, "cpu")
    assert tables.get(0, copies, "cpu") is kept and len(tables.tables) == 1


@pytest.mark.parametrize("few", [to_device.FEW_ROWS, 0], ids=["copies", "tables"])
@pytest.mark.parametrize("register", ["always", "never"])
def test_a_filtered_reload_writes_a_few_views_with_a_copy_each(ckpts, tmp_path, monkeypatch, few, register):
    """A filtered chunk's few views are copied one by one, not through a copy table built
    and sent for it alone (`FEW_ROWS`); with no such limit they take the table. Both
    land bit for bit; full reloads keep their tables."""
    if not torch.cuda.is_available():
        pytest.skip("the copy tables are a CUDA path")
    monkeypatch.setattr(to_device, "FEW_ROWS", few)
    monkeypatch.setattr(to_device, "REGISTER", register)
    built = []
    get = to_device.RowTables.get
    monkeypatch.setattr(to_device.RowTables, "get", lambda self, *a: built.append(a) or get(self, *a))
    _reload_twice_and_compare(ckpts, tmp_path, "cuda", "fp8", SPEC)
    filtered = [a for a in built if a[3] is False]
    assert bool(filtered) == (few == 0)


def test_a_kept_plan_keeps_its_chunks_while_their_size_is_the_same(ckpts, monkeypatch):
    """A repeated full reload lands the chunks the one before laid out (`prepare`'s memo):
    laid out once per kept plan and chunk size, and the reloads land as a fresh load."""
    import fp8_reload.reload.stream as stream_mod

    laid = []

    def counting(*a, **k):
        laid.append(a[0])
        return make_chunks(*a, **k)

    monkeypatch.setattr(stream_mod, "make_chunks", counting)
    model = fr.load_model(ckpts["fp8", 0])
    for _ in range(3):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert len(laid) == 1
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert len(laid) == 3  # (another checkpoint's plan, then the small chunks of the kept one)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []
