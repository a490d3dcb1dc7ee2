"""Post-processing of one MoE layer: sglang 0.5.23's per-expert loop vs the fixed,
in-place version (Triton kernels on a GPU, vectorized torch on CPU).

Each sample processes a layer that was just loaded and not yet processed; `setup`
restores that exact state (Parameter objects and bytes) before every sample, so
``number = 1`` and no warm-up calls (which would time an already processed layer).
Like for like: both sides start with the loaded values on the benchmark device
(bf16 checkpoints: upstream's bf16 Parameters, the fixed mode's staged bf16 pieces),
and the time ends when the device has finished (`synchronized`).
"""

from __future__ import annotations

from .common import KINDS, PRESETS, CheckpointSuite, checkpoint_key, synchronized
from .fixtures import UnprocessedLayer

# name -> (processing mode, experts loaded since the last processing)
IMPLS = {
    "upstream": ("upstream", "all"),  # sglang's loop over every expert
    "fixed": ("fixed", "all"),  # same work, vectorized and in place
    "fixed-1-expert": ("fixed", "one"),  # what a one-expert EPLB reload costs
}


@synchronized
class ProcessMoELayer(CheckpointSuite):
    params = (PRESETS, KINDS, list(IMPLS))
    param_names = ["preset", "kind", "impl"]
    number = 1
    warmup_time = 0.0
    repeat = (3, 20, 10.0)

    def setup(self, paths, preset, kind, impl):
        processing, scope = IMPLS[impl]
        self.state = UnprocessedLayer.get(paths[checkpoint_key(preset, kind)], processing, scope)
        self.state.restore()

    def time_process(self, paths, preset, kind, impl):
        self.state.process()
