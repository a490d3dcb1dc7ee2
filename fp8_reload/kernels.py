"""MoE forward backends.

``torch`` is the reference: per-expert W8A8 GEMMs dequantized to float32, runs
on CPU and GPU. GPU backends register themselves in `BACKENDS` (see
`kernels_gpu`). Every backend reads the layer's scales through
`moe_kernel_scales`, which accepts both the fixed ``[E, 2]`` layout and the
upstream collapsed ``[E]`` layout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import trace
from .quant import dequantize, quantize_dynamic, quantize_static

DEFAULT_BACKEND = "torch"

# Accuracy bounds: DeepGEMM's calc_diff against the float32 reference of the same
# FP8 weights (`moe_forward_torch(..., quantize_activations=False)`). The weights are
# the same bytes on both sides, so all error comes from quantizing activations.
GEMM_BOUND = 1e-3  # one FP8 x FP8 GEMM (DeepGEMM's own test bound)
# A MoE layer quantizes activations twice in series (tokens before gate/up, and
# silu(gate) * up before down): two FP8 GEMMs' independent errors, whose calc_diffs
# add. Measured 0.9e-3 .. 1.4e-3 on the synthetic checkpoints.
MOE_LAYER_BOUND = 2 * GEMM_BOUND
# Backends with the same activation scheme (torch and triton: per-tensor scales) differ
# only by summation order and bf16 rounding of per-expert outputs, which flips a few
# FP8 roundings; measured ~2e-5.
SAME_SCHEME_BOUND = 1e-4
# Backends with different schemes (per-tensor vs DeepGEMM's per-token-group) each err
# independently from the reference: their distance adds up to both bounds.
CROSS_SCHEME_BOUND = 2 * MOE_LAYER_BOUND


class BackendUnavailable(RuntimeError):
    """The requested forward backend cannot run here (no GPU, no deep_gemm, ...)."""


def moe_kernel_scales(layer) -> tuple[torch.Tensor, torch.Tensor,
                                        Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(w13 [E], w2 [E], a13 scalar | None, a2 scalar | None) as kernels consume them.

    A fixed layer keeps ``w13_weight_scale`` as ``[E, 2]`` with equal columns;
    kernels index ``scale + expert``, so they get column 0 as a contiguous [E].
    """
    w13 = layer.w13_weight_scale
    if w13.dim() == 2:
        w13 = w13[:, 0].contiguous()
    a13 = None if layer.w13_input_scale is None else layer.w13_input_scale.max()
    a2 = None if layer.w2_input_scale is None else layer.w2_input_scale.max()
    return w13, layer.w2_weight_scale, a13, a2


def layer_cache(layer, name, build: Callable):
    """Per-layer memo of `build(layer)`, keyed by (name, ``layer.weights_version``, device).

    Every post-processing bumps the version and every reload clears
    ``layer.kernel_cache`` (`reload._invalidate_caches`), so a value derived from
    the weights (collapsed scales, block scales) is rebuilt after any reload that
    touched the layer and never served stale; the device covers ``model.to()``.
    """
    cache = getattr(layer, "kernel_cache", None)
    if cache is None:
        cache = layer.kernel_cache = {}
    key = (name, layer.weights_version, layer.w13_weight.device)
    value = cache.get(key)
    if value is None:
        for old in [k for k in cache if k[0] == name]:
            del cache[old]
        value = cache[key] = build(layer)
    return value


def cached_kernel_scales(layer):
    """`moe_kernel_scales(layer)`, computed once per weights version."""
    return layer_cache(layer, "kernel_scales", moe_kernel_scales)


def _quant_act(x: torch.Tensor, scale: Optional[torch.Tensor]):
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
            a2 = torch.stack([a.abs().amax() for _, _, a in acts.values()]).amax() / 448.0
            a2 = a2.clamp(min=1e-12)
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


BACKENDS: dict[str, Callable] = {"torch": moe_forward_torch}
# Backends known but unusable here -> why (filled by `kernels_gpu` on import).
UNAVAILABLE: dict[str, str] = {}


def available_backends() -> list[str]:
    _register_gpu_backends()
    return list(BACKENDS)


def _register_gpu_backends() -> None:
    try:
        from . import kernels_gpu  # noqa: F401  (registers on import when usable)
    except ImportError:
        pass


def run_moe(layer, x, topk_weights, topk_ids, backend: Optional[str] = None):
    name = backend or DEFAULT_BACKEND
    if name not in BACKENDS:
        _register_gpu_backends()
    fn = BACKENDS.get(name)
    if fn is None:
        why = f": {UNAVAILABLE[name]}" if name in UNAVAILABLE else ""
        raise BackendUnavailable(f"MoE backend {name!r} is not available here{why} "
                                 f"(available: {', '.join(BACKENDS)})")
    with trace.range("fp8_reload/moe", payload=x.shape[0]):
        return fn(layer, x, topk_weights, topk_ids)
