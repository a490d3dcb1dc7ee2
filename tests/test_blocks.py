"""Post-processing of big linears works a block of rows at a time (`quant.by_row_blocks_`):
the float32 temporary is one block, and the bytes are those of one call on the whole."""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
from fp8_reload import quant
from fp8_reload.layers import Fp8Linear
from fp8_reload.processing import FixedFp8LinearMethod
from fp8_reload.quant import FP8_DTYPE, amax_scale, by_row_blocks_, quantize_static, requantize
from fp8_reload.testing import assert_bitwise_equal


def _values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 5
    x.view(-1)[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -500.0, 3.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_amax_scale_without_a_temporary_equals_abs_then_max(dtype):
    def expected(x):
        return (x.float().abs().amax() * quant.INV_FP8_MAX).clamp_(min=quant.MIN_SCALE)

    for x in (_values((37, 11), dtype), -_values((5, 3), dtype, 1).abs(), torch.zeros(4, 4, dtype=dtype),
              -torch.zeros(3, dtype=dtype), _values((9,), dtype, 2).abs()):
        assert_bitwise_equal(amax_scale(x), expected(x))
    q = quantize_static(_values((6, 8), torch.float32), 0.01)
    assert q.dtype == FP8_DTYPE
    assert_bitwise_equal(amax_scale(q), expected(q))


@pytest.mark.parametrize("block", [1, 7, 11 * 13, 10**9],
                         ids=["one-element", "partial-rows", "whole-rows", "all"])
@pytest.mark.parametrize("shape", [(29, 13), (5, 3, 4), (1, 50), (40,)])
def test_row_blocks_give_the_bytes_of_one_call(monkeypatch, block, shape):
    monkeypatch.setattr(quant, "BLOCK_ELEMENTS", block)
    x = _values(shape, torch.bfloat16)
    scale = amax_scale(x)
    out = torch.empty(shape, dtype=FP8_DTYPE)
    by_row_blocks_(out, x, lambda rows: quantize_static(rows, scale))
    assert_bitwise_equal(out, quantize_static(x, scale))
    old, new = torch.tensor(0.7), torch.tensor(1.3)
    moved = out.clone()
    by_row_blocks_(moved, moved, lambda rows: requantize(rows, old, new))  # in place, as processing does
    assert_bitwise_equal(moved, requantize(out, old, new))


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_a_reload_processed_in_small_blocks_equals_a_fresh_load(ckpts, monkeypatch, kind):
    """Every linear of the tiny model goes through several blocks (a fresh load in one)."""
    fresh = fr.snapshot(fr.load_model(ckpts[kind, 1]))
    model = fr.load_model(ckpts[kind, 0])
    before = fr.snapshot(model)
    monkeypatch.setattr(quant, "BLOCK_ELEMENTS", 5)
    fr.update_weights_from_disk(model, ckpts[kind, 1])
    after = fr.snapshot(model)
    assert fr.compare_states(fresh, after) == []
    assert [d for d in fr.compare_states(before, after, identity=True) if "bytes differ" not in d] == []


def _processing_peak(layer: Fp8Linear, staged: dict) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layer.staged = staged
    layer.needs_processing = True
    layer.quant_method.process_weights_after_loading(layer)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device memory peak)")
def test_quantizing_a_dense_gate_up_on_load_needs_no_float32_copy_of_it():
    """v2-lite's dense gate_up_proj (2 x 10944 x 2048): device memory beyond the FP8
    weight is the bf16 weight plus one block, not a float32 copy of it (171 MiB)."""
    widths, hidden = [10944, 10944], 2048
    layer = Fp8Linear(hidden, widths, FixedFp8LinearMethod(fp8_checkpoint=False), device="cuda")
    staged = {k: _values((w, hidden), torch.bfloat16, k).pin_memory() for k, w in enumerate(widths)}
    bf16_bytes = sum(widths) * hidden * 2
    peak = _processing_peak(layer, staged)
    assert peak <= bf16_bytes + 6 * quant.BLOCK_ELEMENTS, (peak / 2**20, bf16_bytes / 2**20)
