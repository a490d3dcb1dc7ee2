"""`load_model` and `update_weights_from_disk`: plan, stage, back up, commit, post-process.

A reload is a transaction:

1. plan: open the checkpoint (config, index, headers), check it fits the
   model, resolve the filter, check every selected tensor's shape and dtype
   from the headers;
2. stage ("read"): read every selected tensor to host memory and validate it
   (shape, dtype, values: finite weights, no FP8 NaN bytes, finite positive
   scales; checked on the model's device). Nothing in the model is written
   before this has fully succeeded; any failure up to here raises a
   `ReloadError` subclass and the model was never touched;
3. backup: copies (host, or device with ``backup="device"``) of what commit may
   change, bounded by the reload (the reloaded expert slots of the big MoE weights,
   whole small tensors); the streaming engine plans it before step 2, and on a GPU
   copies its first piece while the host reads (a full reload with a host backup
   waits for the link's device-to-host direction);
4. commit ("wait", "load", "process", "drain"): take the weights lock exclusively
   (forwards drain, see `locks.py`), write the weights (streamed into place, or
   through the parameters' own `weight_loader`s), post-process; on a GPU the last
   two are queued without waiting and "drain" waits once for the device, then
   checks the files' stamps. If anything fails here, a device error or a
   KeyboardInterrupt, the backup is restored (Ctrl-C is deferred while
   restoring), so the model is bit-identical to before, and `CommitError` is
   raised (KeyboardInterrupt propagates as is). If the restore itself fails,
   `RollbackError` says so and only a full reload is accepted afterwards.

`ReloadReport` gives `staged_bytes` and `backup_bytes` (the memory the
transaction costs) and per-phase `seconds`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import trace
from ..checkpoint import Checkpoint, files, staging
from ..device import current_cuda, model_device, on_cuda, resolve_device, side_stream, synchronize
from ..errors import CommitError, CorruptCheckpointError, ReloadError, RollbackError
from ..kernels.scales import clear_kernel_caches
from ..knobs import env_choice
from ..layers import FP8MoEModel
from ..processing import get_mode, process_modules
from ..processing.ops import on_triton
from .backup import BACKUP_PLACES, capture_backup, roll_back
from .filters import NameFilter, experts_by_layer, processing_order
from .plan import (
    check_compatible,
    checkpoint_stamp,
    nothing_written,
    open_checkpoint,
    plan,
    plan_reload,
    remember_checkpoint,
    stage,
    target_cache,
)
from .stream import commit, kinds_of, prepare
from .targets import write_order
from .to_device import registered_files, registered_now, release_dropped

# "stream" (default): the fixed path streams bytes into place (`stream.py`); "staged": every
# tensor read to host memory first, then the modules' loaders (the engine before; kept to
# compare against, and what the upstream mode's scan-all reads use)
ENGINE = env_choice("FP8_RELOAD_ENGINE", "stream", ("stream", "staged"))


def on_triton_device(model) -> bool:
    return on_cuda(model) and on_triton(next(model.parameters()))


@dataclass
class ReloadReport:
    """What one load or reload did. `seconds` holds per-phase wall times, and "read_wait"
    (within "load") when files were read through the ring: the time the commit waited for
    the readers (when it is most of "load", the reads are the limit)."""

    mode: str
    full: bool
    tensors_loaded: int = 0
    bytes_read: int = 0
    files_opened: int = 0
    bytes_direct: int = 0  # of which read with O_DIRECT, past the page cache (FP8_RELOAD_IO)
    modules_processed: list[str] = field(default_factory=list)
    experts_reloaded: dict[int, list[int]] = field(default_factory=dict)
    staged_bytes: int = 0  # host memory holding the validated tensors before commit
    backup_bytes: int = 0  # memory holding the copies a failed commit is restored from
    backup_device_bytes: int = 0  # of which in the weights' memory (`backup="device"`, `backup.ON_DEVICE`)
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        n_exp = sum(len(v) for v in self.experts_reloaded.values())
        return (f"[{self.mode}] {'full' if self.full else 'filtered'} reload: "
                f"{self.tensors_loaded} tensors, {self.bytes_read / 2**20:.2f} MiB read from "
                f"{self.files_opened} files, {n_exp} experts, "
                f"{len(self.modules_processed)} modules processed, "
                f"staged {self.staged_bytes / 2**20:.2f} MiB, "
                f"backup {self.backup_bytes / 2**20:.2f} MiB "
                f"({self.backup_device_bytes / 2**20:.2f} on the device) ({phases})")


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


class _Progress:
    """What commit is doing right now, for the error message."""

    def __init__(self):
        self.doing = "loading weights"

    def loading(self, staged):
        for name, tensor in staged:
            self.doing = f"loading tensor {name!r}"
            yield name, tensor


def _exclusive(model: FP8MoEModel, path):
    """The locks a reload holds, for one `with` (each given back by C code: no Ctrl-C can
    land between a `with` body and their release), refusing the two calls that could
    never get them: a reload from inside a forward of this model (another reload may hold
    the lock while it waits for that very forward to finish: a deadlock, whoever came
    first), and one from inside a reload of this model on the same thread (a hook or
    loader calling back would re-enter the transaction half-way)."""
    if model.weights_lock.held_for_reading:
        raise ReloadError(f"{path}: cannot write the weights from inside a forward of the "
                          "same model (it would wait for itself); nothing was written")
    running = model.__dict__.setdefault("_reload_running", threading.RLock())
    if running._is_owned():
        raise ReloadError(f"{path}: a reload of this model is already running on this "
                          "thread (this call comes from inside it); nothing was written")
    return model.reload_lock, running, model.weights_lock.commit_hold()


def _take_lock(held, timer: _Timer, path) -> None:
    """Take the weights lock (`held`, entered by the reload): running forwards finish,
    new ones queue."""
    with timer.phase("wait"):
        try:
            held.take()
        except RuntimeError as e:
            raise ReloadError(f"{path}: {e}; nothing was written") from e


def _drain_device(model, timer: _Timer, device, progress: _Progress) -> None:
    """Under the lock: the kernels forwards queued on any stream finish; what registrations
    dropped is unregistered (the driver waits for the whole device: here, where it is idle)."""
    with timer.phase("wait"):
        progress.doing = "waiting for running forwards"
        synchronize(device)
        if device.type == "cuda":
            release_dropped(model)


@trace.range("fp8_reload/reload")
def update_weights_from_disk(model: FP8MoEModel, path, weight_name_filter: NameFilter | None = None,
                             *, scan_all: bool | None = None,
                             postprocess_all: bool | None = None,
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
    weights are written (see `locks.py`), and for a full reload from registered
    shards (nothing to read on the host) from its planning on. Concurrent reloads
    run one at a time.

    Raises a `ReloadError` subclass naming the file/tensor and the cause; the
    model is then exactly as it was (except `RollbackError`, see errors.py).
    """
    path = files.directory_path(path)
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
    device = model_device(model) or torch.device("cpu")  # looked up once: a walk of the model
    reload_lock, running, held = _exclusive(model, path)
    with reload_lock, running, held, current_cuda(device):
        undefined = getattr(model, "weights_undefined", None)
        if undefined and weight_name_filter is not None:
            raise RollbackError(f"refusing a filtered reload: {undefined}; only a full reload "
                                "(weight_name_filter=None) can repair the model")
        stats: dict = {}
        streaming = ENGINE == "stream" and not scan_all
        cuda = device.type == "cuda"
        saved, progress = None, _Progress()

        def abandon() -> None:  # failed before the commit: no copy left running
            if saved is not None:
                saved.settle()

        with nothing_written(path, on_failure=abandon):
            with timer.phase("plan"):
                ckpt = open_checkpoint(model, path)
                stamp = checkpoint_stamp(ckpt)
                check_compatible(model, ckpt)
                if streaming:  # what is worked out once per checkpoint is kept with it
                    names, targets = plan_reload(model, ckpt, weight_name_filter,
                                                 cuda and on_triton_device(model), mode.expand_units)
                    # what derives from a kept full plan is kept with it
                    memo = target_cache(model).derived_of(names)
                    kinds = kinds_of(targets, memo)
                    now = registered_now(model, ckpt, kinds.files) if cuda else set()
                else:
                    names = plan(model, ckpt, weight_name_filter, mode.expand_units and not scan_all)
                    memo = {}
            # a full reload from registered shards reads (nearly) nothing on the host: its time
            # is the link's, and with the weights taken now (forwards wait from here, ~2 ms
            # sooner; the reload ends sooner by as much) both directions start at once: the
            # device synchronization under the lock waits for what is queued before it
            early = streaming and weight_name_filter is None and bool(now) and now >= kinds.files
            if early:
                _take_lock(held, timer, ckpt.path)
                _drain_device(model, timer, device, progress)
            if streaming:  # planned first: on a GPU its first piece is copied while the host reads
                with timer.phase("backup"):
                    if "order" not in memo:
                        memo["order"] = write_order(targets)
                    saved = capture_backup(model, names, process_all, backup, order=memo["order"],
                                           stream=side_stream(device, "backup") if cuda else None,
                                           start=False, memo=memo)
                    saved.begin()
            with timer.phase("read"):
                if streaming:  # scales and loader-bound tensors; the rest streams in commit
                    into = staging.arena(model, "staging") if cuda else None
                    prepared = prepare(ckpt, targets, stats, into=into, whole=weight_name_filter is None,
                                       registered=now, memo=memo)
                    if cuda:  # registering pins shards' pages: here, not under the weights lock (but
                        # when all are registered), and once the checks passed (a checkpoint that
                        # cannot load neither counts nor pins)
                        prepared.registered = registered_files(model, ckpt, kinds.streamed_by_file)
                    report.staged_bytes = prepared.staged_bytes
                else:
                    staged = stage(model, ckpt, names, weight_name_filter, scan_all, stats)
                    report.staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)
            if not streaming:
                with timer.phase("backup"):
                    saved = capture_backup(model, names, process_all, backup, memo=memo)
            report.backup_bytes, report.backup_device_bytes = saved.nbytes, saved.device_bytes
        with held:
            if not early:
                try:  # (a Ctrl-C while forwards drain: the begun backup's copies are waited for)
                    _take_lock(held, timer, ckpt.path)
                except BaseException:
                    saved.settle()
                    raise
            try:
                if not early:
                    _drain_device(model, timer, device, progress)
                if streaming:  # its copies run beside the commit's (see capture_backup)
                    with timer.phase("backup"):
                        progress.doing = "backing up"
                        saved.start_on_demand()
                with timer.phase("load"):
                    touched = None
                    with torch.no_grad():
                        if streaming:
                            progress.doing = "streaming weights into place"
                            touched = commit(model, prepared, stats, wait_for=saved.event_for, device=device,
                                             backup_ahead=saved.queue_all)
                            saved.complete()  # what processing writes is backed up before it
                            report.backup_bytes, report.backup_device_bytes = saved.nbytes, saved.device_bytes
                        else:
                            touched = model.load_weights(progress.loading(staged))
                    if not streaming:
                        synchronize(device)
                with timer.phase("process"):  # on a GPU queued behind the copies: no wait here
                    if process_all:
                        todo = list(model.quantized_modules())
                    else:
                        order = processing_order(model)
                        todo = [(n, order[n][1])
                                for n in sorted(touched & order.keys(), key=lambda n: order[n][0])]
                    with torch.no_grad():
                        for item in todo:
                            progress.doing = f"post-processing module {item[0]!r}"
                            report.modules_processed += process_modules([item])
                with timer.phase("drain"):  # the device finishes what was queued; bytes read
                    synchronize(device)     # from registered shards are all read by now
                    if streaming and checkpoint_stamp(ckpt) != stamp:
                        raise CorruptCheckpointError(f"{ckpt.path}: its files changed while they were "
                                                     "read; the reload is rolled back")
                # committed: the model says so before anything else runs (dict stores call no
                # Python code, so no Ctrl-C lands between them and the commit; one landing later
                # propagates with the new weights in place, and the model naming them)
                model.__dict__["weights_undefined"] = None
                model.__dict__["checkpoint_path"] = ckpt.path
            except BaseException as fault:
                report.backup_bytes, report.backup_device_bytes = saved.nbytes, saved.device_bytes
                with timer.phase("restore"):
                    roll_back(model, saved, fault, ckpt, progress.doing)
                if not isinstance(fault, Exception):
                    raise  # KeyboardInterrupt / SystemExit: model restored, propagate as is
                if isinstance(fault, ReloadError):  # a bad value or a changed file: restored
                    raise
                err = CommitError(f"reload from {ckpt.path} failed while {progress.doing} and was "
                                  f"rolled back, the model is unchanged: {type(fault).__name__}: {fault}")
                err.report = report
                raise err from fault
            finally:
                clear_kernel_caches(model)
    report.tensors_loaded = len(names) if streaming else len(staged)
    report.bytes_read = stats.get("bytes_read", 0)
    report.files_opened = stats.get("files_opened", 0)
    report.bytes_direct = stats.get("bytes_direct", 0)
    if "read_wait" in stats:  # (part of "load": the commit waiting for the readers)
        report.seconds["read_wait"] = stats["read_wait"]
    if "experts" not in memo:
        memo["experts"] = experts_by_layer(names if streaming else (n for n, _ in staged))
    report.experts_reloaded = {layer: list(ids) for layer, ids in memo["experts"].items()}
    report.seconds["total"] = time.perf_counter() - t0
    return report


@trace.range("fp8_reload/load_model")
def load_model(path, device="cpu", processing: str = "fixed", **moe_kwargs) -> FP8MoEModel:
    """Build the model a checkpoint describes on `device` and load it (a fresh load).

    `path`: a directory, or an opened `Checkpoint` (its parse kept while its files are
    unchanged). A device this machine lacks raises `DeviceUnavailableError` first."""
    device = resolve_device(device)
    mode = get_mode(processing)
    reuse = isinstance(path, Checkpoint) and path.unchanged()
    ckpt = path if reuse else Checkpoint(getattr(path, "path", path))
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
    # Triton kernels (value checks, processing) run on the model's device, not the current one
    with current_cuda(model_device(model)):
        with nothing_written(ckpt.path):
            with timer.phase("plan"):
                names = plan(model, ckpt, None, False)
            with timer.phase("read"):
                staged = stage(model, ckpt, names, None, False, stats)
        report.staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)
        try:
            with timer.phase("load"), torch.no_grad():
                model.load_weights(staged)
            with timer.phase("process"), torch.no_grad():
                report.modules_processed = process_modules(list(model.quantized_modules()))
            synchronize(model)
            if ENGINE == "stream" and not mode.scan_all:
                # the first reload finds the parse and where every tensor lands (views of the
                # Parameters: a property of the model) already worked out
                with timer.phase("plan"):
                    remember_checkpoint(model, ckpt)
                    plan_reload(model, ckpt, None, on_triton_device(model), mode.expand_units)
        except Exception as e:
            raise ReloadError(f"loading {ckpt.path} failed: {type(e).__name__}: {e}") from e
    report.tensors_loaded = len(staged)
    report.bytes_read = stats["bytes_read"]
    report.files_opened = stats["files_opened"]
    report.seconds["total"] = time.perf_counter() - t0
    model.checkpoint_path = ckpt.path
    model.load_report = report
    return model
