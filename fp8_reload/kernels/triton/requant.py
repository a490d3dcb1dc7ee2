"""Post-load processing of FP8 MoE layers at memory speed: in place, reloaded experts only.

One reloaded expert is a few MiB, microseconds of device time: what it costs is the host
time of its launch, so each job is one launch, made through the compiled kernel once
Triton has compiled it (`runtime.Launcher`: 5 us of host time against 15 us through
Triton's launcher on an H200 host), and the host work around it is cached per layer
(`_layer`):

* `requantize_w13_` (FP8 checkpoints), ONE launch: each listed expert's gate or up half
  whose scale is below the expert's max moves to it, ``q * (old / new)`` rounded back to
  e4m3; the last program to finish (a ticket counter) then sets both columns of
  ``w13_weight_scale[e]`` to the max and merges the static input scales. The scales are
  written only after every program has read them: no second launch, no host sync.
* `quantize_experts_` (bf16 checkpoints quantized on load), ONE cooperative launch: every
  program takes the maxima of its blocks of an expert's gate + up and of its down, waits
  at a grid-wide barrier, then writes ``x / scale`` rounded to e4m3 into the FP8 slots,
  ``scale = amax * (1 / 448)`` reduced from every program's maxima. The second read of
  an expert's 17 MB comes from L2, so memory sees each byte once. One expert passes its
  addresses as arguments; more go through one small host-to-device table.

Bit for bit what the torch path (`processing.ops`) computes: the same float32 operations
in the same order, IEEE-rounded division (`tl.math.div_rn`) where torch
divides two tensors, and round-to-nearest-even e4m3 conversion.
"""

from __future__ import annotations

import functools

import torch

from ...quant import INV_FP8_MAX, MIN_SCALE
from .fp8 import to_fp8
from .runtime import INTERPRET, Launcher, cdiv, check_device, device_ints, next_pow2, tl, triton

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
def _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, row, col, ONE: tl.constexpr):
    """Column `col` of expert `row`: from the arguments (ONE expert) or the device table
    ``[k, 7]``: src gate, src up, src down, dst w13, dst w2, scale13, scale2."""
    if ONE:
        v = tl.where(col == 0, a0, tl.where(col == 1, a1, tl.where(col == 2, a2, tl.where(
            col == 3, a3, tl.where(col == 4, a4, tl.where(col == 5, a5, a6))))))
    else:
        v = tl.load(table_ptr + row * 7 + col)
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


@triton.jit
def _expert_amax(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, sync_ptr, partial_ptr, NUMEL: tl.constexpr,
                 ONE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's maxima of |x| over its blocks of expert i's gate + up and of its down,
    into its slot of buffer ``i % 4``, then its arrival at barrier i."""
    n_prog = tl.num_programs(0)
    nb = (NUMEL + BLOCK - 1) // BLOCK
    a13 = tl.zeros([BLOCK], tl.float32)
    a2m = tl.zeros([BLOCK], tl.float32)
    for b in range(tl.program_id(0), 3 * nb, n_prog):
        j = b // nb  # the piece: gate, up, down
        src = _pointer(_row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, j, ONE), tl.bfloat16, ALIGNED)
        offs = (b - j * nb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.abs(tl.load(src + offs, mask=offs < NUMEL, other=0.0).to(tl.float32))
        a13 = tl.maximum(a13, tl.where(j == 2, 0.0, x))
        a2m = tl.maximum(a2m, tl.where(j == 2, x, 0.0))
    slot = partial_ptr + ((i % 4) * n_prog + tl.program_id(0)) * 2
    tl.store(slot, tl.max(a13, axis=0))
    tl.store(slot + 1, tl.max(a2m, axis=0))
    tl.debug_barrier()  # the stores above, then the arrival (release)
    tl.atomic_add(sync_ptr + i % 4, 1, sem="release")


@triton.jit
def _expert_quant(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, sync_ptr, partial_ptr, inv_fp8_max, min_scale,
                  NUMEL: tl.constexpr, COLS13: tl.constexpr, ONE: tl.constexpr, BLOCK: tl.constexpr,
                  PBLOCK: tl.constexpr, EXACT: tl.constexpr, ALIGNED: tl.constexpr):
    """Wait until every program arrived at barrier i (counter ``i % 4`` reaches its share),
    reduce the scales from every program's maxima, and quantize this program's blocks of
    expert i (read again, from L2: the expert was just read); program 0 writes the scales."""
    n_prog = tl.num_programs(0)
    while tl.load(sync_ptr + i % 4, volatile=True) < n_prog * (i // 4 + 1):  # polled without atomics,
        pass  # which the arrivals queue behind
    tl.atomic_add(sync_ptr + i % 4, 0, sem="acquire")  # orders the reads below after the arrivals
    tl.debug_barrier()
    r = tl.arange(0, PBLOCK)
    base = partial_ptr + (i % 4) * n_prog * 2
    m13 = tl.max(tl.load(base + 2 * r, mask=r < n_prog, other=0.0, cache_modifier=".cg"), axis=0)
    m2 = tl.max(tl.load(base + 2 * r + 1, mask=r < n_prog, other=0.0, cache_modifier=".cg"), axis=0)
    s13 = tl.maximum(m13 * inv_fp8_max, min_scale)
    s2 = tl.maximum(m2 * inv_fp8_max, min_scale)
    nb = (NUMEL + BLOCK - 1) // BLOCK
    for b in range(tl.program_id(0), 3 * nb, n_prog):
        j = b // nb
        src = _pointer(_row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, j, ONE), tl.bfloat16, ALIGNED)
        dst = _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, tl.where(j == 2, 4, 3), ONE)
        dst = _pointer(dst + tl.where(j == 1, NUMEL, 0), tl.float8e4nv, ALIGNED)
        offs = (b - j * nb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        q = to_fp8(tl.math.div_rn(x, tl.where(j == 2, s2, s13)), EXACT)
        tl.store(dst + offs, q, mask=mask)
    if tl.program_id(0) == 0:
        c = tl.arange(0, 2)
        out13 = _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, 5, ONE).to(tl.pointer_type(tl.float32))
        out2 = _row_address(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, 6, ONE).to(tl.pointer_type(tl.float32))
        tl.store(out13 + c, tl.zeros([2], tl.float32) + s13, mask=c < COLS13)
        tl.store(out2, s2)


@triton.jit(do_not_specialize=["a0", "a1", "a2", "a3", "a4", "a5", "a6", "k"])
def _quantize_experts_kernel(table_ptr, a0: tl.int64, a1: tl.int64, a2: tl.int64, a3: tl.int64,
                             a4: tl.int64, a5: tl.int64, a6: tl.int64, k, sync_ptr, partial_ptr, inv_fp8_max,
                             min_scale, NUMEL: tl.constexpr, COLS13: tl.constexpr, ONE: tl.constexpr,
                             BLOCK: tl.constexpr, PBLOCK: tl.constexpr, EXACT: tl.constexpr,
                             ALIGNED: tl.constexpr):
    """Every program (all resident at once: a cooperative launch) works on every expert, in
    order: its blocks' maxima, a grid-wide barrier, then those blocks quantized with the
    expert's scales, read again from L2 (memory sees each byte once). Buffers and counters
    rotate over four experts (a program cannot be four experts ahead of another). The last
    program out resets the counters for the next launch on this stream. (Taking the
    maxima of expert i + 1 before waiting at barrier i saves the wait but evicts expert i
    from L2: no faster on the H200, `results/h200/kernels-probe/launch_probe-*.txt`.)"""
    for i in range(k):
        _expert_amax(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, sync_ptr, partial_ptr, NUMEL, ONE, BLOCK,
                     ALIGNED)
        _expert_quant(table_ptr, a0, a1, a2, a3, a4, a5, a6, i, sync_ptr, partial_ptr, inv_fp8_max, min_scale,
                      NUMEL, COLS13, ONE, BLOCK, PBLOCK, EXACT, ALIGNED)
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 4, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for c in tl.static_range(5):  # every program has passed its last wait
            tl.atomic_xchg(sync_ptr + c, 0)


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


def _fp8_layer(w13, w13_scale, input_scales, tensors):
    check_device(w13)
    e_all, rows, hidden = w13.shape
    if not (w13.is_contiguous() and w13_scale.is_contiguous() and w13_scale.shape == (e_all, 2)
            and w13.dtype == torch.float8_e4m3fn and w13_scale.dtype == torch.float32):
        raise ValueError("requantize_w13_ needs contiguous FP8 w13 [E, 2I, H] and float32 w13_scale [E, 2]")
    for t in () if input_scales is None else (t for pair in input_scales for t in pair):
        if t.shape != (e_all,) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != w13.device:
            raise ValueError("requantize_w13_ needs contiguous float32 input scales [E] on w13's device")
    ticket = torch.zeros(1, dtype=torch.int32, device=w13.device)
    # what the launch specializes on besides the constexprs: which addresses are 16-byte aligned
    aligned = tuple(t.data_ptr() % 16 == 0 for t in (*tensors, ticket))
    return ticket, rows // 2 * hidden, e_all, aligned


_REQUANT = Launcher(_requant_w13_kernel)


def requantize_w13_(w13: torch.Tensor, w13_scale: torch.Tensor, experts: list[int],
                    input_scales=None, cache: dict | None = None) -> None:
    """`processing.ops.requantize_w13_to_expert_max_` (plus `merge_input_scales_` of
    ``input_scales = ((a13, a13_raw), (a2, a2_raw))``) in one launch.

    `experts` are local slots (one listed twice counts once); a run of consecutive slots
    (every expert, or one) is passed as its first slot and count, anything else as a
    table copied to the device.
    """
    experts = list(dict.fromkeys(experts))  # a slot listed twice is requantized once
    k = len(experts)
    if k == 0:
        return
    merge = input_scales is not None
    (a13, a13_raw), (a2, a2_raw) = input_scales if merge else ((w13_scale, w13_scale),) * 2
    # what `_fp8_layer` checked: another tensor at a cached address is checked again
    tensors = (w13, w13_scale, a13, a13_raw, a2, a2_raw)
    key = (merge, w13.stride(), *((t.data_ptr(), t.dtype, t.shape) for t in tensors))
    make = lambda: _fp8_layer(w13, w13_scale, input_scales, tensors)  # noqa: E731
    ticket, half, e_all, aligned = _layer(key, make, cache)
    first = int(experts[0])
    listed = k > 1 and experts != list(range(first, first + k))
    idx = device_ints(experts, w13.device) if listed else ticket  # (unused when not listed)
    iters = _iters(k)
    block_k, block_e = min(1024, next_pow2(k)), next_pow2(e_all)
    try:
        _REQUANT((k, cdiv(half, BLOCK * iters)), (merge, half, e_all, listed, iters, block_k, aligned),
                 w13, w13_scale, idx, first, k, ticket, a13, a13_raw, a2, a2_raw, half, e_all, listed, merge,
                 iters, BLOCK, block_k, block_e, EXACT)
    except BaseException:  # a launch cut short may leave its ticket counter non-zero, which would
        (_LAYERS if cache is None else cache).pop(key, None)  # break every later launch's "last
        raise  # program": a new one


QUANT_BLOCK = 8192  # elements per step of the quantization's programs
PROGRAMS_PER_SM = 2  # resident at once (a cooperative launch): enough loads in flight
QUANT_WARPS = 8
_QUANTIZE = Launcher(_quantize_experts_kernel)
_SYNC: dict = {}  # (device, stream) -> (counters, maxima): launches on one stream run in turn
_FEWER: dict = {}  # (device, kernel shape) -> programs, where the device holds fewer at once


@functools.cache
def _programs(device_index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def _scratch(device, programs: int):
    """The barrier counters (zero between launches) and the per-program maxima of this
    device and stream (a launch on another stream gets its own)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream, programs)
    entry = _SYNC.get(key)
    if entry is None:
        entry = _SYNC[key] = (torch.zeros(5, dtype=torch.int32, device=device),
                              torch.empty(4 * programs * 2, dtype=torch.float32, device=device))
    return entry


def quantize_experts_(device, numel: int, cols13: int, rows: list[tuple[int, ...]]) -> None:
    """Quantize bf16 experts into FP8 slots in place, one dynamic scale for each expert's
    gate + up and one for its down (what a fresh load computes), in one launch.

    Each row holds addresses: ``(src_gate, src_up, src_down, dst_w13, dst_w2, scale13,
    scale2)``; the sources are `numel` contiguous bf16 elements each, ``dst_w13`` the
    expert's ``2 * numel`` FP8 gate then up rows, ``dst_w2`` its `numel` down, ``scale13``
    `cols13` float32 slots (1 or 2), ``scale2`` one. The caller guarantees sizes, dtypes,
    contiguity and the device; one expert's row travels as arguments, more as one table.
    On a GPU every program is resident (a cooperative launch) and the experts are
    quantized one after another across all of them, each read from memory once and again
    from L2; the interpreter runs one program.
    """
    k = len(rows)
    if k == 0:
        return
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    one = k == 1
    args = rows[0] if one else (0,) * 7
    table = None if one else device_ints([a for row in rows for a in row], device)
    programs = 1 if INTERPRET else min(_programs(device.index), 3 * cdiv(numel, QUANT_BLOCK))
    # weights and staged pieces start on 16 bytes (allocations); a piece read in place from a
    # checkpoint may not: then every element moves on its own
    aligned = numel % 16 == 0 and all(a % 16 == 0 for row in rows for a in row[:5])
    shape = (numel, cols13, one, aligned, QUANT_BLOCK, QUANT_WARPS)
    programs = _FEWER.get((device.index, shape), programs)
    while True:
        sync, partial = _scratch(device, programs)
        pblock = next_pow2(programs)
        try:
            _QUANTIZE((programs,), (*shape, pblock),
                      partial if one else table, *args, k, sync, partial, INV_FP8_MAX, MIN_SCALE,
                      numel, cols13, one, QUANT_BLOCK, pblock, EXACT, aligned,
                      num_warps=QUANT_WARPS, launch_cooperative_grid=True)
            return
        except RuntimeError as exc:  # the compiled kernel needs more of an SM than assumed: the
            if "cooperative" not in str(exc) or programs == 1:  # driver refuses a grid that cannot
                raise  # be resident at once (nothing ran); fewer programs, remembered
            programs = _FEWER[(device.index, shape)] = programs // 2


__all__ = ["quantize_experts_", "requantize_w13_"]
