"""Numeric comparisons shared by tests, benchmarks and tools."""

from __future__ import annotations

import math

import torch

from ..state import raw_bytes


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's accuracy metric: 1 - 2<x,y> / (|x|^2 + |y|^2), in float64.

    0 for identical tensors, ~1e-3 for one FP8 x FP8 GEMM against its exact product.
    """
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def count_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by `tensors` (None entries count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when `a` and `b` are bit for bit equal; else what differs first, in words.

    Bytes are compared, not values: -0.0 vs 0.0 differ, two NaNs with the same
    bits do not. The first differing element is named by its coordinate.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    ra, rb = raw_bytes(a.cpu()), raw_bytes(b.cpu())
    if torch.equal(ra, rb):
        return None
    differ = (ra != rb).nonzero()
    size = a.element_size()
    flat = int(differ[0]) // size
    coord = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    n = len({int(i) // size for i in differ.flatten().tolist()})
    av, bv = a.reshape(-1)[flat], b.reshape(-1)[flat]
    return (f"{n} of {a.numel()} elements differ; first at {coord}: "
            f"{av.float().item()!r} vs {bv.float().item()!r}")


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "tensor") -> None:
    """AssertionError naming the first differing coordinate and both values."""
    diff = first_difference(a, b)
    if diff is not None:
        raise AssertionError(f"{what}: not bitwise equal: {diff}")


def worse(d: float, worst: float) -> bool:
    """Whether measurement `d` is worse than `worst` so far: a NaN is the worst there is, and
    stays so (``not d <= worst`` let the next finite value replace it)."""
    return not math.isnan(worst) and (math.isnan(d) or d > worst)
