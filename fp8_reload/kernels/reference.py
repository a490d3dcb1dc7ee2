"""The torch reference MoE forward (runs on CPU and GPU) and the torch 1 x 128
activation quantization the DeepGEMM path is checked against.

Every backend is compared with `moe_forward_torch(..., quantize_activations=False)`:
the float32 forward of the same FP8 weights, so all error a backend shows comes
from quantizing activations (see `bounds`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import trace
from ..quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize, quantize_dynamic, quantize_static
from .scales import BLOCK, moe_kernel_scales


def _quant_act(x: torch.Tensor, scale: torch.Tensor | None):
    if scale is None:
        return quantize_dynamic(x)
    return quantize_static(x, scale), scale


def moe_forward_torch(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, quantize_activations: bool = True) -> torch.Tensor:
    """Reference fused-MoE: quantize activations like the FP8 kernels, GEMM in float32.

    With ``quantize_activations=False`` it is the float32 reference of the same
    (dequantized) weights that accuracy bounds are measured against.
    """
    w13_s, w2_s, a13, a2 = moe_kernel_scales(layer)
    inter = layer.intermediate_size
    with trace.range("fp8_reload/act_quant", payload=x.shape[0]):
        if quantize_activations:
            xq, xs = _quant_act(x, a13)
            xf = dequantize(xq, xs)
        else:
            xf = x.float()
    experts = torch.unique(topk_ids).tolist()
    acts = {}
    for e in experts:
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        with trace.range("fp8_reload/gemm_w13", payload=tok.numel()):
            h = xf.index_select(0, tok) @ dequantize(layer.w13_weight[e], w13_s[e]).t()
        with trace.range("fp8_reload/activation", payload=tok.numel()):
            acts[e] = (tok, slot, F.silu(h[:, :inter]) * h[:, inter:])
    if quantize_activations and a2 is None and acts:
        # dynamic per-tensor scale over every routed token, as the fused kernel does
        with trace.range("fp8_reload/act_quant"):
            a2 = torch.stack([a.abs().amax() for _, _, a in acts.values()]).amax() / FP8_MAX
            a2 = a2.clamp(min=MIN_SCALE)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in experts:
        tok, slot, a = acts[e]
        if quantize_activations:
            with trace.range("fp8_reload/act_quant", payload=tok.numel()):
                a = dequantize(quantize_static(a, a2), a2)
        with trace.range("fp8_reload/gemm_w2", payload=tok.numel()):
            y = a @ dequantize(layer.w2_weight[e], w2_s[e]).t()
        with trace.range("fp8_reload/combine", payload=tok.numel()):
            out.index_add_(0, tok, y * topk_weights[tok, slot].unsqueeze(1).float())
    return out.to(torch.bfloat16)


def per_token_group_quant(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x `group` activation quantization (DeepGEMM's input format).

    Returns (fp8 [M, K], float32 scales [M, K // group]). K must be a multiple of `group`.
    """
    m, k = x.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the group size {group}")
    xg = x.to(torch.float32).view(m, k // group, group)
    scale = (xg.abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
    q = (xg / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale
