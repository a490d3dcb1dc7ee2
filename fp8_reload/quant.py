"""FP8 (e4m3fn) primitives shared by the checkpoint writer, processing and kernels.

All arithmetic runs in float32 so a result depends only on its inputs, never on
the order in which experts were processed: that is what makes a reload
bit-identical to a fresh load.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# 1 / 448 rounded to float32. Scales are amax * INV_FP8_MAX, not amax / 448: that is what
# torch computes on a GPU for a tensor divided by a Python number, and writing it out makes
# the CPU, the GPU and the Triton kernels agree bit for bit.
INV_FP8_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32))
# Smallest scale we ever produce: keeps an all-zero tensor from dividing by zero.
MIN_SCALE = 1e-12


def quantize_static(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to the FP8 range. `scale` broadcasts against `x`."""
    if not torch.is_tensor(scale):
        scale = torch.tensor(scale, dtype=torch.float32, device=x.device)
    # one float32 temporary, divided in place (x itself is never written)
    q = x.to(torch.float32, copy=True).div_(scale.to(torch.float32))
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def amax_scale(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """Dynamic per-tensor (or per-slice over `dims`) scale: amax / FP8_MAX (as amax * INV_FP8_MAX)."""
    if x.dtype == FP8_DTYPE:  # no FP8 reductions on CPU
        x = x.to(torch.float32)
    if dims is None:
        return amax_scale_of([x])
    return (x.abs().amax(dim=dims).to(torch.float32) * INV_FP8_MAX).clamp_(min=MIN_SCALE)


def amax_scale_of(parts) -> torch.Tensor:
    """`amax_scale` of the concatenation of `parts` (high-precision tensors of one dtype),
    without making it: a maximum is exact, so the bits are those of the whole."""
    a = None
    for x in parts:  # max |x| = max(max x, -min x), exactly: no temporary of x's size
        lo, hi = torch.aminmax(x)
        m = torch.maximum(hi, lo.neg())
        a = m if a is None else torch.maximum(a, m)
    return (a.to(torch.float32) * INV_FP8_MAX).clamp_(min=MIN_SCALE)


# Elementwise float32 work on a big tensor goes a block of rows at a time, so its
# temporary is one block (16 MiB), not the tensor (v2-lite's dense gate_up_proj is
# 171 MiB as float32). Elementwise: the bytes are those of one call on the whole.
BLOCK_ELEMENTS = 1 << 22


def by_row_blocks_(dst: torch.Tensor, src: torch.Tensor, fn) -> None:
    """``dst.copy_(fn(src))``, a block of rows (dim 0) at a time; `fn` is elementwise."""
    if src.dim() == 0 or src.numel() <= BLOCK_ELEMENTS:
        dst.copy_(fn(src))
        return
    step = max(1, BLOCK_ELEMENTS // max(1, src[0].numel()))
    for start in range(0, src.shape[0], step):
        n = min(step, src.shape[0] - start)
        dst.narrow(0, start, n).copy_(fn(src.narrow(0, start, n)))


def quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization; returns (fp8 tensor, 0-dim float32 scale)."""
    scale = amax_scale(x)
    return quantize_static(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 -> float32 with a broadcastable scale."""
    return q.to(torch.float32) * scale


def requantize(q: torch.Tensor, old_scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """Move FP8 values from `old_scale` to `new_scale` (both broadcastable).

    Uses the ratio old/new so that old == new is an exact identity: an expert
    re-processed without having changed keeps every byte.
    """
    ratio = old_scale.to(torch.float32) / new_scale.to(torch.float32)
    return q.to(torch.float32).mul_(ratio).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def has_bad_values(t: torch.Tensor) -> bool:
    """Whether `t` holds a value no checkpoint may: an e4m3 NaN encoding (``x & 0x7f ==
    0x7f``: e4m3 has no infinities), or a NaN / infinity of a wider float type.

    Reductions only, no elementwise temporary (a single pass runs at memory speed on a
    CPU, where a mask costs ~100x more): the int8 view's max is 0x7f exactly when a byte
    0x7f is there, the uint8 view's max is 0xff exactly when 0xff is; NaN and +-inf
    carry through a min or a max. `checkpoint.values` checks many tensors at once by
    the same rules."""
    if t.numel() == 0:
        return False
    if t.dtype == FP8_DTYPE:
        raw = t.view(torch.uint8)
        return bool(raw.view(torch.int8).max() == 0x7F) or bool(raw.max() == 0xFF)
    if t.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        t = t.float()
    lo, hi = torch.aminmax(t)
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def index_copy_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """`Tensor.index_copy_` that also works for FP8 (copied as raw bytes)."""
    if dst.dtype == FP8_DTYPE:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(dim, index, src)

