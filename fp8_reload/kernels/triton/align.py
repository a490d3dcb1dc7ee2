"""Routing on the device in two launches: token-slot pairs grouped by expert, padded to
the GEMM's row block (what `routing.contiguous_rows` does with a dozen torch ops).

* `_align_kernel`, one program: per-expert counts (a histogram of the expert ids),
  each expert's first row (runs padded to `BLOCK_M`), the expert of every row
  block, and every row marked as padding (-1).
* `_scatter_kernel`, one program per block of pairs: each pair takes the next free
  row of its expert (an atomic cursor) and records it both ways (pair -> row,
  row -> pair).

Within an expert, pairs land in the order the atomics serve them, which can
differ between runs. The forward does not depend on it: every row of a grouped
GEMM is computed on its own (no reduction across rows), dynamic activation
scales are maxima, and the combine sums each token's top-k rows in slot order.
The row count is the same static bound as `contiguous_rows`, so the launches can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..routing import RoutedRows, align_up
from .runtime import INTERPRET, cdiv, check_device, next_pow2, tl, triton

PAIRS_PER_PROGRAM = 256
CHUNK = 1024  # pairs (and rows) the align program handles at once
B_CHUNK = 64  # row blocks at once: a [B_CHUNK, experts] comparison


@triton.jit
def _align_kernel(ids_ptr, cursor_ptr, block_expert_ptr, row_pair_ptr, num_pairs, num_experts,
                  num_rows, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr,
                  B_CHUNK: tl.constexpr):
    counts = tl.zeros([E_POW2], tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        # lanes past the last pair count into the last bin, which no expert owns (E_POW2 > E)
        ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=E_POW2 - 1).to(tl.int32)
        counts += tl.histogram(ids, E_POW2)
    e = tl.arange(0, E_POW2)
    counts = tl.where(e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(cursor_ptr + e, starts, mask=e < num_experts)
    used = tl.max(ends, axis=0)
    for b0 in range(0, num_rows // BLOCK_M, B_CHUNK):
        b = b0 + tl.arange(0, B_CHUNK)
        row = b * BLOCK_M
        # the expert of a block: how many runs end at or before its first row
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(row < used, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < num_rows // BLOCK_M)
    for r0 in range(0, num_rows, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(row_pair_ptr + r, tl.full([CHUNK], -1, tl.int32), mask=r < num_rows)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, pos_ptr, row_pair_ptr, num_pairs, PAIRS: tl.constexpr):
    p = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    ok = p < num_pairs
    e = tl.load(ids_ptr + p, mask=ok, other=0)
    row = tl.atomic_add(cursor_ptr + e, tl.full([PAIRS], 1, tl.int32), mask=ok)
    tl.store(pos_ptr + p, row, mask=ok)
    tl.store(row_pair_ptr + row, p.to(tl.int32), mask=ok)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutedRows:
    """`routing.contiguous_rows(topk_ids, num_experts, block_m)` in two launches.

    Returns the rows' pair and expert bookkeeping the Triton MoE kernels read
    (``row_pair``, ``block_experts``, ``pos``); per-row experts and per-expert counts,
    which only the DeepGEMM layouts need, are not computed.
    """
    check_device(topk_ids)
    top_k = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    p = ids.numel()
    num_rows = max(block_m, align_up(p + min(num_experts, p) * (block_m - 1), block_m))
    dev = ids.device
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_experts = torch.empty(num_rows // block_m, dtype=torch.int32, device=dev)
    row_pair = torch.empty(num_rows, dtype=torch.int32, device=dev)
    pos = torch.empty(p, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](ids, cursor, block_experts, row_pair, p, num_experts, num_rows,
                        BLOCK_M=block_m, E_POW2=next_pow2(num_experts + 1),
                        CHUNK=64 if INTERPRET else CHUNK, B_CHUNK=B_CHUNK)
    _scatter_kernel[(cdiv(p, PAIRS_PER_PROGRAM),)](ids, cursor, pos, row_pair, p,
                                                          PAIRS=PAIRS_PER_PROGRAM)
    return RoutedRows(pos=pos, row_expert=None, row_pair=row_pair, counts=None, num_rows=num_rows,
                      rows_per_group=num_rows, align=block_m, top_k=top_k,
                      block_experts=block_experts)
