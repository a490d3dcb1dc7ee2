"""Triton FP8 MoE forward: host wrappers of the kernels in `jit`.

* `fused_moe`: per-tensor FP8 W8A8 fused MoE. Tokens are quantized with the
  layer's static input scale (or a dynamic per-tensor one when there is none,
  as for bf16 checkpoints quantized on load), pairs are sorted and padded by
  expert on the device (`align.align_pairs`), one grouped GEMM computes gate and up
  tiles together and applies SiLU-and-mul and the second quantization in its
  epilogue, a second grouped GEMM does the down projection, and a combine kernel
  sums the top-k outputs weighted by the router.
* `group_quant_rows`: per-token-group (1 x 128) FP8 quantization that writes
  rows straight into a grouped-GEMM layout and scale factors in DeepGEMM's
  MN-major, TMA-aligned layout, optionally fused with SiLU-and-mul.
* `combine_rows`: top-k weighted sum of per-pair rows.
"""

from __future__ import annotations

import functools

import torch

from ...quant import FP8_DTYPE, amax_scale
from ..routing import RoutedRows
from ..scales import BLOCK, cached_kernel_scales
from .align import align_pairs
from .jit import combine_kernel, group_quant_kernel, moe_down_kernel, moe_up_kernel, quant_tensor_kernel
from .runtime import INTERPRET, INTERPRETER_ROWS, cdiv, check_device, launch_opts, next_pow2, pow2


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None):
    """FP8 copy of `x` with a static scale, or a dynamic one (amax / 448) when None."""
    check_device(x)
    if scale is None:
        scale = amax_scale(x)
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    block = 1024
    s = scale.reshape(1).to(device=x.device, dtype=torch.float32)
    quant_tensor_kernel[(cdiv(n, block),)](x, q, s, n, BLOCK=block, EXACT=INTERPRET)
    return q, s


def fp8_operand(num_groups: int, rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [G * rows, k], float32 scale factors [G, rows, ceil(k / 128)]) for a grouped GEMM.

    The scale factors are MN-major and TMA-aligned (stride 1 along rows, `rows`
    along K groups), the layout DeepGEMM's SM90 kernels read without a transpose.
    """
    if rows % 4:
        raise ValueError(f"rows={rows} must be a multiple of 4 for TMA-aligned scale factors")
    q = torch.empty(num_groups * rows, k, dtype=FP8_DTYPE, device=device)
    storage = torch.empty(num_groups, cdiv(k, BLOCK), rows, dtype=torch.float32, device=device)
    return q, storage.transpose(1, 2)


def group_quant_rows(src: torch.Tensor, layout: RoutedRows, q: torch.Tensor, sf: torch.Tensor,
                     silu: bool = False) -> None:
    """Fill rows `layout.pos` of `q` / `sf` (from `fp8_operand`) with 1 x 128 FP8 groups.

    Without `silu`, pair p takes token ``p // top_k`` of `src` ``[T, K]``; with
    `silu`, `src` is the ``[rows, 2K]`` first-GEMM output and pair p's row
    becomes silu(gate) * up. Padding rows are left untouched.
    """
    check_device(src)
    k = q.shape[-1]
    if src.stride(-1) != 1:
        src = src.contiguous()
    src2 = src.reshape(-1, src.shape[-1])
    if src2.shape[1] != (2 * k if silu else k):
        raise ValueError(f"source width {src2.shape[1]} does not match K={k} (silu={silu})")
    groups = cdiv(k, BLOCK)
    pairs = INTERPRETER_ROWS if INTERPRET else 1
    group_quant_kernel[(cdiv(layout.num_pairs, pairs),)](
        src2, layout.pos, q, sf, layout.num_pairs, k, src2.stride(0), q.stride(0),
        layout.rows_per_group, sf.stride(0), sf.stride(2),
        TOP_K=layout.top_k, SILU=silu, PAIRS=pairs, NUM_GROUPS=next_pow2(groups),
        GROUP=BLOCK, EXACT=INTERPRET)


def group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.per_token_group_quant`: (fp8 [M, K], scales [M, K/128]).

    The scales come back in the MN-major, TMA-aligned layout (values equal the
    reference's; `.contiguous()` gives the row-major copy).
    """
    m, k = x.shape
    rows = (m + 3) // 4 * 4
    pos = torch.arange(m, dtype=torch.int32, device=x.device)
    # one "expert", top-1: row i of the output is token i
    layout = RoutedRows(pos=pos, row_expert=torch.zeros_like(pos), row_pair=pos,
                        counts=pos.new_full((1,), m), num_rows=rows, rows_per_group=rows,
                        align=1, top_k=1)
    q, sf = fp8_operand(1, rows, k, x.device)
    group_quant_rows(x, layout, q, sf)
    return q[:m], sf[0, :m]


def combine_rows(y: torch.Tensor, layout: RoutedRows, topk_weights: torch.Tensor,
                 out_dtype=torch.bfloat16) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * y[pos[t * top_k + k]] (float32 accumulation)."""
    check_device(y)
    y2 = y.reshape(-1, y.shape[-1])
    t = layout.num_pairs // layout.top_k
    n = y2.shape[1]
    out = torch.empty(t, n, dtype=out_dtype, device=y.device)
    w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block = pow2(n, 16, 1024)
    tokens = INTERPRETER_ROWS if INTERPRET else 1
    combine_kernel[(cdiv(t, tokens), cdiv(n, block))](
        y2, layout.pos, w, out, t, n, y2.stride(0), out.stride(0), TOP_K=layout.top_k,
        TOKENS=tokens, BLOCK_N=block)
    return out


@functools.lru_cache(maxsize=256)
def default_config(num_pairs: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Tile sizes by rows per expert: small tiles for decode-sized batches.

    Chosen on the H200 (`gpu/kernels_probe.py --sweep`, v2-lite layer): at 128 tokens the
    defaults were within 2% of the best of 40 configurations; at 4096 tokens wider up tiles
    and 8 warps were 10% faster. `fuse_input_quant`: at decode sizes the up GEMM quantizes
    x as it loads it (one launch less); at large batches a separate pass is cheaper than
    every column tile quantizing the same rows again. Cached (read, never changed, by the
    callers): one forward's host time is what a decode step waits for.
    """
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    wide = block_m == 64
    warps = 8 if wide else 4
    return {
        "BLOCK_M": block_m,
        "fuse_input_quant": block_m == 16,
        "up": {"BLOCK_N": pow2(inter, 16, 128 if wide else 64), "BLOCK_K": pow2(hidden, 32, 128),
               "num_warps": warps, "num_stages": 3},
        "down": {"BLOCK_N": pow2(hidden, 16, 64), "BLOCK_K": pow2(inter, 32, 128),
                 "num_warps": warps, "num_stages": 3},
    }


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
              w2_scale: torch.Tensor, a13: torch.Tensor | None, a2: torch.Tensor | None,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: dict | None = None) -> torch.Tensor:
    """Per-tensor FP8 W8A8 fused MoE: x [T, H] -> [T, H] bf16.

    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` FP8; ``w13_scale``/``w2_scale`` contiguous
    float32 ``[E]`` (one scale per expert, indexed as ``scale_ptr + expert``);
    ``a13``/``a2`` static activation scales (0-dim) or None for dynamic per-tensor
    scales over all tokens / all routed rows.
    """
    check_device(x)
    t, h = x.shape
    e, two_i, h_ = w13.shape
    inter = two_i // 2
    if h_ != h or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s.dim() != 1 or s.numel() != e or not s.is_contiguous() or s.dtype != torch.float32:
            raise ValueError(f"{name} must be a contiguous float32 [E]={e} tensor (the kernel reads "
                             f"scale_ptr + expert; collapse [E, 2] first), got {tuple(s.shape)} "
                             f"{s.dtype}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be K-contiguous")
    cfg = config or default_config(topk_ids.numel(), e, h, inter)
    bm = cfg["BLOCK_M"]
    rows = align_pairs(topk_ids, e, bm)
    block_expert = rows.block_experts

    # a static input scale at decode sizes: the up kernel quantizes x as it loads it
    quant_a = a13 is not None and cfg.get("fuse_input_quant", False)
    if quant_a:
        xq, a13 = x.contiguous(), a13.reshape(1).to(device=x.device, dtype=torch.float32)
    else:
        xq, a13 = quantize_per_tensor(x, a13)
    static_a2 = a2 is not None
    if static_a2:
        act = torch.empty(rows.num_rows, inter, dtype=FP8_DTYPE, device=x.device)
        a2_buf = a2.reshape(1).to(device=x.device, dtype=torch.float32)
    else:
        act = torch.empty(rows.num_rows, inter, dtype=torch.float32, device=x.device)
        a2_buf = torch.zeros(1, dtype=torch.float32, device=x.device)
    up = cfg["up"]
    grid = (rows.num_rows // bm, cdiv(inter, up["BLOCK_N"]))
    moe_up_kernel[grid](xq, w13, w13_scale, a13, rows.row_pair, block_expert, act, a2_buf,
                         h, inter, xq.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                         TOP_K=rows.top_k, BLOCK_M=bm, BLOCK_N=up["BLOCK_N"],
                         BLOCK_K=up["BLOCK_K"], STATIC_A2=static_a2, QUANT_A=quant_a,
                         EXACT=INTERPRET, **launch_opts(up))
    y = torch.empty(rows.num_rows, h, dtype=torch.bfloat16, device=x.device)
    down = cfg["down"]
    grid = (rows.num_rows // bm, cdiv(h, down["BLOCK_N"]))
    moe_down_kernel[grid](act, w2, w2_scale, a2_buf, rows.row_pair, block_expert, y,
                           inter, h, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
                           BLOCK_M=bm, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"],
                           STATIC_A2=static_a2, EXACT=INTERPRET, **launch_opts(down))
    return combine_rows(y, rows, topk_weights)


def moe_forward_triton(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The ``triton`` backend: the fused MoE on a FusedMoE layer's parameters."""
    w13_s, w2_s, a13, a2 = cached_kernel_scales(layer)
    return fused_moe(x, layer.w13_weight, layer.w2_weight, w13_s, w2_s, a13, a2,
                     topk_weights, topk_ids, config)


