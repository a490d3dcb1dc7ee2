"""Planning and staging a reload: everything that can fail before the model is written.

plan: open the checkpoint (config, index, headers; reused while its files are
unchanged), check it fits the model, resolve the filter, check every selected
tensor's shape and dtype from the headers. stage: read every selected tensor to
host memory and validate it. A failure in either raises a `ReloadError` and
the model was never touched.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..checkpoint import INDEX_FILE, Checkpoint, staging
from ..checkpoint.registered import file_stamp
from ..device import on_cuda
from ..errors import (
    CheckpointMismatchError,
    FilterMatchedNothingError,
    InvalidTensorError,
    MissingTensorError,
    ReloadError,
)
from .filters import NameFilter, expected_layout, units


def checkpoint_stamp(ckpt: Checkpoint) -> tuple:
    """The stamps of every file of `ckpt`: equal stamps, same bytes (short of a writer
    that restores mtime and ctime)."""
    files = ["config.json", INDEX_FILE] + sorted(set(ckpt.weight_map.values()))
    return tuple(file_stamp(ckpt.path / f) for f in files)


def open_checkpoint(model, path, keep: int = 2) -> Checkpoint:
    """The checkpoint at `path`, reusing the index and shard headers parsed by an
    earlier reload from the same path when none of its files changed (size, mtime,
    ctime, inode): EPLB reloads one checkpoint many times, and parsing its JSON is
    most of a small reload's planning. The last `keep` checkpoints are kept (with what
    hangs on them: checked values, the full-reload plan), so that alternating between
    two (RL weight sync's two buffers) keeps both."""
    key = os.path.realpath(path)
    cache = model.__dict__.setdefault("_checkpoint_cache", {})
    cached = cache.pop(key, None)
    if cached is not None and cached[0] == checkpoint_stamp(cached[1]):
        cache[key] = cached  # most recent last
        return cached[1]
    ckpt = Checkpoint(path)
    cache[key] = (checkpoint_stamp(ckpt), ckpt)
    while len(cache) > keep:
        cache.pop(next(iter(cache)))
    return ckpt


def check_compatible(model, ckpt: Checkpoint) -> None:
    fields = ("hidden_size", "num_layers", "num_experts", "moe_intermediate_size",
              "intermediate_size", "num_shared_experts", "first_dense_layers", "num_heads",
              "qk_head_dim", "v_head_dim")
    diffs = [f"{f}: model {getattr(model.config, f)} vs checkpoint {getattr(ckpt.config, f)}"
             for f in fields if getattr(model.config, f) != getattr(ckpt.config, f)]
    if ckpt.kind != model.checkpoint_kind:
        diffs.append(f"kind: model loaded from {model.checkpoint_kind} vs checkpoint {ckpt.kind}")
    if diffs:
        raise CheckpointMismatchError(f"{ckpt.path}: does not fit the model: " + "; ".join(diffs))


def _where(ckpt: Checkpoint, name: str) -> str:
    return f"{ckpt.path / ckpt.weight_map[name]}: tensor {name!r}"


def plan(model, ckpt: Checkpoint, weight_name_filter: NameFilter | None,
         expand_units: bool) -> list[str]:
    """The checkpoint tensors to reload, checked against the model from the headers."""
    expected = expected_layout(model)
    unknown = [n for n in ckpt.names if n not in expected]
    if unknown:
        raise CheckpointMismatchError(f"{_where(ckpt, unknown[0])}: unknown to the model, which has "
                                      f"no parameter for it ({len(unknown)} unknown in all)")
    if weight_name_filter is None:
        missing = [n for n in expected if n not in ckpt.weight_map]
        if missing:
            raise MissingTensorError(f"{ckpt.path}: tensor {missing[0]!r} is missing "
                                     f"({len(missing)} missing in all); a full reload needs every tensor")
        selected = ckpt.names
    else:
        try:
            selected = [n for n in ckpt.names if weight_name_filter(n)]
        except Exception as e:
            raise ReloadError(f"{ckpt.path}: weight_name_filter raised {type(e).__name__}: {e}") from e
        if not selected:
            raise FilterMatchedNothingError(f"{ckpt.path}: weight_name_filter matched none of the "
                                            f"{len(ckpt.names)} tensors of the checkpoint")
        if expand_units:
            unit_of, _ = units(model)
            chosen = {unit_of[n] for n in selected}
            selected = [n for n in expected if unit_of[n] in chosen]
            absent = [n for n in selected if n not in ckpt.weight_map]
            if absent:
                raise MissingTensorError(f"{ckpt.path}: tensor {absent[0]!r} is missing; it belongs "
                                         "to a reloaded expert/module, which is reloaded whole")
    for n in selected:  # headers only: fail before reading any data
        info = ckpt.info(n)
        _check_layout(n, info.shape, info.dtype, expected, ckpt)
    return selected


def _check_layout(name: str, shape, dtype, expected, ckpt: Checkpoint) -> None:
    want_shape, want_dtype = expected[name]
    if tuple(shape) != tuple(want_shape):
        raise CheckpointMismatchError(f"{_where(ckpt, name)}: shape {tuple(shape)}, the model "
                                      f"expects {tuple(want_shape)}")
    if dtype != want_dtype:
        raise CheckpointMismatchError(f"{_where(ckpt, name)}: dtype {dtype}, the model expects "
                                      f"{want_dtype}")


def _validate(staged: list[tuple[str, torch.Tensor]], expected, ckpt: Checkpoint) -> None:
    """Layout of every tensor; scales finite and positive (checked all at once)."""
    scales = []
    for name, tensor in staged:
        _check_layout(name, tensor.shape, tensor.dtype, expected, ckpt)
        if name.endswith("_scale"):
            scales.append((name, tensor))
    if not scales:
        return
    values = torch.stack([t.reshape(()) if t.numel() == 1 else t.max() for _, t in scales])
    if bool((~torch.isfinite(values) | (values <= 0)).any()):
        for name, tensor in scales:  # rare path: name the first bad one
            if bool((~torch.isfinite(tensor) | (tensor <= 0)).any()):
                raise InvalidTensorError(f"{_where(ckpt, name)}: scale must be finite and "
                                         f"positive, got {tensor.tolist()}")


def stage(model, ckpt: Checkpoint, names: list[str], weight_name_filter, scan_all: bool,
          stats: dict) -> list[tuple[str, torch.Tensor]]:
    """Read and validate every selected tensor into host memory (nothing is written).

    Onto a GPU the tensors land in the model's pinned staging arena (parallel
    reads; every host-to-device copy of the commit is then one async DMA).
    """
    expected = expected_layout(model)
    if scan_all:  # upstream: read everything, filter afterwards
        it = ckpt.read(ckpt.names, stats)
        keep = set(names)
        staged = [(n, t) for n, t in it if n in keep]
    else:
        into = staging.arena(model, "staging") if on_cuda(model) else None
        staged = list(ckpt.read(names, stats, into=into))
    _validate(staged, expected, ckpt)
    return staged


@contextmanager
def nothing_written(path):
    """Before commit: any failure becomes a ReloadError; the model was not touched."""
    try:
        yield
    except ReloadError:
        raise
    except Exception as e:  # e.g. MemoryError while staging
        raise ReloadError(f"{path}: reload failed before anything was written: "
                          f"{type(e).__name__}: {e}") from e
