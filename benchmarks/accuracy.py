"""Accuracy of each MoE forward backend as asv `track_` values, so drift over
commits shows in asv like a slowdown does (lower is better).

calc_diff is DeepGEMM's metric, 1 - 2<x,y>/(|x|^2+|y|^2), between the backend's
output and a float32 reference over the same dequantized weights without
activation quantization: what FP8 activations cost, plus any kernel error.
"""

from __future__ import annotations

import fp8_reload as fr

from .common import (
    ACCURACY_TOKENS,
    BACKENDS,
    PRESETS,
    CheckpointSuite,
    checkpoint_key,
    requires_backend,
)
from .fixtures import RoutedBatch


class ForwardAccuracy(CheckpointSuite):
    params = (PRESETS, BACKENDS, ACCURACY_TOKENS)
    param_names = ["preset", "backend", "tokens"]

    def setup(self, paths, preset, backend, tokens):
        requires_backend(backend, preset)
        self.batch = RoutedBatch(paths[checkpoint_key(preset, "fp8")], tokens)

    def track_calc_diff(self, paths, preset, backend, tokens):
        return fr.calc_diff(self.batch.forward(backend), self.batch.reference())

    track_calc_diff.unit = "calc_diff"
