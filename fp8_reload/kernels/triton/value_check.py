"""The value check of a whole batch of tensors in one launch (`checkpoint.values` on a GPU).

Torch reductions cost a few launches per tensor or per dtype group, and a checkpoint has
thousands of tensors: that check is launch-bound (~50 ms for 1.74 GB that HBM reads in
~0.5 ms). Here one kernel reads every tensor of a batch through a pointer table and
tests raw bits, never converting a value:

* non-finite: the exponent bits all ones (``bits & EXPONENT == EXPONENT``). For e4m3fn
  that is 0x7f/0xff (its NaNs), for e5m2 0x7c..0x7f and 0xfc..0xff (inf and NaN);
* `positive` (scales): also refused where the signed integer view is <= 0, i.e. the
  sign bit is set (negative, -0.0) or every bit is zero (+0.0). A positive subnormal
  passes, as ``x > 0`` lets it.

The work is cut into programs of `span` elements, never across tensors; `owner` maps
each program to its tensor, so a 1-element scale and a 100 MB weight share one launch
without empty programs. Whole blocks load unmasked, as 16-byte vectors on a GPU where
the tensor starts 16-byte aligned (a flag per tensor); only a tensor's last block is
masked.
"""

from __future__ import annotations

import torch

from .runtime import check_device, tl, triton

# dtype -> (bytes per element, exponent bits in the integer view of that width)
EXPONENT = {torch.float8_e4m3fn: (1, 0x7F), torch.float8_e5m2: (1, 0x7C),
            torch.bfloat16: (2, 0x7F80), torch.float16: (2, 0x7C00),
            torch.float32: (4, 0x7F800000)}
BLOCK = 4096
MAX_PROGRAMS = 1 << 15  # the owner table's length, whatever the batch's size
# table columns: address, element count, exponent mask, code (bytes per element | 8 if it
# must be positive | 16 if 16-byte aligned), first program, flag; then each program's tensor


def supported(t: torch.Tensor) -> bool:
    """Whether the kernel can check `t` (others go through torch): a dtype of `EXPONENT`
    (not float64: the torch path judges its scales after a float32 conversion), dense."""
    return t.dtype in EXPONENT and t.is_contiguous()


@triton.jit
def _bad_bits(addr, offs, count, emask, width, positive, FULL: tl.constexpr,
              ALIGNED: tl.constexpr):
    """1 where the element at `offs` holds an invalid value, from its bits. ALIGNED: the
    tensor starts 16-byte aligned, so whole blocks load as 16-byte vectors."""
    mask = offs < count
    if width == 1:
        p8 = addr.to(tl.pointer_type(tl.int8))
        if ALIGNED:
            p8 = tl.multiple_of(p8, 16)
        if FULL:
            x = tl.load(p8 + offs).to(tl.int32)
        else:
            x = tl.load(p8 + offs, mask=mask, other=1).to(tl.int32)
    elif width == 2:
        p16 = addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            p16 = tl.multiple_of(p16, 16)
        if FULL:
            x = tl.load(p16 + offs).to(tl.int32)
        else:
            x = tl.load(p16 + offs, mask=mask, other=1).to(tl.int32)
    else:
        p32 = addr.to(tl.pointer_type(tl.int32))
        if ALIGNED:
            p32 = tl.multiple_of(p32, 16)
        if FULL:
            x = tl.load(p32 + offs)
        else:
            x = tl.load(p32 + offs, mask=mask, other=1)
    bad = (x & emask) == emask
    if positive:
        bad = bad | (x <= 0)
    return (bad & mask).to(tl.int32)


@triton.jit
def _value_check_kernel(table_ptr, n, span, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(table_ptr + 6 * n + pid)
    addr = tl.load(table_ptr + t)
    count = tl.load(table_ptr + n + t)
    emask = tl.load(table_ptr + 2 * n + t).to(tl.int32)
    code = tl.load(table_ptr + 3 * n + t)
    width = code & 7
    positive = (code & 8) != 0
    aligned = (code & 16) != 0
    first = tl.load(table_ptr + 4 * n + t)
    per = span // BLOCK
    b0 = (pid - first) * per  # this program's blocks of its tensor: [b0, b1)
    b1 = tl.minimum(b0 + per, (count + BLOCK - 1) // BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(b0, b1):
        offs = b * BLOCK + tl.arange(0, BLOCK)  # b * BLOCK: a multiple of BLOCK (alignment)
        if (b + 1) * BLOCK <= count:
            if aligned:
                acc |= _bad_bits(addr, offs, count, emask, width, positive, True, True)
            else:
                acc |= _bad_bits(addr, offs, count, emask, width, positive, True, False)
        else:
            acc |= _bad_bits(addr, offs, count, emask, width, positive, False, False)
    if tl.max(acc, axis=0) > 0:
        tl.store(table_ptr + 5 * n + t, 1)


def value_flags_(tensors: list[torch.Tensor], positive: list[bool]) -> torch.Tensor:
    """Flags (int64, one per tensor, nonzero where an invalid value was found) of
    `supported` tensors on one device, in one launch; `positive[i]`: tensor i must also
    be > 0 (a scale). Nothing is read back: the caller reads the flags once, at the end.

    The table and the zeroed flags travel in one host-to-device copy; the flags are a
    view of that table."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    check_device(tensors[0])
    dev = tensors[0].device
    for t in tensors:
        if not supported(t) or t.device != dev:
            raise ValueError(f"value_flags_: contiguous {', '.join(map(str, EXPONENT))} "
                             f"tensors on one device, got {t.dtype} on {t.device}")
    n = len(tensors)
    counts = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    blocks = (counts + BLOCK - 1) // BLOCK
    span = BLOCK * max(1, -(-int(blocks.sum()) // MAX_PROGRAMS))  # bounds the owner table
    per = (counts + span - 1) // span
    owner = torch.repeat_interleave(torch.arange(n), per)
    widths = [EXPONENT[t.dtype] for t in tensors]
    columns = torch.tensor([[t.data_ptr() for t in tensors], [m for _, m in widths],
                            [w | (8 if p else 0) | (16 if t.data_ptr() % 16 == 0 else 0)
                             for t, (w, _), p in zip(tensors, widths, positive)]],
                           dtype=torch.int64)
    table = torch.cat([columns[0], counts, columns[1], columns[2], per.cumsum(0) - per,
                       torch.zeros(n, dtype=torch.int64), owner])
    if dev.type == "cuda":  # one copy from pinned memory, which torch keeps until it ran
        table = table.pin_memory().to(dev, non_blocking=True)
    if owner.numel():
        _value_check_kernel[(owner.numel(),)](table, n, span, BLOCK=BLOCK)
    return table[5 * n:6 * n]


__all__ = ["BLOCK", "EXPONENT", "MAX_PROGRAMS", "supported", "value_flags_"]
