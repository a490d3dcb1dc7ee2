"""Tensor-level FP8 post-processing ops, in place and vectorized over experts.

These are what the fixed processing mode runs and what `sglang_patch` applies to
sglang's own classes. They work on the ``[E, 2]`` scale layout and on the listed
experts only, so an expert that was not reloaded is never touched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..quant import amax_scale, index_copy_, quantize_static, requantize

# Bound on float32 temporaries while (re)quantizing experts: experts are
# processed in chunks of at most this many bytes of float32.
CHUNK_BYTES = 128 << 20


def reload_memory_bound() -> int:
    """Device memory a reload may add above the loaded model: one processing chunk of
    float32 temporaries and its copy (requantizing makes two), whatever the model size.
    The asv suite records it beside the measured peaks, so a report judges each run by
    the bound of the code that was measured."""
    return 2 * CHUNK_BYTES


def gather_to(device, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Stack ``rows[k]`` (pieces concatenated along dim 0) into one new tensor on `device`.

    The pieces are copied straight into their slices (one async copy each from pinned
    staging memory): no host-side concatenation, and device memory holds only the result.
    """
    first = rows[0][0]
    height = sum(p.shape[0] for p in rows[0])
    out = torch.empty((len(rows), height, *first.shape[1:]), dtype=first.dtype, device=device)
    for k, pieces in enumerate(rows):
        start = 0
        for p in pieces:
            out[k].narrow(0, start, p.shape[0]).copy_(p, non_blocking=True)
            start += p.shape[0]
    return out


def chunks(idx: torch.Tensor, per_item_bytes: int) -> Iterable[torch.Tensor]:
    step = max(1, CHUNK_BYTES // max(per_item_bytes, 1))
    for i in range(0, idx.numel(), step):
        yield idx[i:i + step]


def requantize_w13_to_expert_max_(w13: torch.Tensor, w13_scale: torch.Tensor,
                                  experts: torch.Tensor, shard_size: int) -> None:
    """Give each listed expert one w13 scale, in place, vectorized over experts.

    `w13` is ``[E, 2*shard_size, H]`` FP8 holding gate rows then up rows, each
    quantized with its own scale in ``w13_scale[e, 0|1]``. Both halves move to
    ``max(scale[e])`` and both columns of ``w13_scale[e]`` are set to it, so the
    ``[E, 2]`` Parameter keeps its shape, its object and its loader. A half whose
    scale already is the max is left untouched (exact identity), so processing an
    expert twice changes nothing.
    """
    if experts.numel() == 0:
        return
    e_all, rows, hidden = w13.shape
    experts = experts.to(w13.device)
    for idx in chunks(experts, rows * hidden * 4):
        s = w13_scale.index_select(0, idx)  # [k, 2]
        m = s.amax(dim=1)  # [k]
        for half in (0, 1):
            moving = (s[:, half] != m).nonzero().flatten()
            if moving.numel() == 0:
                continue
            sel = idx.index_select(0, moving)
            block = w13.index_select(0, sel).narrow(1, half * shard_size, shard_size)
            new = requantize(block, s.index_select(0, moving)[:, half, None, None],
                             m.index_select(0, moving)[:, None, None])
            index_copy_(w13.narrow(1, half * shard_size, shard_size), 0, sel, new)
        w13_scale.index_copy_(0, idx, m[:, None].expand(-1, 2).contiguous())


def quantize_experts_(w: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                      values: torch.Tensor) -> None:
    """Quantize ``values[k]`` (high precision) into FP8 slots ``w[experts[k]]``.

    One dynamic per-tensor scale per expert (amax / 448), written into
    ``scale[experts]`` in place: every column of a ``[E, 2]`` scale gets it.
    """
    s = amax_scale(values, dims=tuple(range(1, values.dim())))  # [k]
    q = quantize_static(values, s.view(-1, *([1] * (values.dim() - 1))))
    idx = experts.to(w.device)
    index_copy_(w, 0, idx, q)
    if scale.dim() == 2:
        scale.index_copy_(0, idx, s[:, None].expand(-1, scale.shape[1]).contiguous())
    else:
        scale.index_copy_(0, idx, s)


def merge_input_scales_(param: torch.Tensor, raw: torch.Tensor,
                        experts: torch.Tensor) -> None:
    """Static input scales: kernels take one per layer, the max over experts.

    ``param`` ([E], loaded per expert) is overwritten in place with that max. The
    per-expert values are kept in ``raw`` so a reload of some experts recomputes
    the max from the true per-expert values, exactly as a fresh load would.
    """
    if experts.numel():
        idx = experts.to(param.device)
        raw.index_copy_(0, idx, param.index_select(0, idx).to(raw.dtype))
    param.fill_(raw.max())

