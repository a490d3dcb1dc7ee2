"""I/O paths side by side: the reload engines, the field's loaders and the machine's limits.

Every parameter set moves one checkpoint's tensors (all of them, or one expert per MoE
layer) into preallocated device tensors, or reloads them into a loaded model:

``limit-h2d``        one pinned buffer of the checkpoint's size, one host-to-device copy
``limit-read``       16 threads of `preadv`, 64 MiB each, page cache (or disk) to pinned
``limit-read-direct``  the same with O_DIRECT: the disk's limit, whatever is cached
``fp8-reload``       `update_weights_from_disk`, the streaming engine (repeated: shards
                     registered after the warm-up reloads)
``fp8-reload-direct``  the same with ``FP8_RELOAD_IO=direct``: every reload from the disk
                     (nothing registered, nothing cached), the price of keeping the page
                     cache clear
``fp8-reload-staged``  the engine before it (``FP8_RELOAD_ENGINE=staged``)
``instanttensor``    InstantTensor, buffered backend (direct I/O default when cold)
``fastsafetensors``  fastsafetensors, ``nogds=True``
``safetensors``      `safe_open(device="cuda")`, one `get_tensor` per name

``cache=cold`` evicts the shards (`posix_fadvise(DONTNEED)`) before every sample; the
limits are skipped where they do not apply (filtered). CUDA only: on CPU every case skips.
`gpu/reload_io.py` prints the same comparison as one table with per-phase times.
"""

from __future__ import annotations

from unittest.mock import patch

import fp8_reload as fr

from .common import KINDS, ON_CUDA, PRESETS, CheckpointSuite, checkpoint_key, requires_cuda, synchronized

IOS = ["limit-h2d", "limit-read", "limit-read-direct", "fp8-reload", "fp8-reload-direct",
       "fp8-reload-staged", "instanttensor", "fastsafetensors", "safetensors"]
_MODELS: dict = {}
_STARTED: set = set()  # libraries started in this process


def _io_paths():
    from fp8_reload.testing import io_paths  # the module came with the streaming engine

    return io_paths


@synchronized
class IOPaths(CheckpointSuite):
    params = (PRESETS, KINDS, IOS, ["full", "1/layer"], ["warm", "cold"])
    param_names = ["preset", "kind", "io", "scope", "cache"]
    number = 1
    repeat = (1, 3, 20.0)  # a cold sample of v2-lite:4 bf16 reads 3.5 GB from the disk

    def setup(self, paths, preset, kind, io, scope, cache):
        requires_cuda()
        io_paths = _io_paths()
        if not io_paths.available(io):
            raise NotImplementedError(f"{io} is not installed (extra `io`)")
        if io.startswith("limit") and scope != "full":
            raise NotImplementedError("the limits move whole checkpoints")
        self.path = paths[checkpoint_key(preset, kind)]
        self.files = io_paths.shard_files(self.path)
        self.cache = cache
        ckpt = fr.Checkpoint(self.path)
        cfg = ckpt.config
        flt = None if scope == "full" else fr.generate_weight_name_filter(
            {layer: [0] for layer in cfg.moe_layers})
        names = [n for n in ckpt.names if flt is None or flt(n)]
        if io == "limit-h2d":
            copy = io_paths.PinnedCopy(io_paths.total_bytes(self.files), "cuda")
            self.run = copy
        elif io.startswith("limit-read"):
            direct = io.endswith("direct")
            buffer = io_paths.pinned(io_paths.direct_bytes(self.files), io_paths.DIRECT_ALIGN)
            self.run = lambda: io_paths.page_cache_read(self.files, buffer, direct=direct)
        elif io.startswith("fp8-reload"):
            import fp8_reload.reload.transaction as transaction

            engine = "staged" if io.endswith("staged") else "stream"
            key = (self.path, io)
            fresh = key not in _MODELS
            if fresh:
                _MODELS.clear()
                with patch.object(transaction, "ENGINE", engine):
                    _MODELS[key] = fr.load_model(self.path, device="cuda")
            self.model = model = _MODELS[key]
            how = "direct" if io.endswith("direct") else "buffered"
            self.run = lambda: _reload(model, self.path, flt, how, engine)
            for _ in range(3 if fresh else 1 if cache == "warm" else 0):
                self.run()  # first reloads (registration, parsing) stay out of the samples
        else:
            dst = io_paths.device_targets(self.path, names, "cuda")
            load = {"instanttensor": io_paths.load_instanttensor,
                    "fastsafetensors": io_paths.load_fastsafetensors,
                    "safetensors": io_paths.load_safetensors}[io]
            direct = {"direct": True} if io == "instanttensor" and cache == "cold" else {}
            self.run = lambda: load(self.files, dst, **direct)
            if cache == "warm" or io not in _STARTED:
                self.run()  # library start-up stays out of the samples
                _STARTED.add(io)

    def time_move(self, paths, preset, kind, io, scope, cache):
        if self.cache == "cold" and io != "limit-h2d":  # the eviction (a few ms) is timed too
            if io.startswith("fp8-reload"):  # a cold checkpoint is a new one: no registration
                from fp8_reload.checkpoint.staging import held

                if "registered" in held(self.model):
                    held(self.model)["registered"].release()
                _io_paths().touch(self.files)
            _io_paths().evict(self.files)
        self.run()


def _reload(model, path, flt, how: str, engine: str):
    """A reload with its read way and engine switched for this call only: the grouped run
    (and the test suite) measure every benchmark in one process, and a switch left flipped
    would time the wrong path in every later one."""
    import fp8_reload.reload.chunks as chunks
    import fp8_reload.reload.transaction as transaction

    with patch.object(chunks, "READ_IO", how), patch.object(transaction, "ENGINE", engine):
        return fr.update_weights_from_disk(model, path, flt)


if not ON_CUDA:  # keep asv's discovery cheap on CPU: one parameter set, skipped in setup
    IOPaths.params = (PRESETS[:1], KINDS[:1], IOS[:1], ["full"], ["warm"])
