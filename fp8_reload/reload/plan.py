"""Planning and staging a reload: everything that can fail before the model is written.

plan: open the checkpoint (config, index, headers; reused while its files are
unchanged), check it fits the model, resolve the filter, check every selected
tensor's shape and dtype from the headers. stage: read every selected tensor to
host memory and validate it. A failure in either raises a `ReloadError` and
the model was never touched.
"""

from __future__ import annotations

import os
from contextlib import closing, contextmanager, suppress

import torch

from ..checkpoint import INDEX_FILE, Checkpoint, files, staging
from ..checkpoint.registered import file_stamp
from ..checkpoint.values import ValueCheck
from ..device import model_device, on_cuda
from ..errors import (
    CheckpointMismatchError,
    FilterMatchedNothingError,
    MissingTensorError,
    ReloadError,
    UnknownExpertError,
)
from . import chunks as _chunks
from .filters import ExpertFilter, NameFilter, expected_layout, units
from .targets import Target, TargetCache, plan_targets


def checkpoint_stamp(ckpt: Checkpoint) -> tuple:
    """The stamps of every file of `ckpt`, compared before and after a streaming commit:
    a file changed meanwhile may have been read torn (short of a writer that restores
    mtime and ctime, or an in-place rewrite within the same timestamp tick)."""
    base = str(ckpt.path)
    return tuple(file_stamp(os.path.join(base, f)) for f in ["config.json", INDEX_FILE, *ckpt.shard_files])


def open_checkpoint(model, path, keep: int = 2) -> Checkpoint:
    """The checkpoint at `path`, reusing the config, index and shard headers parsed by
    an earlier reload from the same path while they are unchanged
    (`Checkpoint.unchanged`: the stamps taken on the files that were read, before
    reading them, and the bytes of files read while still fresh): EPLB reloads one
    checkpoint many times, and parsing its JSON is most of a small reload's planning.
    Neither a file replaced while it was being parsed nor one rewritten within one
    timestamp tick can leave a stale parse. The last `keep` checkpoints are kept (with
    what hangs on them: checked values, the full-reload plan), so that alternating
    between two (RL weight sync's two buffers) keeps both.

    Files with new stamps are parsed anew (values unchecked, scales unread); with the same
    config.json and index (`Checkpoint.same_index`: touched, or new values written in the
    same places, as RL weight sync does) they keep the plans, and a full reload its kept
    plan while every shard header is the same too (`plan_reload`): planning a whole model
    again cost more than its parse."""
    key = _key(path)
    cache = model.__dict__.setdefault("_checkpoint_cache", {})
    cached = cache.pop(key, None)
    if cached is not None and cached[1].unchanged():
        cache[key] = cached  # most recent last
        return cached[1]
    ckpt = Checkpoint(path)
    if cached is not None and cached[1].plans and ckpt.same_index(cached[1]):
        ckpt.plans = cached[1].plans  # (`Planned`: names and their index only)
    return remember_checkpoint(model, ckpt, keep)


def changed_since_read(model, path) -> bool:
    """Whether the checkpoint at `path` changed since this model last read it (the parse kept
    by `open_checkpoint` is no longer `unchanged`); False for one it kept no parse of."""
    cached = model.__dict__.get("_checkpoint_cache", {}).get(_key(path))
    return cached is not None and not cached[1].unchanged()


def remember_checkpoint(model, ckpt: Checkpoint, keep: int = 2) -> Checkpoint:
    """Keep `ckpt` for `open_checkpoint` (a fresh load keeps the parse it loaded from)."""
    cache = model.__dict__.setdefault("_checkpoint_cache", {})
    # [0] records what the parse was made from: config.json's and the index's bytes and stamps.
    cache[_key(ckpt.path)] = (dict(ckpt.sources), ckpt)
    while len(cache) > keep:
        cache.pop(next(iter(cache)))
    return ckpt


def _key(path) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError) as e:
        raise files.os_error(e, path) from None


def check_compatible(model, ckpt: Checkpoint) -> None:
    # Shapes, and what the forward computes with (routing, norms): a checkpoint whose
    # config.json says otherwise would load bit for bit and still serve other outputs
    # than a fresh load of it.
    fields = ("hidden_size", "num_layers", "num_experts", "moe_intermediate_size",
              "intermediate_size", "num_shared_experts", "first_dense_layers", "num_heads",
              "qk_head_dim", "v_head_dim", "top_k", "norm_topk_prob", "routed_scaling_factor",
              "rms_norm_eps")
    diffs = [f"{f}: model {getattr(model.config, f)} vs checkpoint {getattr(ckpt.config, f)}"
             for f in fields if getattr(model.config, f) != getattr(ckpt.config, f)]
    if ckpt.kind != model.checkpoint_kind:
        diffs.append(f"kind: model loaded from {model.checkpoint_kind} vs checkpoint {ckpt.kind}")
    if diffs:
        raise CheckpointMismatchError(f"{ckpt.path}: does not fit the model: " + "; ".join(diffs))


def tensor_where(ckpt: Checkpoint, name: str) -> str:
    """Where tensor `name` is, for an error: its file and name."""
    return f"{ckpt.path / ckpt.weight_map[name]}: tensor {name!r}"


class Planned:
    """What planning reloads of one parsed checkpoint into one model works out once. Kept
    with the checkpoint (`ckpt.plans`; a checkpoint whose files changed is parsed anew,
    without it), so that a small reload costs what it selects, not what the checkpoint
    holds: EPLB reloads a few experts per layer from one checkpoint again and again."""

    def __init__(self, ckpt: Checkpoint):
        self.names = ckpt.names
        self.known = False  # every checkpoint name has a parameter in the model
        self.experts: dict[tuple[int, int], list[int]] | None = None  # (layer, expert) -> positions

    def select(self, weight_name_filter: NameFilter) -> list[str]:
        """The names the filter matches, in checkpoint order. An `ExpertFilter` is answered
        from the index of `ExpertFilter.key` over all names (built on first use), any
        other callable by calling it on every name."""
        if type(weight_name_filter) is not ExpertFilter:
            return [n for n in self.names if weight_name_filter(n)]
        if self.experts is None:
            index: dict[tuple[int, int], list[int]] = {}
            for k, n in enumerate(self.names):
                key = ExpertFilter.key(n)
                if key is not None:
                    index.setdefault(key, []).append(k)
            self.experts = index
        at = sorted(k for key in weight_name_filter.wanted for k in self.experts.get(key, ()))
        return [self.names[k] for k in at]


def target_cache(model) -> TargetCache:
    """The model's `TargetCache`: where tensors land depends on the model, not on the
    parse, so it outlives checkpoints (RL weight sync reloads new files every step). Held
    with the model's staging memory: `release_staging` gives back the views it holds."""
    return staging.holder(model, "targets", TargetCache)


def planned(model, ckpt: Checkpoint) -> Planned:
    """The `Planned` of `ckpt` for `model` (checkpoints are parsed per model: `open_checkpoint`)."""
    found = ckpt.plans.get(id(model))
    if found is None:
        found = ckpt.plans[id(model)] = Planned(ckpt)
    return found


def plan(model, ckpt: Checkpoint, weight_name_filter: NameFilter | None,
         expand_units: bool) -> list[str]:
    """The checkpoint tensors to reload, checked against the model from the headers."""
    expected = expected_layout(model)
    done = planned(model, ckpt)
    if not done.known:
        unknown = [n for n in done.names if n not in expected]
        if unknown:
            raise CheckpointMismatchError(f"{tensor_where(ckpt, unknown[0])}: unknown to the model, which "
                                          f"has no parameter for it ({len(unknown)} unknown in all)")
        done.known = True
    if weight_name_filter is None:
        missing = [n for n in expected if n not in ckpt.weight_map]
        if missing:
            raise MissingTensorError(f"{ckpt.path}: tensor {missing[0]!r} is missing "
                                     f"({len(missing)} missing in all); a full reload needs every tensor")
        selected = list(done.names)
    else:
        try:
            selected = done.select(weight_name_filter)
        except Exception as e:
            raise ReloadError(f"{ckpt.path}: weight_name_filter raised {type(e).__name__}: {e}") from e
        if type(weight_name_filter) is ExpertFilter:
            _check_experts(model.config, ckpt, weight_name_filter.wanted, done.experts)
        if not selected:
            raise FilterMatchedNothingError(f"{ckpt.path}: weight_name_filter matched none of the "
                                            f"{len(done.names)} tensors of the checkpoint")
        if expand_units:
            unit_of, members, position = units(model)
            chosen = {unit_of[n] for n in selected}
            selected = sorted((n for u in chosen for n in members[u]), key=position.__getitem__)
            absent = [n for n in selected if n not in ckpt.weight_map]
            if absent:
                raise MissingTensorError(f"{ckpt.path}: tensor {absent[0]!r} is missing; it belongs "
                                         "to a reloaded expert/module, which is reloaded whole")
    for n in selected:  # headers only: fail before reading any data
        info = ckpt.info(n)
        _check_layout(n, info.shape, info.dtype, expected, ckpt)
    return selected


def plan_reload(model, ckpt: Checkpoint, weight_name_filter: NameFilter | None,
                quantize_on_device: bool, expand_units: bool = True) -> tuple[list[str], list[Target]]:
    """`plan`, and where each selected tensor lands (`plan_targets`), for the streaming
    engine. A full reload's plan depends only on the model, the parsed headers and
    `quantize_on_device`: it is kept whole while its modules are unchanged (`TargetCache`),
    every header parses to the same `TensorInfo`s (a parse with new stamps whose headers did
    not change too, `open_checkpoint`) and the flag is the same; a filtered one reuses the
    targets of tensors planned before."""
    done, cache = planned(model, ckpt), target_cache(model)
    kept = cache.full.get(done) if weight_name_filter is None else None
    if (kept is not None and kept[2] == cache.version and cache.unchanged(model)
            and ckpt.same_headers(kept[3]) and kept[4] == quantize_on_device):
        return kept[:2]
    names = plan(model, ckpt, weight_name_filter, expand_units)
    # a linear quantized in the stream lands whole in one of the two device buffers, which grow
    # to the biggest chunk: at most a chunk's bytes (two chunks, streaming v2-lite's 85.5 MiB
    # dense gate_up too, measured no faster on the H200 and slower first reloads: results/README)
    targets = plan_targets(model, [ckpt.info(n) for n in names], quantize_on_device, cache,
                           unit_bytes=_chunks.CHUNK_BYTES)
    if weight_name_filter is None:  # valid while no module is replanned (a filtered reload may)
        cache.full[done] = (names, targets, cache.version, ckpt.parsed_headers(), quantize_on_device)
    return names, targets


def _check_experts(cfg, ckpt: Checkpoint, wanted, indexed: dict) -> None:
    """Every expert an `ExpertFilter` names is one of the model's and has tensors in the
    checkpoint: a reload that skipped one would leave the expert EPLB meant to replace (a
    typo, a plan for another model, a checkpoint without it) serving as it was."""
    unknown = sorted((layer, e) for layer, e in wanted
                     if not (0 <= layer < cfg.num_layers and cfg.is_moe_layer(layer)
                             and 0 <= e < cfg.num_experts))
    if unknown:
        layers = cfg.moe_layers
        span = f"layers {layers[0]}..{layers[-1]}" if layers else "no layers"
        raise UnknownExpertError(
            f"{ckpt.path}: weight_name_filter names experts the model does not have: "
            + ", ".join(f"layer {layer} expert {e}" for layer, e in unknown[:4])
            + (f" ({len(unknown)} in all)" if len(unknown) > 4 else "")
            + f"; its experts are 0..{cfg.num_experts - 1} of {span}; nothing was written")
    absent = sorted(key for key in wanted if key not in indexed)
    if absent:
        layer, e = absent[0]
        raise MissingTensorError(f"{ckpt.path}: expert {e} of layer {layer} has no tensor in the "
                                 f"checkpoint ({len(absent)} such experts); nothing was written")


def _check_layout(name: str, shape, dtype, expected, ckpt: Checkpoint) -> None:
    want_shape, want_dtype = expected[name]
    if tuple(shape) != tuple(want_shape):
        raise CheckpointMismatchError(f"{tensor_where(ckpt, name)}: shape {tuple(shape)}, the model "
                                      f"expects {tuple(want_shape)}")
    if dtype != want_dtype:
        raise CheckpointMismatchError(f"{tensor_where(ckpt, name)}: dtype {dtype}, the model expects "
                                      f"{want_dtype}")


def _validate(staged: list[tuple[str, torch.Tensor]], expected, ckpt: Checkpoint) -> None:
    """Every staged tensor has the layout the headers promised."""
    for name, tensor in staged:
        _check_layout(name, tensor.shape, tensor.dtype, expected, ckpt)


def stage(model, ckpt: Checkpoint, names: list[str], weight_name_filter, scan_all: bool,
          stats: dict) -> list[tuple[str, torch.Tensor]]:
    """Read and validate every selected tensor into host memory (nothing is written).

    Onto a GPU the tensors land in the model's pinned staging arena (parallel
    reads; every host-to-device copy of the commit is then one async DMA).
    Values are checked on the model's device (`ValueCheck`): on a GPU the check
    copies each batch into a reused device buffer and runs there while the later
    reads are still running. Each tensor is read from disk once.
    """
    expected = expected_layout(model)
    check = ValueCheck(model_device(model))
    staged = []
    if scan_all:  # upstream: read everything, filter afterwards
        it = ckpt.read(ckpt.names, stats)
        keep = set(names)
    else:
        into = staging.arena(model, "staging") if on_cuda(model) else None
        it = ckpt.read(names, stats, into=into)
        keep = None
    with closing(it):  # on any error: no read still running into the staging arena afterwards
        for name, tensor in it:
            if keep is None or name in keep:
                staged.append((name, tensor))
                check.add(name, tensor)
    _validate(staged, expected, ckpt)
    check.raise_if_invalid(lambda name: tensor_where(ckpt, name))
    return staged


@contextmanager
def nothing_written(path, on_failure=None):
    """Before commit: any failure becomes a ReloadError; the model was not touched.
    `on_failure()` runs first (its own errors dropped: the first failure is the news)."""
    try:
        yield
    except BaseException as e:
        if on_failure is not None:
            with suppress(Exception):
                on_failure()
        if isinstance(e, ReloadError) or not isinstance(e, Exception):
            raise
        if isinstance(e, OSError):  # not mapped where it happened: the one mapping still applies
            raise files.os_error(e, e.filename or path) from e
        raise ReloadError(f"{path}: reload failed before anything was written: "  # e.g. MemoryError
                          f"{type(e).__name__}: {e}") from e
