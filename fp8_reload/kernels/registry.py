"""The MoE forward backends: which exist, which can run here and why not, and `run_moe`.

    torch             the reference (`reference.moe_forward_torch`), CPU and GPU
    triton            fused per-tensor FP8 W8A8 MoE (`triton`)
    deep_gemm         DeepGEMM grouped GEMMs, contiguous layout (`deep_gemm`)
    deep_gemm_masked  the same with DeepGEMM's masked layout

Each backend is imported lazily, in its own branch of `_load`, only once the
cheap checks of `unavailable_reason` passed; no backend imports this module. A
backend that cannot run lands in `UNAVAILABLE` with the reason (no CUDA, no
triton, no deep_gemm, wrong architecture), which `run_moe` puts in its
`BackendUnavailable` message.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from .. import trace
from ..device import current_cuda
from ..errors import BackendUnavailable

DEFAULT_BACKEND = "torch"
BACKEND_NAMES = ("torch", "triton", "deep_gemm", "deep_gemm_masked")
GPU_BACKENDS = BACKEND_NAMES[1:]

# Forwards loaded so far, by name (tests may register their own).
BACKENDS: dict[str, Callable] = {}
# Backends known but unusable here -> why.
UNAVAILABLE: dict[str, str] = {}


def triton_unavailable() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (on CPU the Triton kernels run only in Triton's interpreter, as the tests do)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"FP8 tensor-core dot needs sm89 or newer; this GPU is sm{major}{minor}"
    return None


def deep_gemm_unavailable() -> str | None:
    """Why the DeepGEMM backends cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    why = triton_unavailable()
    if why is not None:
        return f"its activation quantization runs in Triton: {why}"
    from .deep_gemm import deep_gemm_lib

    try:
        deep_gemm_lib()
    except BackendUnavailable as e:
        return str(e)
    return None


def unavailable_reason(name: str) -> str | None:
    if name == "torch":
        return None
    if name == "triton":
        return triton_unavailable()
    if name in ("deep_gemm", "deep_gemm_masked"):
        return deep_gemm_unavailable()
    return f"unknown backend (known: {', '.join(BACKEND_NAMES)})"


def _load(name: str) -> Callable:
    if name == "torch":
        from .reference import moe_forward_torch

        return moe_forward_torch
    if name == "triton":
        from .triton import moe_forward_triton

        return moe_forward_triton
    if name in ("deep_gemm", "deep_gemm_masked"):
        from .deep_gemm import backend

        return backend("masked" if name == "deep_gemm_masked" else "contiguous")
    raise KeyError(name)


def _register(name: str) -> str | None:
    """Load `name` into `BACKENDS` if it can run here; returns why not, or None."""
    if name in BACKENDS:
        return None
    why = unavailable_reason(name)
    if why is None:
        try:
            BACKENDS[name] = _load(name)
        except Exception as e:  # an import error inside the kernels module
            why = f"{type(e).__name__}: {e}"
    if why is None:
        UNAVAILABLE.pop(name, None)
    else:
        UNAVAILABLE[name] = why
    return why


def backend_status() -> dict[str, str | None]:
    """{backend: None if it runs here, else why not}, for every known backend."""
    return {name: _register(name) for name in BACKEND_NAMES}


def available_backends() -> list[str]:
    backend_status()
    return list(BACKENDS)


def get_backend(name: str | None = None) -> Callable:
    """The forward of backend `name` (default: the torch reference), or `BackendUnavailable`."""
    name = name or DEFAULT_BACKEND
    if name not in BACKENDS and name in BACKEND_NAMES:
        _register(name)
    fn = BACKENDS.get(name)
    if fn is None:
        why = f": {UNAVAILABLE[name]}" if name in UNAVAILABLE else ""
        raise BackendUnavailable(f"MoE backend {name!r} is not available here{why} "
                                 f"(available: {', '.join(available_backends())})")
    return fn


def run_moe(layer, x, topk_weights, topk_ids, backend: str | None = None):
    """The routed experts of `layer` for `x` through `backend`."""
    fn = get_backend(backend)
    with trace.range("fp8_reload/moe", payload=x.shape[0]), current_cuda(x):
        return fn(layer, x, topk_weights, topk_ids)
