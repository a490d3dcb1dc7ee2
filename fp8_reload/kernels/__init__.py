"""MoE forward kernels: a registry above the backends, and what the backends share.

    registry   which backends exist, which run here (and why not), `run_moe`
    reference  the torch reference forward (CPU and GPU), 1 x 128 group quantization
    triton/    the fused per-tensor FP8 MoE in Triton (interpreted on CPU)
    deep_gemm  DeepGEMM grouped GEMMs with per-tensor scales expanded to blocks
    scales     [E, 2] -> [E], block scales, per-layer caches keyed on weights_version
    routing    token-slot pairs grouped by expert (contiguous / masked layouts)
    bounds     accuracy bounds: per GEMM, per layer, and the gate's versioned file

Backends are imported by the registry on first use; importing this package
imports neither triton nor deep_gemm.
"""

from ..errors import BackendUnavailable
from .bounds import CROSS_SCHEME_BOUND, GEMM_BOUND, MOE_LAYER_BOUND, SAME_SCHEME_BOUND
from .reference import moe_forward_torch, per_token_group_quant
from .registry import (
                       BACKEND_NAMES,
                       BACKENDS,
                       DEFAULT_BACKEND,
                       GPU_BACKENDS,
                       UNAVAILABLE,
                       available_backends,
                       backend_status,
                       get_backend,
                       run_moe,
)
from .scales import BLOCK, cached_kernel_scales, clear_kernel_caches, layer_cache, moe_kernel_scales

__all__ = ["BACKENDS", "BACKEND_NAMES", "BLOCK", "BackendUnavailable", "CROSS_SCHEME_BOUND",
           "DEFAULT_BACKEND", "GEMM_BOUND", "GPU_BACKENDS", "MOE_LAYER_BOUND", "SAME_SCHEME_BOUND",
           "UNAVAILABLE", "available_backends", "backend_status", "cached_kernel_scales",
           "clear_kernel_caches", "get_backend", "layer_cache", "moe_forward_torch",
           "moe_kernel_scales", "per_token_group_quant", "run_moe"]
