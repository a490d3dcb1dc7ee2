"""Registers the GPU MoE backends in `kernels.BACKENDS` when they can run here.

``triton``            fused per-tensor FP8 W8A8 MoE (`kernels_triton.fused_moe`)
``deep_gemm``         DeepGEMM grouped GEMMs, contiguous layout (`kernels_deepgemm`)
``deep_gemm_masked``  the same with DeepGEMM's masked layout

A backend that cannot run lands in `kernels.UNAVAILABLE` with the reason (no
CUDA, no triton, no deep_gemm, wrong architecture), which `run_moe` puts in its
`BackendUnavailable` message. Imported by `kernels.available_backends` /
`run_moe`; never raises.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch

from .kernels import BACKENDS, UNAVAILABLE, BackendUnavailable

GPU_BACKENDS = ("triton", "deep_gemm", "deep_gemm_masked")


def triton_unavailable() -> Optional[str]:
    """Why the Triton backend cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (on CPU the Triton kernels run only in Triton's interpreter, as the tests do)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"FP8 tensor-core dot needs sm89 or newer; this GPU is sm{major}{minor}"
    return None


def deep_gemm_unavailable() -> Optional[str]:
    """Why the DeepGEMM backends cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    why = triton_unavailable()
    if why is not None:
        return f"its activation quantization runs in Triton: {why}"
    from .kernels_deepgemm import deep_gemm_lib

    try:
        deep_gemm_lib()
    except BackendUnavailable as e:
        return str(e)
    return None


def _forwards() -> dict[str, tuple[Optional[str], Callable[[], Callable]]]:
    def triton_fn():
        from .kernels_triton import moe_forward_triton
        return moe_forward_triton

    def dg(layout):
        def make():
            from .kernels_deepgemm import backend
            return backend(layout)
        return make

    dgw = deep_gemm_unavailable()
    return {"triton": (triton_unavailable(), triton_fn), "deep_gemm": (dgw, dg("contiguous")),
            "deep_gemm_masked": (dgw, dg("masked"))}


def register() -> dict[str, Optional[str]]:
    """Fill `BACKENDS` / `UNAVAILABLE`; returns {name: reason or None}."""
    status = {}
    for name, (why, make) in _forwards().items():
        if why is None:
            try:
                BACKENDS[name] = make()
            except Exception as e:  # an import error inside the kernels module
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            BACKENDS.pop(name, None)
            UNAVAILABLE[name] = why
        else:
            UNAVAILABLE.pop(name, None)
        status[name] = why
    return status


STATUS = register()
