"""Direct reads (``FP8_RELOAD_IO=direct``): the ring's chunks read with O_DIRECT.

The layout puts every span at its file offset's place within a block, so each read
starts, ends and lands on block boundaries; the last partial block of a file is read
buffered. Reloads through it are held to the invariant (bit for bit a fresh load, every
Parameter kept) with reader processes and reader threads, and must really bypass the
page cache where the file system allows O_DIRECT (here: whatever holds pytest's
temporary directory; a file system that refuses it is checked for the fallback).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import fp8_reload as fr
import fp8_reload.checkpoint.read_procs as read_procs
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.ring as ring_mod
from fp8_reload.checkpoint.header import TensorInfo
from fp8_reload.reload.chunks import DIRECT_ALIGN, make_chunks
from fp8_reload.reload.targets import Target
from fp8_reload.testing.io_paths import evict, resident_fraction, shard_files

from .conftest import copy_checkpoint, mix_checkpoints

A = DIRECT_ALIGN
SPEC = {1: [0, 3], 2: [5, 7]}


def _direct_allowed(directory) -> bool:
    probe = os.path.join(directory, "o_direct_probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * A)
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    finally:
        os.unlink(probe)
    os.close(fd)
    return hasattr(os, "O_DIRECT")


@pytest.fixture
def direct(monkeypatch):
    """Direct reads, in chunks of at most 16 KiB read in 4 KiB pieces through 2 slots (on a
    GPU: slots of 8 KiB, a chunk read in parts)."""
    monkeypatch.setattr(chunks_mod, "READ_IO", "direct")
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4 * A)
    monkeypatch.setattr(chunks_mod, "PART_BYTES", 2 * A)
    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", A)
    monkeypatch.setattr(chunks_mod, "MIN_PIECE_BYTES", A)
    monkeypatch.setattr(chunks_mod, "RING_SLOTS", 2)


def _target(offset, nbytes, file="a"):
    return Target(TensorInfo(f"t{offset}", file, torch.uint8, (nbytes,), offset, nbytes), "copy")


def test_an_aligned_chunk_puts_each_span_at_its_place_within_a_block():
    targets = [_target(100, 10), _target(110, 6), _target(5000, 4), _target(9000, 9000), _target(18000, 1)]
    (c,) = make_chunks(targets, chunk_bytes=1 << 20, align=A)
    assert c.spans == [(100, 16, 100), (5000, 4, A + 904), (9000, 9001, 2 * A + 808)]
    assert c.buffer_bytes % A == 0 and c.buffer_bytes >= c.extent
    ends = [0]
    for off, n, at in c.spans:
        assert at % A == off % A  # the block-rounded read lands where the span's bytes belong
        assert at - off % A >= ends[-1]  # after the previous span's last whole block
        ends.append(chunks_mod.round_up(at + n, A))
    assert [c.offset_of(t) for t in c.targets] == [100, 110, A + 904, 2 * A + 808, 2 * A + 808 + 9000]
    # unaligned (the default): packed, as before
    (packed,) = make_chunks(targets, chunk_bytes=1 << 20, align=1)
    assert packed.spans == [(100, 16, 0), (5000, 4, 16), (9000, 9001, 20)] and packed.buffer_bytes == 9021


@pytest.mark.parametrize("size", [18001, 20000, 5 * A, 6 * A + 100])
def test_direct_pieces_are_whole_blocks_and_the_files_last_partial_block_is_read_buffered(size):
    (c,) = make_chunks([_target(100, 16), _target(5000, 4), _target(9000, 9001)], chunk_bytes=1 << 20,
                       align=A)
    pieces = ring_mod._pieces(c, size)
    covered = bytearray(c.buffer_bytes)
    for off, n, at, direct in pieces:
        if direct:
            assert off % A == n % A == at % A == 0 and off + n <= size
        assert at - off in {at_ - off_ for off_, _, at_ in c.spans}  # a span's own shift
        for i in range(at, at + n):
            assert not covered[i], "two pieces write one byte"
            covered[i] = 1
    for _, n, at in c.spans:
        assert all(covered[at:at + n])
    assert any(not d for *_, d in pieces) == (size % A != 0 and size - size % A < 18001)


@pytest.mark.parametrize("part", [A, 2 * A, 3 * A])
@pytest.mark.parametrize("size", [18001, 20000, 5 * A, 6 * A + 100])
def test_the_parts_of_a_chunk_cover_its_spans_once_in_whole_blocks(size, part):
    """A chunk read in parts (a slot each): every byte of its spans in exactly one piece of one
    part, each piece inside its part's slot, direct pieces whole blocks."""
    (c,) = make_chunks([_target(100, 16), _target(5000, 4), _target(9000, 9001)], chunk_bytes=1 << 20,
                       align=A)
    covered = bytearray(c.buffer_bytes)
    parts = ring_mod.parts_of([c], part)
    assert sum(n for _, _, n in parts) == c.buffer_bytes and len(parts) == -(-c.buffer_bytes // part)
    for _, lo, n in parts:
        for off, m, at, direct in ring_mod._pieces(c, size, (lo, lo + n)):
            assert 0 <= at and at + m <= n
            if direct:
                assert off % A == m % A == at % A == 0 and off + m <= size
            for i in range(lo + at, lo + at + m):
                assert not covered[i], "two pieces write one byte"
                covered[i] = 1
    for _, n, at in c.spans:
        assert all(covered[at:at + n])


def _reload_and_compare(ckpts, tmp_path, kind, spec, device):
    """Reload seed 1 (whole, or `spec`'s experts) twice over seed 0: bit for bit what a
    fresh load of the same bytes gives, every Parameter kept. The first reload's report."""
    model = fr.load_model(ckpts[kind, 0], device=device)
    before = fr.snapshot(model)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    want = ckpts[kind, 1] if flt is None else mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1],
                                                              tmp_path / "mixed", flt)
    expected = fr.snapshot(fr.load_model(want, device=device))
    reports = [fr.update_weights_from_disk(model, ckpts[kind, 1], flt) for _ in range(2)]
    after = fr.snapshot(model)
    assert fr.compare_states(expected, after) == []
    assert after.ids == before.ids
    return reports[0]


@pytest.mark.parametrize("readers", ["processes", "threads"])
@pytest.mark.parametrize("spec", [None, SPEC], ids=["full", "filtered"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_a_direct_reload_equals_a_fresh_load(ckpts, tmp_path, direct, monkeypatch, device, kind, spec,
                                            readers):
    monkeypatch.setattr(read_procs, "READERS", readers)
    allowed = _direct_allowed(ckpts[kind, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error" if allowed else "ignore", RuntimeWarning)
        report = _reload_and_compare(ckpts, tmp_path, kind, spec, device)
    # (what the ring reads only: not headers, scales, a file's last partial block, nor the
    # tensors that loaders take: bf16 experts on a CPU, all a filtered reload reads there)
    ring = not (kind == "bf16" and spec is not None and device == "cpu")
    assert (report.bytes_direct > 0) == (allowed and ring)


def test_a_file_system_without_o_direct_is_read_through_the_page_cache_with_a_warning(
        ckpts, tmp_path, direct, monkeypatch):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "no-direct")
    monkeypatch.setattr(ring_mod, "reopen_direct", lambda handle: None)
    model = fr.load_model(ckpts["fp8", 0])
    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT.*page cache"):
        report = fr.update_weights_from_disk(model, path)
    assert report.bytes_direct == 0
    assert fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model)) == []


def test_direct_reads_leave_the_tensors_out_of_the_page_cache(tmp_path, direct, monkeypatch):
    """What direct is for: a checkpoint read once does not push other pages out. Buffered
    reads of the same evicted files cache them whole. (A checkpoint of megabytes: the
    kernel's readahead around a header takes in the whole of a tiny one.)"""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", 256 << 10)
    path = fr.write_checkpoint(tmp_path / "small", fr.MoEConfig.preset("small", num_layers=2), seed=1)
    if not _direct_allowed(path):
        pytest.skip("the file system of pytest's temporary directory refuses O_DIRECT")
    files = shard_files(path)
    model = fr.load_model(path)
    fresh = fr.snapshot(model)
    got = {}
    for io in ("direct", "buffered"):
        monkeypatch.setattr(chunks_mod, "READ_IO", io)
        evict(files)
        before = resident_fraction(files)
        if before < 0:
            pytest.skip("mincore is not available here")
        report = fr.update_weights_from_disk(model, path)
        got[io] = (before, resident_fraction(files), report.bytes_direct)
        assert fr.compare_states(fresh, fr.snapshot(model)) == []
    (d_before, d_after, d_bytes), (b_before, b_after, b_bytes) = got["direct"], got["buffered"]
    assert d_bytes > 0 and b_bytes == 0
    assert d_before < 0.05 and b_before < 0.05
    # headers (and what readahead takes around them), scales, a file's last partial block
    assert d_after < 0.2 and b_after > 0.95, got


@pytest.mark.parametrize("direct", [False, True])
def test_the_read_limit_reads_every_byte_of_every_file(ckpts, direct):
    """`io_paths.page_cache_read`, the limit the benchmarks measure beside the engine: with
    O_DIRECT each file starts on a block boundary of the buffer."""
    from fp8_reload.testing.io_paths import direct_bytes, page_cache_read

    files = shard_files(ckpts["bf16", 1])
    raw = torch.empty(direct_bytes(files) + A, dtype=torch.uint8)
    buffer = raw[-raw.data_ptr() % A:][:direct_bytes(files)]
    evict(files)
    assert page_cache_read(files, buffer, threads=3, chunk=2 * A, direct=direct) == \
        sum(os.path.getsize(f) for f in files)
    at = 0
    for f in files:
        data = open(f, "rb").read()
        assert bytes(buffer[at:at + len(data)].numpy()) == data
        at += chunks_mod.round_up(len(data), A) if direct else len(data)
    with pytest.raises(ValueError, match="bytes needed"):
        page_cache_read(files, buffer[:100], direct=direct)
