"""Errors a load or reload can raise.

Every `ReloadError` except `RollbackError` leaves the model exactly as it was:
problems with the checkpoint are found while planning and staging, before
anything is written, and a failure while writing is rolled back. The classes
say what went wrong, so a server can decide what to do (retry, alert, refuse a
checkpoint) without parsing messages; the message names the file and tensor.

    ReloadError
    ├── CheckpointError               the checkpoint on disk is at fault
    │   ├── CheckpointNotFoundError   directory, config.json or a shard is missing
    │   ├── UnreadableCheckpointError a file exists but cannot be read (permissions, I/O
    │   │                             error, a symlink loop, not a regular file: FIFO, ...)
    │   ├── CorruptCheckpointError    truncated file, corrupt header, bad JSON or config
    │   │                             values, a file changed while it was read
    │   ├── MissingTensorError        a needed tensor is absent (index or shard)
    │   ├── InvalidTensorError        NaN/Inf weights (FP8 NaN bytes), bad scales
    │   ├── UnsupportedCheckpointError  not safetensors, or a quantization we do not do
    │   └── UnsafeCheckpointError     pickle weights, paths leaving the directory
    ├── CheckpointMismatchError       does not fit the model: config, shape, dtype, name
    ├── DeviceUnavailableError        the device asked for cannot be used here (no CUDA)
    ├── FilterMatchedNothingError     the weight_name_filter selected nothing
    │   └── UnknownExpertError        ... for an expert the model does not have
    ├── CommitError                   writing or post-processing failed; rolled back
    └── RollbackError                 ... and the rollback failed too: state undefined
"""


class ReloadError(RuntimeError):
    """A load or reload failed; the message names the file/tensor and the cause."""


class CheckpointError(ReloadError):
    """The checkpoint on disk is missing, unreadable, malformed or unsafe."""


class CheckpointNotFoundError(CheckpointError):
    """The directory, its config.json, or a file the index names does not exist."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file exists but cannot be read: permissions, an I/O error, a
    symlink loop, or it is not a regular file (FIFO, socket, device, directory)."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated or its header/JSON is malformed."""


class MissingTensorError(CheckpointError):
    """A tensor the reload needs is not in the checkpoint (or not where the index says)."""


class InvalidTensorError(CheckpointError):
    """A tensor has the right name, shape and dtype but unusable values: NaN or Inf
    (FP8 bytes encoding NaN included), or a scale that is not finite and positive."""


class UnsupportedCheckpointError(CheckpointError):
    """Not a safetensors checkpoint, or a quantization scheme this loader does not do."""


class UnsafeCheckpointError(UnsupportedCheckpointError):
    """Loading would mean unpickling (running code from the file) or leaving the directory."""


class CheckpointMismatchError(ReloadError):
    """The checkpoint does not fit the loaded model (shapes, dtypes, config, names)."""


class DeviceUnavailableError(ReloadError):
    """The device asked for does not exist here (no CUDA, no such GPU index, unknown name).

    Raised before anything is read, so the caller learns the cause in one line
    rather than from an assertion deep inside a layer's constructor."""


class FilterMatchedNothingError(ReloadError):
    """A weight_name_filter selected no tensor of the checkpoint."""


class UnknownExpertError(FilterMatchedNothingError):
    """An expert filter names an expert the model does not have (a layer without experts,
    an id past the layer's last): it could select nothing, and a reload that quietly
    skipped it would leave the expert the caller meant to replace as it was."""


class CommitError(ReloadError):
    """Writing weights or post-processing failed part-way; the touched slices were
    restored, so the model is bit-identical to before. `__cause__` holds the fault."""


class RollbackError(ReloadError):
    """A commit failed and restoring the backup failed too: the model's weights are
    undefined. Only a full reload is accepted until one succeeds."""


class BackendUnavailable(RuntimeError):
    """The requested MoE forward backend cannot run here (no GPU, no deep_gemm, ...)."""
