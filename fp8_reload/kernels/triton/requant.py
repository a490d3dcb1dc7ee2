"""Post-load processing of FP8 MoE layers at memory speed: in place, reloaded experts only.

Two jobs, each a couple of launches for a whole layer and no float32 copy of the weights:

* `requantize_w13_` (FP8 checkpoints): each listed expert's gate and up halves
  move to the larger of its two scales, ``q * (old / new)`` rounded back to e4m3;
  a half already at the max is not touched. Then both columns of
  ``w13_weight_scale[e]`` take the max, and (optionally) the static input scales
  are merged to the layer max from their per-expert values.
* `quantize_pieces_` (bf16 checkpoints quantized on load): per expert, the
  amax over its staged pieces (gate + up for ``w13``, down for ``w2``), then
  ``x / scale`` rounded to e4m3 into the FP8 weights, ``scale = amax * (1 / 448)``.

Bit for bit what the torch path (`processing.ops`) computes: the same float32
operations in the same order, IEEE-rounded division (`tl.fdiv(..., ieee_rounding=True)`)
where torch divides two tensors, and round-to-nearest-even e4m3 conversion.
"""

from __future__ import annotations

import torch

from ...quant import INV_FP8_MAX, MIN_SCALE
from .fp8 import to_fp8
from .runtime import INTERPRET, check_device, device_ints, tl, triton

BLOCK = 4096  # elements per program of the elementwise passes
EXACT = INTERPRET


@triton.jit
def _requant_halves_kernel(w_ptr, scale_ptr, experts_ptr, first, half_numel, stride_e,
                           LISTED: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    """One block of one half (gate or up) of one expert: q * (s_half / max) -> e4m3. The
    experts are ``experts_ptr[i]`` (LISTED) or the range ``first + i``."""
    if LISTED:
        e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    else:
        e = (first + tl.program_id(0)).to(tl.int64)
    half = tl.program_id(1)
    s0 = tl.load(scale_ptr + 2 * e)
    s1 = tl.load(scale_ptr + 2 * e + 1)
    m = tl.maximum(s0, s1)
    s = tl.where(half == 0, s0, s1)
    if s != m:  # a half already at the expert's max keeps every byte
        ratio = tl.fdiv(s, m, ieee_rounding=True)
        offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < half_numel
        ptrs = w_ptr + e * stride_e + half * half_numel + offs
        q = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, to_fp8(q * ratio, EXACT), mask=mask)


@triton.jit
def _finalize_fp8_scales_kernel(scale_ptr, experts_ptr, first, k, a13_ptr, a13_raw_ptr, a2_ptr,
                                a2_raw_ptr, num_experts, LISTED: tl.constexpr, MERGE_INPUT: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: both columns of each listed expert's w13 scale take their max; with
    MERGE_INPUT the listed experts' input scales are kept per expert, then every slot
    of the input scales takes the layer max (what a fresh load sets)."""
    for i0 in range(0, k, BLOCK_K):
        i = i0 + tl.arange(0, BLOCK_K)
        ok = i < k
        if LISTED:
            e = tl.load(experts_ptr + i, mask=ok, other=0).to(tl.int64)
        else:
            e = (first + i).to(tl.int64)
        s0 = tl.load(scale_ptr + 2 * e, mask=ok, other=0.0)
        s1 = tl.load(scale_ptr + 2 * e + 1, mask=ok, other=0.0)
        m = tl.maximum(s0, s1)
        tl.store(scale_ptr + 2 * e, m, mask=ok)
        tl.store(scale_ptr + 2 * e + 1, m, mask=ok)
    if MERGE_INPUT:
        # each slot's new per-expert value (listed: the raw value just loaded into the
        # parameter; others: the one kept) is computed, stored and reduced from registers:
        # no global-memory round trip between threads of the program
        slots = tl.arange(0, BLOCK_E)
        ok = slots < num_experts
        if LISTED:
            listed = slots < 0
            for i0 in range(0, k, BLOCK_K):
                i = i0 + tl.arange(0, BLOCK_K)
                e = tl.load(experts_ptr + i, mask=i < k, other=-1)
                listed = listed | (tl.sum((slots[:, None] == e[None, :]).to(tl.int32), axis=1) > 0)
        else:
            listed = (slots >= first) & (slots < first + k)
        new13 = tl.where(listed, tl.load(a13_ptr + slots, mask=ok, other=0.0),
                         tl.load(a13_raw_ptr + slots, mask=ok, other=0.0))
        new2 = tl.where(listed, tl.load(a2_ptr + slots, mask=ok, other=0.0),
                        tl.load(a2_raw_ptr + slots, mask=ok, other=0.0))
        tl.store(a13_raw_ptr + slots, new13, mask=ok)
        tl.store(a2_raw_ptr + slots, new2, mask=ok)
        m13 = tl.max(tl.where(ok, new13, float("-inf")), axis=0)
        m2 = tl.max(tl.where(ok, new2, float("-inf")), axis=0)
        tl.store(a13_ptr + slots, tl.zeros([BLOCK_E], tl.float32) + m13, mask=ok)
        tl.store(a2_ptr + slots, tl.zeros([BLOCK_E], tl.float32) + m2, mask=ok)


@triton.jit
def _piece_amax_kernel(src_ptr, partial_ptr, numel, nblocks, BLOCK: tl.constexpr):
    """The amax of one block of one staged piece, into its own slot of `partial`."""
    p = tl.program_id(0)
    src = tl.load(src_ptr + p).to(tl.pointer_type(tl.bfloat16))
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(partial_ptr + p * nblocks + tl.program_id(1), tl.max(tl.abs(x), axis=0))


@triton.jit
def _piece_quant_kernel(src_ptr, dst_ptr, gstart_ptr, gcount_ptr, scale_dst_ptr, scale_cols_ptr, partial_ptr,
                        numel, nblocks, inv_fp8_max, min_scale, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                        EXACT: tl.constexpr):
    """One block of one piece: x / scale -> e4m3 at its place in the FP8 weight, with the
    scale of its group (consecutive pieces) reduced from their blocks' maxima. The first
    block of a piece that carries a scale destination writes the scale too."""
    p = tl.program_id(0)
    lo = tl.load(gstart_ptr + p) * nblocks
    hi = lo + tl.load(gcount_ptr + p) * nblocks
    amax = tl.zeros([RBLOCK], tl.float32)
    for r0 in range(lo, hi, RBLOCK):
        r = r0 + tl.arange(0, RBLOCK)
        amax = tl.maximum(amax, tl.load(partial_ptr + r, mask=r < hi, other=0.0))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    src = tl.load(src_ptr + p).to(tl.pointer_type(tl.bfloat16))
    dst = tl.load(dst_ptr + p).to(tl.pointer_type(tl.float8e4nv))
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, to_fp8(tl.fdiv(x, scale, ieee_rounding=True), EXACT), mask=mask)
    cols = tl.load(scale_cols_ptr + p)
    if tl.program_id(1) == 0 and cols > 0:
        out = tl.load(scale_dst_ptr + p).to(tl.pointer_type(tl.float32))
        c = tl.arange(0, 2)
        tl.store(out + c, tl.zeros([2], tl.float32) + scale, mask=c < cols)


def requantize_w13_(w13: torch.Tensor, w13_scale: torch.Tensor, experts: list[int],
                    input_scales=None) -> None:
    """`processing.ops.requantize_w13_to_expert_max_` (plus `merge_input_scales_` of
    ``input_scales = ((a13, a13_raw), (a2, a2_raw))``) in two launches.

    `experts` are local slots; a run of consecutive slots (every expert, or one) is
    passed as its first slot and count, anything else as a list copied to the device.
    ``w13`` is ``[E, 2I, H]`` FP8 and ``w13_scale`` contiguous ``[E, 2]`` float32.
    """
    check_device(w13)
    k = len(experts)
    if k == 0:
        return
    first = int(experts[0])
    listed = list(experts) != list(range(first, first + k))
    idx = device_ints(experts, w13.device) if listed else w13_scale  # (unused when not listed)
    e_all, rows, hidden = w13.shape
    if not (w13.is_contiguous() and w13_scale.is_contiguous() and w13_scale.shape == (e_all, 2)):
        raise ValueError("requantize_w13_ needs contiguous w13 [E, 2I, H] and w13_scale [E, 2]")
    half = rows // 2 * hidden
    _requant_halves_kernel[(k, 2, triton.cdiv(half, BLOCK))](
        w13, w13_scale, idx, first, half, w13.stride(0), LISTED=listed, BLOCK=BLOCK, EXACT=EXACT)
    merge = input_scales is not None
    (a13, a13_raw), (a2, a2_raw) = input_scales if merge else ((w13_scale, w13_scale),) * 2
    _finalize_fp8_scales_kernel[(1,)](
        w13_scale, idx, first, k, a13, a13_raw, a2, a2_raw, e_all, LISTED=listed, MERGE_INPUT=merge,
        BLOCK_K=min(1024, triton.next_power_of_2(k)), BLOCK_E=triton.next_power_of_2(e_all))


def quantize_pieces_(pieces: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]) -> None:
    """Quantize bf16 `pieces` into FP8 in place: ``(src, dst, group, scale_out)`` each.

    Every `src` (bf16, contiguous, on the device) and `dst` (its FP8 destination view)
    hold the same number of elements; consecutive pieces with the same `group` share one
    dynamic scale, amax / 448, which `scale_out` (a float32 view of 1 or 2 slots, on one
    piece of the group) receives. One small copy and two launches whatever the number of
    pieces; no zero-filled buffer, no atomics.
    """
    if not pieces:
        return
    src0 = pieces[0][0]
    check_device(src0)
    numel = src0.numel()
    for src, dst, _, _ in pieces:
        if (src.dtype != torch.bfloat16 or dst.dtype != torch.float8_e4m3fn or src.numel() != numel
                or dst.numel() != numel or not src.is_contiguous() or not dst.is_contiguous()):
            raise ValueError("quantize_pieces_: contiguous bf16 sources and FP8 destinations of one size")
    quantize_pointers_(src0.device, numel, [src.data_ptr() for src, _, _, _ in pieces],
                       [dst.data_ptr() for _, dst, _, _ in pieces], [g for _, _, g, _ in pieces],
                       [(0, 0) if out is None else (out.data_ptr(), out.numel()) for *_, out in pieces])


def quantize_pointers_(device, numel: int, src: list[int], dst: list[int], groups: list[int],
                       scales: list[tuple[int, int]]) -> None:
    """`quantize_pieces_` given the addresses (what a caller that knows the layout computes
    without making a view per piece): `numel` bf16 elements at each ``src[i]`` into FP8 at
    ``dst[i]``; ``scales[i]`` is ``(address, slots)`` of the float32 scale piece `i` writes,
    ``(0, 0)`` for none. The caller guarantees sizes, dtypes and contiguity."""
    starts = [i for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    gstart, gcount = [], []
    for lo, hi in zip(starts, starts[1:] + [len(groups)]):
        gstart += [lo] * (hi - lo)
        gcount += [hi - lo] * (hi - lo)
    columns = (src, dst, gstart, gcount, [a for a, _ in scales], [n for _, n in scales])
    table = device_ints([v for col in columns for v in col], device).view(6, -1)  # one copy
    src_ptr, dst_ptr, gstart_d, gcount_d, scale_dst, scale_cols = table
    nblocks = triton.cdiv(numel, BLOCK)
    partial = torch.empty(len(src) * nblocks, dtype=torch.float32, device=device)
    grid = (len(src), nblocks)
    _piece_amax_kernel[grid](src_ptr, partial, numel, nblocks, BLOCK=BLOCK)
    _piece_quant_kernel[grid](src_ptr, dst_ptr, gstart_d, gcount_d, scale_dst, scale_cols, partial, numel,
                              nblocks, INV_FP8_MAX, MIN_SCALE, BLOCK=BLOCK, RBLOCK=1024, EXACT=EXACT)


__all__ = ["quantize_pieces_", "quantize_pointers_", "requantize_w13_"]
