"""Launching a compiled Triton kernel again without Triton's per-call Python.

`kernel[grid](...)` binds every argument, works out its specialization, hashes a cache key
and canonicalizes the grid in Python on every call: 10-30 us of host time on the H200
hosts, more than the device time of a reloaded expert's processing (one launch) or of a
decode-sized MoE forward's small kernels. `host_kernel` wraps a kernel launched from the
host: the first call of each specialization goes through Triton (which compiles and
launches it); later ones find the compiled kernel under a key worked out here and call
its launcher directly, with the arguments in the signature's order, as Triton does.

The key holds what Triton specializes on: the device; each tensor's dtype and whether its
address is 16-byte aligned; each integer's width class, divisibility by 16 and whether it
is 1; the type of anything else (its value for constexpr parameters); the keyword
arguments (constexprs and compile options). With a launch hook set (profilers), or when
the compiled kernel does not offer a launcher, every call goes through Triton; under the
interpreter the kernels are Triton's own.
"""

from __future__ import annotations

import inspect
import os

import torch

from .runtime import INTERPRET, triton

_I32 = (-(2**31), 2**31 - 1)
_SCALARS = (bool, int, float, str, type(None))


def _launch_hook():
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs.runtime, "launch_enter_hook", None) if knobs is not None else None


class Launcher:
    """A JIT kernel with a fast path for calls whose specialization was seen before."""

    def __init__(self, fn):
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.constexpr = [getattr(kp, "is_constexpr", False) for kp in fn.params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.compiled: dict = {}  # key -> compiled kernel, or None (always through Triton)

    def __getitem__(self, grid):
        return lambda *args, **kw: self._launch(grid, args, kw)

    def _key(self, device: int, args, kw) -> tuple | None:
        key = [device]
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or self.constexpr[i]:
                key.append(a)
            elif isinstance(a, int):
                key.append((a == 1, a % 16 == 0, _I32[0] <= a <= _I32[1]))
            else:
                key.append(type(a))
        if not all(isinstance(v, _SCALARS) for v in kw.values()):
            return None  # a tensor passed by name: no key (its address would be one), Triton's path
        key.append(tuple(sorted(kw.items())))
        return tuple(key)

    def _launch(self, grid, args, kw):
        if _launch_hook() is not None:
            return self.fn[grid](*args, **kw)
        device = torch.cuda.current_device()
        key = self._key(device, args, kw)
        if key is None:
            return self.fn[grid](*args, **kw)
        compiled = self.compiled.get(key, False)
        if compiled is False:  # first call of this specialization: Triton compiles and launches
            compiled = self.fn[grid](*args, **kw)
            usable = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            self.compiled[key] = compiled if usable else None
            return compiled
        if compiled is None:
            return self.fn[grid](*args, **kw)
        values = list(args)
        for name in self.names[len(args):]:  # the rest by name, in the signature's order
            values.append(kw[name] if name in kw else self.defaults[name])
        g = tuple(grid) + (1, 1)
        try:
            compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *values)
        except TypeError:  # a Triton whose launcher takes other arguments: refused before launching
            self.compiled[key] = None
            return self.fn[grid](*args, **kw)
        return compiled


# FP8_RELOAD_FAST_LAUNCH=0: every launch through Triton (an A/B of this module's gain)
FAST = os.environ.get("FP8_RELOAD_FAST_LAUNCH", "1") != "0"


def host_kernel(fn):
    """``@triton.jit`` for a kernel launched from the host (see the module docstring); the
    interpreter's kernels as they are."""
    kernel = triton.jit(fn)
    return Launcher(kernel) if FAST and not INTERPRET else kernel
