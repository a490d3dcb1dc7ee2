"""Weight scales as kernels consume them, and the per-layer caches derived from them.

The fixed layout keeps ``w13_weight_scale`` as ``[E, 2]`` (one column per shard,
equal after processing); kernels index ``scale + expert`` and need a contiguous
``[E]``: `collapse_w13_scale` is the one place that makes it. DeepGEMM takes one
float32 scale per ``BLOCK x BLOCK`` tile of a weight: `expand_block_scales`.

Anything derived from the weights is memoized per layer by `layer_cache`, keyed
by ``weights_version``; every post-processing bumps the version and every
reload calls `clear_kernel_caches`, so a derived value is never served stale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import trace

# DeepGEMM's scale block (128 x 128 weights, 1 x 128 activations) and the group of
# the Triton per-token-group quantization that feeds it.
BLOCK = 128


def collapse_w13_scale(scale: torch.Tensor) -> torch.Tensor:
    """``[E, 2]`` (fixed layout, equal columns) -> contiguous ``[E]``; ``[E]`` as it is."""
    return scale[:, 0].contiguous() if scale.dim() == 2 else scale


def moe_kernel_scales(layer) -> tuple[torch.Tensor, torch.Tensor,
                                        torch.Tensor | None, torch.Tensor | None]:
    """(w13 [E], w2 [E], a13 scalar | None, a2 scalar | None) as kernels consume them.

    Accepts both the fixed ``[E, 2]`` layout and the upstream collapsed ``[E]`` one.
    """
    a13 = None if layer.w13_input_scale is None else layer.w13_input_scale.max()
    a2 = None if layer.w2_input_scale is None else layer.w2_input_scale.max()
    return collapse_w13_scale(layer.w13_weight_scale), layer.w2_weight_scale, a13, a2


def layer_cache(layer, name, build: Callable):
    """Per-layer memo of `build(layer)`, keyed by (name, ``layer.weights_version``, device).

    The device covers ``model.to()``; the version covers any post-processing.
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


@trace.range("fp8_reload/invalidate_caches")
def clear_kernel_caches(model) -> None:
    """Drop every layer's `layer_cache` (a reload may have changed any weight)."""
    for _, layer in model.moe_layers():
        cache = getattr(layer, "kernel_cache", None)
        if cache is not None:
            cache.clear()


def expand_block_scales(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """Per-expert ``[E]`` -> contiguous ``[E, ceil(n/block), ceil(k/block)]`` (one kernel)."""
    if scale.dim() != 1:
        raise ValueError(f"expected a per-expert [E] scale, got shape {tuple(scale.shape)} "
                         "(collapse [E, 2] with collapse_w13_scale first)")
    nb, kb = -(-n // block), -(-k // block)
    return scale.to(torch.float32)[:, None, None].expand(-1, nb, kb).contiguous()


def expand_block_scales_per_forward(scale: torch.Tensor, n: int, k: int,
                                    block: int = BLOCK) -> torch.Tensor:
    """sglang 0.5.23's expansion: two ``repeat_interleave`` per weight, every forward."""
    nb, kb = (n - 1) // block + 1, (k - 1) // block + 1
    return scale.unsqueeze(1).repeat_interleave(nb, dim=1).unsqueeze(2).repeat_interleave(kb, dim=2)


def build_block_scales(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 ``[E, 2I/128, H/128]``, w2 ``[E, H/128, I/128]``) from the layer's scales."""
    w13_s, w2_s, _, _ = moe_kernel_scales(layer)
    _, n13, k13 = layer.w13_weight.shape
    _, n2, k2 = layer.w2_weight.shape
    return expand_block_scales(w13_s, n13, k13), expand_block_scales(w2_s, n2, k2)


def block_scales(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """`build_block_scales`, cached per weights version."""
    return layer_cache(layer, "deep_gemm_block_scales", build_block_scales)


def block_scales_per_forward(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """What sglang 0.5.23 does on every forward (after the collapse it lacks)."""
    _, n13, k13 = layer.w13_weight.shape
    _, n2, k2 = layer.w2_weight.shape
    return (expand_block_scales_per_forward(collapse_w13_scale(layer.w13_weight_scale), n13, k13),
            expand_block_scales_per_forward(layer.w2_weight_scale, n2, k2))
