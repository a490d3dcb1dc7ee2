"""Review s20: bf16 linears quantized in the stream (13254e0), driven on the emulated GPU path
(`test_review_s7.gpu_path`: streams and events emulated, the model reported as a CUDA device
with Triton, the experts' quantization in Triton's interpreter).

Found: a loaded but unprocessed model, reloaded, kept its old staged linears (fixed). What is
pinned here: a streamed linear whose quantization fails part way (an exception, a
Ctrl-C) is restored with its weight, scale and state, and a later reload is right; bad values
in any shard roll back; checkpoints whose linear shards are in other files, in reverse order
or apart take the loader path (or stream) and equal a fresh load, also alternating with a
checkpoint whose shards stream, and with small chunks; custom filters that name one shard
of a merged linear reload it whole; repeated reloads reuse kept plans correctly."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fp8_reload as fr
import fp8_reload.reload.backup as bk
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as tx
from fp8_reload.checkpoint import INDEX_FILE
from fp8_reload.layers import Fp8Linear
from fp8_reload.processing import FixedFp8LinearMethod
from fp8_reload.reload.filters import units
from fp8_reload.reload.plan import open_checkpoint, plan_reload

from .conftest import copy_checkpoint, mix_checkpoints, rewrite_tensor, unchanged
from .test_review_s7 import _cpu_tensors_reach_triton, gpu_path  # noqa: F401  (a fixture)

GATE_UP = "model.layers.0.mlp.gate_up_proj"
GATE = "model.layers.0.mlp.gate_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
SHARED_GATE = "model.layers.1.mlp.shared_experts.gate_proj.weight"
SHARED_UP = "model.layers.1.mlp.shared_experts.up_proj.weight"
EXPERT_UP = "model.layers.2.mlp.experts.3.up_proj.weight"


@pytest.fixture(autouse=True)
def _triton_interpreter(request):
    if not request.node.name.startswith("test_cuda"):  # (the emulated GPU path: on CPU tensors)
        _cpu_tensors_reach_triton("bf16")


def _fresh(path) -> fr.Snapshot:
    return fr.snapshot(fr.load_model(path))


def _kinds(model, path, flt=None) -> dict[str, str]:
    _, targets = plan_reload(model, open_checkpoint(model, path), flt, True, model.mode.expand_units)
    return {t.info.name: t.kind for t in targets}


def _weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def _write_ordered(file: Path, tensors: list[tuple[str, torch.Tensor]], odd: bool = False) -> None:
    """A safetensors file whose data regions are in the order of `tensors` (save_file sorts);
    `odd`: a header of odd length (every tensor at an odd file offset)."""
    header, data, at = {"__metadata__": {"format": "pt"}}, [], 0
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
    for name, t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8 + (1 if odd else 0))
    file.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(data))


def _reorder(src: Path, dst: Path, name_order, odd: bool = False) -> Path:
    """`src` copied to `dst`, the shard of the first name in `name_order` rewritten with the
    names of `name_order` in that order at its start (then the rest, as they were)."""
    path = copy_checkpoint(src, dst)
    wm = _weight_map(path)
    fname = wm[name_order[0]]
    tensors = load_file(str(path / fname))
    rest = [n for n in tensors if n not in name_order]
    _write_ordered(path / fname, [(n, tensors[n]) for n in [*name_order, *rest]], odd)
    return path


def _move(src: Path, dst: Path, name: str, to_file: str) -> Path:
    """`src` copied to `dst` with tensor `name` moved into shard `to_file`."""
    from safetensors.torch import save_file

    path = copy_checkpoint(src, dst)
    wm = _weight_map(path)
    old = wm[name]
    a, b = load_file(str(path / old)), load_file(str(path / to_file))
    b[name] = a.pop(name)
    save_file(a, str(path / old), metadata={"format": "pt"})
    save_file(b, str(path / to_file), metadata={"format": "pt"})
    wm[name] = to_file
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return path


# ---- faults inside a streamed linear's quantization ----


def _failing_quantize(monkeypatch, at, exc: BaseException, after_rows: bool = True):
    """`quantize_shards_` raises `exc` on its `at`-th call (0: the first; or on the layer `at`
    names), after writing the first shard's rows (`after_rows`), while armed."""
    import fp8_reload.processing.linear as linear_mod

    real_block = linear_mod.by_row_blocks_
    calls, armed = [], [True]
    real = FixedFp8LinearMethod.quantize_shards_

    def quantize(self, layer, shards):
        calls.append(layer)
        hit = layer is at if isinstance(at, torch.nn.Module) else len(calls) == at + 1
        if not (armed[0] and hit):
            return real(self, layer, shards)
        done = []

        def block_then_fail(dst, src, fn):
            if done and after_rows:
                raise exc
            real_block(dst, src, fn)
            done.append(1)
            if not after_rows:
                raise exc

        monkeypatch.setattr(linear_mod, "by_row_blocks_", block_then_fail)
        try:
            return real(self, layer, shards)
        finally:
            monkeypatch.setattr(linear_mod, "by_row_blocks_", real_block)

    monkeypatch.setattr(FixedFp8LinearMethod, "quantize_shards_", quantize)
    return calls, armed


@pytest.mark.parametrize("backup", ["host", "device"])
@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_fault_inside_a_streamed_merged_linear_restores_it_and_the_next_reload_is_right(
        ckpts, gpu_path, monkeypatch, backup, exc):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    assert _kinds(model, ckpts["bf16", 1])[GATE] == "quant"
    before = fr.snapshot(model)
    gate_up = dict(model.named_modules())[GATE_UP]
    # the merged gate_up of layer 0: its first shard's rows are written, then the fault
    calls, armed = _failing_quantize(monkeypatch, gate_up, exc)
    with pytest.raises((fr.CommitError, KeyboardInterrupt)):
        fr.update_weights_from_disk(model, ckpts["bf16", 1], backup=backup)
    assert calls and calls[-1] is gate_up
    assert unchanged(model, before) == []
    assert not gate_up.needs_processing and gate_up.kernel_layout and gate_up.staged == {}
    armed[0] = False
    fr.update_weights_from_disk(model, ckpts["bf16", 1], backup=backup)
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


@pytest.mark.parametrize("at", [0, 7])
def test_a_fault_in_a_later_linear_restores_the_linears_already_quantized(ckpts, gpu_path, monkeypatch,  # noqa: F811
                                                                          at):
    monkeypatch.setattr(bk, "LOOKAHEAD", 0)
    model = fr.load_model(ckpts["bf16", 0])
    before = fr.snapshot(model)
    calls, armed = _failing_quantize(monkeypatch, at, RuntimeError("injected"), after_rows=False)
    with pytest.raises(fr.CommitError, match="injected"):
        fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert len(calls) == at + 1
    assert unchanged(model, before) == []
    armed[0] = False
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


def test_a_fault_in_post_processing_after_linears_streamed_restores_them(ckpts, gpu_path, monkeypatch):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    before = fr.snapshot(model)
    real = FixedFp8LinearMethod.process_weights_after_loading
    seen = []

    def process(self, layer):
        seen.append(layer)
        if len(seen) == 5:
            raise RuntimeError("injected in processing")
        return real(self, layer)

    monkeypatch.setattr(FixedFp8LinearMethod, "process_weights_after_loading", process)
    with pytest.raises(fr.CommitError, match="injected in processing"):
        fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert unchanged(model, before) == []
    monkeypatch.setattr(FixedFp8LinearMethod, "process_weights_after_loading", real)
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


# ---- bad values in either shard of a streamed merged linear ----


@pytest.mark.parametrize("name,value", [(GATE, float("nan")), (UP, float("inf")), (SHARED_UP, float("-inf")),
                                        ("model.layers.2.self_attn.o_proj.weight", float("nan"))],
                         ids=["gate-nan", "up-inf", "shared-up-minus-inf", "o-proj-nan"])
def test_a_bad_value_in_any_shard_of_a_streamed_linear_rolls_back(ckpts, gpu_path, tmp_path, name,  # noqa: F811
                                                                  value):
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, name, lambda t: t.index_fill(0, torch.tensor([2]), value))
    model = fr.load_model(ckpts["bf16", 0])
    assert _kinds(model, path)[name] == "quant"
    before = fr.snapshot(model)
    for _ in range(2 if name == GATE else 1):  # (the same bad files again: checked, refused again)
        with pytest.raises(fr.InvalidTensorError, match=name.rsplit(".", 2)[0].rsplit(".", 1)[-1]):
            fr.update_weights_from_disk(model, path)
        assert unchanged(model, before) == []
    fr.update_weights_from_disk(model, ckpts["bf16", 1])  # a later reload is right
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


# ---- checkpoints whose linear shards are elsewhere ----


def _variants(ckpts, tmp_path):
    seed1 = ckpts["bf16", 1]
    wm = _weight_map(seed1)
    other = sorted({f for f in wm.values() if f != wm[UP]})[0]
    return {
        "other-file": _move(seed1, tmp_path / "moved", UP, other),
        "reversed": _reorder(seed1, tmp_path / "reversed", [UP, GATE]),
        "apart": _reorder(seed1, tmp_path / "apart", [GATE, "model.layers.0.mlp.down_proj.weight", UP]),
        "shared-reversed": _reorder(seed1, tmp_path / "shared", [SHARED_UP, SHARED_GATE]),
    }


WANT_KIND = {"other-file": "loader", "reversed": "quant", "apart": "loader", "shared-reversed": "quant"}


@pytest.mark.parametrize("variant", list(WANT_KIND))
def test_linear_shards_in_other_files_reversed_or_apart_equal_a_fresh_load(ckpts, gpu_path, tmp_path,  # noqa: F811
                                                                          variant):
    path = _variants(ckpts, tmp_path)[variant]
    model = fr.load_model(ckpts["bf16", 0])
    kinds = _kinds(model, path)
    gate, up = (SHARED_GATE, SHARED_UP) if variant.startswith("shared") else (GATE, UP)
    assert kinds[gate] == kinds[up] == WANT_KIND[variant]
    want = _fresh(path)
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), want) == []  # the same values, moved
    for src in (path, ckpts["bf16", 0]):  # streamed and not, in turns
        fr.update_weights_from_disk(model, src)
        assert fr.compare_states(_fresh(src), fr.snapshot(model)) == [], src


@pytest.mark.parametrize("chunk_bytes", [4096, 8192, 12288, 24576])
def test_chunk_sizes_around_a_merged_linear_equal_a_fresh_load(ckpts, gpu_path, monkeypatch,  # noqa: F811
                                                              chunk_bytes):
    """gate_up of layer 0 is 2 x 12288 bytes, a shared expert's 2 x 4096: below, at and above
    what streams (a linear of at most one chunk)."""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk_bytes)
    cap = chunk_bytes
    model = fr.load_model(ckpts["bf16", 0])
    kinds = _kinds(model, ckpts["bf16", 1])
    assert kinds[GATE] == kinds[UP] == ("quant" if 2 * 12288 <= cap else "loader")
    assert kinds[SHARED_GATE] == kinds[SHARED_UP] == ("quant" if 2 * 4096 <= cap else "loader")
    for src in (ckpts["bf16", 1], ckpts["bf16", 0]):
        fr.update_weights_from_disk(model, src)
        assert fr.compare_states(_fresh(src), fr.snapshot(model)) == []


# ---- filters ----


@pytest.mark.parametrize("names", [[GATE], [SHARED_UP], [SHARED_GATE, EXPERT_UP],
                                   ["model.layers.2.self_attn.q_proj.weight"]],
                         ids=["gate", "shared-up", "shared-gate-and-an-expert", "q-proj"])
def test_a_custom_filter_naming_one_shard_reloads_the_whole_linear(ckpts, gpu_path, tmp_path, names):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    before = fr.snapshot(model)
    picked = set(names)
    flt = picked.__contains__
    kinds = _kinds(model, ckpts["bf16", 1], flt)
    assert {k for n, k in kinds.items() if n in picked} == {"quant"}
    report = fr.update_weights_from_disk(model, ckpts["bf16", 1], flt)
    assert report.tensors_loaded == len(kinds) >= len(names)
    unit_of = units(model)[0]
    touched = {unit_of[n] for n in names}
    mixed = mix_checkpoints(ckpts["bf16", 0], ckpts["bf16", 1], tmp_path / "mixed",
                            lambda n: unit_of[n] in touched)
    assert fr.compare_states(_fresh(mixed), fr.snapshot(model)) == []
    assert fr.compare_states(before, _fresh(ckpts["bf16", 0])) == []


def test_an_expert_filter_leaves_the_linears_alone(ckpts, gpu_path, monkeypatch):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    calls = []
    real = FixedFp8LinearMethod.quantize_shards_
    monkeypatch.setattr(FixedFp8LinearMethod, "quantize_shards_",
                        lambda self, layer, shards: calls.append(layer) or real(self, layer, shards))
    before = fr.snapshot(model)
    fr.update_weights_from_disk(model, ckpts["bf16", 1], fr.generate_weight_name_filter({1: [0, 3], 2: [7]}))
    assert calls == []
    after = fr.snapshot(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    for k in after.tensors:
        if any(k.startswith(n + ".") for n in linears):
            assert torch.equal(after.tensors[k], before.tensors[k]), k


# ---- repeated reloads (kept plans, cached targets) ----


def test_repeated_full_and_filtered_reloads_alternate_correctly(ckpts, gpu_path, tmp_path):  # noqa: F811
    model = fr.load_model(ckpts["bf16", 0])
    flt = {GATE, SHARED_UP}.__contains__
    seq = [(ckpts["bf16", 1], None), (ckpts["bf16", 0], flt), (ckpts["bf16", 0], None),
           (ckpts["bf16", 1], flt), (ckpts["bf16", 1], None), (ckpts["bf16", 0], None)]
    state = ckpts["bf16", 0]
    for k, (src, f) in enumerate(seq):
        fr.update_weights_from_disk(model, src, f)
        if f is None:
            state = src
            assert fr.compare_states(_fresh(src), fr.snapshot(model)) == [], k
        else:
            touched = {GATE_UP, "model.layers.1.mlp.shared_experts.gate_up_proj"}
            mixed = mix_checkpoints(state, src, tmp_path / f"mix{k}",
                                    lambda n, touched=touched: model.resolve(n)[1] in touched)
            assert fr.compare_states(_fresh(mixed), fr.snapshot(model)) == [], k
            state = mixed


# ---- a model never processed ----


def _built(path) -> fr.FP8MoEModel:
    from fp8_reload.processing.modes import get_mode

    ckpt = fr.Checkpoint(path)
    model = fr.FP8MoEModel(ckpt.config, get_mode("fixed"), ckpt.kind)
    model.eval()
    return model


def test_a_full_reload_of_a_model_built_but_never_loaded_equals_a_fresh_load(ckpts, gpu_path):  # noqa: F811
    model = _built(ckpts["bf16", 0])
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


@pytest.mark.parametrize("what", ["linears", "everything"])
def test_a_full_reload_of_a_model_loaded_but_never_processed_equals_a_fresh_load(
        ckpts, gpu_path, what):  # noqa: F811
    """Found by this review (bug of 13254e0, fixed): the linears given to `load_weights`
    (staged, as sglang's loading does) and the model reloaded before its post-processing. The
    reload streamed and quantized the new linears in place; post-processing then found the old
    staged shards and quantized them over the new values: the old checkpoint's linears won,
    silently. `quantize_shards_` now drops what was staged before, and so does the stream's
    quantization of an expert (its staged pieces did the same before 13254e0)."""
    _cpu_tensors_reach_triton("bf16")
    model = _built(ckpts["bf16", 0])
    ckpt = fr.Checkpoint(ckpts["bf16", 0])
    names = [n for n in ckpt.names if what == "everything" or "experts." not in n]
    model.load_weights(list(ckpt.read(names)))
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


# ---- every streamed linear write waits for the backup of what it overwrites ----


@pytest.mark.parametrize("small_bytes", [0, 1 << 16], ids=["linears-big", "linears-small"])
@pytest.mark.parametrize("chunk", [8192, 24576, 1 << 20])
@pytest.mark.parametrize("spec", [None, "linear"])
def test_every_streamed_linear_quantization_waits_for_its_backup(ckpts, monkeypatch, small_bytes, chunk,
                                                                 spec):
    """`test_review_s5`'s emulated backup stream: a quant linear's writes (its whole weight and
    scale, `quantize_shards_`) come after the events `_write_out` waited for."""
    import fp8_reload.reload.backup_plan as bplan
    from fp8_reload.reload.chunks import make_chunks
    from fp8_reload.reload.targets import write_order

    from . import test_review_s5 as s5

    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(bk, "LOOKAHEAD", 0)
    monkeypatch.setattr(bplan, "SMALL_BYTES", small_bytes)
    model = fr.load_model(ckpts["bf16", 0])
    queued = s5.emulated.__wrapped__(monkeypatch)
    flt = None if spec is None else {GATE, SHARED_UP, "model.layers.2.self_attn.q_proj.weight"}.__contains__
    ckpt = open_checkpoint(model, ckpts["bf16", 1])
    names, targets = plan_reload(model, ckpt, flt, True, model.mode.expand_units)
    assert any(t.kind == "quant" and isinstance(t.module, Fp8Linear) for t in targets)
    backup = bk.capture_backup(model, names, False, order=write_order(targets), stream=s5._Stream())
    done = {"n": 0}

    def writable(module, slots=()):
        for slot in slots or (None,):
            event = backup.event_for(module, slot)
            if event is not None:
                done["n"] = max(done["n"], event.pos)

    writes = []
    for c in make_chunks([t for t in targets if t.kind in ("copy", "quant")]):
        for t in c.targets:
            writable(t.module, t.slots)
        for t in c.targets:
            if t.kind == "quant" and isinstance(t.module, Fp8Linear):
                for p in ("weight", "weight_scale"):
                    writes.append((f"{t.module_name}.{p}", s5._span(getattr(t.module, p).data), done["n"]))
    backup.complete()
    assert writes
    bad, missing = s5._check(writes, backup, queued)
    assert not missing, missing[:5]
    assert not bad, bad[:5]


@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_a_streamed_linear_at_odd_file_offsets_equals_a_fresh_load(ckpts, gpu_path, tmp_path,  # noqa: F811
                                                                   monkeypatch, io):
    """A header of odd length: every bf16 shard at an odd offset (laid at its file offset's place
    in a block for direct reads, `Chunk.source` then copies it aligned)."""
    monkeypatch.setattr(chunks_mod, "READ_IO", io)
    path = _reorder(ckpts["bf16", 1], tmp_path / "odd", [UP, GATE], odd=True)
    model = fr.load_model(ckpts["bf16", 0])
    assert _kinds(model, path)[GATE] == "quant"
    fr.update_weights_from_disk(model, path)
    assert fr.compare_states(_fresh(ckpts["bf16", 1]), fr.snapshot(model)) == []


# ---- every shard "registered" (a host copy of the file for its mapping): windows, not the ring ----


@pytest.fixture
def registered_quant(monkeypatch):
    from .test_loader_read import _HostCopy

    monkeypatch.setattr(tx, "registered_files",
                        lambda model, ckpt, read: {f: _HostCopy(ckpt.path / f) for f in read})
    monkeypatch.setattr(tx, "registered_now", lambda model, ckpt, files: set(files))


@pytest.mark.parametrize("chunk_bytes,fault", [(None, True), (8192, False)],
                         ids=["all-stream-after-a-fault", "some-loaders-beside"])
def test_registered_windows_stream_linears_and_equal_a_fresh_load(ckpts, gpu_path, registered_quant,  # noqa: F811
                                                                   monkeypatch, chunk_bytes, fault):
    if chunk_bytes:
        monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk_bytes)
    model = fr.load_model(ckpts["bf16", 0])
    kinds = _kinds(model, ckpts["bf16", 1])
    assert "quant" in {kinds[n] for n in (GATE, SHARED_UP)}
    if fault:
        before = fr.snapshot(model)
        _, armed = _failing_quantize(monkeypatch, 1, RuntimeError("injected"), after_rows=False)
        with pytest.raises(fr.CommitError, match="injected"):
            fr.update_weights_from_disk(model, ckpts["bf16", 1])
        assert unchanged(model, before) == []
        armed[0] = False
    for src in (ckpts["bf16", 1], ckpts["bf16", 0]):
        fr.update_weights_from_disk(model, src)
        assert fr.compare_states(_fresh(src), fr.snapshot(model)) == []


def test_an_expert_parallel_rank_streams_its_linears_and_equals_a_fresh_load(ckpts, gpu_path):  # noqa: F811
    ep = {"num_local_experts": 6, "expert_slots": {0: [3], 2: [0, 5], 5: [1], 7: [2, 4]}}
    model = fr.load_model(ckpts["bf16", 0], **ep)
    assert _kinds(model, ckpts["bf16", 1])[GATE] == "quant"
    for src, flt in ((ckpts["bf16", 1], None), (ckpts["bf16", 0], None)):
        fr.update_weights_from_disk(model, src, flt)
        assert fr.compare_states(fr.snapshot(fr.load_model(src, **ep)), fr.snapshot(model)) == []


# ---- on a real GPU (compiled Triton, real streams): skipped without CUDA ----

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fresh_cuda(path) -> fr.Snapshot:
    return fr.snapshot(fr.load_model(path, device="cuda"))


@CUDA
@pytest.mark.parametrize("chunk_bytes", [None, 8192])
@pytest.mark.parametrize("register", ["never", "always"])
def test_cuda_streamed_linears_equal_a_fresh_load(ckpts, monkeypatch, chunk_bytes, register):
    if chunk_bytes:
        monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(to_device, "REGISTER", register)
    calls = []
    real = FixedFp8LinearMethod.quantize_shards_
    monkeypatch.setattr(FixedFp8LinearMethod, "quantize_shards_",
                        lambda self, layer, shards: calls.append(layer) or real(self, layer, shards))
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    kinds = _kinds(model, ckpts["bf16", 1])
    assert "quant" in {kinds[n] for n in (GATE, SHARED_UP)}
    for src in (ckpts["bf16", 1], ckpts["bf16", 0], ckpts["bf16", 1], ckpts["bf16", 1]):
        calls.clear()
        fr.update_weights_from_disk(model, src)
        assert calls
        assert fr.compare_states(_fresh_cuda(src), fr.snapshot(model)) == []


@CUDA
@pytest.mark.parametrize("backup", ["host", "device"])
def test_cuda_a_fault_inside_a_streamed_linear_restores_it(ckpts, monkeypatch, backup):
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    before = fr.snapshot(model)
    gate_up = dict(model.named_modules())[GATE_UP]
    _, armed = _failing_quantize(monkeypatch, gate_up, RuntimeError("injected"))
    with pytest.raises(fr.CommitError, match="injected"):
        fr.update_weights_from_disk(model, ckpts["bf16", 1], backup=backup)
    assert unchanged(model, before) == []
    armed[0] = False
    fr.update_weights_from_disk(model, ckpts["bf16", 1], backup=backup)
    assert fr.compare_states(_fresh_cuda(ckpts["bf16", 1]), fr.snapshot(model)) == []


@CUDA
@pytest.mark.parametrize("name", [GATE, UP])
def test_cuda_a_bad_value_in_a_streamed_linear_rolls_back(ckpts, tmp_path, name):
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, name, lambda t: t.index_fill(0, torch.tensor([2]), float("nan")))
    model = fr.load_model(ckpts["bf16", 0], device="cuda")
    assert _kinds(model, path)[name] == "quant"
    before = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError):
        fr.update_weights_from_disk(model, path)
    assert unchanged(model, before) == []
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh_cuda(ckpts["bf16", 1]), fr.snapshot(model)) == []


@CUDA
def test_cuda_a_model_loaded_but_never_processed(ckpts):
    """The review's bug (fixed) on a GPU: see the CPU-emulated test of the same name."""
    from fp8_reload.processing.modes import get_mode

    ckpt = fr.Checkpoint(ckpts["bf16", 0])
    model = fr.FP8MoEModel(ckpt.config, get_mode("fixed"), ckpt.kind, device="cuda")
    model.load_weights([(n, t.to("cuda")) for n, t in ckpt.read(ckpt.names)])  # (experts too)
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert fr.compare_states(_fresh_cuda(ckpts["bf16", 1]), fr.snapshot(model)) == []
