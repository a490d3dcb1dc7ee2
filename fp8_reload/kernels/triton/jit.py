"""Triton device code of the FP8 MoE forward (host wrappers: `moe`).

Scales are read as ``scale_ptr + expert``: the caller hands a contiguous ``[E]``
(what `scales.collapse_w13_scale` makes of the fixed ``[E, 2]`` layout).
"""

from .fp8 import to_fp8
from .runtime import tl, triton


@triton.jit
def quant_tensor_kernel(x_ptr, q_ptr, scale_ptr, n, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, to_fp8(x / tl.load(scale_ptr), EXACT), mask=mask)


@triton.jit
def moe_up_kernel(x_ptr, w_ptr, w_scale_ptr, a_scale_ptr, row_pair_ptr, block_expert_ptr,
                   out_ptr, a2_ptr, K: tl.constexpr, N, stride_xm, stride_we, stride_wn, stride_om,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STATIC_A2: tl.constexpr, QUANT_A: tl.constexpr,
                   EXACT: tl.constexpr):
    """act[row, n] = silu(x W_gate^T) * (x W_up^T) for one expert's rows.

    w is ``[E, 2N, K]`` (gate rows, then up rows). With QUANT_A, x is the bf16
    input, quantized here with the static scale as its tiles load (no separate
    pass over x); otherwise x is already FP8. With a static second-GEMM scale the
    result is quantized here; otherwise it is stored in float32 and its absolute
    max is folded into ``a2_ptr``.
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
    a_scale = tl.load(a_scale_ptr)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if QUANT_A:
            a = to_fp8(a.to(tl.float32) / a_scale, EXACT)
        wg = tl.load(g_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(u_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        # promote to the float32 accumulator every BLOCK_K products, as DeepGEMM does
        # (Hopper's FP8 MMA accumulates with fewer bits; Triton's sm90 default never promotes)
        acc_g = tl.dot(a, wg, acc_g, max_num_imprecise_acc=BLOCK_K)
        acc_u = tl.dot(a, wu, acc_u, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    s = a_scale * tl.load(w_scale_ptr + expert)
    g = acc_g * s
    act = g / (1.0 + tl.exp(-g)) * (acc_u * s)
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    o_mask = valid[:, None] & col_ok[None, :]
    if STATIC_A2:
        tl.store(o_ptrs, to_fp8(act / tl.load(a2_ptr), EXACT), mask=o_mask)
    else:
        tl.store(o_ptrs, act, mask=o_mask)
        amax = tl.max(tl.max(tl.where(o_mask, tl.abs(act), 0.0), axis=1), axis=0)
        tl.atomic_max(a2_ptr, amax)


@triton.jit
def moe_down_kernel(act_ptr, w_ptr, w_scale_ptr, a2_ptr, row_pair_ptr, block_expert_ptr,
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
            a = to_fp8(a / a2, EXACT)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y = acc * (a2 * tl.load(w_scale_ptr + expert))
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def group_quant_kernel(src_ptr, pos_ptr, q_ptr, s_ptr, num_pairs, K, stride_src, stride_q,
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
    tl.store(q_ptr + row * stride_q + cols, to_fp8(x / scale[:, :, None], EXACT), mask=mask)
    grp = row1 // rows_per_group
    r = row1 - grp * rows_per_group
    s_ptrs = s_ptr + (grp * s_stride_group + r)[:, None] + g1[None, :] * s_stride_k
    tl.store(s_ptrs, scale, mask=(g1 * GROUP < K)[None, :] & p_ok[:, None])


@triton.jit
def combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, num_tokens, N, stride_y, stride_o,
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

