"""Importing triton the right way for this machine, and helpers every Triton kernel shares.

Without CUDA, Triton can only run in its interpreter: this module then sets
``TRITON_INTERPRET=1`` before importing triton, so the same kernels run on CPU
tensors in the tests. The interpreter's float -> FP8 conversion neither rounds
ties to even nor carries a mantissa overflow into the exponent (124.7 becomes
64), so under the interpreter the kernels round to the e4m3 grid in float32
arithmetic first (``EXACT``); on a GPU the hardware conversion (RTNE,
saturating) is used directly.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

from ...errors import BackendUnavailable

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (re-exported for the kernel modules)

try:  # Triton's cache key of a launch (a private function: without it, every launch goes through Triton)
    from triton.runtime.jit import compute_cache_key  # noqa: E402
except ImportError:
    compute_cache_key = None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRET = _interpreting()


def check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRET:
        raise BackendUnavailable("Triton kernels got CPU tensors but triton was imported without "
                           "TRITON_INTERPRET=1 (set it before anything imports triton)")


# A launch through `kernel[grid](...)` costs 15-20 us of host time on the H200 hosts; a
# decode-sized MoE forward is five of them, and the device waits for the first three.
# `launch` keeps Triton's own binder and cache key (what it specializes on cannot drift from
# what Triton compiled: a key Triton would compile anew misses, and that launch goes through
# Triton) and skips the rest: the knobs re-read per launch (read at a kernel's first launch
# on a device), the device and stream lookups through its driver, launch metadata for
# hooks nobody set. FP8_RELOAD_FAST_LAUNCH=0: every launch through Triton (for an A/B).
FAST_LAUNCH = os.environ.get("FP8_RELOAD_FAST_LAUNCH", "1") != "0" and compute_cache_key is not None
_BOUND: dict = {}  # (kernel, device) -> (its compiled kernels, its key cache, binder, options run() adds)


def launch_hooks_set() -> bool:
    """Whether a profiler set Triton's launch hooks (chains of them in Triton 3.5+, always
    truthy: their calls tell; a callable or None before)."""
    h = triton.knobs.runtime
    return bool(getattr(h.launch_enter_hook, "calls", h.launch_enter_hook)
                or getattr(h.launch_exit_hook, "calls", h.launch_exit_hook))


def launch(kernel, grid: tuple, *args, **opts) -> None:
    """``kernel[grid](*args, **opts)``, through what Triton compiled for these arguments."""
    global FAST_LAUNCH
    if INTERPRET or not FAST_LAUNCH:
        kernel[grid](*args, **opts)
        return
    dev = torch._C._cuda_getDevice()  # (Triton launches on the current device)
    bound = _BOUND.get((kernel, dev))
    if bound is not None and not kernel.pre_run_hooks and not launch_hooks_set():
        compiled_kernels, key_cache, binder, added = bound
        params, specialization, options = binder(*args, **{**added, **opts})
        compiled = compiled_kernels.get(compute_cache_key(key_cache, specialization, options))
        if compiled is not None and hasattr(compiled, "packed_metadata"):  # (not a compile under way)
            compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                         torch._C._cuda_getCurrentRawStream(dev), compiled.function, compiled.packed_metadata,
                         None, None, None, *params.values())
            return
    try:
        _BOUND[(kernel, dev)] = _launch_recording(kernel, grid, args, opts, dev)
    except (AttributeError, TypeError, ValueError) as exc:  # another Triton's private layout
        FAST_LAUNCH = False
        warnings.warn(f"Triton launches go through Triton from now on: {exc!r}", stacklevel=2)
        kernel[grid](*args, **opts)


def _launch_recording(kernel, grid, args, opts, dev) -> tuple:
    """Launch through Triton, noting what its `run` hands the binder besides `opts`."""
    caches = kernel.device_caches[dev]
    kernel_cache, key_cache, target, backend, binder = caches
    seen: dict = {}

    def recording(*a, **kw):
        seen.update(kw)
        return binder(*a, **kw)

    kernel.device_caches[dev] = (kernel_cache, key_cache, target, backend, recording)
    try:
        kernel[grid](*args, **opts)
    finally:
        kernel.device_caches[dev] = caches
    if not seen:  # (this Triton never called its binder as expected)
        raise ValueError("the binder was not called")
    return kernel_cache, key_cache, binder, {k: v for k, v in seen.items() if k not in opts}


# The interpreter pays per program, not per element: give it many rows at once.
INTERPRETER_ROWS = 64


# Host-side arithmetic for grids and tile sizes. Triton's `cdiv` and `next_power_of_2` are
# constexpr functions: called from Python, each unwraps its arguments (~2 us on the H200
# hosts, a dozen per forward).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def pow2(n: int, lo: int = 16, hi: int = 128) -> int:
    """`n` rounded up to a power of two, clamped to [lo, hi] (tile sizes)."""
    return max(lo, min(hi, next_pow2(max(int(n), 1))))


def launch_opts(cfg: dict) -> dict:
    """Compile options of a tile config; the interpreter takes none."""
    return {} if INTERPRET else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def owners(per) -> np.ndarray:
    """``[0] * per[0] + [1] * per[1] + ...`` (int64 numpy, from a host tensor or array):
    which row each program of a launch serves. Built in numpy: torch's CPU
    ``repeat_interleave`` runs on its thread pool whatever the size, and a pool woken while
    a reload's reader threads hold the cores cost each chunk of a bf16 first reload ~3 ms
    on the H200 host (x100 a reload, `results/h200/reload-engine/trace-57009e6.md`)."""
    per = np.asarray(per, dtype=np.int64)
    return np.repeat(np.arange(per.size, dtype=np.int64), per)


def device_ints(values, device) -> torch.Tensor:
    """Small host integers (a list, or an int64 tensor) as a device tensor without waiting
    for the device: the copy leaves from pinned memory, which torch keeps until it ran."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.pin_memory() if cuda else values
    else:  # straight into pinned memory: one host copy of the list, not two
        host = torch.tensor(list(values), dtype=torch.int64, pin_memory=cuda)
    return host.to(device, non_blocking=True) if cuda else host
