"""DeepGEMM MoE forward: grouped FP8 GEMMs fed 128x128 block scales made from per-tensor ones.

DeepGEMM's SM90 grouped GEMMs take activations quantized per token group
(1 x 128, float32 scales, MN-major and TMA-aligned) and weights with one
float32 scale per 128 x 128 block, ``[E, ceil(N/128), ceil(K/128)]``. A
per-tensor FP8 checkpoint has one scale per expert, so the forward expands it:

* ``scale_mode="cached"`` (default): expanded once per weights version
  (`scales.block_scales`); any reload that touches the layer bumps
  ``weights_version`` and clears the cache, so it is rebuilt.
* ``scale_mode="per-forward"``: sglang 0.5.23's way, ``repeat_interleave`` twice
  per weight on every call (after collapsing ``[E, 2]`` to ``[E]``, which
  upstream needs and lacks). Kept as the benchmark baseline.
* ``scale_mode="precomputed"``: the caller passes the block scales (what a
  block-quantized checkpoint would store); the benchmark's upper bound.

Two layouts: ``contiguous`` (pairs sorted by expert, runs padded to DeepGEMM's
M alignment, ``m_indices`` = -1 on padding) and ``masked`` (``[E, max_m, K]``
with ``masked_m`` valid rows per expert). Static input scales are not used:
DeepGEMM quantizes activations dynamically per token group, as sglang's
DeepGEMM MoE runner does.

`EmulatedGroupedGemm` computes the two grouped GEMMs with torch while checking
the operand layouts DeepGEMM checks, so the whole host-side path (routing,
padding, scale-factor layout, block scales, cache, combine) runs and is tested
on CPU; on an H200 the same path calls DeepGEMM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import BackendUnavailable
from .routing import align_up, contiguous_rows, masked_rows
from .scales import BLOCK, block_scales, block_scales_per_forward

LAYOUTS = ("contiguous", "masked")
SCALE_MODES = ("cached", "per-forward", "precomputed")

# DeepGEMM's names across releases. Positional arguments are the same in all of them:
# contiguous(a, b, d, m_indices), masked(a, b, d, masked_m, expected_m), with
# a = (fp8 [M, K], sf [M, K/128]) and b = (fp8 [G, N, K], sf [G, N/128, K/128]).
CONTIGUOUS_NAMES = ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous",
                    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")
MASKED_NAMES = ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
                "m_grouped_fp8_fp4_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked")
ALIGNMENT_NAMES = ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout")


def _check_operands(a, sfa, b, sfb, d, groups_a: int | None) -> None:
    """The layout rules DeepGEMM's SM90 FP32-scale path asserts (see csrc/utils/layout.hpp)."""
    fp8 = torch.float8_e4m3fn
    if a.dtype != fp8 or b.dtype != fp8:
        raise ValueError(f"A and B must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("A and B must be K-major")
    g, n, k = b.shape
    m = a.shape[-2]
    if a.shape[-1] != k or d.shape[-1] != n or d.shape[-2] != m or d.dtype != torch.bfloat16:
        raise ValueError(f"shapes: A {tuple(a.shape)}, B {tuple(b.shape)}, D {tuple(d.shape)} {d.dtype}")
    if d.stride(-1) != 1:
        raise ValueError("D must be N-major")
    if sfb.dtype != torch.float32 or tuple(sfb.shape) != (g, -(-n // BLOCK), -(-k // BLOCK)) \
            or not sfb.is_contiguous():
        raise ValueError(f"SFB must be contiguous float32 [G, ceil(N/128), ceil(K/128)] = "
                         f"{(g, -(-n // BLOCK), -(-k // BLOCK))}, got {tuple(sfb.shape)} "
                         f"contiguous={sfb.is_contiguous()}")
    want = ((groups_a,) if groups_a else ()) + (m, -(-k // BLOCK))
    if sfa.dtype != torch.float32 or tuple(sfa.shape) != want:
        raise ValueError(f"SFA must be float32 {want}, got {tuple(sfa.shape)} {sfa.dtype}")
    # MN-major and TMA-aligned: otherwise DeepGEMM would transpose it on every call.
    if sfa.stride(-2) != 1 or sfa.stride(-1) != align_up(m, 4):
        raise ValueError(f"SFA must be MN-major and TMA-aligned, strides {sfa.stride()}")


class EmulatedGroupedGemm:
    """DeepGEMM's two grouped GEMMs in torch (float32), with DeepGEMM's operand checks.

    Rows DeepGEMM would not compute (``m_indices < 0``, rows past ``masked_m``)
    are left as they were.
    """

    name = "emulated"
    m_alignment = BLOCK

    @staticmethod
    def _dequant_a(a, sfa):
        k = a.shape[-1]
        s = sfa.repeat_interleave(BLOCK, dim=-1)[..., :k]
        return a.to(torch.float32) * s

    @staticmethod
    def _dequant_b(b, sfb):
        n, k = b.shape
        s = sfb.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
        return b.to(torch.float32) * s

    def contiguous(self, a_pair, b_pair, d, m_indices) -> None:
        (a, sfa), (b, sfb) = a_pair, b_pair
        _check_operands(a, sfa, b, sfb, d, None)
        if m_indices.dtype != torch.int32 or m_indices.shape != (a.shape[0],):
            raise ValueError("m_indices must be int32 [M]")
        for e in torch.unique(m_indices[m_indices >= 0]).tolist():
            rows = (m_indices == e).nonzero().flatten()
            y = self._dequant_a(a[rows], sfa[rows]) @ self._dequant_b(b[e], sfb[e]).t()
            d[rows] = y.to(d.dtype)

    def masked(self, a_pair, b_pair, d, masked_m, expected_m) -> None:
        (a, sfa), (b, sfb) = a_pair, b_pair
        _check_operands(a, sfa, b, sfb, d, b.shape[0])
        if masked_m.dtype != torch.int32 or masked_m.shape != (b.shape[0],) or expected_m <= 0:
            raise ValueError("masked_m must be int32 [G] and expected_m positive")
        for g, m in enumerate(masked_m.tolist()):
            if m:
                y = self._dequant_a(a[g, :m], sfa[g, :m]) @ self._dequant_b(b[g], sfb[g]).t()
                d[g, :m] = y.to(d.dtype)


@dataclass
class DeepGemmLib:
    """The installed DeepGEMM, probed once: which names this release uses."""

    module: object
    version: str
    contiguous_name: str
    masked_name: str | None
    m_alignment: int
    notes: list[str] = field(default_factory=list)
    name = "deep_gemm"

    def contiguous(self, a_pair, b_pair, d, m_indices) -> None:
        getattr(self.module, self.contiguous_name)(a_pair, b_pair, d, m_indices)

    def masked(self, a_pair, b_pair, d, masked_m, expected_m) -> None:
        if self.masked_name is None:
            raise BackendUnavailable(f"deep_gemm {self.version} has no masked grouped FP8 GEMM "
                                     f"(looked for {', '.join(MASKED_NAMES)})")
        getattr(self.module, self.masked_name)(a_pair, b_pair, d, masked_m, int(expected_m))

    def describe(self) -> str:
        return (f"deep_gemm {self.version}: contiguous={self.contiguous_name}, "
                f"masked={self.masked_name}, M alignment {self.m_alignment}")


_LIB: DeepGemmLib | None = None
_LIB_ERROR: str | None = None


def _probe() -> DeepGemmLib:
    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise BackendUnavailable(
            f"needs an sm90 (Hopper) GPU: DeepGEMM's FP32 block-scale kernels are SM90-only "
            f"(on sm100 scales are cast to UE8M0, which rounds per-tensor scales); this is sm{major}{minor}")
    try:
        import deep_gemm
    except Exception as e:  # ImportError, or a failing JIT/library load inside it
        raise BackendUnavailable(f"cannot import deep_gemm ({type(e).__name__}: {e}); install "
                                 "sgl-deep-gemm (see README 'GPU backends')") from None
    cont = next((n for n in CONTIGUOUS_NAMES if callable(getattr(deep_gemm, n, None))), None)
    if cont is None:
        raise BackendUnavailable(f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has none of "
                                 f"{', '.join(CONTIGUOUS_NAMES)}")
    masked = next((n for n in MASKED_NAMES if callable(getattr(deep_gemm, n, None))), None)
    notes = []
    align = None
    for n in ALIGNMENT_NAMES:
        fn = getattr(deep_gemm, n, None)
        if fn is not None:
            align = int(fn())
            break
    if align is None:
        align = BLOCK
        notes.append("no alignment query found; assuming 128")
    return DeepGemmLib(deep_gemm, str(getattr(deep_gemm, "__version__", "unknown")), cont, masked,
                       align, notes)


def deep_gemm_lib() -> DeepGemmLib:
    """The usable DeepGEMM, or `BackendUnavailable` naming why not (probed once)."""
    global _LIB, _LIB_ERROR
    if _LIB is None and _LIB_ERROR is None:
        try:
            _LIB = _probe()
        except BackendUnavailable as e:
            _LIB_ERROR = str(e)
    if _LIB is None:
        raise BackendUnavailable(f"deep_gemm: {_LIB_ERROR}")
    return _LIB


# --------------------------------------------------------------------------
# MoE forward
# --------------------------------------------------------------------------

def check_shapes(hidden: int, inter: int) -> None:
    """DeepGEMM tiles K by 128 and needs 128-aligned N for the block scales to line up."""
    bad = [f"{name}={v}" for name, v in (("hidden_size", hidden), ("moe_intermediate_size", inter))
           if v % BLOCK]
    if bad:
        raise BackendUnavailable(f"deep_gemm needs hidden_size and moe_intermediate_size to be "
                                 f"multiples of {BLOCK}; got {', '.join(bad)}")


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_bs: torch.Tensor,
                w2_bs: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                layout: str = "contiguous", gemm=None) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16 through two grouped FP8 GEMMs (`gemm`: DeepGEMM by default).

    ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` FP8 with block scales ``w13_bs``, ``w2_bs``.
    """
    from .triton import combine_rows, fp8_operand, group_quant_rows  # needs triton: imported on use

    gemm = gemm or deep_gemm_lib()
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if layout == "contiguous":
        rows = contiguous_rows(topk_ids, e, gemm.m_alignment)
        groups, m = 1, rows.num_rows
    elif layout == "masked":
        m = align_up(max(t, 1), BLOCK)
        rows = masked_rows(topk_ids, e, m)
        groups = e
    else:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")

    def operand(k):
        q, sf = fp8_operand(groups, m, k, x.device)
        return q, sf

    def view(q, sf):
        return (q, sf[0]) if layout == "contiguous" else (q.view(groups, m, -1), sf)

    def run(a_pair, b_pair, d):
        if layout == "contiguous":
            gemm.contiguous(a_pair, b_pair, d, rows.row_expert)
        else:
            expected = max(1, math.ceil(rows.num_pairs / e))
            gemm.masked(a_pair, b_pair, d.view(groups, m, -1), rows.counts, expected)

    a, sfa = operand(h)
    group_quant_rows(x, rows, a, sfa)
    h13 = torch.empty(groups * m, two_i, dtype=torch.bfloat16, device=x.device)
    run(view(a, sfa), (w13, w13_bs), h13)
    act, sfact = operand(inter)
    group_quant_rows(h13, rows, act, sfact, silu=True)
    y = torch.empty(groups * m, h, dtype=torch.bfloat16, device=x.device)
    run(view(act, sfact), (w2, w2_bs), y)
    return combine_rows(y, rows, topk_weights)


def moe_forward_deepgemm(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, layout: str = "contiguous",
                         scale_mode: str = "cached",
                         precomputed_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                         gemm=None) -> torch.Tensor:
    """The ``deep_gemm`` (contiguous) / ``deep_gemm_masked`` backend on a FusedMoE layer."""
    check_shapes(layer.hidden_size, layer.intermediate_size)
    if scale_mode == "cached":
        w13_bs, w2_bs = block_scales(layer)
    elif scale_mode == "per-forward":
        w13_bs, w2_bs = block_scales_per_forward(layer)
    elif scale_mode == "precomputed":
        if precomputed_scales is None:
            raise ValueError("scale_mode='precomputed' needs precomputed_scales=(w13_bs, w2_bs)")
        w13_bs, w2_bs = precomputed_scales
    else:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; choose one of {', '.join(SCALE_MODES)}")
    # plain tensors (not Parameters) for DeepGEMM's DLPack-based bindings
    return grouped_moe(x, layer.w13_weight.data, layer.w2_weight.data, w13_bs, w2_bs, topk_weights,
                       topk_ids, layout, gemm)


def backend(layout: str) -> Callable:
    def forward(layer, x, topk_weights, topk_ids):
        return moe_forward_deepgemm(layer, x, topk_weights, topk_ids, layout=layout)

    forward.__name__ = f"moe_forward_deepgemm_{layout}"
    return forward

