"""Post-load processing of FP8 layers (see `modes` for the three processing modes).

    ops      in-place, vectorized tensor ops on the [E, 2] layout (shared with sglang_patch)
    linear   Fp8LinearMethod: upstream and fixed
    moe      Fp8MoEMethod: upstream, identity-only and fixed
    modes    ProcessingMode, MODES, get_mode, process_modules
"""

from .linear import FixedFp8LinearMethod, UpstreamFp8LinearMethod
from .modes import MODES, ProcessingMode, get_mode, process_modules
from .moe import FixedFp8MoEMethod, IdentityOnlyFp8MoEMethod, UpstreamFp8MoEMethod
from .ops import (
    CHUNK_BYTES,
    merge_input_scales_,
    quantize_experts_,
    reload_memory_bound,
    requantize_w13_to_expert_max_,
)

__all__ = ["CHUNK_BYTES", "FixedFp8LinearMethod", "FixedFp8MoEMethod", "IdentityOnlyFp8MoEMethod",
           "MODES", "ProcessingMode", "UpstreamFp8LinearMethod", "UpstreamFp8MoEMethod",
           "get_mode", "merge_input_scales_", "process_modules", "quantize_experts_",
           "reload_memory_bound", "requantize_w13_to_expert_max_"]
