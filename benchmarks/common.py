"""Shared settings, skips and checkpoints of the asv suite.

What every benchmark module needs lives here, so the modules only say what
they time:

* where to run and on what: `DEVICE`, `PRESETS`, `KINDS`, `FRACTIONS`, read from
  ``FP8_RELOAD_BENCH_*`` environment variables at import (asv fixes parameter
  lists when it discovers the suite, so they must be known then);
* `CheckpointSuite`: the base class whose one `setup_cache` writes every
  checkpoint once per asv run (asv keys the cache on that single function, so
  all subclasses share it) on the local disk asv runs in;
* lazily built, per-process fixtures live in `fixtures.py` (`loaded_model`,
  `RoutedBatch`, `UnprocessedLayer`);
* `synchronized`: the one place that synchronizes the GPU around every `setup`
  and `time_` method (instead of sync calls sprinkled through benchmarks);
* `requires_*`: raise ``NotImplementedError`` so asv records a clean skip when
  CUDA, Triton, DeepGEMM or a forward backend is missing.

Environment knobs (all optional):

``FP8_RELOAD_BENCH_DEVICE``   cpu | cuda (default: cuda if available)
``FP8_RELOAD_BENCH_PRESETS``  comma list of ``preset[:num_layers]``
                              (default: ``small`` on CPU, ``v2-lite:4`` on CUDA)
``FP8_RELOAD_BENCH_KINDS``    comma list of checkpoint kinds (default ``fp8,bf16``)
``FP8_RELOAD_BENCH_TOKENS``   comma list of token counts for forward benchmarks
``FP8_RELOAD_BENCH_DIR``      keep checkpoints here across runs (default: asv's
                              temporary directory, rewritten every run)
``FP8_RELOAD_BENCH_THREADS``  torch CPU threads (default under asv: 1 on CPU, so numbers
                              from a shared CI box are comparable; torch's default on CUDA)
``FP8_RELOAD_BENCH_TIMER``    cpu | wall: what time_ benchmarks measure (default: process
                              CPU time on CPU with one thread, wall time otherwise)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import time
from pathlib import Path

import torch

import fp8_reload as fr
from fp8_reload import kernels

Checkpoint = fr.Checkpoint


# --------------------------------------------------------------------------
# Names that moved between commits
# --------------------------------------------------------------------------
# `fp8-reload regress BASE HEAD` runs this checkout's suite against older code too,
# so the suite imports only `fp8_reload`'s public names and looks up each name that
# moved (the package layout of issue 12) where the commit under test has it, as
# scipy's suite guards with `safe_import`. A benchmark whose name is missing skips.

def moved(*places: str):
    """The first of `places` (``"module:name"``) the code under test has, else None."""
    for place in places:
        module, _, name = place.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def require(*places: str):
    """`moved(*places)`, or a skip (NotImplementedError) naming what is missing."""
    found = moved(*places)
    if found is None:
        raise NotImplementedError(f"the code under test has none of {', '.join(places)}")
    return found


def _synchronize_cuda() -> None:  # commits before fp8_reload.testing
    if torch.cuda.is_available():
        torch.cuda.synchronize()


synchronize = moved("fp8_reload.testing:synchronize") or _synchronize_cuda


# The parameter lists live in knobs.py (torch-free), re-exported here; read again whenever
# this module is (tests re-import it with other knobs).
from . import knobs  # noqa: E402

importlib.reload(knobs)
from .knobs import (  # noqa: E402, F401
    ACCURACY_TOKENS,
    BACKENDS,
    DEVICE,
    FRACTIONS,
    KINDS,
    ON_CUDA,
    PRESETS,
    TOKENS,
)

_threads = os.environ.get("FP8_RELOAD_BENCH_THREADS")
if _threads or (os.environ.get("ASV") and not ON_CUDA):  # only inside asv's processes
    torch.set_num_threads(int(_threads or 1))

# What time_ benchmarks measure. On CPU with one thread: the process's CPU time
# (user + sys, page-cache reads included), which a shared, oversubscribed CI box
# disturbs far less than wall time. On CUDA, or with FP8_RELOAD_BENCH_TIMER=wall,
# or with more threads (CPU time would sum them): wall time.
TIMER_KIND = os.environ.get("FP8_RELOAD_BENCH_TIMER") or (
    "wall" if ON_CUDA or torch.get_num_threads() != 1 else "cpu")
if TIMER_KIND not in ("cpu", "wall"):
    raise ValueError(f"FP8_RELOAD_BENCH_TIMER must be cpu or wall, not {TIMER_KIND!r}")
TIMER = time.process_time if TIMER_KIND == "cpu" else time.perf_counter


def preset_config(spec: str) -> fr.MoEConfig:
    """``"v2-lite:4"`` -> the v2-lite preset cut to 4 layers; ``"small"`` -> small."""
    if hasattr(fr.MoEConfig, "from_spec"):
        return fr.MoEConfig.from_spec(spec)
    name, _, layers = spec.partition(":")  # commits before MoEConfig.from_spec
    return fr.MoEConfig.preset(name, **({"num_layers": int(layers)} if layers else {}))


def fraction_experts(cfg: fr.MoEConfig, fraction: str) -> dict[int, list[int]]:
    """{MoE layer: experts} for one `FRACTIONS` entry: the same count in every MoE
    layer, a different seeded choice per layer (EPLB moves different experts)."""
    e = cfg.num_experts
    if fraction == "1/layer":
        k = 1
    elif fraction.endswith("%"):
        k = max(1, round(e * float(fraction[:-1]) / 100))
    else:
        raise ValueError(f"unknown fraction {fraction!r}")
    out = {}
    for layer in cfg.moe_layers:
        g = torch.Generator().manual_seed(1000 + layer)
        out[layer] = sorted(torch.randperm(e, generator=g)[:k].tolist())
    return out


# --------------------------------------------------------------------------
# Skips
# --------------------------------------------------------------------------

def requires_cuda() -> None:
    if not ON_CUDA:
        raise NotImplementedError("needs a CUDA device (FP8_RELOAD_BENCH_DEVICE=cuda)")


def requires_triton() -> None:
    requires_cuda()
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise NotImplementedError("needs triton") from e


def requires_deep_gemm() -> None:
    requires_cuda()
    try:
        import deep_gemm  # noqa: F401
    except ImportError as e:
        raise NotImplementedError("needs deep_gemm") from e


def requires_backend(name: str, preset: str | None = None) -> None:
    """Skip unless MoE forward backend `name` is registered and usable on `DEVICE` (and,
    given a `preset`, on its shapes: DeepGEMM's tiles need 128-aligned sizes)."""
    if name == "triton":
        requires_triton()
    elif name.startswith("deep_gemm"):
        requires_deep_gemm()
    if name not in kernels.available_backends():
        why = getattr(kernels, "UNAVAILABLE", {}).get(name, "not registered in fp8_reload.kernels")
        raise NotImplementedError(f"MoE backend {name!r} is not available: {why}")
    if name.startswith("deep_gemm") and preset is not None:
        from fp8_reload.errors import BackendUnavailable
        from fp8_reload.kernels.deep_gemm import check_shapes

        cfg = preset_config(preset)
        try:
            check_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        except BackendUnavailable as e:
            raise NotImplementedError(str(e)) from None


# --------------------------------------------------------------------------
# GPU synchronization
# --------------------------------------------------------------------------

def sync() -> None:
    if ON_CUDA:
        synchronize()


def _synchronized_func(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        sync()
        try:
            return func(*args, **kwargs)
        finally:
            sync()

    return wrapper


def synchronized(target):
    """Synchronize the device before and after every `setup` and `time_*` method.

    Before: nothing queued by setup leaks into the timing. After: the timing
    includes all device work the call queued. Works on a class (wraps its
    methods) or a single function; free on CPU.
    """
    if inspect.isclass(target):
        for name, member in list(vars(target).items()):
            if inspect.isfunction(member) and (name == "setup" or name.startswith("time_")):
                setattr(target, name, _synchronized_func(member))
        for base in target.__mro__[1:]:  # inherited setup methods too
            member = vars(base).get("setup")
            if inspect.isfunction(member) and "setup" not in vars(target):
                target.setup = _synchronized_func(member)
                break
        return target
    return _synchronized_func(target)


def device_peak_bytes(fn) -> int:
    """Device memory `fn` allocates beyond what was allocated before it (peak)."""
    requires_cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# --------------------------------------------------------------------------
# Checkpoints, written once per asv run
# --------------------------------------------------------------------------

def checkpoint_key(preset: str, kind: str) -> str:
    return f"{preset}-{kind}"


def write_checkpoints(root: Path, presets=None, kinds=None) -> dict[str, str]:
    """{checkpoint_key: path} for every preset x kind, seed 0, under `root`.

    An existing directory is reused only when it is complete and matches (the
    persistent ``FP8_RELOAD_BENCH_DIR`` case).
    """
    out = {}
    for preset in presets or PRESETS:
        cfg = preset_config(preset)
        for kind in kinds or KINDS:
            path = Path(root) / checkpoint_key(preset, kind)
            if not _reusable(path, cfg, kind):
                fr.write_checkpoint(path, cfg, seed=0, kind=kind)
            out[checkpoint_key(preset, kind)] = str(path.resolve())
    return out


def _reusable(path: Path, cfg: fr.MoEConfig, kind: str) -> bool:
    if not (path / "config.json").exists():
        return False
    try:
        ck = Checkpoint(path)
        ck.total_bytes()  # every shard header present and consistent
    except fr.CheckpointError:
        return False
    return ck.kind == kind and ck.config == cfg


class CheckpointSuite:
    """Base class of every benchmark that needs checkpoints on disk."""

    timeout = 600.0
    timer = TIMER

    def setup_cache(self):
        root = os.environ.get("FP8_RELOAD_BENCH_DIR") or os.getcwd()
        # forward benchmarks always use the FP8 checkpoint
        return write_checkpoints(Path(root), kinds=list(dict.fromkeys(KINDS + ["fp8"])))

    setup_cache.timeout = 1800.0
