"""Errors a reload can raise. Every one leaves the model exactly as it was."""


class ReloadError(RuntimeError):
    """A load or reload failed; the message names the file/tensor and the cause."""


class CheckpointError(ReloadError):
    """The checkpoint on disk is missing, unreadable, malformed or unsafe."""


class CheckpointMismatchError(ReloadError):
    """The checkpoint does not fit the loaded model (shapes, dtypes, config)."""


class FilterMatchedNothingError(ReloadError):
    """A weight_name_filter selected no tensor of the checkpoint."""
