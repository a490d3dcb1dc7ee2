"""MoE layer forward per backend and token count, and the DeepGEMM block-scale
expansion: upstream's per-forward `repeat_interleave` vs computed once and cached.

Times only: throughput (TFLOPS) is derived from these times by `fp8-reload report`.
Backends missing here (triton and deep_gemm without CUDA) are skipped.
"""

from __future__ import annotations

from fp8_reload import kernels

from .common import (BACKENDS, PRESETS, TOKENS, CheckpointSuite, RoutedBatch, checkpoint_key,
                     requires_attr, requires_backend, requires_deep_gemm, synchronized)

_warm: set = set()


@synchronized
class MoEForward(CheckpointSuite):
    params = (PRESETS, BACKENDS, TOKENS)
    param_names = ["preset", "backend", "tokens"]

    def setup(self, paths, preset, backend, tokens):
        requires_backend(backend)
        self.batch = RoutedBatch(paths[checkpoint_key(preset, "fp8")], tokens)
        if (preset, backend, tokens) not in _warm:  # JIT compilation, autotuning
            self.batch.forward(backend)
            _warm.add((preset, backend, tokens))

    def time_forward(self, paths, preset, backend, tokens):
        self.batch.forward(backend)


# The kernels issue keeps upstream's per-forward expansion as a baseline. This is
# the entry point the benchmark expects from it (skipped until it exists):
#   kernels.block_scales(layer, cached: bool) -> block scales for w13 and w2,
#   cached=False recomputing them with repeat_interleave like sglang on every
#   forward, cached=True returning the copy kept until the next reload.
EXPANSIONS = {"per-forward": False, "cached": True}


@synchronized
class BlockScaleExpansion(CheckpointSuite):
    params = (PRESETS, list(EXPANSIONS))
    param_names = ["preset", "expansion"]

    def setup(self, paths, preset, expansion):
        requires_deep_gemm()
        self.block_scales = requires_attr(
            kernels, "block_scales",
            "expected block_scales(layer, cached) from the DeepGEMM kernels issue")
        self.layer = RoutedBatch(paths[checkpoint_key(preset, "fp8")], 1).layer
        self.cached = EXPANSIONS[expansion]
        self.block_scales(self.layer, cached=self.cached)  # fills the cache

    def time_block_scales(self, paths, preset, expansion):
        self.block_scales(self.layer, cached=self.cached)
