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

import numpy as np
import torch

from ...errors import BackendUnavailable

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (re-exported for the kernel modules)


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
