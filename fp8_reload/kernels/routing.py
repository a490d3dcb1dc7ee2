"""Token-slot pairs grouped by expert: the row layouts grouped GEMMs consume.

A routed token produces ``top_k`` pairs (token, slot); pair ``p = token * top_k + slot``
goes to expert ``topk_ids.flatten()[p]``. Grouped GEMMs want the pairs of one
expert in consecutive rows:

* **contiguous** (DeepGEMM ``m_grouped_*_contiguous``, the Triton fused MoE): each
  expert's run starts on a multiple of ``align`` rows and is padded up to one;
  ``row_expert`` (DeepGEMM's ``m_indices``) holds -1 on padding rows.
* **masked** (DeepGEMM ``m_grouped_*_masked``): expert ``e`` owns rows
  ``[e * max_m, (e + 1) * max_m)`` of an ``[E, max_m, K]`` tensor and the first
  ``counts[e]`` of them are valid.

Everything is computed with device ops and a row count that is a static upper
bound (no host synchronization), so a forward can be captured in a CUDA graph
and the GEMM shapes, and hence the JIT-compiled kernels, depend only on the
number of tokens. Expert ids must lie in ``[0, num_experts)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class RoutedRows:
    pos: torch.Tensor  # [P] int32: row of each (token, slot) pair
    row_expert: torch.Tensor  # [R] int32: expert of each row, -1 on padding
    row_pair: torch.Tensor  # [R] int32: pair of each row, -1 on padding
    counts: torch.Tensor  # [E] int32: pairs routed to each expert
    num_rows: int  # R, a static upper bound
    rows_per_group: int  # rows sharing one scale-factor block (R for contiguous, max_m for masked)
    align: int
    top_k: int
    block_experts: torch.Tensor | None = None  # [R / align] expert of each row block, when known

    @property
    def num_pairs(self) -> int:
        return self.pos.numel()

    def block_expert(self, block_m: int) -> torch.Tensor:
        """Expert of each `block_m`-row block (-1: nothing to compute); needs align % block_m == 0."""
        if self.block_experts is not None and block_m == self.align:
            return self.block_experts
        if self.align % block_m:
            raise ValueError(f"block_m={block_m} does not divide the row alignment {self.align}")
        return self.row_expert.view(-1, block_m)[:, 0].contiguous()


def _sort_pairs(topk_ids: torch.Tensor, num_experts: int):
    """Stable sort of the pairs by expert, per-expert counts and each pair's rank in its expert.

    Counts come from searchsorted on the sorted ids, not bincount (which reads
    the max back to the host and so cannot be captured in a CUDA graph).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    sorted_e, order = torch.sort(flat, stable=True)  # pairs of expert 0 first, then 1, ...
    edges = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, device=flat.device))
    first = edges[:-1]
    counts = edges[1:] - first
    rank = torch.arange(flat.numel(), device=flat.device) - first.index_select(0, sorted_e)
    return order, sorted_e, counts, rank


def _finish(order, sorted_e, counts, dest, num_rows, rows_per_group, align, top_k) -> RoutedRows:
    dev = order.device
    pos = torch.empty_like(order)
    pos[order] = dest
    row_expert = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    row_expert[dest] = sorted_e.to(torch.int32)
    row_pair = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    row_pair[dest] = order.to(torch.int32)
    return RoutedRows(pos.to(torch.int32), row_expert, row_pair, counts.to(torch.int32),
                      num_rows, rows_per_group, align, top_k)


def contiguous_rows(topk_ids: torch.Tensor, num_experts: int, align: int) -> RoutedRows:
    """Pairs sorted by expert, each expert's run padded to a multiple of `align` rows.

    The row count is the bound ``align_up(P + min(E, P) * (align - 1), align)``;
    rows past the last expert's run are padding too.
    """
    top_k = topk_ids.shape[-1]
    order, sorted_e, counts, rank = _sort_pairs(topk_ids, num_experts)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(padded, 0) - padded
    dest = start.index_select(0, sorted_e) + rank
    p = order.numel()
    num_rows = max(align, align_up(p + min(num_experts, p) * (align - 1), align))
    return _finish(order, sorted_e, counts, dest, num_rows, num_rows, align, top_k)


def masked_rows(topk_ids: torch.Tensor, num_experts: int, max_m: int) -> RoutedRows:
    """Expert `e`'s pairs in rows ``e * max_m + [0, counts[e])``.

    `max_m` must be at least the largest count; the number of tokens always is
    (an expert appears at most once in a token's top-k).
    """
    top_k = topk_ids.shape[-1]
    order, sorted_e, counts, rank = _sort_pairs(topk_ids, num_experts)
    dest = sorted_e * max_m + rank
    return _finish(order, sorted_e, counts, dest, num_experts * max_m, max_m, max_m, top_k)
