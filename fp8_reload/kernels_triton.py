"""Triton kernels for the FP8 MoE forward.

* `fused_moe`: per-tensor FP8 W8A8 fused MoE. Tokens are quantized with the
  layer's static input scale (or a dynamic per-tensor one when there is none,
  as for bf16 checkpoints quantized on load), pairs are sorted and padded by
  expert (`routing.contiguous_rows`), one grouped GEMM computes gate and up
  tiles together and applies SiLU-and-mul and the second quantization in its
  epilogue, a second grouped GEMM does the down projection, and a combine kernel
  sums the top-k outputs weighted by the router. Weight scales are read as
  ``scale_ptr + expert``: the caller must hand a contiguous ``[E]`` (what
  `kernels.moe_kernel_scales` makes of the fixed ``[E, 2]`` layout).
* `group_quant_rows`: per-token-group (1 x 128) FP8 quantization that writes
  rows straight into a grouped-GEMM layout and scale factors in DeepGEMM's
  MN-major, TMA-aligned layout, optionally fused with SiLU-and-mul.
* `combine_rows`: top-k weighted sum of per-pair rows.

Without CUDA, Triton can only run in its interpreter: this module then sets
``TRITON_INTERPRET=1`` before importing triton, so the same kernels run on CPU
tensors in the tests. The interpreter's float -> FP8 conversion neither rounds
ties to even nor carries a mantissa overflow into the exponent (124.7 becomes
64), so under the interpreter the kernels round to the e4m3 grid in float32
arithmetic first (``EXACT``); on a GPU the hardware conversion (RTNE,
saturating) is used directly.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, amax_scale  # noqa: E402
from .routing import RoutedRows, contiguous_rows  # noqa: E402


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRET = _interpreting()


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels got CPU tensors but triton was imported without "
                           "TRITON_INTERPRET=1 (set it before anything imports triton)")


# --------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------

@triton.jit
def _to_fp8(x, EXACT: tl.constexpr):
    """Saturate to +-448 and round to float8 e4m3 (round to nearest even)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        # Add and subtract 1.5 * 2^(ulp + 23): float32 addition rounds x to a
        # multiple of e4m3's spacing 2^ulp, ulp = max(exponent, -6) - 3.
        biased = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.maximum(biased, 121)
        magic = (((biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
        x = (x + magic) - magic
    return x.to(tl.float8e4nv)


@triton.jit
def _quant_tensor_kernel(x_ptr, q_ptr, scale_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _to_fp8(x / tl.load(scale_ptr), EXACT), mask=mask)


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, w_scale_ptr, a_scale_ptr, row_pair_ptr, block_expert_ptr,
                   out_ptr, a2_ptr, K: tl.constexpr, N, stride_xm, stride_we, stride_wn, stride_om,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STATIC_A2: tl.constexpr, EXACT: tl.constexpr):
    """act[row, n] = silu(x W_gate^T) * (x W_up^T) for one expert's rows.

    w is ``[E, 2N, K]`` (gate rows, then up rows). With a static second-GEMM
    scale the result is quantized here; otherwise it is stored in float32 and
    its absolute max is folded into ``a2_ptr``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    valid = pair >= 0
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + ks[None, :]
    g_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + cols[None, :].to(tl.int64) * stride_wn + ks[:, None])
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(u_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        # promote to the float32 accumulator every BLOCK_K products, as DeepGEMM does
        # (Hopper's FP8 MMA accumulates with fewer bits; Triton's sm90 default never promotes)
        acc_g = tl.dot(a, wg, acc_g, max_num_imprecise_acc=BLOCK_K)
        acc_u = tl.dot(a, wu, acc_u, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    s = tl.load(a_scale_ptr) * tl.load(w_scale_ptr + expert)
    g = acc_g * s
    act = g / (1.0 + tl.exp(-g)) * (acc_u * s)
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    o_mask = valid[:, None] & col_ok[None, :]
    if STATIC_A2:
        tl.store(o_ptrs, _to_fp8(act / tl.load(a2_ptr), EXACT), mask=o_mask)
    else:
        tl.store(o_ptrs, act, mask=o_mask)
        amax = tl.max(tl.max(tl.where(o_mask, tl.abs(act), 0.0), axis=1), axis=0)
        tl.atomic_max(a2_ptr, amax)


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, w_scale_ptr, a2_ptr, row_pair_ptr, block_expert_ptr,
                     out_ptr, K: tl.constexpr, N, stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STATIC_A2: tl.constexpr, EXACT: tl.constexpr):
    """out[row] = act[row] @ W_down[expert]^T; a float32 `act` is quantized on load
    with the dynamic scale amax / 448 that `_moe_up_kernel` accumulated."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tl.load(row_pair_ptr + rows) >= 0
    if STATIC_A2:
        a2 = tl.load(a2_ptr)
    else:
        a2 = tl.maximum(tl.load(a2_ptr) / 448.0, 1e-12)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + cols[None, :].to(tl.int64) * stride_wn + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if not STATIC_A2:
            a = _to_fp8(a / a2, EXACT)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y = acc * (a2 * tl.load(w_scale_ptr + expert))
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _group_quant_kernel(src_ptr, pos_ptr, q_ptr, s_ptr, num_pairs, K, stride_src, stride_q,
                        rows_per_group, s_stride_group, s_stride_k,
                        TOP_K: tl.constexpr, SILU: tl.constexpr, PAIRS: tl.constexpr,
                        NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr):
    """PAIRS pairs per program: quantize each pair's K values in 1 x GROUP groups into row pos[pair].

    The source row is token ``pair // TOP_K`` of `src`, or with SILU row pos[pair]
    of a ``[rows, 2K]`` gate|up tensor, reduced to silu(gate) * up first.
    """
    pair = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    p_ok = pair < num_pairs
    row1 = tl.load(pos_ptr + pair, mask=p_ok, other=0).to(tl.int64)
    row = row1[:, None, None]
    g1 = tl.arange(0, NUM_GROUPS)
    cols = g1[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (cols < K) & p_ok[:, None, None]
    if SILU:
        base = src_ptr + row * stride_src
        gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = gate / (1.0 + tl.exp(-gate)) * up
    else:
        tok = (pair // TOP_K).to(tl.int64)[:, None, None]
        x = tl.load(src_ptr + tok * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=2) / 448.0, 1e-12)
    tl.store(q_ptr + row * stride_q + cols, _to_fp8(x / scale[:, :, None], EXACT), mask=mask)
    grp = row1 // rows_per_group
    r = row1 - grp * rows_per_group
    s_ptrs = s_ptr + (grp * s_stride_group + r)[:, None] + g1[None, :] * s_stride_k
    tl.store(s_ptrs, scale, mask=(g1 * GROUP < K)[None, :] & p_ok[:, None])


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, num_tokens, N, stride_y, stride_o,
                    TOP_K: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < num_tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = t_ok[:, None] & (cols < N)[None, :]
    acc = tl.zeros((TOKENS, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + t * TOP_K + k, mask=t_ok, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * TOP_K + k, mask=t_ok, other=0.0)
        y = tl.load(y_ptr + row[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_o + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------

GROUP = 128
# The interpreter pays per program, not per element: give it many rows at once.
_INTERPRETER_ROWS = 64


def _pow2(n: int, lo: int = 16, hi: int = 128) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def quantize_per_tensor(x: torch.Tensor, scale: Optional[torch.Tensor]):
    """FP8 copy of `x` with a static scale, or a dynamic one (amax / 448) when None."""
    _check_device(x)
    if scale is None:
        scale = amax_scale(x)
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    block = 1024
    s = scale.reshape(1).to(device=x.device, dtype=torch.float32)
    _quant_tensor_kernel[(triton.cdiv(n, block),)](x, q, s, n, BLOCK=block, EXACT=INTERPRET)
    return q, s


def fp8_operand(num_groups: int, rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [G * rows, k], float32 scale factors [G, rows, ceil(k / 128)]) for a grouped GEMM.

    The scale factors are MN-major and TMA-aligned (stride 1 along rows, `rows`
    along K groups), the layout DeepGEMM's SM90 kernels read without a transpose.
    """
    if rows % 4:
        raise ValueError(f"rows={rows} must be a multiple of 4 for TMA-aligned scale factors")
    q = torch.empty(num_groups * rows, k, dtype=FP8_DTYPE, device=device)
    storage = torch.empty(num_groups, triton.cdiv(k, GROUP), rows, dtype=torch.float32, device=device)
    return q, storage.transpose(1, 2)


def group_quant_rows(src: torch.Tensor, layout: RoutedRows, q: torch.Tensor, sf: torch.Tensor,
                     silu: bool = False) -> None:
    """Fill rows `layout.pos` of `q` / `sf` (from `fp8_operand`) with 1 x 128 FP8 groups.

    Without `silu`, pair p takes token ``p // top_k`` of `src` ``[T, K]``; with
    `silu`, `src` is the ``[rows, 2K]`` first-GEMM output and pair p's row
    becomes silu(gate) * up. Padding rows are left untouched.
    """
    _check_device(src)
    k = q.shape[-1]
    if src.stride(-1) != 1:
        src = src.contiguous()
    src2 = src.reshape(-1, src.shape[-1])
    if src2.shape[1] != (2 * k if silu else k):
        raise ValueError(f"source width {src2.shape[1]} does not match K={k} (silu={silu})")
    groups = triton.cdiv(k, GROUP)
    pairs = _INTERPRETER_ROWS if INTERPRET else 1
    _group_quant_kernel[(triton.cdiv(layout.num_pairs, pairs),)](
        src2, layout.pos, q, sf, layout.num_pairs, k, src2.stride(0), q.stride(0),
        layout.rows_per_group, sf.stride(0), sf.stride(2),
        TOP_K=layout.top_k, SILU=silu, PAIRS=pairs, NUM_GROUPS=triton.next_power_of_2(groups),
        GROUP=GROUP, EXACT=INTERPRET)


def group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `quant.per_token_group_quant`: (fp8 [M, K], scales [M, K/128]).

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
    _check_device(y)
    y2 = y.reshape(-1, y.shape[-1])
    t = layout.num_pairs // layout.top_k
    n = y2.shape[1]
    out = torch.empty(t, n, dtype=out_dtype, device=y.device)
    w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block = _pow2(n, 16, 1024)
    tokens = _INTERPRETER_ROWS if INTERPRET else 1
    _combine_kernel[(triton.cdiv(t, tokens), triton.cdiv(n, block))](
        y2, layout.pos, w, out, t, n, y2.stride(0), out.stride(0), TOP_K=layout.top_k,
        TOKENS=tokens, BLOCK_N=block)
    return out


def default_config(num_pairs: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Tile sizes by rows per expert: small tiles for decode-sized batches."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    up_n, down_n = 64, 64 if block_m < 64 else 128
    return {
        "BLOCK_M": block_m,
        "up": {"BLOCK_N": _pow2(inter, 16, up_n), "BLOCK_K": _pow2(hidden, 32, 128),
               "num_warps": 4, "num_stages": 3},
        "down": {"BLOCK_N": _pow2(hidden, 16, down_n), "BLOCK_K": _pow2(inter, 32, 128),
                 "num_warps": 4, "num_stages": 3},
    }


def _launch_opts(cfg: dict) -> dict:
    # The interpreter takes no compile options.
    return {} if INTERPRET else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
              w2_scale: torch.Tensor, a13: Optional[torch.Tensor], a2: Optional[torch.Tensor],
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: Optional[dict] = None) -> torch.Tensor:
    """Per-tensor FP8 W8A8 fused MoE: x [T, H] -> [T, H] bf16.

    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` FP8; ``w13_scale``/``w2_scale`` contiguous
    float32 ``[E]`` (one scale per expert, indexed as ``scale_ptr + expert``);
    ``a13``/``a2`` static activation scales (0-dim) or None for dynamic per-tensor
    scales over all tokens / all routed rows.
    """
    _check_device(x)
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
    rows = contiguous_rows(topk_ids, e, bm)
    block_expert = rows.block_expert(bm)

    xq, a13 = quantize_per_tensor(x, a13)
    static_a2 = a2 is not None
    if static_a2:
        act = torch.empty(rows.num_rows, inter, dtype=FP8_DTYPE, device=x.device)
        a2_buf = a2.reshape(1).to(device=x.device, dtype=torch.float32)
    else:
        act = torch.empty(rows.num_rows, inter, dtype=torch.float32, device=x.device)
        a2_buf = torch.zeros(1, dtype=torch.float32, device=x.device)
    up = cfg["up"]
    grid = (rows.num_rows // bm, triton.cdiv(inter, up["BLOCK_N"]))
    _moe_up_kernel[grid](xq, w13, w13_scale, a13, rows.row_pair, block_expert, act, a2_buf,
                         h, inter, xq.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                         TOP_K=rows.top_k, BLOCK_M=bm, BLOCK_N=up["BLOCK_N"],
                         BLOCK_K=up["BLOCK_K"], STATIC_A2=static_a2, EXACT=INTERPRET,
                         **_launch_opts(up))
    y = torch.empty(rows.num_rows, h, dtype=torch.bfloat16, device=x.device)
    down = cfg["down"]
    grid = (rows.num_rows // bm, triton.cdiv(h, down["BLOCK_N"]))
    _moe_down_kernel[grid](act, w2, w2_scale, a2_buf, rows.row_pair, block_expert, y,
                           inter, h, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
                           BLOCK_M=bm, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"],
                           STATIC_A2=static_a2, EXACT=INTERPRET, **_launch_opts(down))
    return combine_rows(y, rows, topk_weights)


def moe_forward_triton(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """`kernels.BACKENDS["triton"]`: the fused MoE on a FusedMoE layer's parameters."""
    from .kernels import cached_kernel_scales

    w13_s, w2_s, a13, a2 = cached_kernel_scales(layer)
    return fused_moe(x, layer.w13_weight, layer.w2_weight, w13_s, w2_s, a13, a2,
                     topk_weights, topk_ids, config)


__all__ = ["fused_moe", "moe_forward_triton", "group_quant", "group_quant_rows", "combine_rows",
           "fp8_operand", "quantize_per_tensor", "default_config", "INTERPRET", "FP8_MAX",
           "MIN_SCALE"]
