"""`fp8-reload bench-kernels`: the MoE forward kernels on a GPU, timed and checked.

Three tables, written as Markdown and CSV:

* **scales**: DeepGEMM MoE forward (contiguous) at the v2-lite shape fed block
  scales three ways: precomputed (what a block-quantized checkpoint stores, the
  upper bound), cached per weights version (this project: collapse ``[E, 2]``
  once, expand once) and expanded by ``repeat_interleave`` on every forward
  (sglang 0.5.23). Target: cached >= 97% of precomputed throughput.
* **gemm**: DeepGEMM's grouped contiguous FP8 GEMM at DeepSeek shapes, 8 groups
  x 4096 rows, per-tensor weight scales expanded to blocks, per-token-group
  activations; GPU kernel time and TFLOPS. Target: >= 1300 TFLOPS.
* **forward**: the whole MoE layer at the v2-lite shape (hidden 2048, 64
  experts, intermediate 1408, top-6) for each backend: wall time per forward
  (CUDA events), GPU kernel time (profiler), TFLOPS and calc_diff against the
  float32 reference.

Timing (`fp8_reload.testing.bench`): `cuda_time_ms` brackets each call with
CUDA events after an optional L2 flush and takes the median (what a caller
waits, launch overhead included); `kernel_time_ms` sums the durations of the
GPU kernels the profiler saw per call (DeepGEMM's bench_kineto idea: no launch
gaps, no host work).
Working sets here (>= 235 MB of weights) are far above the H200's 50 MB L2.

DeepGEMM and Triton compile kernels on first use; `prewarm` runs every case
once in parallel worker processes first so the JIT caches are warm and the
timed run measures kernels, not compilers.

    cases   the measured configurations, and the bench that builds and times them
    run     parallel JIT prewarm, then every case
    output  Markdown and CSV tables, the verdict against the targets
"""

from .cases import (
                    FORWARD_BACKENDS,
                    FORWARD_TOKENS,
                    GEMM_SHAPES,
                    Bench,
                    Case,
                    forward_cases,
                    gemm_cases,
                    scale_cases,
)
from .output import verdict, write_results
from .run import all_cases, command, environment, main, prewarm, run

__all__ = ["Bench", "Case", "FORWARD_BACKENDS", "FORWARD_TOKENS", "GEMM_SHAPES", "all_cases", "command",
           "environment", "forward_cases", "gemm_cases", "main", "prewarm", "run",
           "scale_cases", "verdict", "write_results"]
