"""Tensor-level FP8 post-processing ops, in place and vectorized over experts.

These are what the fixed processing mode runs and what `sglang_patch` applies to
sglang's own classes. They work on the ``[E, 2]`` scale layout and on the listed
experts only, so an expert that was not reloaded is never touched.

On a CUDA device that runs Triton's FP8 conversion they run as a few Triton
launches per layer (`kernels.triton.requant`: no float32 copy of the weights, no
host synchronization); elsewhere as torch ops in float32 chunks of at most
`CHUNK_BYTES`. Both give the same bytes (`tests/test_requant.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ..kernels.registry import triton_unavailable
from ..quant import FP8_DTYPE, amax_scale, index_copy_, quantize_static, requantize

# Bound on float32 temporaries while (re)quantizing experts: experts are
# processed in chunks of at most this many bytes of float32.
CHUNK_BYTES = 128 << 20


def reload_memory_bound() -> int:
    """Device memory a reload may add above the loaded model, whatever the model size: the
    torch path's worst case, one processing chunk of float32 temporaries and its copy
    (requantizing makes two); the Triton path stays below it. The asv suite records it
    beside the measured peaks, so a report judges each run by the bound of the code that
    was measured."""
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
    """`idx` in pieces of at most `CHUNK_BYTES` worth of items (all at once for 0 bytes)."""
    step = max(1, CHUNK_BYTES // per_item_bytes) if per_item_bytes > 0 else max(1, idx.numel())
    for i in range(0, idx.numel(), step):
        yield idx[i:i + step]


@functools.cache
def _triton_runs_here() -> bool:
    return triton_unavailable() is None


def on_triton(t: torch.Tensor) -> bool:
    """Whether `t` is processed by the Triton kernels (a CUDA tensor, Triton usable)."""
    return t.is_cuda and _triton_runs_here()


@functools.cache
def _requant():
    from ..kernels.triton import requant  # needs triton: imported on use (once: an import
                                          # statement costs a reloaded expert ~2 us a call)
    return requant


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
    process_fp8_experts_(w13, w13_scale, experts, shard_size)


def _requantize_torch_(w13: torch.Tensor, w13_scale: torch.Tensor, experts: torch.Tensor,
                       shard_size: int) -> None:
    rows, hidden = w13.shape[1:]
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


def process_fp8_experts_(w13: torch.Tensor, w13_scale: torch.Tensor, experts: torch.Tensor | list[int],
                         shard_size: int, input_scales=None, cache: dict | None = None) -> None:
    """The whole processing of an FP8-checkpoint MoE layer's listed experts: the static
    input scales merged (`merge_input_scales_` of each ``(param, raw)`` in
    `input_scales`), then `requantize_w13_to_expert_max_`. One launch on Triton (one
    reloaded expert costs that launch's host time: keep Python out of this path). `cache`:
    where the launch keeps what it checked of these tensors (the layer's, if given)."""
    ids = experts if isinstance(experts, list) else experts.tolist()
    if ids and w13.shape[1] != 2 * shard_size:
        raise ValueError(f"w13 has {w13.shape[1]} rows, not gate + up of {shard_size} each")
    if ids and on_triton(w13):
        _requant().requantize_w13_(w13, w13_scale, ids, input_scales, cache)
        return
    idx = torch.tensor(ids, dtype=torch.long)
    for param, raw in input_scales or ():
        merge_input_scales_(param, raw, idx)
    if ids:
        _requantize_torch_(w13, w13_scale, idx, shard_size)


def fp8_expert_layout(w13, w13_scale, w2, w2_scale) -> bool:
    """Whether a layer's experts can be quantized by address (`expert_row`): contiguous
    1-byte FP8 weights and float32 scales, the byte offsets the rows assume."""
    return (w13.dtype == w2.dtype == FP8_DTYPE and w13_scale.dtype == w2_scale.dtype == torch.float32
            and w13.is_contiguous() and w13_scale.is_contiguous() and w2.is_contiguous()
            and w2_scale.is_contiguous())


def expert_rows(w13, w13_scale, w2, w2_scale):
    """``row(slot, sources)``: slot `slot`'s row for the Triton `quantize_experts_`, the
    addresses of its bf16 gate, up and down (`sources`), then of its FP8 w13 and w2 rows and
    its two scales (a layer of `fp8_expert_layout`; the layer's addresses read once)."""
    b13, st13, b2, st2 = w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0)
    c13, cst13 = w13_scale.data_ptr(), 4 * w13_scale.stride(0)
    c2, cst2 = w2_scale.data_ptr(), 4 * w2_scale.stride(0)
    return lambda slot, src: (*src, b13 + slot * st13, b2 + slot * st2, c13 + slot * cst13, c2 + slot * cst2)


def quantize_staged_by_address_(w13, w13_scale, w2, w2_scale, staged, slots: list[int]) -> None:
    """Two launches per chunk of experts, each expert a row of addresses computed from the
    layout (a view per piece costs more host time than one expert's kernels take). Pieces
    on the device are read where they are; others are copied over a chunk at a time.
    Every piece is checked before anything is written."""
    numel = w13.shape[1] // 2 * w13.shape[2]
    e = w13.shape[0]
    if w2.shape[0] != e or w13_scale.shape[0] != e or w2_scale.shape[0] != e or w2[0].numel() != numel:
        raise ValueError("quantize-on-load: w13, w2 and their scales hold other expert counts or sizes")
    if slots and (min(slots) < 0 or max(slots) >= e):
        raise IndexError(f"quantize-on-load: expert slots {slots} outside the layer's {e}")
    dev = w13.get_device()
    bf16 = torch.bfloat16
    row = expert_rows(w13, w13_scale, w2, w2_scale)
    rows, on_device = [], True  # one pass: a layer's 64 experts are 192 pieces to check
    for s in slots:
        p = staged[s]
        gate, up, down = p["w1"], p["w3"], p["w2"]
        for t in (gate, up, down):
            if t.dtype is not bf16 or t.numel() != numel or not t.is_contiguous():
                raise ValueError(f"quantize-on-load: expert slot {s} has pieces of another size or dtype")
            if t.get_device() != dev:
                on_device = False
        if on_device:  # (else the rows are made below, from the copies' addresses)
            rows.append(row(s, (gate.data_ptr(), up.data_ptr(), down.data_ptr())))
    cols = w13_scale.numel() // w13_scale.shape[0]
    if on_device:  # read where they are: one chunk
        _requant().quantize_experts_(w13.device, numel, cols, rows)
        return
    step = max(1, CHUNK_BYTES // (3 * numel * 2))
    for i in range(0, len(slots), step):
        rows, copies = [], []
        for s in slots[i:i + step]:
            # kept (`copies`) until the kernels are queued behind them
            p = {n: t.to(w13.device, non_blocking=True) for n, t in staged[s].items()}
            copies.append(p)
            rows.append(row(s, (p["w1"].data_ptr(), p["w3"].data_ptr(), p["w2"].data_ptr())))
        _requant().quantize_experts_(w13.device, numel, cols, rows)


def quantize_staged_experts_(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                             w2_scale: torch.Tensor, staged: dict[int, dict[str, torch.Tensor]]) -> None:
    """Quantize staged bf16 experts ``{slot: {"w1": gate, "w3": up, "w2": down}}`` into the
    FP8 weights, one dynamic scale per expert and weight (what a fresh load computes).

    Device memory beyond the weights stays within one chunk of `CHUNK_BYTES`: staged
    pieces already on the device are read where they are; others are copied over a
    chunk at a time.
    """
    slots = sorted(staged)
    if not slots:
        return
    inter = w13.shape[1] // 2
    # the address path assumes bf16 pieces, 1-byte FP8 weights and float32 scales (its byte
    # offsets): bf16 is the first piece's, each piece is checked there
    if (on_triton(w13) and next(iter(staged[slots[0]].values())).dtype == torch.bfloat16
            and fp8_expert_layout(w13, w13_scale, w2, w2_scale)):
        quantize_staged_by_address_(w13, w13_scale, w2, w2_scale, staged, slots)
        return
    per_expert = 2 * inter * w13.shape[2] * 4
    for idx in chunks(torch.tensor(slots, dtype=torch.long), per_expert):
        ids = idx.tolist()
        block = gather_to(w13.device, [[staged[s]["w1"], staged[s]["w3"]] for s in ids])
        quantize_experts_(w13, w13_scale, idx, block)
        del block
        block = gather_to(w13.device, [[staged[s]["w2"]] for s in ids])
        quantize_experts_(w2, w2_scale, idx, block)
        del block
