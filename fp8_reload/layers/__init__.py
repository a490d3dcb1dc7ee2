"""Modules with sglang's parameter layout and `weight_loader` semantics.

`Fp8Linear` mirrors sglang's (Merged)ColumnParallelLinear + Fp8LinearMethod and
`FusedMoE` mirrors sglang's FusedMoE + Fp8MoEMethod, per rank with E local
experts:

    w13_weight        [E, 2I, H]  fp8   gate rows [0, I), up rows [I, 2I)
    w2_weight         [E, H, I]   fp8
    w13_weight_scale  [E, 2]      f32   one slot per shard (w1 = gate, w3 = up)
    w2_weight_scale   [E]         f32
    w13_input_scale   [E]         f32   static activation scheme only
    w2_input_scale    [E]         f32

Parameters carry `weight_loader` (and `quant_method` for scales) the way sglang
sets them, because those attributes are exactly what upstream post-processing
loses. How parameters are created, post-processed and consumed is delegated to
a quant method from `processing`, chosen by the processing mode.
"""

from .blocks import PER_TENSOR, Fp8Linear, FusedMoE, MoEBlock, set_weight_attrs
from .model import EXPERT_RE, FP8MoEModel, expert_of

__all__ = ["EXPERT_RE", "PER_TENSOR", "FP8MoEModel", "Fp8Linear", "FusedMoE", "MoEBlock", "expert_of",
           "set_weight_attrs"]
