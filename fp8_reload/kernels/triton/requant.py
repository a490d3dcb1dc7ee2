"""Post-load processing of FP8 MoE layers at memory speed: in place, reloaded experts only.

One reloaded expert is a few MiB, microseconds of device time: what it costs is the host
time of its launches (~15-20 us each through Triton's launcher on the H200 host), so each
job is as few launches as its data dependencies allow, and the host work around them is
cached per layer (`_layer`):

* `requantize_w13_` (FP8 checkpoints), ONE launch: each listed expert's gate or up half
  whose scale is below the expert's max moves to it, ``q * (old / new)`` rounded back to
  e4m3; the last program to finish (a ticket counter) then sets both columns of
  ``w13_weight_scale[e]`` to the max and merges the static input scales. The scales are
  written only after every program has read them: no second launch, no host sync.
* `quantize_experts_` (bf16 checkpoints quantized on load), TWO launches: the amax of each
  expert's gate + up and of its down, per block, then ``x / scale`` rounded to e4m3 into
  the FP8 slots, ``scale = amax * (1 / 448)`` reduced from the blocks' maxima. One expert
  passes its addresses as arguments; more go through one small host-to-device table.

Bit for bit what the torch path (`processing.ops`) computes: the same float32 operations
in the same order, IEEE-rounded division (`tl.math.div_rn`: on the H200 with Triton 3.6,
``tl.fdiv(..., ieee_rounding=True)`` was not correctly rounded, and 1 in 2M quantized
elements of a test layer landed one e4m3 step from torch's) where torch divides two
tensors, and round-to-nearest-even e4m3 conversion.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from ...quant import INV_FP8_MAX, MIN_SCALE
from .fp8 import to_fp8
from .runtime import INTERPRET, cdiv, check_device, device_ints, next_pow2, tl, triton

BLOCK = 4096  # elements per step of a program
EXACT = INTERPRET


def _iters(k: int) -> int:
    """Blocks per program: few experts want many programs (all SMs busy), a whole layer
    fewer, bigger ones (fewer tickets, fewer partial maxima to reduce)."""
    return 2 if k <= 4 else 8


@triton.jit(do_not_specialize=["first", "k"])
def _requant_w13_kernel(w_ptr, scale_ptr, experts_ptr, first, k, ticket_ptr, a13_ptr, a13_raw_ptr,
                        a2_ptr, a2_raw_ptr, HALF: tl.constexpr, NUM_E: tl.constexpr, LISTED: tl.constexpr,
                        MERGE_INPUT: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, EXACT: tl.constexpr):
    """Program (i, p): blocks p*ITERS.. of the half of expert i that moves (none when the
    two scales are equal). The last program to take a ticket writes the scales."""
    if LISTED:
        e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    else:
        e = (first + tl.program_id(0)).to(tl.int64)
    s0 = tl.load(scale_ptr + 2 * e)
    s1 = tl.load(scale_ptr + 2 * e + 1)
    m = tl.maximum(s0, s1)
    h = tl.where(s0 != m, 0, 1)  # at most one half is below the max
    s = tl.where(h == 0, s0, s1)
    if s != m:  # a half already at the expert's max keeps every byte
        ratio = tl.math.div_rn(s, m)
        base = w_ptr + e * (2 * HALF) + h * HALF
        for it in range(ITERS):
            offs = (tl.program_id(1) * ITERS + it).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < HALF
            q = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(base + offs, to_fp8(q * ratio, EXACT), mask=mask)
    # every thread of this program has read the scales; the ticket (acq_rel) orders those
    # reads before the last program's writes below
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1)
    if ticket == k * tl.num_programs(1) - 1:
        tl.atomic_xchg(ticket_ptr, 0)  # ready for the next launch
        for i0 in range(0, k, BLOCK_K):
            i = i0 + tl.arange(0, BLOCK_K)
            ok = i < k
            if LISTED:
                ei = tl.load(experts_ptr + i, mask=ok, other=0).to(tl.int64)
            else:
                ei = (first + i).to(tl.int64)
            mi = tl.maximum(tl.load(scale_ptr + 2 * ei, mask=ok, other=0.0),
                            tl.load(scale_ptr + 2 * ei + 1, mask=ok, other=0.0))
            tl.store(scale_ptr + 2 * ei, mi, mask=ok)
            tl.store(scale_ptr + 2 * ei + 1, mi, mask=ok)
        if MERGE_INPUT:
            # each slot's per-expert value (listed: the one just loaded into the parameter;
            # others: the one kept) is stored and reduced from registers, then every slot
            # takes the layer max (what a fresh load sets)
            slots = tl.arange(0, BLOCK_E)
            ok = slots < NUM_E
            if LISTED:
                listed = slots < 0
                for i0 in range(0, k, BLOCK_K):
                    i = i0 + tl.arange(0, BLOCK_K)
                    ei = tl.load(experts_ptr + i, mask=i < k, other=-1)
                    listed = listed | (tl.sum((slots[:, None] == ei[None, :]).to(tl.int32), axis=1) > 0)
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
def _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, col, ONE: tl.constexpr):
    """Column `col` of this program's expert row: from the arguments (ONE expert) or the
    device table ``[k, 7]``: src gate, src up, src down, dst w13, dst w2, scale13, scale2."""
    if ONE:
        v = tl.where(col == 0, a0, tl.where(col == 1, a1, tl.where(col == 2, a2, tl.where(
            col == 3, a3, tl.where(col == 4, a4, tl.where(col == 5, a5, a6))))))
    else:
        v = tl.load(table_ptr + tl.program_id(0) * 7 + col)
    return v


@triton.jit
def _pointer(address, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """An address as a pointer; ALIGNED (every address of the launch 16-byte aligned, checked
    on the host) lets the compiler load and store 16 bytes at a time: an address from a
    table carries no alignment the compiler can see, and without the hint it moves each
    element on its own."""
    p = address.to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


# the addresses a0..a6 are not specialized (their alignment is the ALIGNED constexpr): one
# compiled kernel serves every expert (`_launch`)
ADDRESSES = [f"a{i}" for i in range(7)]


@triton.jit(do_not_specialize=ADDRESSES)
def _expert_amax_kernel(table_ptr, a0, a1, a2, a3, a4, a5, a6, partial_ptr, NUMEL: tl.constexpr,
                        ONE: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Program (i, j, p): the amax of blocks p*ITERS.. of piece j (gate, up, down) of
    expert i, into its own slot of `partial` ([k, 3, P]): no zeroed buffer, no atomics."""
    j = tl.program_id(1)
    src = _pointer(_row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, j, ONE), tl.bfloat16, ALIGNED)
    amax = tl.zeros([BLOCK], tl.float32)
    for it in range(ITERS):
        offs = (tl.program_id(2) * ITERS + it).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < NUMEL, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    slot = (tl.program_id(0) * 3 + j) * tl.num_programs(2) + tl.program_id(2)
    tl.store(partial_ptr + slot, tl.max(amax, axis=0))


@triton.jit(do_not_specialize=ADDRESSES)
def _expert_quant_kernel(table_ptr, a0, a1, a2, a3, a4, a5, a6, partial_ptr, inv_fp8_max, min_scale,
                         NUMEL: tl.constexpr, COLS13: tl.constexpr, ONE: tl.constexpr, ITERS: tl.constexpr,
                         BLOCK: tl.constexpr, RBLOCK: tl.constexpr, EXACT: tl.constexpr,
                         ALIGNED: tl.constexpr):
    """Program (i, j, p): blocks p*ITERS.. of piece j of expert i, x / scale -> e4m3 at its
    place in the FP8 weight; the scale of its group (gate + up, or down) is reduced from the
    group's block maxima. Program p = 0 of the gate and of the down piece writes the scale."""
    j = tl.program_id(1)
    p_all = tl.num_programs(2)
    down = j == 2
    lo = (tl.program_id(0) * 3 + tl.where(down, 2, 0)) * p_all
    hi = lo + tl.where(down, 1, 2) * p_all
    amax = tl.zeros([RBLOCK], tl.float32)
    for r0 in range(lo, hi, RBLOCK):
        r = r0 + tl.arange(0, RBLOCK)
        amax = tl.maximum(amax, tl.load(partial_ptr + r, mask=r < hi, other=0.0))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    src = _pointer(_row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, j, ONE), tl.bfloat16, ALIGNED)
    dst = _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, tl.where(down, 4, 3), ONE)
    dst = _pointer(dst + tl.where(j == 1, NUMEL, 0), tl.float8e4nv, ALIGNED)
    for it in range(ITERS):
        offs = (tl.program_id(2) * ITERS + it).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + offs, to_fp8(tl.math.div_rn(x, scale), EXACT), mask=mask)
    if tl.program_id(2) == 0 and j != 1:
        out = _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, tl.where(down, 6, 5), ONE)
        out = out.to(tl.pointer_type(tl.float32))
        c = tl.arange(0, 2)
        tl.store(out + c, tl.zeros([2], tl.float32) + scale, mask=c < tl.where(down, 1, COLS13))


# Per-layer facts the hot path would otherwise recompute on every call (validation, the
# ticket counter), keyed by the tensors' addresses and shapes: in the caller's `cache` (a
# layer's, gone with it) or here. Kept here, the entries of dead layers stay until 1024
# pile up (a test's live tensors grew by one ticket per model loaded and dropped).
_LAYERS: dict = {}


def _layer(key, make, cache: dict | None = None):
    table = _LAYERS if cache is None else cache
    entry = table.get(key)
    if entry is None:
        if len(table) > 1024:
            table.clear()
        entry = table[key] = make()
    return entry


def _fp8_layer(w13, w13_scale, input_scales):
    check_device(w13)
    e_all, rows, hidden = w13.shape
    if not (w13.is_contiguous() and w13_scale.is_contiguous() and w13_scale.shape == (e_all, 2)
            and w13.dtype == torch.float8_e4m3fn and w13_scale.dtype == torch.float32):
        raise ValueError("requantize_w13_ needs contiguous FP8 w13 [E, 2I, H] and float32 w13_scale [E, 2]")
    for t in () if input_scales is None else (t for pair in input_scales for t in pair):
        if t.shape != (e_all,) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != w13.device:
            raise ValueError("requantize_w13_ needs contiguous float32 input scales [E] on w13's device")
    ticket = torch.zeros(1, dtype=torch.int32, device=w13.device)
    scales = (w13_scale,) * 4 if input_scales is None else (t for pair in input_scales for t in pair)
    # the launch's pointers as integers (the key holds every address): Triton's launcher takes
    # an integer as it is, where a tensor costs a `data_ptr` call and a driver query each
    ptrs = (w13.data_ptr(), w13_scale.data_ptr(), ticket.data_ptr(), *(t.data_ptr() for t in scales))
    return ticket, rows // 2 * hidden, e_all, {}, ptrs, next_pow2(e_all)


# Launch a kernel through what Triton compiled for it (`compiled`, by the constexprs and
# argument types that vary between calls: the sub-key): 7 us of host time a launch against
# 19 us through Triton's launcher, which binds and specializes every argument again
# (`results/h200/kernels-probe/launch_probe-0d9c695.txt`, "[launch]"). The requantization
# keeps its compiled kernels in the layer's cache entry, which fixes what Triton
# specializes on (the device, the tensors' addresses, dtypes, shapes and strides); `first`
# and `k` are not specialized. The bf16 quantization passes fresh scratch tensors and
# addresses as integers that are not specialized, so its sub-key holds the rest (the
# device, the constexprs, the integers' width). What Triton reads again on each launch of
# its own (its debug and instrumentation knobs, pre-run hooks) is read at the first launch
# of a sub-key only. `fast`: the same arguments with tensors given as their addresses (what
# the compiled launch passes on, without asking each tensor and the driver again).
# FP8_RELOAD_FAST_LAUNCH=0: always through Triton (for an A/B); so too after a compiled
# kernel's `run` refused its arguments once (another Triton's private signature).
PREPARED = os.environ.get("FP8_RELOAD_FAST_LAUNCH", "1") != "0"


def _launch(kernel, compiled: dict, sub: tuple, grid: tuple, args: tuple, dev: int, fast: tuple = ()) -> None:
    global PREPARED
    run = compiled.get(sub) if PREPARED and dev >= 0 else None
    hooks = triton.knobs.runtime if run is not None else None
    if (run is not None and torch._C._cuda_getDevice() == dev
            and not getattr(hooks.launch_enter_hook, "calls", hooks.launch_enter_hook)
            and not getattr(hooks.launch_exit_hook, "calls", hooks.launch_exit_hook)):
        try:
            run.run(*grid, *(1,) * (3 - len(grid)), torch._C._cuda_getCurrentRawStream(dev), run.function,
                    run.packed_metadata, None, None, None, *(fast or args))
            return
        except (TypeError, AttributeError) as exc:  # refused before anything was launched
            PREPARED = False
            warnings.warn(f"processing launches go through Triton from now on: {exc}", stacklevel=3)
    # the first launch of this sub-key (or a profiler's launch hooks): through Triton, which
    # compiles and binds, on the tensors' device (Triton launches on the current one)
    with torch.cuda.device(dev) if dev >= 0 else contextlib.nullcontext():
        run = kernel[grid](*args)
    if sub is not None and dev >= 0 and not INTERPRET:
        if len(compiled) > 1024:
            compiled.clear()
        compiled[sub] = run


def requantize_w13_(w13: torch.Tensor, w13_scale: torch.Tensor, experts: list[int],
                    input_scales=None, cache: dict | None = None) -> None:
    """`processing.ops.requantize_w13_to_expert_max_` (plus `merge_input_scales_` of
    ``input_scales = ((a13, a13_raw), (a2, a2_raw))``) in one launch.

    `experts` are local slots (one listed twice counts once); a run of consecutive slots
    (every expert, or one) is passed as its first slot and count, anything else as a
    table copied to the device.
    """
    if type(experts) is not list:  # (a set, a tuple, a range)
        experts = list(experts)
    k = len(experts)
    if k > 1:
        experts = list(dict.fromkeys(experts))  # a slot listed twice is requantized once
        k = len(experts)
    elif k == 0:
        return
    merge = input_scales is not None
    (a13, a13_raw), (a2, a2_raw) = input_scales if merge else ((w13_scale, w13_scale),) * 2
    input_scales = ((a13, a13_raw), (a2, a2_raw)) if merge else None  # (read once: an iterator)
    # what `_fp8_layer` checked: another tensor at a cached address (or another device, or
    # the same memory seen through other strides) is checked again
    dev = w13.get_device()
    key = (merge, dev, w13.data_ptr(), w13.dtype, w13.shape, w13.stride(),  # (written out: a generator
           w13_scale.data_ptr(), w13_scale.dtype, w13_scale.shape, w13_scale.stride(),  # costs ~1 us)
           a13.data_ptr(), a13.dtype, a13.shape, a13.stride(), a13_raw.data_ptr(), a13_raw.dtype,
           a13_raw.shape, a13_raw.stride(), a2.data_ptr(), a2.dtype, a2.shape, a2.stride(),
           a2_raw.data_ptr(), a2_raw.dtype, a2_raw.shape, a2_raw.stride())
    entry = _layer(key, lambda: _fp8_layer(w13, w13_scale, input_scales), cache)
    ticket, half, e_all, compiled, ptrs, block_e = entry
    if k == 1:
        listed = False
        if not 0 <= experts[0] < e_all:
            raise IndexError(f"requantize_w13_: expert {experts[0]} outside the layer's {e_all}")
        first = int(experts[0])
    else:
        if min(experts) < 0 or max(experts) >= e_all:
            raise IndexError(f"requantize_w13_: experts {experts} outside the layer's {e_all}")
        first = int(experts[0])
        listed = experts != list(range(first, first + k))
    idx = device_ints(experts, w13.device) if listed else ticket  # (unused when not listed)
    iters = _iters(k)
    grid = (k, cdiv(half, BLOCK * iters))
    block_k = min(1024, next_pow2(k))
    args = (w13, w13_scale, idx, first, k, ticket, a13, a13_raw, a2, a2_raw, half, e_all, listed, merge,
            iters, BLOCK, block_k, block_e, EXACT)
    p13, p_scale, p_ticket, *p_inputs = ptrs
    fast = (p13, p_scale, idx.data_ptr() if listed else p_ticket, first, k, p_ticket, *p_inputs, *args[10:])
    try:
        _launch(_requant_w13_kernel, compiled, (listed, iters, block_k, BLOCK, EXACT), grid, args, dev, fast)
    except BaseException:  # a launch cut short may leave its ticket counter non-zero, which would
        (_LAYERS if cache is None else cache).pop(key, None)  # break every later launch's "last
        raise  # program": a new one


# The bf16 quantization's compiled kernels by sub-key: a handful (a layer shape, one expert
# or more, the blocks per program), the number held bounded as a layer's are.
_BF16_AMAX: dict = {}
_BF16_QUANT: dict = {}


def quantize_experts_(device, numel: int, cols13: int, rows: list[tuple[int, ...]]) -> None:
    """Quantize bf16 experts into FP8 slots in place, one dynamic scale for each expert's
    gate + up and one for its down (what a fresh load computes), in two launches.

    Each row holds addresses: ``(src_gate, src_up, src_down, dst_w13, dst_w2, scale13,
    scale2)``; the sources are `numel` contiguous bf16 elements each, ``dst_w13`` the
    expert's ``2 * numel`` FP8 gate then up rows, ``dst_w2`` its `numel` down, ``scale13``
    `cols13` float32 slots (1 or 2), ``scale2`` one. The caller guarantees sizes, dtypes,
    contiguity and the device; one expert's row travels as arguments, more as one table.
    """
    k = len(rows)
    if k == 0:
        return
    one = k == 1
    args = rows[0] if one else (0,) * 7
    table = None if one else device_ints([a for row in rows for a in row], device)
    iters = _iters(k)
    p_all = cdiv(numel, BLOCK * iters)
    partial = torch.empty(k * 3 * p_all, dtype=torch.float32, device=device)
    table = partial if one else table  # (unused when one)
    grid = (k, 3, p_all)
    # weights and staged pieces start on 16 bytes (allocations); a piece read in place from a
    # checkpoint may not: then every element moves on its own
    low = numel
    for row in rows:  # (an OR of every address: 3x faster than testing each)
        low |= row[0] | row[1] | row[2] | row[3] | row[4]
    aligned = low % 16 == 0
    # Triton types an integer by its width (i32 below 2**31, else i64): part of the sub-key;
    # addresses of both widths at once (no device gives those) are never cached. The two
    # tensors are fresh allocations (256-byte aligned): Triton's alignment specialization
    # of them never varies, so it is not in the sub-key.
    lo, hi = min(args), max(args)
    wide = True if lo >= 1 << 31 and hi < 1 << 63 else False if 0 <= lo and hi < 1 << 31 else None
    dev = partial.get_device()
    sub = (dev, numel, cols13, one, iters, BLOCK, EXACT, aligned, wide) if wide is not None else None
    rblock = min(1024, next_pow2(2 * p_all))
    amax_args = (table, *args, partial, numel, one, iters, BLOCK, aligned)
    quant_args = (table, *args, partial, INV_FP8_MAX, MIN_SCALE, numel, cols13, one, iters, BLOCK, rblock,
                  EXACT, aligned)
    p_table, p_partial = table.data_ptr(), partial.data_ptr()
    _launch(_expert_amax_kernel, _BF16_AMAX, sub, grid, amax_args, dev,
            (p_table, *args, p_partial, *amax_args[9:]))
    _launch(_expert_quant_kernel, _BF16_QUANT, sub, grid, quant_args, dev,
            (p_table, *args, p_partial, *quant_args[9:]))


__all__ = ["quantize_experts_", "requantize_w13_"]
