"""Scatters a reload writes in one launch instead of one copy each: `write_scalars_`
(thousands of 0-dim scales, one float per address) and `copy_words_` (a chunk's tensors
from the device slot it landed in to their parameters). (The streaming reload's value
check is `value_check.value_flags_`, shared with `checkpoint.values`.)"""

from __future__ import annotations

import torch

from .runtime import check_device, device_ints, tl, triton

ROW_WORDS = 1 << 14  # 64 KiB: a copy is cut into rows of at most this many words, a program each


@triton.jit
def _scalars_kernel(addr_ptr, value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dst = tl.load(addr_ptr + i, mask=ok, other=0).to(tl.pointer_type(tl.float32))
    tl.store(dst, tl.load(value_ptr + i, mask=ok, other=0.0), mask=ok)


def write_scalars_(views: list[torch.Tensor], values: list[float]) -> None:
    """``views[i].fill_(values[i])`` for float32 0-dim views on one device, in one launch."""
    check_device(views[0])
    dev = views[0].device
    addrs = device_ints([v.data_ptr() for v in views], dev)
    vals = torch.tensor(values, dtype=torch.float32)
    if dev.type == "cuda":  # from pinned memory: no wait for the device
        vals = vals.pin_memory().to(dev, non_blocking=True)
    _scalars_kernel[(triton.cdiv(len(views), 1024),)](addrs, vals, len(views), BLOCK=1024)


@triton.jit
def _words_kernel(src_ptr, table_ptr, BLOCK: tl.constexpr):
    # row r of the table: (word offset in src, destination address, words)
    r = tl.program_id(0)
    at = tl.load(table_ptr + 3 * r)
    dst = tl.load(table_ptr + 3 * r + 1).to(tl.pointer_type(tl.int32))
    n = tl.load(table_ptr + 3 * r + 2)
    for i in range(0, n, BLOCK):
        k = i + tl.arange(0, BLOCK)
        ok = k < n
        tl.store(dst + k, tl.load(src_ptr + at + k, mask=ok), mask=ok)


def word_table(copies: list[tuple[int, int, int]], device) -> torch.Tensor:
    """The table `copy_words_` runs: `copies` as (byte offset in the source, destination
    address, bytes), each a multiple of 4, cut into rows of at most `ROW_WORDS` words."""
    rows = []
    for at, dst, nbytes in copies:
        if at % 4 or dst % 4 or nbytes % 4:
            raise ValueError(f"copy of {nbytes} B from offset {at} to {dst:#x}: not whole 32-bit words")
        words = nbytes // 4
        for k in range(0, words, ROW_WORDS):
            rows += (at // 4 + k, dst + 4 * k, min(ROW_WORDS, words - k))
    return device_ints(rows, device)


def copy_words_(src: torch.Tensor, table: torch.Tensor) -> None:
    """Every copy of `table` (`word_table`) out of `src` (a byte buffer on its device),
    in one launch. The destinations must stay allocated until it has run."""
    check_device(src)
    if table.numel():
        _words_kernel[(table.numel() // 3,)](src.view(torch.int32), table, BLOCK=1024)
