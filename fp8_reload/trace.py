"""Named ranges for Nsight (NVTX) and torch.profiler, free when nothing listens.

One call site, two consumers::

    from fp8_reload import trace

    with trace.range("fp8_reload/tensor_read", payload=nbytes):
        ...

    @trace.range("fp8_reload/routing")
    def forward(self, x): ...

* **NVTX** (the ``nvtx`` package, optional): a push/pop range in the domain
  ``fp8_reload`` with a category, an ARGB color and an optional numeric
  payload. Nsight Systems draws it on the timeline, Nsight Compute filters
  kernels with ``--nvtx --nvtx-include "fp8_reload@<range>/"`` (escape the
  ``/`` inside names as ``\\/``, see the README).
* **torch.profiler**: a ``record_function`` with the same name, so a Chrome
  trace from ``torch.profiler`` carries the same ranges without Nsight.

Cost when no tool is attached: ``nvtx`` is looked up once at import. Recent
``nvtx`` releases hand out a dummy domain when no NVTX tool is injected into
the process; then no NVTX call is made at all. ``record_function`` is only
entered while a torch profiler is running (a module flag torch keeps for such
fast checks; entering it regardless costs microseconds). What is left is a
call, a few flag tests and a dictionary lookup, and entering and leaving the
range runs no Python code: about the cost of ``with contextlib.nullcontext()``
(``fp8-reload profile --overhead`` measures it).

Names start with ``fp8_reload/``. `RANGES` lists the ranges the suite emits,
with their category, color and what the payload counts; other modules (GPU
kernels) may add their own names, which get the ``other`` category unless one
is given.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import profiler as _autograd_profiler

if not hasattr(_autograd_profiler, "_is_profiler_enabled"):  # an older (or future) torch
    class _ProfilerFlag:
        """Stands in for torch's module flag: asks the profiler itself (slower)."""

        record_function = _autograd_profiler.record_function

        @property
        def _is_profiler_enabled(self) -> bool:
            return torch._C._autograd._profiler_enabled()

    _autograd_profiler = _ProfilerFlag()  # noqa: F811

DOMAIN = "fp8_reload"
PREFIX = DOMAIN + "/"

# ARGB colors per category (Nsight shows the range in this color).
CATEGORY_COLORS = {
    "profile": 0xFF9E9E9E,   # grey: the profiled window and its scenarios
    "reload": 0xFF1565C0,    # blue: reload / load phases
    "io": 0xFF00897B,        # teal: index, shard headers, file reads
    "load": 0xFF7CB342,      # green: weight_loader calls (host-to-device copies)
    "process": 0xFFF9A825,   # amber: post-load processing (requantization)
    "forward": 0xFF6A1B9A,   # purple: model / layer forward
    "quant": 0xFFD84315,     # deep orange: activation quantization
    "gemm": 0xFFC62828,      # red: GEMMs
    "activation": 0xFFAD1457,  # pink: SiLU * up
    "combine": 0xFF4E342E,   # brown: weighted scatter-add of expert outputs
    "other": 0xFF546E7A,     # blue grey: anything not listed in RANGES
}


@dataclass(frozen=True)
class RangeInfo:
    category: str
    payload: str  # what the numeric payload counts ("" when none is attached)
    doc: str


# Every range the suite itself emits, in the order a reload / forward nests them.
RANGES: dict[str, RangeInfo] = {
    "fp8_reload/profile": RangeInfo("profile", "", "the profiled window (`fp8-reload profile`; "
                                    "nsys capture range)"),
    "fp8_reload/scenario/reload-full": RangeInfo("profile", "", "one full update_weights_from_disk"),
    "fp8_reload/scenario/reload-filtered": RangeInfo("profile", "", "one EPLB-style filtered reload"),
    "fp8_reload/scenario/forward": RangeInfo("profile", "tokens", "one model forward"),
    "fp8_reload/load_model": RangeInfo("reload", "", "load_model: a fresh load"),
    "fp8_reload/reload": RangeInfo("reload", "", "update_weights_from_disk"),
    "fp8_reload/plan": RangeInfo("reload", "", "phase: open the checkpoint, resolve the filter "
                                 "against the index"),
    "fp8_reload/index_read": RangeInfo("io", "", "config.json + model.safetensors.index.json"),
    "fp8_reload/shard_header": RangeInfo("io", "", "parse one shard's safetensors header"),
    "fp8_reload/read": RangeInfo("reload", "", "phase: read + validate what must be known before "
                                 "writing (streaming: scales and loader-bound tensors; staged: every "
                                 "selected tensor) to host memory"),
    "fp8_reload/shard_open": RangeInfo("io", "", "open one shard file"),
    "fp8_reload/tensor_read": RangeInfo("io", "bytes", "read one tensor from a shard"),
    "fp8_reload/scales_read": RangeInfo("io", "bytes", "read the reload's scales (before anything is "
                                        "written)"),
    "fp8_reload/backup": RangeInfo("reload", "", "phase: back up the slices the reload will change"),
    "fp8_reload/wait": RangeInfo("reload", "", "phase: take the weights lock exclusively (running "
                                 "forwards finish; on a GPU, their kernels too)"),
    "fp8_reload/load_weights": RangeInfo("reload", "", "phase: write the weights (streamed into place, "
                                         "or model.load_weights over the staged tensors)"),
    "fp8_reload/drain": RangeInfo("reload", "", "phase: wait for the device to finish what the reload "
                                  "queued, then check the files' stamps"),
    "fp8_reload/restore": RangeInfo("reload", "", "phase, on a failed commit only: put the backup back"),
    "fp8_reload/register": RangeInfo("io", "bytes", "map one shard and register its pages for DMA"),
    "fp8_reload/dma": RangeInfo("load", "bytes", "queue copies straight from registered shards"),
    "fp8_reload/ring": RangeInfo("load", "bytes", "stream shards through the pinned ring"),
    "fp8_reload/chunk_read": RangeInfo("io", "bytes", "wait for one chunk's reads into the ring"),
    "fp8_reload/weight_loader": RangeInfo("load", "bytes", "one tensor through its parameter's weight_loader "
                                          "(the host-to-device copy happens here)"),
    "fp8_reload/process_weights_after_loading": RangeInfo("reload", "", "phase: post-load processing"),
    "fp8_reload/process_moe": RangeInfo("process", "experts", "one FusedMoE's process_weights_after_loading "
                                        "(payload: experts loaded since the last processing)"),
    "fp8_reload/process_linear": RangeInfo("process", "", "one Fp8Linear's process_weights_after_loading"),
    "fp8_reload/invalidate_caches": RangeInfo("reload", "", "drop forward caches keyed on weights_version"),
    "fp8_reload/forward": RangeInfo("forward", "tokens", "FP8MoEModel.forward"),
    "fp8_reload/attention": RangeInfo("forward", "", "attention block (FP8 q/k/v/o projections)"),
    "fp8_reload/mlp": RangeInfo("forward", "", "dense MLP or shared experts"),
    "fp8_reload/linear": RangeInfo("gemm", "", "one FP8 linear: activation quantization + GEMM"),
    "fp8_reload/routing": RangeInfo("forward", "", "router: logits, softmax, top-k"),
    "fp8_reload/moe": RangeInfo("forward", "tokens", "routed experts of one layer (run_moe, any backend)"),
    "fp8_reload/act_quant": RangeInfo("quant", "tokens", "FP8 activation quantization"),
    "fp8_reload/gemm_w13": RangeInfo("gemm", "tokens", "gate/up GEMM of one expert (torch backend)"),
    "fp8_reload/activation": RangeInfo("activation", "tokens", "SiLU(gate) * up of one expert"),
    "fp8_reload/gemm_w2": RangeInfo("gemm", "tokens", "down GEMM of one expert (torch backend)"),
    "fp8_reload/combine": RangeInfo("combine", "tokens", "weighted scatter-add of one expert's output"),
}

# Reload phases timed by reload._Timer, by phase name.
PHASES = {"plan": "fp8_reload/plan", "read": "fp8_reload/read", "backup": "fp8_reload/backup",
          "wait": "fp8_reload/wait", "load": "fp8_reload/load_weights",
          "process": "fp8_reload/process_weights_after_loading", "drain": "fp8_reload/drain",
          "restore": "fp8_reload/restore"}


def category_of(name: str) -> str:
    info = RANGES.get(name)
    return info.category if info is not None else "other"


def _color_for(name: str, category: str, color) -> int:
    if isinstance(color, int):
        return color
    if isinstance(color, str):
        if color in CATEGORY_COLORS:
            return CATEGORY_COLORS[color]
        raise ValueError(f"unknown color {color!r}: give an ARGB int or one of {', '.join(CATEGORY_COLORS)}")
    if category in CATEGORY_COLORS and (category != "other" or name in RANGES):
        return CATEGORY_COLORS[category]
    # An unlisted name: a stable color of its own so neighbours stay distinguishable.
    return 0xFF000000 | (zlib.crc32(name.encode()) & 0xFFFFFF)


# --------------------------------------------------------------------------
# Back ends, resolved once
# --------------------------------------------------------------------------

def _nvtx_domain():
    """The ``fp8_reload`` NVTX domain, or None when NVTX is off or no tool listens.

    ``FP8_RELOAD_NVTX=0`` turns NVTX off. nvtx >= 0.2.11 returns a dummy domain
    when no tool is injected; older releases always return a real one (their
    calls are then no-ops inside libnvtx).
    """
    if os.environ.get("FP8_RELOAD_NVTX", "1").lower() in ("0", "false", "off", "no"):
        return None
    try:
        import nvtx
    except ImportError:
        return None
    domain = nvtx.get_domain(DOMAIN)
    if type(domain).__name__ == "DummyDomain" or not hasattr(domain, "push_range"):
        return None
    return domain


_domain = _nvtx_domain()
_recorder: list | None = None  # (name, payload) of every range entered while recording
_enabled = True
_quiet = True  # enabled and not recording: `range` may hand out the cached static range


def nvtx_active() -> bool:
    """True when ranges reach an NVTX tool (Nsight Systems / Compute attached)."""
    return _domain is not None


def set_enabled(enabled: bool) -> None:
    """Switch every range off (a no-op object) or back on; for overhead measurements."""
    global _enabled, _quiet
    _enabled = bool(enabled)
    _quiet = _enabled and _recorder is None


# --------------------------------------------------------------------------
# Ranges
# --------------------------------------------------------------------------

class _Spec:
    """A range's static part (name, category, color), cached per name.

    Entered directly on the fast path: pushes/pops NVTX when a tool listens,
    nothing otherwise. Also the decorator.
    """

    __slots__ = ("name", "category", "color", "_attrs", "_payload_attrs")

    def __init__(self, name: str, category: str | None, color):
        if not name.startswith(PREFIX):
            raise ValueError(f"range names start with {PREFIX!r}, got {name!r}")
        self.name = name
        self.category = category or category_of(name)
        self.color = _color_for(name, self.category, color)
        self._attrs = None
        self._payload_attrs = threading.local()

    def attrs(self, payload=None):
        """NVTX event attributes; one shared object without payload, one per thread with."""
        if payload is None:
            if self._attrs is None:
                self._attrs = _domain.get_event_attributes(self.name, self.color, self.category)
            return self._attrs
        a = getattr(self._payload_attrs, "a", None)
        if a is None:
            a = self._payload_attrs.a = _domain.get_event_attributes(self.name, self.color, self.category)
        try:
            a.payload = payload
        except (AttributeError, TypeError, ValueError):  # an nvtx without payload support
            return self.attrs()
        return a

    def __enter__(self):
        if _domain is not None:
            _domain.push_range(self.attrs())
        return self

    def __exit__(self, *exc):
        if _domain is not None:
            _domain.pop_range()
        return False

    def __call__(self, func: Callable) -> Callable:
        name, category, color = self.name, self.category, self.color

        @functools.wraps(func)
        def traced(*args, **kwargs):
            if _domain is None and _recorder is None and not _autograd_profiler._is_profiler_enabled:
                return func(*args, **kwargs)  # nothing listens: not even a context manager
            with range(name, category, color):
                return func(*args, **kwargs)

        return traced


class _QuietSpec(_Spec):
    """`_Spec` when no NVTX tool is attached: entering and leaving it runs no Python code.

    ``with`` looks special methods up on the type and binds descriptors only;
    a bound builtin method is no descriptor, so ``"".format`` is called as is,
    with no argument on entry and (type, value, traceback) on exit, and returns
    ``""``: falsy, so exceptions propagate.
    """

    __slots__ = ()
    __enter__ = "".format
    __exit__ = "".format


class _Active:
    """A range entered while something records: payload NVTX, record_function, recorder."""

    __slots__ = ("spec", "payload", "_rf", "_nv")

    def __init__(self, spec: _Spec, payload):
        self.spec = spec
        self.payload = payload
        self._rf = None
        self._nv = False

    def __enter__(self):
        spec = self.spec
        if _recorder is not None:
            _recorder.append((spec.name, self.payload))
        if _domain is not None:
            _domain.push_range(spec.attrs(self.payload))
            self._nv = True
        if _autograd_profiler._is_profiler_enabled:
            self._rf = _autograd_profiler.record_function(spec.name)
            self._rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self._rf is not None:
            self._rf.__exit__(*exc)
            self._rf = None
        if self._nv:
            _domain.pop_range()
            self._nv = False
        return False

    def __call__(self, func: Callable) -> Callable:
        return self.spec(func)


class _Off:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, func):
        return func


_OFF = _Off()
_specs: dict[tuple, _Spec] = {}
_by_name: dict[str, _Spec] = {}  # the default-category, default-color specs, for the fast path


def _spec(name: str, category: str | None, color) -> _Spec:
    key = (name, category, color)
    spec = _specs.get(key)
    if spec is None:
        spec = _specs[key] = (_Spec if _domain is not None else _QuietSpec)(name, category, color)
        if category is None and color is None:
            _by_name[name] = spec
    return spec


def range(name: str, category: str | None = None, color: int | str | None = None,
          payload: int | float | None = None):  # noqa: A001  (shadows builtins.range on purpose)
    """A context manager / decorator emitting `name` to NVTX and torch.profiler.

    `category` defaults to the one `RANGES` lists (``other`` for unlisted
    names), `color` to the category's color (an ARGB int or a category name).
    `payload` is one number shown with the range (bytes, tokens, experts: see
    `RANGES`); as a decorator the range carries no payload.
    """
    if (_quiet and category is None and color is None and not _autograd_profiler._is_profiler_enabled
            and (_domain is None or payload is None)):
        spec = _by_name.get(name)
        if spec is not None:
            return spec
    if not _enabled:
        return _OFF
    spec = _spec(name, category, color)
    if (_autograd_profiler._is_profiler_enabled or _recorder is not None
            or (payload is not None and _domain is not None)):
        return _Active(spec, payload)
    return spec


def phase(name: str):
    """The range of a reload phase timed by `reload._Timer` (`PHASES`)."""
    return range(PHASES.get(name) or PREFIX + name)


class recording:
    """Collect (name, payload) of every range entered inside the block, in order.

    torch.profiler has no slot for a numeric payload; the profile command joins
    these to the trace's ranges by name. Not re-entrant.
    """

    def __init__(self):
        self.events: list[tuple[str, float | None]] = []

    def __enter__(self):
        global _recorder, _quiet
        if _recorder is not None:
            raise RuntimeError("trace.recording() is already active")
        _recorder = self.events
        _quiet = False
        return self

    def __exit__(self, *exc):
        global _recorder, _quiet
        _recorder = None
        _quiet = _enabled
        return False
