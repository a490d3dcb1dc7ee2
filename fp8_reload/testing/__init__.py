"""Small, sharp helpers shared by tests, benchmarks and tools (in the spirit of deep_gemm.testing).

    numeric    calc_diff, bitwise comparison naming the first differing coordinate
    bench      CUDA-event / graph / profiler timing, interleaved comparisons
    workloads  synthetic MoE layers, routed tokens, grouped-GEMM operands, FLOP counts
    reference  a float32 reference forward of the whole model
    ep_bench   what the expert-parallel benchmarks run inside each rank (imported by name)
"""

from ..device import synchronize
from .bench import (
                    H200_DATASHEET,
                    H200_FP8_FLOP_PER_S,
                    H200_HBM_BYTES_PER_S,
                    DeviceLimits,
                    capture_graph,
                    cuda_time_ms,
                    flush_l2,
                    host_time_per_call,
                    interleaved_ms,
                    kernel_time_ms,
                    measure_device_limits,
                    roofline_ms,
                    tflops,
)
from .numeric import assert_bitwise_equal, calc_diff, count_bytes, first_difference
from .workloads import moe_bytes, moe_flop, routed_tokens, synthetic_moe_layer, v2_lite_moe

__all__ = ["H200_DATASHEET", "H200_FP8_FLOP_PER_S", "H200_HBM_BYTES_PER_S", "DeviceLimits",
           "assert_bitwise_equal", "calc_diff", "capture_graph", "count_bytes", "cuda_time_ms",
           "first_difference", "flush_l2", "host_time_per_call", "interleaved_ms", "kernel_time_ms",
           "measure_device_limits", "moe_bytes", "moe_flop", "roofline_ms", "routed_tokens",
           "synchronize", "synthetic_moe_layer", "tflops", "v2_lite_moe"]
