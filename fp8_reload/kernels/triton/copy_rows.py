"""Many byte ranges copied in one launch, from a table of (source, destination, bytes).

A rebalance moves thousands of rows (every moved slot of every layer, one row per
slot tensor) between Parameters and flat buffers; a streaming reload moves each chunk's
tensors from the device buffer it landed in to their Parameters. A torch copy per
tensor costs a launch and a handful of view ops each, and `index_select` on wide rows
runs well below copy bandwidth; here one kernel copies every row of a batch through an
address table built on the host (`row_table`, one copy to the device, reusable).

Work is cut into programs of `span` blocks, never across rows; `owner` maps each
program to its row (as `value_check` does). A row by its alignment: ends 16-byte
aligned and whole 32-bit words, as words with whole blocks unmasked (16-byte vectors);
ends 4-byte aligned (checkpoint tensors after 4-byte scales), as 32-bit words; any
other row (4-byte scales at odd offsets) byte by byte, 1 KiB a step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .runtime import INTERPRET, check_device, device_ints, owners, tl, triton

WORDS = 4096  # 32-bit words (16 KiB) per block
BLOCK_BYTES = 4 * WORDS
MAX_PROGRAMS = 1 << 15  # the owner table's length, whatever the batch's size
# table columns: source, destination, bytes, alignment (2, 1, 0), first program; then each program's row


@triton.jit
def _copy_rows_kernel(table_ptr, n, span, WORDS: tl.constexpr, BYTES: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.load(table_ptr + 5 * n + pid)
    src = tl.load(table_ptr + r)
    dst = tl.load(table_ptr + n + r)
    nbytes = tl.load(table_ptr + 2 * n + r)
    aligned = tl.load(table_ptr + 3 * n + r)
    first = tl.load(table_ptr + 4 * n + r)
    b0 = (pid - first) * span  # this program's blocks of its row: [b0, b1)
    b1 = tl.minimum(b0 + span, (nbytes + 4 * WORDS - 1) // (4 * WORDS))
    if aligned != 0:
        words = nbytes // 4
        for b in range(b0, b1):
            offs = b * WORDS + tl.arange(0, WORDS)
            if aligned == 2 and (b + 1) * WORDS <= words:  # each branch makes its own pointers (hints)
                s = tl.multiple_of(src.to(tl.pointer_type(tl.uint32)), 16)
                d = tl.multiple_of(dst.to(tl.pointer_type(tl.uint32)), 16)
                tl.store(d + offs, tl.load(s + offs))
            else:
                ok = offs < words
                s = src.to(tl.pointer_type(tl.uint32))
                d = dst.to(tl.pointer_type(tl.uint32))
                tl.store(d + offs, tl.load(s + offs, mask=ok), mask=ok)
    else:  # bytes, BYTES at a time (a block's worth of bytes would take many registers)
        steps = 4 * WORDS // BYTES
        for c in range(b0 * steps, tl.minimum(b1 * steps, (nbytes + BYTES - 1) // BYTES)):
            offs = c * BYTES + tl.arange(0, BYTES)
            ok = offs < nbytes
            s = src.to(tl.pointer_type(tl.uint8))
            d = dst.to(tl.pointer_type(tl.uint8))
            tl.store(d + offs, tl.load(s + offs, mask=ok), mask=ok)


class RowTable(NamedTuple):
    """A batch of copies ready to launch (`launch_rows_`) any number of times."""

    table: torch.Tensor  # on the device
    rows: int
    span: int
    programs: int


def row_table(src, dst, nbytes, device) -> RowTable:
    """The table of copying ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``
    (int64 host tensors or arrays; addresses on `device`). Ranges must not overlap a
    destination of another row (rows run concurrently). Built in numpy: a filtered
    reload builds one per chunk, and a dozen torch ops on a handful of rows cost ~0.3
    ms of host time (`gpu/filtered_probe.py`)."""
    src, dst, nbytes = (np.asarray(t, dtype=np.int64) for t in (src, dst, nbytes))
    keep = nbytes > 0
    src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    n = nbytes.size
    if not n:
        return RowTable(torch.empty(0, dtype=torch.int64), 0, 1, 0)
    blocks = (nbytes + BLOCK_BYTES - 1) // BLOCK_BYTES
    span = max(1, -(-int(blocks.sum()) // MAX_PROGRAMS))  # blocks per program
    per = (blocks + span - 1) // span
    owner = owners(per)
    words = (src % 4 == 0) & (dst % 4 == 0) & (nbytes % 4 == 0)
    aligned = words.astype(np.int64) + (words & (src % 16 == 0) & (dst % 16 == 0))
    table = np.concatenate([src, dst, nbytes, aligned, np.cumsum(per) - per, owner])
    return RowTable(device_ints(torch.from_numpy(table), device), n, span, owner.size)


def launch_rows_(rows: RowTable, device) -> None:
    """Run the copies of `rows` in one launch queued on the current stream; what they
    read and write must stay allocated until it has run."""
    if not rows.rows:
        return
    if torch.device(device).type == "cpu":
        check_device(torch.empty(0))
    opts = {} if INTERPRET else {"num_warps": 8}
    _copy_rows_kernel[(rows.programs,)](rows.table, rows.rows, rows.span, WORDS=WORDS, BYTES=1024, **opts)


def copy_rows_(src: torch.Tensor, dst: torch.Tensor, nbytes: torch.Tensor, device) -> None:
    """`row_table` then `launch_rows_`: one batch of copies, one launch."""
    launch_rows_(row_table(src, dst, nbytes, device), device)
