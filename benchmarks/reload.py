"""Reload: `update_weights_from_disk`, full and filtered, against upstream's scope
and against the physical bound of reading the same bytes and copying them.

Strategies of a filtered reload (all on a ``fixed``-mode model, so every one of
them can run repeatedly; an ``upstream``-mode model cannot reload at all):

``fixed``           this project: only the matching tensors are read, only the
                    modules that received weights are post-processed
``scan-all``        upstream's read scope: every tensor is read, then filtered
``upstream-style``  upstream's read and processing scope: every tensor read,
                    every quantized module post-processed (with the fixed,
                    vectorized code: sglang's per-expert loop is slower still,
                    see ``processing.ProcessMoELayer``)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

import fp8_reload as fr
from fp8_reload.checkpoint import Checkpoint

from .common import (DEVICE, FRACTIONS, KINDS, PRESETS, CheckpointSuite, checkpoint_key,
                     device_peak_bytes, fraction_experts, loaded_model, requires_cuda,
                     synchronized)

STRATEGIES = {
    "fixed": {},
    "scan-all": {"scan_all": True},
    "upstream-style": {"scan_all": True, "postprocess_all": True},
}

_warm: set = set()


def _reload(model, path, weight_filter, kwargs) -> fr.ReloadReport:
    return fr.update_weights_from_disk(model, path, weight_filter, **kwargs)


class _ReloadCase(CheckpointSuite):
    """setup: a loaded model, the filter for `experts`, one untimed warm-up reload."""

    def _setup(self, paths, preset, kind, experts, strategy):
        self.path = paths[checkpoint_key(preset, kind)]
        self.model = loaded_model(self.path)
        self.filter = (None if experts == "full" else
                       fr.generate_weight_name_filter(fraction_experts(self.model.config, experts)))
        self.kwargs = STRATEGIES[strategy]
        key = (self.path, experts, strategy)
        if key not in _warm:  # first-call costs (allocator, kernel loading) stay out of samples
            _reload(self.model, self.path, self.filter, self.kwargs)
            _warm.add(key)

    def _run(self) -> fr.ReloadReport:
        return _reload(self.model, self.path, self.filter, self.kwargs)


@synchronized
class FilteredReload(_ReloadCase):
    """EPLB's step: reload a share of every MoE layer's experts from disk."""

    params = (PRESETS, KINDS, FRACTIONS, list(STRATEGIES))
    param_names = ["preset", "kind", "experts", "strategy"]

    def setup(self, paths, preset, kind, experts, strategy):
        self._setup(paths, preset, kind, experts, strategy)

    def time_reload(self, paths, preset, kind, experts, strategy):
        self._run()

    def track_bytes_read(self, paths, preset, kind, experts, strategy):
        return self._run().bytes_read

    track_bytes_read.unit = "bytes"


@synchronized
class FullReload(_ReloadCase):
    """`update_weights_from_disk(model, path)`: every tensor (RL weight sync)."""

    params = (PRESETS, KINDS)
    param_names = ["preset", "kind"]

    def setup(self, paths, preset, kind):
        self._setup(paths, preset, kind, "full", "fixed")

    def time_reload(self, paths, preset, kind):
        self._run()

    def track_bytes_read(self, paths, preset, kind):
        return self._run().bytes_read

    track_bytes_read.unit = "bytes"


@synchronized
class RawReadCopy(CheckpointSuite):
    """The physical bound: read the same tensors with safetensors and copy each into
    preallocated device memory, nothing else (no planning, validation, backup,
    loader or post-processing)."""

    params = (PRESETS, KINDS, FRACTIONS + ["full"])
    param_names = ["preset", "kind", "experts"]

    def setup(self, paths, preset, kind, experts):
        path = Path(paths[checkpoint_key(preset, kind)])
        ckpt = Checkpoint(path)
        if experts == "full":
            names = ckpt.names
        else:
            flt = fr.generate_weight_name_filter(fraction_experts(ckpt.config, experts))
            names = [n for n in ckpt.names if flt(n)]
        infos = sorted((ckpt.info(n) for n in names), key=lambda i: (i.file, i.offset))
        self.groups: dict[str, list] = {}
        for info in infos:
            dst = torch.empty(info.shape, dtype=info.dtype, device=DEVICE)
            self.groups.setdefault(str(path / info.file), []).append((info.name, dst))
        self.nbytes = sum(i.nbytes for i in infos)
        self.time_read_copy(paths, preset, kind, experts)  # warm-up

    def time_read_copy(self, paths, preset, kind, experts):
        for file, tensors in self.groups.items():
            with safe_open(file, framework="pt") as f:
                for name, dst in tensors:
                    dst.copy_(f.get_tensor(name))

    def track_bytes(self, paths, preset, kind, experts):
        return self.nbytes

    track_bytes.unit = "bytes"


class ReloadDeviceMemory(_ReloadCase):
    """Peak device memory a reload allocates beyond the loaded model (CUDA only;
    asv's ``peakmem_`` measures host RSS)."""

    params = (PRESETS, KINDS, FRACTIONS + ["full"])
    param_names = ["preset", "kind", "experts"]

    def setup(self, paths, preset, kind, experts):
        requires_cuda()
        self._setup(paths, preset, kind, experts, "fixed")

    def track_peak_bytes(self, paths, preset, kind, experts):
        return device_peak_bytes(self._run)

    track_peak_bytes.unit = "bytes"
