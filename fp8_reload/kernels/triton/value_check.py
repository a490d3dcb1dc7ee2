"""The value check of a whole batch of tensors in one launch (`checkpoint.values` on a GPU).

Torch reductions cost a few launches per tensor or per dtype group, and a checkpoint has
thousands of tensors: that check is launch-bound (~50 ms for 1.74 GB that HBM reads in
~0.5 ms). Here one kernel reads every tensor of a batch through a pointer table, as
32-bit words, and tests raw bits, never converting a value.

A value is non-finite when its exponent bits are all ones (e4m3fn: 0x7f/0xff, its NaNs;
e5m2: 0x7c.. inf and NaN; bf16 / fp16 / fp32: inf and NaN). A word holds 4, 2 or 1
values (lanes); with `mask` the exponent bits of every lane and `low` the lowest of
them, ``((word & mask) + low) & (mask + low)`` is nonzero exactly when some lane has all
its exponent bits set: a lane's masked bits plus `low` reach the lane's top bit only
from all ones, and never carry into the next lane. So one formula serves every dtype.
Scales (`positive`, float32 only) are also refused where the word as a signed integer
is <= 0: the sign bit set (negative, -0.0) or all bits zero (+0.0); a positive subnormal
passes, as ``x > 0`` lets it.

The work is cut into programs of `span` words, never across tensors; `owner` maps each
program to its tensor, so a 1-element scale and a 100 MB weight share one launch without
empty programs. Whole blocks load unmasked, as 16-byte vectors where the tensor starts
16-byte aligned; only a tensor's last block is masked. The kernel takes tensors whose
bytes are whole, aligned words (every weight and scale of a checkpoint); the torch path
checks the rest.
"""

from __future__ import annotations

import torch

from .runtime import check_device, device_ints, owners, tl, triton

# dtype -> (bytes per element, exponent bits of one element)
EXPONENT = {torch.float8_e4m3fn: (1, 0x7F), torch.float8_e5m2: (1, 0x7C),
            torch.bfloat16: (2, 0x7F80), torch.float16: (2, 0x7C00),
            torch.float32: (4, 0x7F800000)}
BLOCK = 2048  # words (8 KiB) per step of a program
MAX_PROGRAMS = 1 << 15  # the owner table's length, whatever the batch's size
# table columns: address, words, mask, low | positive << 32 | aligned << 33, first
# program; then each program's tensor


def word_masks(dtype: torch.dtype) -> tuple[int, int]:
    """(mask, low) of `dtype` for a 32-bit word: its lanes' exponent bits, their lowest."""
    width, exponent = EXPONENT[dtype]
    lanes = range(0, 32, 8 * width)
    return (sum(exponent << s for s in lanes), sum((exponent & -exponent) << s for s in lanes))


_WORDS = {dtype: (EXPONENT[dtype][0], *word_masks(dtype)) for dtype in EXPONENT}  # width, mask, low


def supported(t: torch.Tensor, positive: bool = False) -> bool:
    """Whether the kernel can check `t` (others go through torch): a dtype of `EXPONENT`
    (not float64: the torch path judges its scales after a float32 conversion), dense,
    whole aligned 32-bit words; a scale (`positive`) only as float32."""
    return (t.dtype in EXPONENT and t.is_contiguous() and (t.numel() * t.element_size()) % 4 == 0
            and t.data_ptr() % 4 == 0 and (not positive or t.dtype == torch.float32))


@triton.jit
def _value_check_kernel(table_ptr, flag_ptr, n, span, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(table_ptr + 5 * n + pid)
    words = tl.load(table_ptr + n + t)
    mask = tl.load(table_ptr + 2 * n + t).to(tl.uint32)
    code = tl.load(table_ptr + 3 * n + t)
    low = (code & 0xFFFFFFFF).to(tl.uint32)
    top = mask + low
    positive = ((code >> 32) & 1) != 0
    aligned = ((code >> 33) & 1) != 0
    addr = tl.load(table_ptr + t)
    first = tl.load(table_ptr + 4 * n + t)
    per = span // BLOCK
    b0 = (pid - first) * per  # this program's blocks of its tensor: [b0, b1)
    b1 = tl.minimum(b0 + per, (words + BLOCK - 1) // BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    for b in range(b0, b1):
        offs = b * BLOCK + tl.arange(0, BLOCK)  # b * BLOCK: a multiple of BLOCK (alignment)
        if (b + 1) * BLOCK <= words:
            # each branch makes its own pointer: the hint marks the op that made it, so a
            # pointer shared by both would be marked aligned in the other branch too
            if aligned:
                w = tl.load(tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16) + offs)
            else:
                w = tl.load(addr.to(tl.pointer_type(tl.uint32)) + offs)
        else:  # 1 is finite and > 0 in every dtype
            w = tl.load(addr.to(tl.pointer_type(tl.uint32)) + offs, mask=offs < words, other=1)
        bad = ((w & mask) + low) & top
        if positive:  # float32: negative, -0.0 or +0.0
            bad |= (w.to(tl.int32, bitcast=True) <= 0).to(tl.uint32)
        acc |= bad
    if tl.max(acc, axis=0) != 0:
        tl.store(flag_ptr + t, 1)


class ValueTable:
    """The kernel's table of `supported` tensors on one device, built once (a walk over
    every tensor: thousands per checkpoint) and launched as often as needed; it keeps the
    tensors, so their memory stays where the table points. `positive[i]`: tensor i must
    also be > 0 (a scale)."""

    def __init__(self, tensors: list[torch.Tensor], positive: list[bool]):
        dev = tensors[0].device if tensors else torch.device("cpu")
        ptrs, words, masks, codes = [], [], [], []
        for t, p in zip(tensors, positive):  # one pass: thousands of tensors per call
            width, mask, low = _WORDS.get(t.dtype, (0, 0, 0))
            ptr, nbytes = t.data_ptr(), t.numel() * width
            if (not width or nbytes % 4 or ptr % 4 or t.device != dev or not t.is_contiguous()
                    or (p and width != 4)):
                raise ValueError(f"value_flags_: contiguous {', '.join(map(str, EXPONENT))} tensors of "
                                 "whole aligned 32-bit words on one device (scales float32), got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
            ptrs.append(ptr)
            words.append(nbytes >> 2)
            masks.append(mask)
            codes.append(low | (bool(p) << 32) | ((ptr % 16 == 0) << 33))
        if tensors:
            check_device(tensors[0])
        self.tensors, self.device, self.n = list(tensors), dev, len(tensors)
        words = torch.tensor(words, dtype=torch.int64)
        blocks = (words + BLOCK - 1) // BLOCK
        self.span = BLOCK * max(1, -(-int(blocks.sum()) // MAX_PROGRAMS))  # bounds the owner table
        per = (words + self.span - 1) // self.span
        owner = torch.from_numpy(owners(per))
        self.programs = owner.numel()
        columns = torch.tensor([ptrs, masks, codes], dtype=torch.int64).view(3, -1)
        table = torch.cat([columns[0], words, columns[1], columns[2], per.cumsum(0) - per, owner])
        self.table = device_ints(table, dev)  # one copy

    def flags(self) -> torch.Tensor:
        """Flags (int64, one per tensor, nonzero where an invalid value was found), queued
        on the current stream: nothing is read back."""
        flags = torch.zeros(self.n, dtype=torch.int64, device=self.device)
        if self.programs:
            _value_check_kernel[(self.programs,)](self.table, flags, self.n, self.span, BLOCK=BLOCK)
        return flags


def value_flags_(tensors: list[torch.Tensor], positive: list[bool]) -> torch.Tensor:
    """`ValueTable(tensors, positive).flags()`: one launch for a batch, checked once."""
    return ValueTable(tensors, positive).flags()


__all__ = ["BLOCK", "EXPONENT", "MAX_PROGRAMS", "ValueTable", "supported", "value_flags_", "word_masks"]
