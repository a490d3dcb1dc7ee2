"""Review s16 (helper 38): d6a089a (a filtered chunk's few views copied one by one) and 1415eac (`Kinds`
in prepare's memo, the values' check skipped once a parse has checked every target, the
backup reading modules' state from their dict).

Where the copy path takes a target's bytes out of the device slot (`Chunk.source`) it views
them with the target's dtype: a tensor whose buffer offset is not a multiple of its element
size cannot be viewed so. The chunk layout keeps a span at its file offset's place within a
block (direct reads) or a 16-byte window (registered shards on a GPU), so a spec-valid
safetensors file whose header length is odd puts every 2- and 4-byte tensor at an odd
offset there. The copy table (`copy_rows`) moves bytes and never views them."""

from __future__ import annotations

import struct

import pytest

import fp8_reload as fr
import fp8_reload.checkpoint.files as files_mod
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.stream as stream_mod
import fp8_reload.reload.to_device as to_device

from .conftest import copy_checkpoint, mix_checkpoints, rewrite_tensor, unchanged
from .test_review_s7 import gpu_path  # noqa: F401  (the fixture)

NORM = "model.layers.1.post_attention_layernorm.weight"


def _odd_header(path) -> None:
    """Every shard of `path` rewritten with a header of odd length (JSON padded with one
    space, as the format allows): the data, and each tensor in it, one byte further on."""
    for shard in path.glob("*.safetensors"):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8:8 + n].rstrip(b" ")
        if len(header) % 2 == 0:
            header += b" "
        shard.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


@pytest.fixture
def direct_layout(monkeypatch):
    """Chunks laid out for direct reads: each span at its file offset's place in a block
    (as `commit_cuda`'s windows of a registered shard put it at its offset from a 16-byte
    boundary). The reads fall back to the page cache where O_DIRECT is refused."""
    monkeypatch.setattr(chunks_mod, "READ_IO", "direct")
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4 * chunks_mod.DIRECT_ALIGN)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_direct_reload_of_an_odd_header_checkpoint_equals_a_fresh_load(ckpts, tmp_path, direct_layout):
    """Pre-existing (010fcc3 too), CPU: the host commit takes every target through
    `Chunk.source`, and a bf16 norm at an odd place in the chunk's buffer cannot be viewed
    as bf16. The transaction holds (rolled back), but a checkpoint `load_model` loads is
    refused by the reload."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "odd")
    _odd_header(path)
    want = fr.snapshot(fr.load_model(path))  # a fresh load reads it
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, path)
    assert fr.compare_states(want, fr.snapshot(model)) == []


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("spec", ["norm", None], ids=["filtered", "full"])
def test_a_filtered_gpu_reload_of_a_few_views_at_odd_offsets_equals_a_fresh_load(
        ckpts, tmp_path, gpu_path, direct_layout, monkeypatch, spec, kind):  # noqa: F811
    """d6a089a: on a GPU with Triton a filtered chunk of at most `FEW_ROWS` views is copied
    view by view from `Chunk.source(dslot, t)`; before, its contiguous views went through
    the copy table, bytes moved as they are (a full reload still does). A filtered reload
    of one norm from a checkpoint whose tensors sit at odd offsets failed (rolled back)
    where 010fcc3 and the full reload land it. bf16 experts (quantized in the stream from
    `Chunk.source` views) failed so before d6a089a too. (The kernels run in Triton's
    interpreter on CPU, as in test_review_s5.)"""
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton.runtime import INTERPRET

    if not INTERPRET:
        pytest.skip("CPU tensors reach Triton's interpreter only")
    monkeypatch.setattr(to_device, "on_triton", lambda t: True)
    path = copy_checkpoint(ckpts[kind, 1], tmp_path / "odd")
    _odd_header(path)
    model = fr.load_model(ckpts[kind, 0])
    flt = None if spec is None else (lambda n: n == NORM)
    fr.update_weights_from_disk(model, path, flt)
    want = path if flt is None else mix_checkpoints(ckpts[kind, 0], path, tmp_path / "mixed", flt)
    assert fr.compare_states(fr.snapshot(fr.load_model(want)), fr.snapshot(model)) == []


# ---- 1415eac: the `all_checked` memo (these pass: the shortcut holds) ----

def _nan_first(t):
    raw = t.contiguous().view(-1).view(__import__("torch").uint8).clone()
    raw[0] = 0x7F  # an e4m3 NaN
    return raw.view(t.dtype).view(t.shape)


def test_a_kept_plan_memo_checked_by_one_parse_does_not_spare_the_next_parse(ckpts, tmp_path, monkeypatch):
    """Files at rest, every value checked by parse 1 (`all_checked` = parse 1 in the kept
    plan's memo); the shard rewritten (new stamps, same header: parse 2 keeps the plan and
    its memo) with a NaN, and with every file settled at once: parse 2 must check."""
    monkeypatch.setattr(files_mod, "SETTLED_NS", -10**18)  # every file settled when read
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    for _ in range(3):  # checked, then skipped twice (the memo set)
        fr.update_weights_from_disk(model, path)
    fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({2: [5]}))
    kept = fr.snapshot(model)
    rewrite_tensor(path, "model.layers.2.mlp.experts.5.down_proj.weight", _nan_first)
    with pytest.raises(fr.InvalidTensorError, match="NaN"):
        fr.update_weights_from_disk(model, path)
    assert unchanged(model, kept) == []
    with pytest.raises(fr.InvalidTensorError, match="NaN"):  # and again (the memo not set by a failure)
        fr.update_weights_from_disk(model, path)
    assert unchanged(model, kept) == []


def test_a_bad_scale_in_a_new_parse_after_release_staging_is_refused(ckpts, tmp_path, monkeypatch):
    """`release_staging` drops the kept plan and its memo; a new parse of a rewritten
    file with a non-positive scale is refused, before and after the memo is rebuilt."""
    import torch

    monkeypatch.setattr(files_mod, "SETTLED_NS", -10**18)
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    calls = []
    orig = stream_mod.read_scalars
    monkeypatch.setattr(stream_mod, "read_scalars", lambda c, t, ck: calls.append(ck) or orig(c, t, ck))
    for _ in range(3):
        fr.update_weights_from_disk(model, path)
    assert calls == [True, False, False]
    fr.release_staging(model)
    fr.update_weights_from_disk(model, path)
    assert calls[-1] is False  # (the same parse: its checked names still hold)
    kept = fr.snapshot(model)
    rewrite_tensor(path, "model.layers.1.mlp.experts.2.up_proj.weight_scale",
                   lambda t: torch.zeros_like(t))
    with pytest.raises(fr.InvalidTensorError):
        fr.update_weights_from_disk(model, path)
    assert unchanged(model, kept) == []


def test_alternating_two_checkpoints_of_one_layout_each_parse_checks_its_own(ckpts, tmp_path, monkeypatch):
    """RL's two buffers (A, B, A, B: each parse kept, each full plan and memo its own): a
    NaN written into A after both are fully checked is refused; B still reloads."""
    monkeypatch.setattr(files_mod, "SETTLED_NS", -10**18)
    a = copy_checkpoint(ckpts["fp8", 0], tmp_path / "a")
    b = copy_checkpoint(ckpts["fp8", 1], tmp_path / "b")
    model = fr.load_model(a)
    for _ in range(3):
        fr.update_weights_from_disk(model, b)
        fr.update_weights_from_disk(model, a)
    rewrite_tensor(a, "model.layers.2.mlp.experts.5.down_proj.weight", _nan_first)
    fr.update_weights_from_disk(model, b)
    kept = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError, match="NaN"):
        fr.update_weights_from_disk(model, a)
    assert unchanged(model, kept) == []
    fr.update_weights_from_disk(model, b)
    assert fr.compare_states(fr.snapshot(fr.load_model(b)), fr.snapshot(model)) == []


def test_a_nan_in_a_filtered_few_views_chunk_is_refused_and_rolled_back(ckpts, tmp_path, gpu_path,  # noqa: F811
                                                                        monkeypatch):
    """d6a089a's copies land where the value check reads them (`t.views[0]`): a NaN in
    a filtered chunk written view by view is still refused, the model restored."""
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton.runtime import INTERPRET

    if not INTERPRET:
        pytest.skip("CPU tensors reach Triton's interpreter only")
    monkeypatch.setattr(to_device, "on_triton", lambda t: True)
    built = []
    get = to_device.RowTables.get
    monkeypatch.setattr(to_device.RowTables, "get", lambda self, *a: built.append(a) or get(self, *a))
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "bad")
    rewrite_tensor(path, "model.layers.2.mlp.experts.5.down_proj.weight", _nan_first)
    model = fr.load_model(ckpts["fp8", 0])
    kept = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError, match="NaN"):
        fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({2: [5]}))
    assert not built and unchanged(model, kept) == []  # (no table: the views copied one by one)


@pytest.mark.parametrize("register", ["always", "never"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("spec", ["norm", None], ids=["filtered", "full"])
def test_a_cuda_reload_of_an_odd_header_checkpoint_equals_a_fresh_load(ckpts, tmp_path, monkeypatch, spec,
                                                                       kind, register):
    """The same on a GPU: registered shards' windows keep each tensor's odd offset (the
    copy-table, view-by-view and in-stream quantization paths); the ring packs spans."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("the CUDA paths (the emulated ones above run on CPU)")
    monkeypatch.setattr(to_device, "REGISTER", register)
    path = copy_checkpoint(ckpts[kind, 1], tmp_path / "odd")
    _odd_header(path)
    model = fr.load_model(ckpts[kind, 0], device="cuda")
    flt = None if spec is None else (lambda n: n == NORM)
    want = path if flt is None else mix_checkpoints(ckpts[kind, 0], path, tmp_path / "mixed", flt)
    for _ in range(2):  # the second: shards registered (`always`), values checked
        fr.update_weights_from_disk(model, path, flt)
        assert fr.compare_states(fr.snapshot(fr.load_model(want, device="cuda")), fr.snapshot(model)) == []
