"""HF-layout safetensors checkpoints: layout, synthetic writer, strict reader, pinned staging.

    layout      which tensors a model has, in file order (names, shapes, dtypes)
    synthetic   deterministic checkpoints of any preset, and mixes of two seeds
    header      strict safetensors header parsing, weight file name rules
    reader      `Checkpoint`: config, index, headers, positional reads of tensor bytes
    staging     pinned host arenas that GPU reloads read into and back up to
"""

from .header import TensorInfo, parse_json, read_safetensors_header
from .layout import INDEX_FILE, KINDS, SINGLE_FILE, Projection, projections, shard_name, tensor_layout
from .reader import Checkpoint
from .staging import PinnedArena, release_staging
from .synthetic import ensure_checkpoint, mix_checkpoints, write_checkpoint

__all__ = ["Checkpoint", "INDEX_FILE", "KINDS", "PinnedArena", "Projection", "SINGLE_FILE",
           "TensorInfo", "ensure_checkpoint", "mix_checkpoints", "parse_json", "projections",
           "read_safetensors_header", "release_staging", "shard_name", "tensor_layout",
           "write_checkpoint"]
