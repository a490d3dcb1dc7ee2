"""Reload: `update_weights_from_disk`, full and filtered, against upstream's scope
and against a plain read and copy of the same bytes (the machine's limits are in `io`).

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

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

import fp8_reload as fr
from fp8_reload.locks import WeightsLock

from .common import (
    DEVICE,
    FRACTIONS,
    KINDS,
    ON_CUDA,
    PRESETS,
    CheckpointSuite,
    checkpoint_key,
    device_peak_bytes,
    fraction_experts,
    moved,
    require,
    requires_cuda,
    sync,
    synchronized,
)
from .fixtures import loaded_model

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

    def _setup(self, paths, preset, kind, experts, strategy, warm=True):
        self.path = paths[checkpoint_key(preset, kind)]
        self.model = loaded_model(self.path)
        self.filter = (None if experts == "full" else
                       fr.generate_weight_name_filter(fraction_experts(self.model.config, experts)))
        self.kwargs = STRATEGIES[strategy]
        key = (self.path, experts, strategy)
        if warm and key not in _warm:  # first-call costs (allocator, kernel loading) stay out of samples
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


@synchronized
class FullReload(_ReloadCase):
    """`update_weights_from_disk(model, path)`: every tensor (RL weight sync)."""

    params = (PRESETS, KINDS)
    param_names = ["preset", "kind"]

    def setup(self, paths, preset, kind):
        self._setup(paths, preset, kind, "full", "fixed")

    def time_reload(self, paths, preset, kind):
        self._run()


class ReloadBytes(_ReloadCase):
    """Bytes a fixed-mode reload reads for each share of experts (``full``: no filter).
    Deterministic, so one process per parameter set and no timing; a reload that starts
    reading more than it needs shows here as a regression. Upstream's scope reads the
    whole checkpoint whatever the filter (`RawReadCopy` with ``full`` reads the same)."""

    params = (PRESETS, KINDS, FRACTIONS + ["full"])
    param_names = ["preset", "kind", "experts"]

    def setup(self, paths, preset, kind, experts):
        self._setup(paths, preset, kind, experts, "fixed", warm=False)

    def track_bytes_read(self, paths, preset, kind, experts):
        return self._run().bytes_read

    track_bytes_read.unit = "bytes"


_CHECKED: dict = {}  # ValidateStaged's tensors of one checkpoint: {path: (staged, resident, landed, tables)}


@synchronized
class ValidateStaged(CheckpointSuite):
    """The value check of a full checkpoint (FP8 NaN bytes, non-finite floats, scales:
    `fp8_reload.checkpoint.values`), beside `FullReload` with the same parameters: what
    validating every value costs.

    ``time_validate``           as the staged path runs it (`load_model`, upstream's scan-all
                                reads, ``FP8_RELOAD_ENGINE=staged``), from the pinned staging
                                arena: each batch copied to the device, checked there (inside
                                a reload those copies overlap the disk reads, so this is an
                                upper bound on what they add); on CPU, in place
    ``time_validate_resident``  the same check, tensors already on the device (its kernel)
    ``time_check_landed``       as the default (streaming) reload runs it: the values where
                                they landed, one flag per tensor (`nonfinite_flags`, its
                                table kept as the reload keeps it: built by the warm-up, as
                                by a model's first check) and the one read-back, on the same
                                tensors already on the device; it runs in the first reload
                                of a checkpoint's files
    ``time_first_reload``       that reload: the files' stamps just changed (their mtime
                                moved, as when RL weight sync writes a new checkpoint), so
                                it parses, plans and checks (the 4-8 ``utime`` calls are
                                timed too, a few µs); `FullReload` is the repeated reload,
                                which checks nothing
    """

    params = (PRESETS, KINDS)
    param_names = ["preset", "kind"]

    def setup(self, paths, preset, kind):
        self.value_check = require("fp8_reload.checkpoint.values:ValueCheck")
        self.path = paths[checkpoint_key(preset, kind)]
        first = self.path not in _CHECKED
        if first:  # setup runs before every sample: read once per checkpoint
            arena_cls = require("fp8_reload.checkpoint:PinnedArena")
            _CHECKED.clear()
            ckpt = fr.Checkpoint(self.path)
            staged = list(ckpt.read(ckpt.names, {}, into=arena_cls() if ON_CUDA else None))
            resident = [(n, t.to(DEVICE)) for n, t in staged]
            kept = moved("fp8_reload.checkpoint.values:KeptTables")  # (newer code than the check)
            _CHECKED[self.path] = (staged, resident, [t for _, t in resident if t.numel()],
                                   kept() if kept else None)
        self.staged, self.resident, self.landed, self.tables = _CHECKED[self.path]
        if first:  # warm-ups (the landed check's builds its kept table)
            self._validate(self.staged)
            if self.tables is not None:
                self.time_check_landed(paths, preset, kind)

    def _validate(self, staged):
        check = self.value_check(DEVICE)
        for name, tensor in staged:
            check.add(name, tensor)
        if check.first_invalid() is not None:  # waits for the device: the timing includes it
            raise RuntimeError("the benchmark checkpoint holds invalid values")

    def time_validate(self, paths, preset, kind):
        self._validate(self.staged)

    def time_validate_resident(self, paths, preset, kind):
        self._validate(self.resident)

    def time_check_landed(self, paths, preset, kind):
        landed_flags = require("fp8_reload.checkpoint.values:nonfinite_flags")
        if bool(landed_flags(self.landed, self.tables).any()):  # the read-back waits for the device
            raise RuntimeError("the benchmark checkpoint holds invalid values")

    def time_first_reload(self, paths, preset, kind):
        touch = require("fp8_reload.testing.io_paths:touch")  # (newer code than the reload)
        touch(require("fp8_reload.testing.io_paths:shard_files")(self.path))
        fr.update_weights_from_disk(loaded_model(self.path), self.path)  # (one model per checkpoint)
        sync()


class DeviceMemoryBound:
    """The bound `ReloadDeviceMemory` is judged against, recorded with the results: it is
    a property of the code (the processing chunk, the backup's pieces on the device), so
    `fp8-reload report` judges each run by the bound of the code it measured.
    Device-independent; runs everywhere."""

    def setup(self):
        self.bound = require("fp8_reload.reload:device_memory_bound",
                             "fp8_reload.processing:reload_memory_bound")

    def track_bound_bytes(self):
        return self.bound()

    track_bound_bytes.unit = "bytes"


READ_THREADS = 8


@synchronized
class RawReadCopy(CheckpointSuite):
    """Issue 4's baseline: read the same tensors and copy each into preallocated device
    memory, nothing else (no planning, validation, backup, loader or post-processing). Two
    plain readers, a call and a copy per tensor; not the machine's limit (one pinned copy of
    the checkpoint, `io.IOPaths` ``limit-h2d``, is: the reload streams and beats these):

    ``safetensors``  `safe_open(...).get_tensor` (memory-mapped) and a copy per tensor
    ``preadv``       `os.preadv` from 8 threads into one pinned host buffer (on CUDA),
                     then one asynchronous copy per tensor
    """

    params = (PRESETS, KINDS, FRACTIONS + ["full"], ["safetensors", "preadv"])
    param_names = ["preset", "kind", "experts", "reader"]

    def setup(self, paths, preset, kind, experts, reader):
        path = Path(paths[checkpoint_key(preset, kind)])
        ckpt = fr.Checkpoint(path)
        if experts == "full":
            names = ckpt.names
        else:
            flt = fr.generate_weight_name_filter(fraction_experts(ckpt.config, experts))
            names = [n for n in ckpt.names if flt(n)]
        infos = sorted((ckpt.info(n) for n in names), key=lambda i: (i.file, i.offset))
        self.nbytes = sum(i.nbytes for i in infos)
        self.groups: dict[str, list] = {}
        self.jobs = []
        buf = torch.empty(sum(_align(i.nbytes) for i in infos), dtype=torch.uint8,
                          pin_memory=ON_CUDA) if reader == "preadv" else None
        start = 0
        for info in infos:
            dst = torch.empty(info.shape, dtype=info.dtype, device=DEVICE)
            file = str(path / info.file)
            self.groups.setdefault(file, []).append((info.name, dst))
            if buf is not None:
                self.jobs.append((file, info.offset, buf[start:start + info.nbytes],
                                  dst.reshape(-1).view(torch.uint8)))
                start += _align(info.nbytes)
        self.run = self._preadv if reader == "preadv" else self._safetensors
        self.run()  # warm-up

    def _safetensors(self):
        for file, tensors in self.groups.items():
            with safe_open(file, framework="pt") as f:
                for name, dst in tensors:
                    dst.copy_(f.get_tensor(name))

    def _preadv(self):
        fds = {file: os.open(file, os.O_RDONLY) for file in self.groups}
        try:
            def read(job):
                file, offset, host, _ = job
                view, done = memoryview(host.numpy()), 0
                while done < len(view):
                    n = os.preadv(fds[file], [view[done:]], offset + done)
                    if n <= 0:
                        raise OSError(f"{file}: short read")
                    done += n

            list(_pool().map(read, self.jobs))
        finally:
            for fd in fds.values():
                os.close(fd)
        for _, _, host, dst in self.jobs:
            dst.copy_(host, non_blocking=True)

    def time_read_copy(self, paths, preset, kind, experts, reader):
        self.run()


_POOL = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(READ_THREADS)
    return _POOL


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


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


class WeightsLockAccess:
    """The weights lock's accesses, uncontended, on the thread asv times (the main one, where
    a Ctrl-C can land): a forward's read access, which every model forward takes before its
    first kernel, and a reload's write access (`commit_hold`, then `take`)."""

    def setup(self):
        self.lock = WeightsLock()

    def time_read_access(self):
        with self.lock.read():
            pass

    def time_write_access(self):
        hold = self.lock.commit_hold()
        with hold:
            hold.take()

