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

import torch

from ...errors import BackendUnavailable

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (re-exported for the kernel modules)
from triton import knobs  # noqa: E402


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


def _hooked(hook) -> bool:
    """Whether a launch hook is set (None, or a chain of none, when not: Triton 3.6 / 3.9)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """A Triton kernel launched through its compiled form once a call with the same `key` has
    compiled it.

    Triton binds and specializes every argument on each launch: ~10 us of host time on the
    H200 hosts (`gpu/launch_probe.py`: 15.1 us per launch of an empty kernel, 5.4 us through
    its compiled form), while one reloaded expert is a few us of device work. A call's `key`
    must determine everything Triton specializes on besides the integer arguments (the
    constexpr values, the compile options, the dtypes of the tensors and whether their
    addresses are 16-byte aligned); integer arguments must be ``do_not_specialize``, checked
    on each key's first launch. That launch, and every launch under the interpreter or a
    launch hook (a profiler), goes through Triton.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}

    def __call__(self, grid: tuple, key, *args, **options):
        if INTERPRET:
            return self.kernel[grid](*args)
        device = torch.cuda.current_device()
        compiled = self.compiled.get((device, key))
        hooks = knobs.runtime
        if compiled is None or _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            return self._through_triton(grid, key, device, args, options)
        g = (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args)

    def _through_triton(self, grid, key, device, args, options):
        for p, v in zip(self.kernel.params, args):
            if not p.is_constexpr and isinstance(v, int) and not p.do_not_specialize:
                raise TypeError(f"{self.kernel.fn.__name__}: integer argument {p.name} must be "
                                "do_not_specialize to launch through `Launcher`")
        compiled = self.kernel[grid](*args, **options)
        if len(self.compiled) > 256:  # keys hold addresses' facts, not addresses: few per kernel
            self.compiled.clear()
        self.compiled[(device, key)] = compiled


def device_ints(values, device) -> torch.Tensor:
    """Small host integers (a list, or an int64 tensor) as a device tensor without waiting
    for the device: the copy leaves from pinned memory, which torch keeps until it ran."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.pin_memory() if cuda else values
    else:  # straight into pinned memory: one host copy of the list, not two
        host = torch.tensor(list(values), dtype=torch.int64, pin_memory=cuda)
    return host.to(device, non_blocking=True) if cuda else host
