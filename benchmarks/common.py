"""Shared fixtures and helpers of the asv suite.

Everything a benchmark module needs lives here, so the modules only say what
they time:

* where to run and on what: `DEVICE`, `PRESETS`, `KINDS`, `FRACTIONS`, read from
  ``FP8_RELOAD_BENCH_*`` environment variables at import (asv fixes parameter
  lists when it discovers the suite, so they must be known then);
* `CheckpointSuite`: the base class whose one `setup_cache` writes every
  checkpoint once per asv run (asv keys the cache on that single function, so
  all subclasses share it) on the local disk asv runs in;
* lazily built, per-process fixtures (`loaded_model`, `moe_layer`,
  `UnprocessedLayer`) in the spirit of numpy's benchmark `common.py`: asv
  re-runs `setup` before every sample, so the expensive part is built once per
  process and cached;
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


# --------------------------------------------------------------------------
# Per-process fixtures (asv runs each parameter set in its own process)
# --------------------------------------------------------------------------

_MODELS: dict = {}


def loaded_model(path: str, processing: str = "fixed") -> fr.FP8MoEModel:
    """A model freshly loaded from `path` on `DEVICE`, built once per process."""
    key = (path, processing)
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time: v2-lite slices are GiBs on the device
        _MODELS[key] = fr.load_model(path, device=DEVICE, processing=processing)
    return _MODELS[key]


def first_moe_layer(model: fr.FP8MoEModel) -> int:
    return model.config.moe_layers[0]


def layer_tensor_names(ckpt: Checkpoint, layer: int, experts=None) -> list[str]:
    """Checkpoint names of the routed experts (all, or `experts`) of `layer`."""
    prefix = f"model.layers.{layer}.mlp.experts."
    names = [n for n in ckpt.names if n.startswith(prefix)]
    if experts is not None:
        keep = {int(e) for e in experts}
        names = [n for n in names if int(n[len(prefix):].split(".", 1)[0]) in keep]
    return names


_LAYERS: dict = {}


def processed_moe_block(path: str):
    """(model, MoE block) with only the first MoE layer's router and experts loaded and
    post-processed (fixed mode), built once per process: forward benchmarks need one
    layer, not the whole model read from disk."""
    if path not in _LAYERS:
        _LAYERS.clear()
        ckpt = Checkpoint(path)
        model = fr.FP8MoEModel(ckpt.config, fr.MODES["fixed"], ckpt.kind, device=DEVICE)
        model.eval()
        layer_id = first_moe_layer(model)
        block = model.model.layers[layer_id].mlp
        names = layer_tensor_names(ckpt, layer_id) + [f"model.layers.{layer_id}.mlp.gate.weight"]
        with torch.no_grad():
            model.load_weights(ckpt.read(names))
            block.experts.quant_method.process_weights_after_loading(block.experts)
        sync()
        _LAYERS[path] = (model, block)
    return _LAYERS[path]


class RoutedBatch:
    """The first MoE layer of a checkpoint plus `tokens` routed tokens for it."""

    def __init__(self, path: str, tokens: int, seed: int = 0):
        model, block = processed_moe_block(path)
        self.model = model
        self.layer = block.experts
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, model.config.hidden_size, generator=g).to(torch.bfloat16)
        self.x = x.to(DEVICE)
        with torch.no_grad():
            self.topk_weights, self.topk_ids = block.gate(self.x)

    def forward(self, backend: str):
        with torch.no_grad():
            return kernels.run_moe(self.layer, self.x, self.topk_weights, self.topk_ids,
                                   backend=backend)

    def reference(self):
        """float32 reference of the same dequantized weights (no activation quantization)."""
        with torch.no_grad():
            return kernels.moe_forward_torch(self.layer, self.x, self.topk_weights,
                                             self.topk_ids, quantize_activations=False)


class UnprocessedLayer:
    """The first MoE layer of a `processing`-mode model, loaded but not post-processed.

    `scope` "all": every expert was just loaded (a fresh load); "one": the layer
    was loaded and processed, then expert 0 loaded again (a one-expert reload).
    `restore()` puts back the exact unprocessed state (Parameter objects and
    bytes; for "one" only what processing one expert writes, checked once to be
    exact), so every timed post-processing starts from the same place.

    Both modes start with the loaded values on `DEVICE`: upstream holds bf16
    checkpoints in bf16 Parameters there, and the fixed mode's staged bf16 pieces
    are moved there too, so neither side pays a host-to-device copy in the timing.
    """

    _cache: dict = {}

    @classmethod
    def get(cls, path: str, processing: str, scope: str) -> UnprocessedLayer:
        key = (path, processing, scope)
        if key not in cls._cache:
            cls._cache.clear()
            cls._cache[key] = cls(path, processing, scope)
        return cls._cache[key]

    def __init__(self, path: str, processing: str, scope: str):
        ckpt = Checkpoint(path)
        mode = fr.MODES[processing]
        # Only the one layer gets bytes; the rest of the model stays unallocated garbage.
        self.model = fr.FP8MoEModel(ckpt.config, mode, ckpt.kind, device=DEVICE)
        layer_id = first_moe_layer(self.model)
        self.layer = self.model.model.layers[layer_id].mlp.experts
        with torch.no_grad():
            self.model.load_weights(ckpt.read(layer_tensor_names(ckpt, layer_id)))
            if scope == "one":
                self.process()
                self.model.load_weights(ckpt.read(layer_tensor_names(ckpt, layer_id, [0])))
            elif scope != "all":
                raise ValueError(f"unknown scope {scope!r}")
        staged = getattr(self.layer, "staged", {})
        for slot, pieces in staged.items():  # like-for-like with upstream: on the device
            staged[slot] = {k: v.to(DEVICE) for k, v in pieces.items()}
        sync()
        self._save()
        # "one": `restore` puts back the reloaded slots of the two expert weights and the
        # small tensors, what processing one expert writes, as an EPLB reload leaves the
        # layer (only that expert's bytes just written); copying the whole layer back
        # before every sample left the caches cold for the timed call (H200: 34.4 against
        # 28.4 us, results/h200/kernels-probe/launch_probe-processing-wip1.txt, "[after]")
        self.slots = sorted(self.loaded) if scope == "one" else None
        self.process()  # warm-up (first-call costs, kernel loading), then back
        self.restore()
        if self.slots is not None:  # what was not put back is exactly what was saved
            for k, saved in self.bytes.items():
                if not torch.equal(_raw(self.params[k].data), _raw(saved)):
                    raise RuntimeError(f"processing one expert wrote {k} outside slots {self.slots}")

    def process(self) -> None:
        with torch.no_grad():
            self.layer.quant_method.process_weights_after_loading(self.layer)

    def _save(self) -> None:
        layer = self.layer
        self.params = dict(layer._parameters)
        self.bytes = {k: p.data.clone() for k, p in self.params.items() if p is not None}
        self.buffers = {k: b.clone() for k, b in layer._buffers.items() if b is not None}
        self.attrs = {k: getattr(layer, k) for k in ("w13_input_scale", "w2_input_scale")
                      if k not in self.params and hasattr(layer, k)}
        self.loaded = set(layer.loaded_experts)
        self.staged = {s: dict(v) for s, v in getattr(layer, "staged", {}).items()}
        self.version = layer.weights_version

    def restore(self) -> None:
        layer = self.layer
        for k in list(layer._parameters):
            if k not in self.params:
                del layer._parameters[k]
        for k, p in self.params.items():
            if k in layer.__dict__:
                del layer.__dict__[k]
            layer._parameters[k] = p
        with torch.no_grad():
            for k, saved in self.bytes.items():
                dst, src = _raw(self.params[k].data), _raw(saved)
                if self.slots is not None and k in ("w13_weight", "w2_weight"):
                    for s in self.slots:
                        dst[s].copy_(src[s])
                else:
                    dst.copy_(src)
            for k, saved in self.buffers.items():
                layer._buffers[k].copy_(saved)
        for k, v in self.attrs.items():
            setattr(layer, k, v)
        layer.loaded_experts = set(self.loaded)
        if hasattr(layer, "staged"):
            layer.staged = {s: dict(v) for s, v in self.staged.items()}
        layer.weights_version = self.version
        sync()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
