"""bf16 linears quantized where they land (issue 13): a bf16 checkpoint's linear weights are
quantized on load, one dynamic scale over all shards of a weight. Their loaders staged them
in pinned memory and post-processing copied them to the device at the reload's end (~420
MiB of v2-lite:4, after the stream, read on the host beside it); now a linear whose shards
are adjacent in one file and fit a chunk streams like the experts and is quantized from the
device buffer it landed in (`FixedFp8LinearMethod.quantize_shards_`), by the same
operations as post-processing, so the bytes are those of a fresh load."""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.targets as targets_mod
import fp8_reload.reload.transaction as tx
from fp8_reload.layers import Fp8Linear, FusedMoE
from fp8_reload.processing import FixedFp8LinearMethod
from fp8_reload.quant import amax_scale, amax_scale_of, quantize_static
from fp8_reload.reload.chunks import make_chunks, unit_of
from fp8_reload.reload.targets import plan_targets

from .conftest import copy_checkpoint, rewrite_tensor
from .test_review_s7 import _cpu_tensors_reach_triton, gpu_path  # noqa: F401  (a fixture)


def _values(shape, seed: int, top: float = 5.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * top).to(torch.bfloat16)


@pytest.mark.parametrize("extreme", [0, 1, 2], ids=["max-in-first", "max-in-second", "min-in-third"])
def test_the_scale_of_parts_is_the_scale_of_their_concatenation(extreme):
    parts = [_values((n, 8), seed) for seed, n in enumerate((3, 5, 2))]
    parts[extreme].view(-1)[1] = 700.0 if extreme < 2 else -900.0
    assert torch.equal(amax_scale_of(parts).view(torch.int32), amax_scale(torch.cat(parts)).view(torch.int32))


@pytest.mark.parametrize("widths", [[48], [32, 32], [16, 40, 24]], ids=["one", "gate-up", "qkv"])
def test_quantize_shards_gives_the_bytes_of_quantizing_the_whole_weight(widths, monkeypatch):
    """The whole weight's scale and elementwise quantization (what post-processing computed
    before, from one concatenated copy), whether the shards come staged or in place; in row
    blocks smaller than a shard too."""
    import fp8_reload.quant as quant

    monkeypatch.setattr(quant, "BLOCK_ELEMENTS", 40)
    hidden = 24
    shards = {k: _values((w, hidden), 10 + i) for i, (k, w) in
              enumerate(zip([None] if len(widths) == 1 else range(len(widths)), widths))}
    whole = torch.cat(list(shards.values()))
    scale = amax_scale(whole)
    want = quantize_static(whole, scale).view(torch.uint8)
    staged = Fp8Linear(hidden, widths, FixedFp8LinearMethod(fp8_checkpoint=False))
    staged.staged, staged.needs_processing = dict(shards), True
    staged.quant_method.process_weights_after_loading(staged)
    in_place = Fp8Linear(hidden, widths, FixedFp8LinearMethod(fp8_checkpoint=False))
    in_place.quant_method.quantize_shards_(in_place, dict(reversed(list(shards.items()))))
    in_place.needs_processing = True  # (what `mark_loaded` sets for a streamed target)
    in_place.quant_method.process_weights_after_loading(in_place)  # nothing staged: rebinds only
    for layer in (staged, in_place):
        assert torch.equal(layer.weight.data.t().view(torch.uint8), want)
        assert torch.equal(layer.weight_scale.data, scale.expand(len(widths)))
        assert layer.kernel_layout and not layer.needs_processing and not layer.staged
    part = Fp8Linear(hidden, widths, FixedFp8LinearMethod(fp8_checkpoint=False))
    if len(widths) > 1:  # a weight loaded in part still refuses to be processed
        part.staged, part.needs_processing = {0: shards[0]}, True
        with pytest.raises(RuntimeError, match="were not loaded"):
            part.quant_method.process_weights_after_loading(part)


def _linear_weights(targets):
    return [t for t in targets if isinstance(t.module, Fp8Linear) and t.info.name.endswith("proj.weight")]


def test_bf16_linears_are_quantized_in_the_stream_when_whole_and_no_bigger_than_a_chunk(ckpts, monkeypatch):
    ckpt = fr.Checkpoint(ckpts["bf16", 0])
    model = fr.load_model(ckpts["bf16", 0])
    infos = [ckpt.info(n) for n in ckpt.names]
    linears = _linear_weights(plan_targets(model, infos, quantize_on_device=True))
    assert linears and {t.kind for t in linears} == {"quant"}
    assert any(len(t.module.logical_widths) > 1 for t in linears)  # merged shards among them
    # a cap below the biggest linear: that one (all its shards) takes its loader, the rest stream
    sizes = {}
    for t in linears:
        sizes[t.module_name] = sizes.get(t.module_name, 0) + t.info.nbytes
    cap = max(sizes.values()) - 1
    capped = _linear_weights(plan_targets(model, infos, True, unit_bytes=cap))
    assert {t.module_name for t in capped if t.kind == "loader"} == {m for m, n in sizes.items() if n > cap}
    assert {t.module_name for t in capped if t.kind == "quant"} == {m for m, n in sizes.items() if n <= cap}
    # FP8_RELOAD_STREAM_QUANT=experts: linears through their loaders, experts still in the stream
    monkeypatch.setattr(targets_mod, "STREAM_QUANT", ("experts",))
    experts_only = plan_targets(model, infos, True)
    assert {t.kind for t in _linear_weights(experts_only)} == {"loader"}
    assert any(t.kind == "quant" and isinstance(t.module, FusedMoE) for t in experts_only)
    # without a device to quantize on, linears take their loader as experts do
    monkeypatch.setattr(targets_mod, "STREAM_QUANT", ("experts", "linears"))
    assert {t.kind for t in _linear_weights(plan_targets(model, infos, False))} == {"loader"}


def test_a_unit_that_does_not_fit_whole_starts_a_chunk_of_its_own(ckpts):
    """A chunk holds at most `chunk_bytes` or one unit (it once took a unit's first piece and
    then the rest past its size: device buffers of a chunk and a unit)."""
    ckpt = fr.Checkpoint(ckpts["bf16", 0])
    model = fr.load_model(ckpts["bf16", 0])
    targets = [t for t in plan_targets(model, [ckpt.info(n) for n in ckpt.names], True)
               if t.kind in ("copy", "quant")]
    sizes = {}
    for t in targets:
        sizes[unit_of(t)] = sizes.get(unit_of(t), 0) + t.info.nbytes
    limit = sorted(sizes.values())[-3]  # some units bigger, most smaller
    chunks = make_chunks(targets, chunk_bytes=limit)
    assert [t for c in chunks for t in c.targets] == targets
    for c in chunks:
        units = {unit_of(t) for t in c.targets}
        assert c.nbytes <= limit or len(units) == 1, (c.nbytes, limit, units)
    where = {}
    for k, c in enumerate(chunks):
        for t in c.targets:
            where.setdefault(unit_of(t), set()).add(k)
    assert all(len(ks) == 1 for ks in where.values())


@pytest.mark.parametrize("chunk_bytes", [None, 4096], ids=["default-chunks", "small-chunks"])
def test_the_gpu_path_streams_bf16_linears_and_equals_a_fresh_load(ckpts, gpu_path, monkeypatch,  # noqa: F811
                                                                    chunk_bytes):
    """(The GPU path emulated on CPU, `test_review_s7.gpu_path`.) Small chunks: linears larger
    than one take their loaders beside those that stream."""
    _cpu_tensors_reach_triton("bf16")
    if chunk_bytes:
        monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", chunk_bytes)
    calls, loaded = [], []
    quantize, load = FixedFp8LinearMethod.quantize_shards_, FixedFp8LinearMethod.load_linear
    monkeypatch.setattr(FixedFp8LinearMethod, "quantize_shards_",
                        lambda self, layer, shards: calls.append(layer) or quantize(self, layer, shards))
    monkeypatch.setattr(FixedFp8LinearMethod, "load_linear",
                        lambda self, layer, *a: loaded.append(layer) or load(self, layer, *a))
    model = fr.load_model(ckpts["bf16", 0])
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    calls.clear(), loaded.clear()
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    assert {id(m) for m in calls} == {id(m) for m in linears} and len(calls) == len(linears)
    # every linear streamed (none through its loader) unless chunks are smaller than some
    assert (loaded == []) == (chunk_bytes is None)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["bf16", 1])), fr.snapshot(model)) == []


def test_a_bad_value_in_a_streamed_linear_rolls_back(ckpts, tmp_path, gpu_path):  # noqa: F811
    _cpu_tensors_reach_triton("bf16")
    path = copy_checkpoint(ckpts["bf16", 1], tmp_path / "bad")
    rewrite_tensor(path, "model.layers.1.self_attn.q_proj.weight",
                   lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    model = fr.load_model(ckpts["bf16", 0])
    before = fr.snapshot(model)
    with pytest.raises(fr.InvalidTensorError, match="q_proj"):
        fr.update_weights_from_disk(model, path)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    assert tx.on_triton_device(model)  # (the emulated GPU path: the linear was a quant target)


def test_a_kept_full_plan_is_reused_only_for_the_same_quantization_place(ckpts):
    """A full reload's plan is kept with the model; one made where bf16 weights take their
    loaders (`quantize_on_device` False: a CPU model) is not reused where they stream."""
    from fp8_reload.reload.plan import open_checkpoint, plan_reload

    model = fr.load_model(ckpts["bf16", 0])
    path = ckpts["bf16", 1]
    _, on_host = plan_reload(model, open_checkpoint(model, path), None, False)
    _, on_device = plan_reload(model, open_checkpoint(model, path), None, True)
    assert {t.kind for t in _linear_weights(on_host)} == {"loader"}
    assert {t.kind for t in _linear_weights(on_device)} == {"quant"}
    _, again = plan_reload(model, open_checkpoint(model, path), None, True)
    assert again is on_device  # (kept: the same place)
