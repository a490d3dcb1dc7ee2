"""Triton kernels of the FP8 MoE forward (compiled on a GPU, interpreted on CPU).

    runtime  imports triton (interpreter mode without CUDA) and shared helpers
    jit      the device code
    moe      host wrappers: fused_moe, group_quant_rows, combine_rows, ...
"""

from .moe import (
                  combine_rows,
                  default_config,
                  fp8_operand,
                  fused_moe,
                  group_quant,
                  group_quant_rows,
                  moe_forward_triton,
                  quantize_per_tensor,
)
from .runtime import INTERPRET

__all__ = ["INTERPRET", "combine_rows", "default_config", "fp8_operand", "fused_moe", "group_quant",
           "group_quant_rows", "moe_forward_triton", "quantize_per_tensor"]
