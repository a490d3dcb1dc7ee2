"""Workloads for kernel tests and benchmarks: synthetic MoE layers, routed tokens, GEMM operands.

Built on the device in milliseconds, with the statistics of the checkpoint
writer, so a v2-lite layer needs no checkpoint on disk.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.layout import Projection
from ..checkpoint.synthetic import gain, input_amax
from ..config import MoEConfig
from ..kernels.scales import expand_block_scales
from ..layers import FusedMoE
from ..processing import MODES
from ..quant import FP8_DTYPE, FP8_MAX, MIN_SCALE


def v2_lite_moe() -> MoEConfig:
    """The v2-lite shape with one MoE layer (what the kernel benchmarks run)."""
    return MoEConfig.preset("v2-lite", num_layers=2)


def moe_flop(cfg: MoEConfig, tokens: int) -> float:
    """Routed FLOPs of one MoE layer (2 per multiply-add; padding rows not counted)."""
    pairs = tokens * cfg.top_k
    return 2.0 * pairs * (2 * cfg.moe_intermediate_size * cfg.hidden_size
                          + cfg.hidden_size * cfg.moe_intermediate_size)


def moe_bytes(cfg: MoEConfig, topk_ids: torch.Tensor) -> float:
    """Bytes one MoE layer's forward must move at least: the FP8 weights of every expert
    a token is routed to (each read once), the bf16 tokens in and out."""
    touched = torch.unique(topk_ids).numel()
    weights = touched * 3 * cfg.hidden_size * cfg.moe_intermediate_size  # w13 + w2, 1 byte each
    return float(weights + 2 * 2 * topk_ids.shape[0] * cfg.hidden_size)


def synthetic_moe_layer(cfg: MoEConfig, device="cuda", seed: int = 0, kind: str = "fp8"):
    """A FusedMoE built the way a checkpoint load builds it, with the fixed processing.

    Weights follow the checkpoint writer's statistics (per-expert gains that make
    gate and up scales differ, static input scales with headroom) but are drawn
    on the device, so a v2-lite layer takes milliseconds instead of a checkpoint.
    """
    fp8 = kind == "fp8"
    layer = FusedMoE(cfg, cfg.first_dense_layers, MODES["fixed"].moe_method(fp8), device=device)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for ex in range(e):
            base = f"model.layers.{cfg.first_dense_layers}.mlp.experts.{ex}"
            parts = {}
            for proj, role, rows, cols in (("gate_proj", "expert_gate", i, h),
                                           ("up_proj", "expert_up", i, h),
                                           ("down_proj", "expert_down", h, i)):
                std = gain(seed, f"{base}.{proj}", role) / math.sqrt(cols)
                w = torch.randn(rows, cols, generator=g, device=device) * std
                s = (w.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
                parts[proj] = (w, s, Projection(f"{base}.{proj}", rows, cols, role))
            if fp8:
                for proj, sl in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
                    w, s, p = parts[proj]
                    layer.w13_weight.data[ex, sl] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                    layer.w13_weight_scale.data[ex, 0 if proj == "gate_proj" else 1] = s
                    layer.w13_input_scale.data[ex] = input_amax(seed, p) / FP8_MAX
                w, s, p = parts["down_proj"]
                layer.w2_weight.data[ex] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                layer.w2_weight_scale.data[ex] = s
                layer.w2_input_scale.data[ex] = input_amax(seed, p) / FP8_MAX
            else:
                layer.staged[ex] = {"w1": parts["gate_proj"][0], "w3": parts["up_proj"][0],
                                    "w2": parts["down_proj"][0]}
            layer.loaded_experts.add(ex)
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def routed_tokens(cfg: MoEConfig, tokens: int, device="cuda", seed: int = 0):
    """RMS-scale tokens and a softmax top-k routing over random router logits."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, cfg.hidden_size, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(tokens, cfg.num_experts, generator=g, device=device) * 2.0
    w, ids = logits.softmax(-1).topk(cfg.top_k, dim=-1)
    return x, w, ids


def gemm_operands(groups: int, m_per: int, n: int, k: int, device="cuda", seed: int = 0):
    """Grouped contiguous operands: per-token-group activations, per-tensor weights as blocks.

    Returns (x bf16, w bf16, (a, sfa), (b, sfb), d, m_indices); x and w are the
    unquantized values the accuracy is measured against.
    """
    from ..kernels.triton import group_quant  # needs triton: imported on use

    g = torch.Generator(device=device).manual_seed(seed)
    m = groups * m_per
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    wt = (torch.randn(groups, n, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)
    scale = (wt.float().abs().amax(dim=(1, 2)) / FP8_MAX).clamp(min=MIN_SCALE)
    b = (wt.float() / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    a, sfa = group_quant(x)
    m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m_per)
    d = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    return x, wt, (a, sfa), (b, expand_block_scales(scale, n, k)), d, m_indices


def gemm_reference_diff(x, wt, d, m_per) -> float:
    """calc_diff of the grouped GEMM output against float64 products of the unquantized operands."""
    num, den = 0.0, 0.0
    for gi in range(wt.shape[0]):
        rows = slice(gi * m_per, (gi + 1) * m_per)
        ref = x[rows].double() @ wt[gi].double().t()
        y = d[rows].double()
        num += float((y * ref).sum())
        den += float((y * y + ref * ref).sum())
    return 1 - 2 * num / den

