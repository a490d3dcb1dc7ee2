"""`load_model` and `update_weights_from_disk`: plan, stage, back up, commit, post-process.

A reload is a transaction:

1. plan: open the checkpoint (config, index, headers), check it fits the
   model, resolve the filter, check every selected tensor's shape and dtype
   from the headers;
2. stage ("read"): read every selected tensor to host memory and validate it
   (shape, dtype, finite positive scales). Nothing in the model is written
   before this has fully succeeded; any failure up to here raises a
   `ReloadError` subclass and the model was never touched;
3. backup: host copies of what commit may change, bounded by the reload
   (the reloaded expert slots of the big MoE weights, whole small tensors);
4. commit ("wait", "load", "process"): take the weights lock exclusively
   (forwards drain, see `locks.py`), load through the parameters' own
   `weight_loader`s, post-process. If anything fails here, a device error or a
   KeyboardInterrupt, the backup is restored (Ctrl-C is deferred while
   restoring), so the model is bit-identical to before, and `CommitError` is
   raised (KeyboardInterrupt propagates as is). If the restore itself fails,
   `RollbackError` says so and only a full reload is accepted afterwards.

`ReloadReport` gives `staged_bytes` and `backup_bytes` (the memory the
transaction costs) and per-phase `seconds`.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .checkpoint import INDEX_FILE, Checkpoint, tensor_layout
from .errors import (CheckpointMismatchError, CommitError, FilterMatchedNothingError,
                     InvalidTensorError, MissingTensorError, ReloadError, RollbackError)
from .layers import EXPERT_RE, FP8MoEModel, FusedMoE
from .processing import get_mode, process_modules
from .quant import index_copy_
from . import staging, trace

NameFilter = Callable[[str], bool]


@dataclass
class ReloadReport:
    """What one load or reload did. `seconds` holds per-phase wall times."""

    mode: str
    full: bool
    tensors_loaded: int = 0
    bytes_read: int = 0
    files_opened: int = 0
    modules_processed: list[str] = field(default_factory=list)
    experts_reloaded: dict[int, list[int]] = field(default_factory=dict)
    staged_bytes: int = 0  # host memory holding the validated tensors before commit
    backup_bytes: int = 0  # memory holding the copies a failed commit is restored from
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        n_exp = sum(len(v) for v in self.experts_reloaded.values())
        return (f"[{self.mode}] {'full' if self.full else 'filtered'} reload: "
                f"{self.tensors_loaded} tensors, {self.bytes_read / 2**20:.2f} MiB read from "
                f"{self.files_opened} files, {n_exp} experts, "
                f"{len(self.modules_processed)} modules processed, "
                f"staged {self.staged_bytes / 2**20:.2f} MiB, "
                f"backup {self.backup_bytes / 2**20:.2f} MiB ({phases})")


class _Timer:
    def __init__(self, seconds: dict):
        self.seconds = seconds

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            with trace.phase(name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def generate_weight_name_filter(layer_experts: dict[int, Iterable[int]]) -> NameFilter:
    """EPLB's filter: matches checkpoint tensors of the given experts of the given layers."""
    wanted = {(int(layer), int(e)) for layer, experts in layer_experts.items() for e in experts}
    pattern = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")

    def weight_name_filter(name: str) -> bool:
        m = pattern.search(name)
        return m is not None and (int(m.group(1)), int(m.group(2))) in wanted

    weight_name_filter.layer_experts = {k: sorted(set(v)) for k, v in layer_experts.items()}
    return weight_name_filter


# --------------------------------------------------------------------------
# Planning and staging
# --------------------------------------------------------------------------

def _unit(model: FP8MoEModel, name: str) -> tuple[str, Optional[int]]:
    """The smallest set of tensors that must be reloaded together.

    An expert (all its gate/up/down weights and scales) or a whole module: the
    post-processing of either needs every one of its tensors.
    """
    _, module, kw = model.resolve(name)
    return module, kw.get("expert_id")


def _units(model: FP8MoEModel) -> tuple[dict, dict]:
    """(name -> unit, unit -> names in checkpoint order) of the model's layout, cached."""
    cached = model.__dict__.get("_units_cache")
    if cached is None:
        of, members = {}, {}
        for n in _expected_layout(model):
            u = of[n] = _unit(model, n)
            members.setdefault(u, []).append(n)
        cached = model.__dict__["_units_cache"] = (of, members)
    return cached


def _file_stamp(path) -> Optional[tuple]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _checkpoint_stamp(ckpt: Checkpoint) -> tuple:
    files = ["config.json", INDEX_FILE] + sorted(set(ckpt.weight_map.values()))
    return tuple(_file_stamp(ckpt.path / f) for f in files)


def _open_checkpoint(model: FP8MoEModel, path) -> Checkpoint:
    """The checkpoint at `path`, reusing the index and shard headers parsed by the
    previous reload from the same path when none of its files changed (size,
    mtime, ctime, inode): EPLB reloads one checkpoint many times, and parsing
    its JSON is most of a small reload's planning."""
    key = os.path.realpath(path)
    cached = model.__dict__.get("_checkpoint_cache")
    if cached is not None and cached[0] == key and cached[1] == _checkpoint_stamp(cached[2]):
        return cached[2]
    ckpt = Checkpoint(path)
    model.__dict__["_checkpoint_cache"] = (key, _checkpoint_stamp(ckpt), ckpt)
    return ckpt


def _expected_layout(model: FP8MoEModel) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    cached = getattr(model, "_expected_layout", None)
    if cached is None:
        cached = {n: (s, d) for n, s, d in tensor_layout(model.config, model.checkpoint_kind)}
        model._expected_layout = cached
    return cached


def _check_compatible(model: FP8MoEModel, ckpt: Checkpoint) -> None:
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


def _plan(model: FP8MoEModel, ckpt: Checkpoint, weight_name_filter: Optional[NameFilter],
          expand_units: bool) -> list[str]:
    """The checkpoint tensors to reload, checked against the model from the headers."""
    expected = _expected_layout(model)
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
            unit_of, members = _units(model)
            units = {unit_of[n] for n in selected}
            selected = [n for n in expected if unit_of[n] in units]
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


def _on_cuda(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.is_cuda


def _stage(model, ckpt: Checkpoint, names: list[str], weight_name_filter, scan_all: bool,
           stats: dict) -> list[tuple[str, torch.Tensor]]:
    """Read and validate every selected tensor into host memory (nothing is written).

    Onto a GPU the tensors land in the model's pinned staging arena (parallel
    reads; every host-to-device copy of the commit is then one async DMA).
    """
    expected = _expected_layout(model)
    if scan_all:  # upstream: read everything, filter afterwards
        it = ckpt.read(ckpt.names, stats)
        keep = set(names)
        staged = [(n, t) for n, t in it if n in keep]
    else:
        into = staging.arena(model, "staging") if _on_cuda(model) else None
        staged = list(ckpt.read(names, stats, into=into))
    _validate(staged, expected, ckpt)
    return staged


@contextmanager
def _nothing_written(path):
    """Before commit: any failure becomes a ReloadError; the model was not touched."""
    try:
        yield
    except ReloadError:
        raise
    except Exception as e:  # e.g. MemoryError while staging
        raise ReloadError(f"{path}: reload failed before anything was written: "
                          f"{type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------
# Backup
# --------------------------------------------------------------------------

_STATE_ATTRS = ("kernel_layout", "needs_processing", "weights_version")
# "host": copies in CPU memory (no device memory needed); "device": copies next to
# the weights (fast on a GPU, costs `backup_bytes` of device memory).
BACKUP_PLACES = ("host", "device")


class _Backup:
    """Everything commit and post-processing may change, bounded by the reload.

    Parameter objects (a failing upstream processing may have replaced them),
    each Parameter's `.data` tensor (rebinding), small per-module state, and
    host copies of the bytes: for a FusedMoE only the expert slots being
    reloaded of the two big weights, everything else of a touched module whole.
    """

    def __init__(self, where: str = "host"):
        if where not in BACKUP_PLACES:
            raise ValueError(f"backup must be one of {', '.join(BACKUP_PLACES)}, got {where!r}")
        self.where = where
        self.modules: list[tuple[nn.Module, dict, dict, dict, dict]] = []
        self.copies: list[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = []
        self.pending: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self.nbytes = 0

    def _copy(self, tensor: torch.Tensor, index: Optional[torch.Tensor]) -> None:
        self.pending.append((tensor, index))

    def run(self, arena=None) -> None:
        """Make the copies planned by `capture`. With `arena` (host backups of a GPU
        model) they go into its pinned memory as async device-to-host copies, which
        the stream orders before the commit's writes."""
        sizes = [(t.numel() if i is None else i.numel() * t[0].numel()) * t.element_size()
                 for t, i in self.pending]
        if arena is not None:
            arena.reset(sum(staging.aligned(n) for n in sizes))
        for (tensor, index), n in zip(self.pending, sizes):
            src = tensor if index is None else tensor.index_select(0, index.to(tensor.device))
            if arena is not None:
                copy = staging.typed_slice(arena, src.dtype, src.shape)
                copy.copy_(src, non_blocking=True)
            elif self.where == "host":
                copy = src.to("cpu", copy=index is None)
            else:
                copy = src.clone() if index is None else src
            self.copies.append((tensor, index, copy))
            self.nbytes += n
        self.pending = []

    def capture(self, module: nn.Module, slots: Optional[list[int]]) -> None:
        params = dict(module._parameters)
        buffers = dict(module._buffers)
        datas = {k: p.data for k, p in params.items() if p is not None}
        state = {k: getattr(module, k) for k in _STATE_ATTRS if hasattr(module, k)}
        if hasattr(module, "staged"):  # {key: tensor} or {slot: {shard: tensor}}
            state["staged"] = {k: dict(v) if isinstance(v, dict) else v
                               for k, v in module.staged.items()}
        if isinstance(module, FusedMoE):
            state["loaded_experts"] = set(module.loaded_experts)
        self.modules.append((module, params, buffers, datas, state))
        index = torch.tensor(slots, dtype=torch.long) if slots is not None else None
        for name, p in params.items():
            if p is None:
                continue
            big = isinstance(module, FusedMoE) and name in ("w13_weight", "w2_weight")
            self._copy(p.data, index if big else None)
        for buf in buffers.values():
            if buf is not None:
                self._copy(buf, None)

    def restore(self) -> None:
        """Objects and small state first (cannot fail), then the bytes."""
        for module, params, buffers, datas, state in self.modules:
            for k, p in params.items():
                module._parameters[k] = p
                if p is not None:
                    p.data = datas[k]
            module._buffers.clear()
            module._buffers.update(buffers)
            for k, v in state.items():
                setattr(module, k, v)
        with torch.no_grad():
            for tensor, index, host in self.copies:
                if index is None:
                    tensor.copy_(host)
                else:
                    index_copy_(tensor, 0, index.to(tensor.device), host.to(tensor.device))


def _capture_backup(model: FP8MoEModel, names: list[str], process_all: bool,
                    where: str = "host") -> _Backup:
    slots: dict[str, set[int]] = {}
    modules = dict(model.named_modules())
    for n in names:
        _, module_name, kw = model.resolve(n)
        s = slots.setdefault(module_name, set())
        if "expert_id" in kw:
            s.update(modules[module_name].local_slots(kw["expert_id"]))
    backup = _Backup(where)
    targets = set(slots)
    if process_all:
        targets |= {name for name, _ in model.quantized_modules()}
    for name in sorted(targets):
        module = modules[name]
        whole = (not isinstance(module, FusedMoE) or name not in slots or process_all
                 or len(slots[name]) == module.num_local_experts)
        backup.capture(module, None if whole else sorted(slots[name]))
    gpu_host = where == "host" and _on_cuda(model)
    backup.run(staging.arena(model, "backup") if gpu_host else None)
    return backup


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------

def _experts_by_layer(model: FP8MoEModel, names: Iterable[str]) -> dict[int, list[int]]:
    out: dict[int, set[int]] = {}
    for n in names:
        m = EXPERT_RE.match(n)
        if m:
            layer = int(n.split(".")[2])
            out.setdefault(layer, set()).add(int(m.group(2)))
    return {k: sorted(v) for k, v in sorted(out.items())}


def _sync(model: nn.Module) -> None:
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)


@contextmanager
def _sigint_deferred():
    """Hold Ctrl-C while restoring a backup (main thread only), re-raise it after.

    A handler not installed from Python (`signal.signal` returns None) cannot be
    put back, so then nothing is deferred.
    """
    received = []
    old = None
    if threading.current_thread() is threading.main_thread():
        try:
            old = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            old = None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    if received:
        raise KeyboardInterrupt


def _roll_back(model: FP8MoEModel, backup: _Backup, fault: BaseException, ckpt: Checkpoint,
               doing: str) -> None:
    """Restore the backup; RollbackError (and mark the model) if that fails too."""
    try:
        with _sigint_deferred():
            backup.restore()
            _sync(model)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        reason = (f"reload from {ckpt.path} failed while {doing} ({type(fault).__name__}: {fault}) "
                  f"and restoring the backup failed too ({type(e).__name__}: {e})")
        model.weights_undefined = reason
        raise RollbackError(f"{reason}: the model's weights are undefined; reload it fully "
                            "(weight_name_filter=None) to repair it") from e


class _Progress:
    """What commit is doing right now, for the error message."""

    def __init__(self):
        self.doing = "loading weights"

    def loading(self, staged):
        for name, tensor in staged:
            self.doing = f"loading tensor {name!r}"
            yield name, tensor


@trace.range("fp8_reload/reload")
def update_weights_from_disk(model: FP8MoEModel, path, weight_name_filter: Optional[NameFilter] = None,
                             *, scan_all: Optional[bool] = None,
                             postprocess_all: Optional[bool] = None,
                             backup: str = "host") -> ReloadReport:
    """Reload weights of `model` in place from the checkpoint at `path`.

    `weight_name_filter` (checkpoint name -> bool) limits the reload, e.g. to the
    experts EPLB moves (`generate_weight_name_filter`). In ``fixed`` mode a
    matched tensor pulls in the rest of its expert or module, only the shards
    holding selected tensors are opened, only selected tensors are read, and
    only modules that received weights are post-processed. `scan_all` and
    `postprocess_all` override the mode's read and processing scope (the
    benchmarks use them to time upstream behaviour on a working model).
    `backup` is where the rollback copies live: "host" (default) or "device".

    Forwards keep running while the checkpoint is read; they wait only while
    weights are written (see `locks.py`). Concurrent reloads run one at a time.

    Raises a `ReloadError` subclass naming the file/tensor and the cause; the
    model is then exactly as it was (except `RollbackError`, see errors.py).
    """
    if weight_name_filter is not None and not callable(weight_name_filter):
        raise TypeError(f"weight_name_filter must be a callable (name -> bool) or None, "
                        f"got {type(weight_name_filter).__name__}")
    if backup not in BACKUP_PLACES:
        raise ValueError(f"backup must be one of {', '.join(BACKUP_PLACES)}, got {backup!r}")
    mode = model.mode
    scan_all = mode.scan_all if scan_all is None else scan_all
    process_all = mode.postprocess_all if postprocess_all is None else postprocess_all
    report = ReloadReport(mode=mode.name, full=weight_name_filter is None)
    timer = _Timer(report.seconds)
    t0 = time.perf_counter()
    with model.reload_lock:
        undefined = getattr(model, "weights_undefined", None)
        if undefined and weight_name_filter is not None:
            raise RollbackError(f"refusing a filtered reload: {undefined}; only a full reload "
                                "(weight_name_filter=None) can repair the model")
        stats: dict = {}
        with _nothing_written(path):
            with timer.phase("plan"):
                ckpt = _open_checkpoint(model, path)
                _check_compatible(model, ckpt)
                names = _plan(model, ckpt, weight_name_filter, mode.expand_units and not scan_all)
            with timer.phase("read"):
                staged = _stage(model, ckpt, names, weight_name_filter, scan_all, stats)
            report.staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)
            with timer.phase("backup"):
                saved = _capture_backup(model, [n for n, _ in staged], process_all, backup)
            report.backup_bytes = saved.nbytes
        progress = _Progress()
        with ExitStack() as held:
            with timer.phase("wait"):  # running forwards finish; new ones queue
                try:
                    held.enter_context(model.weights_lock.write())
                except RuntimeError as e:  # a reload from inside a forward of this model
                    raise ReloadError(f"{ckpt.path}: {e}; nothing was written") from e
            try:
                with timer.phase("wait"):  # GPU: kernels of forwards on any stream finish
                    progress.doing = "waiting for running forwards"
                    _sync(model)
                with timer.phase("load"):
                    touched = None
                    with torch.no_grad():
                        touched = model.load_weights(progress.loading(staged))
                    _sync(model)
                with timer.phase("process"):
                    if process_all:
                        todo = list(model.quantized_modules())
                    else:
                        todo = [(n, m) for n, m in model.quantized_modules() if n in touched]
                    with torch.no_grad():
                        for item in todo:
                            progress.doing = f"post-processing module {item[0]!r}"
                            report.modules_processed += process_modules([item])
                    _sync(model)
            except BaseException as fault:
                with timer.phase("restore"):
                    _roll_back(model, saved, fault, ckpt, progress.doing)
                if not isinstance(fault, Exception):
                    raise  # KeyboardInterrupt / SystemExit: model restored, propagate as is
                err = CommitError(f"reload from {ckpt.path} failed while {progress.doing} and was "
                                  f"rolled back, the model is unchanged: {type(fault).__name__}: {fault}")
                err.report = report
                raise err from fault
            finally:
                _invalidate_caches(model)
    model.weights_undefined = None
    report.tensors_loaded = len(staged)
    report.bytes_read = stats["bytes_read"]
    report.files_opened = stats["files_opened"]
    report.experts_reloaded = _experts_by_layer(model, (n for n, _ in staged))
    report.seconds["total"] = time.perf_counter() - t0
    model.checkpoint_path = ckpt.path
    return report


@trace.range("fp8_reload/invalidate_caches")
def _invalidate_caches(model: FP8MoEModel) -> None:
    """Forward caches key on `weights_version`; drop any a backend keeps on the side."""
    for _, layer in model.moe_layers():
        cache = getattr(layer, "kernel_cache", None)
        if cache is not None:
            cache.clear()


@trace.range("fp8_reload/load_model")
def load_model(path, device="cpu", processing: str = "fixed", **moe_kwargs) -> FP8MoEModel:
    """Build the model a checkpoint describes on `device` and load it (a fresh load)."""
    mode = get_mode(processing)
    ckpt = Checkpoint(path)
    try:
        model = FP8MoEModel(ckpt.config, mode, ckpt.kind, device=device, **moe_kwargs)
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise ReloadError(f"{ckpt.path}: cannot build the model config.json describes on "
                          f"{device}: {type(e).__name__}: {e}") from e
    model.eval()
    report = ReloadReport(mode=mode.name, full=True)
    timer = _Timer(report.seconds)
    t0 = time.perf_counter()
    stats: dict = {}
    with _nothing_written(ckpt.path):
        with timer.phase("plan"):
            names = _plan(model, ckpt, None, False)
        with timer.phase("read"):
            staged = _stage(model, ckpt, names, None, False, stats)
    report.staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)
    try:
        with timer.phase("load"), torch.no_grad():
            model.load_weights(staged)
        with timer.phase("process"), torch.no_grad():
            report.modules_processed = process_modules(list(model.quantized_modules()))
        _sync(model)
    except Exception as e:
        raise ReloadError(f"loading {ckpt.path} failed: {type(e).__name__}: {e}") from e
    report.tensors_loaded = len(staged)
    report.bytes_read = stats["bytes_read"]
    report.files_opened = stats["files_opened"]
    report.seconds["total"] = time.perf_counter() - t0
    model.checkpoint_path = ckpt.path
    model.load_report = report
    return model
