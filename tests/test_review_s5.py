"""Review s5: the streaming backup's ordering against the commit's writes, on CPU.

The CUDA streams are emulated: an event remembers how many backup copies had been
queued on the backup stream when it was recorded; a write may run once the writes
stream has waited for an event recorded after every copy of the bytes it overwrites
(CUDA streams run in order). The commit's waits are replayed exactly as
`stream._commit_cuda` / `to_device._land` make them (every target of a chunk, then its
one scatter; the scales; the loaders on the current stream)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.backup as bk
import fp8_reload.reload.backup_plan as bplan
import fp8_reload.reload.chunks as chunks_mod
from fp8_reload.layers import FusedMoE
from fp8_reload.reload.chunks import make_chunks
from fp8_reload.reload.plan import open_checkpoint, plan_reload
from fp8_reload.reload.targets import write_order

from .conftest import fake_cuda_streams


class _Stream:
    device = "cpu"

    def wait_stream(self, other):
        pass


@pytest.fixture
def emulated(monkeypatch):
    """Backup with a (fake) side stream on CPU: returns the list of the copies queued,
    in queue order; events carry `.pos` (copies queued before they were recorded)."""
    queued: list[torch.Tensor] = []

    class Event:
        def record(self, stream=None):
            self.pos = len(queued)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def keep(self, src, arena, fresh):
        queued.append(src.clone())
        return queued[-1]

    monkeypatch.setattr(bk.Backup, "_keep", keep)
    monkeypatch.setattr(bk, "on_cuda", lambda model: True)
    monkeypatch.setattr(bk, "staging", types.SimpleNamespace(
        arena=lambda *a: types.SimpleNamespace(reset=lambda n: None), aligned=lambda n: n,
        DeviceArena=lambda device: types.SimpleNamespace(reset=lambda n: None)))
    return queued


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` spans in its storage (all of them, for a dense or permuted-dense one)."""
    assert all(s >= 0 for s in t.stride())
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _sources(backup, queued) -> list[tuple[int, int, int]]:
    """[(position in the queue, first byte, end byte)] of what each backup copy holds."""
    out = []
    for tensor, run, copy in backup.copies:
        k = next(k for k, q in enumerate(queued)
                 if q.data_ptr() <= copy.data_ptr() < q.data_ptr() + q.numel() * q.element_size())
        out.append((k, *_span(bplan.piece_of(tensor, run))))
    return out


def _covered_by(span, sources, upto: int) -> bool:
    """Whether every byte of `span` is in one of the first `upto` queued copies."""
    lo, hi = span
    pieces = sorted((a, b) for k, a, b in sources if k < upto and a < hi and b > lo)
    at = lo
    for a, b in pieces:
        if a > at:
            return False
        at = max(at, b)
    return at >= hi


def _replay(model, backup, targets, queued, quant_writes=False):
    """The commit's waits and writes; returns [(what, span, copies done before it)]
    of every write, checked against `queued` afterwards."""
    done = {"copy": 0}  # copies the writes stream has waited for

    def writable(module, slots=()):
        for slot in slots or (None,):
            event = backup.event_for(module, slot)
            if event is not None:
                done["copy"] = max(done["copy"], event.pos)

    writes = []
    streamed = [t for t in targets if t.kind in ("copy", "quant")]
    for chunk in make_chunks(streamed):
        for t in chunk.targets:
            writable(t.module, t.slots)
        for t in chunk.targets:  # the chunk's one scatter, after all of its waits
            if t.kind == "copy":
                writes += [(t.info.name, _span(v), done["copy"]) for v in t.views]
            elif quant_writes:
                layer = t.module
                for s in t.slots:
                    for p in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
                        writes.append((f"{t.module_name}.{p}[{s}]", _span(getattr(layer, p).data[s]),
                                       done["copy"]))
    scalars = [t for t in targets if t.kind == "scalar"]
    for t in scalars:
        writable(t.module)
    for t in scalars:
        writes += [(t.info.name, _span(v), done["copy"]) for v in t.views]
    backup.complete()  # (what the transaction does before post-processing)
    return writes


def _check(writes, backup, queued):
    sources = _sources(backup, queued)
    bad = [(name, n) for name, span, n in writes if not _covered_by(span, sources, n)]
    missing = [name for name, span, n in writes if not _covered_by(span, sources, len(queued))]
    return bad, missing


EP = {"num_local_experts": 6, "expert_slots": {0: [3], 2: [0, 5], 5: [1], 7: [2, 4]}}


def _setup(ckpts, kind, spec, process_all, **moe_kwargs):
    model = fr.load_model(ckpts[kind, 0], **moe_kwargs)
    path = ckpts[kind, 1]
    ckpt = open_checkpoint(model, path)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    names, targets = plan_reload(model, ckpt, flt, False, model.mode.expand_units)
    return model, names, targets


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("spec", [None, {1: [0, 3], 2: [5, 7]}])
@pytest.mark.parametrize("process_all", [False, True])
@pytest.mark.parametrize("lookahead", [0, 1 << 30])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_every_write_waits_for_the_backup_of_its_bytes(ckpts, emulated, monkeypatch, kind, spec,
                                                      process_all, lookahead, chunk):
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(bk, "LOOKAHEAD", lookahead)
    model, names, targets = _setup(ckpts, kind, spec, process_all)
    backup = bk.capture_backup(model, names, process_all, order=write_order(targets), stream=_Stream())
    writes = _replay(model, backup, targets, emulated)
    bad, missing = _check(writes, backup, emulated)
    assert not missing, missing[:5]
    assert not bad, bad[:5]


def test_the_first_piece_is_queued_before_the_small_tensors(ckpts, emulated, monkeypatch):
    """On a side stream the backup's first piece goes first (the commit's first writes wait
    for it; the small tensors' batched copies cost host time before it otherwise), and the
    events of that piece are recorded after the small copies, which they then cover too."""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(bk, "LOOKAHEAD", 0)
    model, names, targets = _setup(ckpts, "fp8", None, False)
    backup = bk.capture_backup(model, names, False, order=write_order(targets), stream=_Stream())
    n_small = len(backup.small)
    head = len(emulated) - n_small  # the first piece's copies, queued by `start`
    assert head >= 1 and n_small >= 1
    assert all(copy is q for (_, _, copy), q in zip(backup.big, emulated[:head], strict=True))
    assert all(flat is q for (_, flat), q in zip(backup.small, emulated[head:], strict=True))
    first_events = [backup.recorded[k] for k in backup.marks if k < head]
    assert first_events and all(e.pos == len(emulated) for e in first_events)
    assert all(e.pos == len(emulated) for e in backup.events.values())


@pytest.mark.parametrize("spec", [None, {1: [0, 3], 2: [2, 7]}, {2: [7]}])
@pytest.mark.parametrize("lookahead", [0, 4096, 1 << 30])
@pytest.mark.parametrize("chunk", [4096, 20000])
def test_every_write_waits_with_redundant_expert_slots(ckpts, emulated, monkeypatch, spec, lookahead, chunk):
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(bk, "LOOKAHEAD", lookahead)
    model, names, targets = _setup(ckpts, "fp8", spec, False, **EP)
    backup = bk.capture_backup(model, names, False, order=write_order(targets), stream=_Stream())
    writes = _replay(model, backup, targets, emulated)
    bad, missing = _check(writes, backup, emulated)
    assert not missing, missing[:5]
    assert not bad, bad[:5]


@pytest.mark.parametrize("spec", [None, {1: [0, 3]}])
def test_a_big_whole_tensor_of_a_pieced_moe_layer_is_backed_up_before_slot_writes(
        ckpts, emulated, monkeypatch, spec):
    """A FusedMoE tensor other than w13/w2 above SMALL_BYTES (here: every tensor, with
    SMALL_BYTES = 0; in practice a [E, 2] scale of > 8192 local experts) is copied whole,
    by the module's first write (it went last: `written[(module, None)]`, which a
    FusedMoE never has, its units being slots), since the quantize-on-load path writes its slot rows after
    waiting for the slot's piece only."""
    monkeypatch.setattr(bplan, "SMALL_BYTES", 0)
    monkeypatch.setattr(bk, "LOOKAHEAD", 0)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    model, names, targets = _setup(ckpts, "bf16", spec, False)
    for t in targets:  # as with FP8_RELOAD_STREAM_QUANT=1 on a GPU with Triton
        if isinstance(t.module, FusedMoE) and t.kind == "loader" and t.shard is not None:
            t.kind = "quant"
    backup = bk.capture_backup(model, names, False, order=write_order(targets), stream=_Stream())
    writes = _replay(model, backup, targets, emulated, quant_writes=True)
    bad, missing = _check(writes, backup, emulated)
    assert not missing, missing[:5]
    assert not bad, bad[:5]


# ---- `to_device._land` on CPU, its streams emulated ----

from fp8_reload.checkpoint.header import TensorInfo  # noqa: E402
from fp8_reload.reload import to_device  # noqa: E402
from fp8_reload.reload.chunks import Chunk  # noqa: E402
from fp8_reload.reload.targets import Target  # noqa: E402


@pytest.fixture
def cpu_streams(monkeypatch):
    fake_cuda_streams(monkeypatch, to_device)


def _chunk(sizes):
    """A chunk of fp8 tensors of `sizes` bytes back to back, its bytes, their destinations."""
    dsts = [torch.zeros(n + 8, dtype=torch.uint8) for n in sizes]
    targets, at = [], 0
    for k, n in enumerate(sizes):
        info = TensorInfo(f"t{k}", "f.safetensors", torch.float8_e4m3fn, (n,), at, n)
        targets.append(Target(info, "copy", [dsts[k][4:4 + n].view(torch.float8_e4m3fn)]))
        at += n
    chunk = Chunk("f.safetensors", targets, [(0, at, 0)])
    src = torch.arange(at, dtype=torch.int64).remainder(120).to(torch.uint8) + 1
    return chunk, src, dsts


def _land_one(chunk, src, tables=None, keep=True):
    slots = to_device.DeviceSlots()
    slots.reserve(chunk.extent, "cpu")
    checks: list = []
    to_device._land(chunk, src, 0, slots, tables or to_device.RowTables(), keep,
                    lambda module, slots=(): None, checks, None)
    return checks


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "filtered"])
@pytest.mark.parametrize("views", [2, to_device.FEW_ROWS + 1])
def test_a_chunk_takes_a_copy_table_unless_it_is_a_few_views_not_kept(cpu_streams, monkeypatch, keep, views):
    """Kept tables (a full reload's) and chunks of many views land through one copy table;
    a filtered chunk of at most `FEW_ROWS` views is copied view by view (building and
    sending its table cost more host time than the copies). Either way, the same bytes."""
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton.runtime import INTERPRET

    if not INTERPRET:
        pytest.skip("CPU tensors reach Triton's interpreter only (on a GPU: test_stream's few-views test)")
    monkeypatch.setattr(to_device, "on_triton", lambda t: True)  # (the kernel runs interpreted)
    tables = to_device.RowTables()
    built = []
    monkeypatch.setattr(tables, "get", lambda *a: built.append(a) or to_device.RowTables.get(tables, *a))
    chunk, src, dsts = _chunk([8 + 4 * k for k in range(views)])
    _land_one(chunk, src, tables, keep)
    assert bool(built) == (keep or views > to_device.FEW_ROWS)
    at = 0
    for k, d in enumerate(dsts):
        n = 8 + 4 * k
        assert torch.equal(d[4:4 + n], src[at:at + n]) and not d[:4].any() and not d[4 + n:].any()
        at += n


def test_a_gpu_reload_lands_its_chunks_without_triton(cpu_streams, monkeypatch):
    """Triton is an optional extra (`gpu`): without it `_land` copies each tensor (it
    imported the copy kernel for every chunk, and every streaming reload on a GPU
    failed with a CommitError)."""
    import sys

    monkeypatch.setitem(sys.modules, "fp8_reload.kernels.triton.copy_rows", None)  # as if no triton
    chunk, src, dsts = _chunk([8, 16])
    _land_one(chunk, src)
    assert torch.equal(dsts[0][4:12], src[:8]) and torch.equal(dsts[1][4:20], src[8:24])


@pytest.mark.parametrize("fail_at", [3, 10, 25])
def test_a_backup_copy_failing_inside_the_commit_leaves_every_earlier_write_restorable(
        ckpts, emulated, monkeypatch, fail_at):
    """`_queue` raising from `event_for` (inside `_land`'s `writable`): the chunk asking
    for it is not scattered, and every write queued before is covered by `copies` (what
    `restore` puts back)."""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(bk, "LOOKAHEAD", 0)
    model, names, targets = _setup(ckpts, "fp8", None, False)
    backup = bk.capture_backup(model, names, False, order=write_order(targets), stream=_Stream())
    keep = bk.Backup._keep
    started = len(emulated)  # (the copies `start` queued: the first piece, the small tensors)

    def failing(self, src, arena, fresh):
        if len(emulated) == started + fail_at:
            raise RuntimeError("injected: pinned arena exhausted")
        return keep(self, src, arena, fresh)

    monkeypatch.setattr(bk.Backup, "_keep", failing)
    writes = []
    with pytest.raises(RuntimeError, match="injected"):
        done = 0
        for chunk in make_chunks([t for t in targets if t.kind in ("copy", "quant")]):
            for t in chunk.targets:
                for slot in t.slots or (None,):
                    event = backup.event_for(t.module, slot)
                    if event is not None:
                        done = max(done, event.pos)
            writes += [(t.info.name, _span(v), done) for t in chunk.targets for v in t.views]
    assert writes  # some chunks were written before the failure
    bad, missing = _check(writes, backup, emulated)
    assert not bad and not missing
