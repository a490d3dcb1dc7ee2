"""MoE layer forward per backend and token count, and DeepGEMM's block scales:
upstream's per-forward `repeat_interleave` expansion vs expanded once and cached.

Times only: throughput (TFLOPS) is derived from these times by `fp8-reload report`.
Backends missing here (triton and deep_gemm without CUDA) are skipped. Kernel
functions are looked up in `setup` (`common.require`), so the suite still imports
against older commits (`fp8-reload regress`).
"""

from __future__ import annotations

from .common import (
    BACKENDS,
    PRESETS,
    TOKENS,
    CheckpointSuite,
    checkpoint_key,
    require,
    requires_backend,
    synchronized,
)
from .fixtures import RoutedBatch

_warm: set = set()
# (current place, place before the package layout change)
DEEPGEMM_FORWARD = ("fp8_reload.kernels.deep_gemm:moe_forward_deepgemm",
                    "fp8_reload.kernels_deepgemm:moe_forward_deepgemm")
BUILD_BLOCK_SCALES = ("fp8_reload.kernels.scales:build_block_scales",
                      "fp8_reload.kernels_deepgemm:_build_block_scales")
BLOCK_SCALES = {"cached": ("fp8_reload.kernels.scales:block_scales",
                           "fp8_reload.kernels_deepgemm:block_scales"),
                "per-forward": ("fp8_reload.kernels.scales:block_scales_per_forward",
                                "fp8_reload.kernels_deepgemm:block_scales_per_forward")}


@synchronized
class MoEForward(CheckpointSuite):
    params = (PRESETS, BACKENDS, TOKENS)
    param_names = ["preset", "backend", "tokens"]

    def setup(self, paths, preset, backend, tokens):
        requires_backend(backend, preset)
        self.batch = RoutedBatch(paths[checkpoint_key(preset, "fp8")], tokens)
        if (preset, backend, tokens) not in _warm:  # JIT compilation, autotuning
            self.batch.forward(backend)
            _warm.add((preset, backend, tokens))

    def time_forward(self, paths, preset, backend, tokens):
        self.batch.forward(backend)


@synchronized
class DeepGemmScaleMode(CheckpointSuite):
    """The DeepGEMM forward fed block scales three ways: ``precomputed`` (what a
    block-quantized checkpoint stores: the ceiling), ``cached`` (this project:
    expanded once per weights version) and ``per-forward`` (sglang 0.5.23)."""

    params = (PRESETS, ["precomputed", "cached", "per-forward"], TOKENS)
    param_names = ["preset", "scale_mode", "tokens"]

    def setup(self, paths, preset, scale_mode, tokens):
        requires_backend("deep_gemm", preset)
        forward = require(*DEEPGEMM_FORWARD)
        self.batch = RoutedBatch(paths[checkpoint_key(preset, "fp8")], tokens)
        b = self.batch
        pre = require(*BUILD_BLOCK_SCALES)(b.layer) if scale_mode == "precomputed" else None
        self.call = lambda: forward(b.layer, b.x, b.topk_weights, b.topk_ids,
                                    scale_mode=scale_mode, precomputed_scales=pre)
        if (preset, scale_mode, tokens) not in _warm:
            self.call()
            _warm.add((preset, scale_mode, tokens))

    def time_forward(self, paths, preset, scale_mode, tokens):
        self.call()


@synchronized
class BlockScaleExpansion(CheckpointSuite):
    """Block scales alone (pure torch, so it runs on CPU too): the two
    `repeat_interleave` sglang runs on every forward vs the cached copy."""

    params = (PRESETS, ["per-forward", "cached"])
    param_names = ["preset", "expansion"]

    def setup(self, paths, preset, expansion):
        fn = require(*BLOCK_SCALES[expansion])
        layer = RoutedBatch(paths[checkpoint_key(preset, "fp8")], 1).layer
        self.call = lambda: fn(layer)
        self.call()  # fills the cache

    def time_block_scales(self, paths, preset, expansion):
        self.call()
