"""fp8-reload: hot-reloading FP8 MoE weights the way SGLang's EPLB does, fixed and measured.

    import fp8_reload as fr
    cfg = fr.MoEConfig.preset("tiny")
    fr.write_checkpoint(path, cfg, seed=0, kind="fp8")
    model = fr.load_model(path, device="cpu", processing="fixed")
    report = fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({1: [0, 3]}))

The public names are imported on first use (PEP 562): `import fp8_reload` and the
`fp8-reload` command line start without importing torch, so `fp8-reload --help`
answers at once; `fr.load_model` imports what it needs when it is first looked up.
"""

from __future__ import annotations

import importlib

from .version import __version__ as __version__  # re-exported

# Public name -> the submodule that defines it.
_EXPORTS = {
    "MoEConfig": "config",
    "write_checkpoint": "checkpoint", "Checkpoint": "checkpoint", "release_staging": "checkpoint",
    "load_model": "reload", "update_weights_from_disk": "reload",
    "generate_weight_name_filter": "reload", "ReloadReport": "reload",
    "available_backends": "kernels",
    "FP8MoEModel": "layers", "FusedMoE": "layers",
    "MODES": "processing",
    "calc_diff": "testing.numeric",
    "snapshot": "state", "Snapshot": "state", "compare_states": "state",
    **{name: "errors" for name in (
        "ReloadError", "CheckpointError", "CheckpointMismatchError", "FilterMatchedNothingError",
        "BackendUnavailable", "CheckpointNotFoundError", "UnreadableCheckpointError",
        "CorruptCheckpointError", "MissingTensorError", "InvalidTensorError",
        "UnsupportedCheckpointError", "UnsafeCheckpointError", "CommitError", "RollbackError",
        "DeviceUnavailableError", "UnknownExpertError")},
}
# Subpackages and modules reachable as attributes (`fr.kernels.run_moe`, `fr.state`).
_SUBMODULES = ("version", "errors", "config", "quant", "trace", "locks", "device", "kernels", "layers",
               "checkpoint", "state", "processing", "reload", "expert_parallel", "sglang_patch",
               "testing", "tools")

__all__ = [
    "MoEConfig", "write_checkpoint", "Checkpoint", "load_model", "update_weights_from_disk",
    "generate_weight_name_filter", "ReloadReport", "ReloadError", "CheckpointError",
    "CheckpointMismatchError", "FilterMatchedNothingError", "BackendUnavailable",
    "available_backends", "FP8MoEModel", "FusedMoE", "MODES", "calc_diff", "snapshot", "Snapshot",
    "compare_states", "CheckpointNotFoundError", "UnreadableCheckpointError",
    "CorruptCheckpointError", "MissingTensorError", "InvalidTensorError",
    "UnsupportedCheckpointError", "UnsafeCheckpointError", "CommitError", "RollbackError",
    "DeviceUnavailableError", "UnknownExpertError", "release_staging", "state",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
