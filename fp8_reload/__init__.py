"""fp8-reload: hot-reloading FP8 MoE weights the way SGLang's EPLB does, fixed and measured.

    import fp8_reload as fr
    cfg = fr.MoEConfig.preset("tiny")
    fr.write_checkpoint(path, cfg, seed=0, kind="fp8")
    model = fr.load_model(path, device="cpu", processing="fixed")
    report = fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({1: [0, 3]}))
"""

from . import state
from .checkpoint import Checkpoint, release_staging, write_checkpoint
from .config import MoEConfig
from .errors import (
                     BackendUnavailable,
                     CheckpointError,
                     CheckpointMismatchError,
                     CheckpointNotFoundError,
                     CommitError,
                     CorruptCheckpointError,
                     FilterMatchedNothingError,
                     InvalidTensorError,
                     MissingTensorError,
                     ReloadError,
                     RollbackError,
                     UnreadableCheckpointError,
                     UnsafeCheckpointError,
                     UnsupportedCheckpointError,
)
from .kernels import available_backends
from .layers import FP8MoEModel, FusedMoE
from .processing import MODES
from .reload import ReloadReport, generate_weight_name_filter, load_model, update_weights_from_disk
from .state import Snapshot, compare_states, snapshot
from .testing.numeric import calc_diff

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "write_checkpoint", "Checkpoint", "load_model", "update_weights_from_disk",
    "generate_weight_name_filter", "ReloadReport", "ReloadError", "CheckpointError",
    "CheckpointMismatchError", "FilterMatchedNothingError", "BackendUnavailable",
    "available_backends", "FP8MoEModel", "FusedMoE", "MODES", "calc_diff", "snapshot", "Snapshot",
    "compare_states", "CheckpointNotFoundError", "UnreadableCheckpointError",
    "CorruptCheckpointError", "MissingTensorError", "InvalidTensorError",
    "UnsupportedCheckpointError", "UnsafeCheckpointError", "CommitError", "RollbackError",
    "release_staging", "state",
]
