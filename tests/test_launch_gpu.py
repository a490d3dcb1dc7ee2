"""`kernels.triton.runtime.launch`: a launch through what Triton compiled for its arguments,
found by Triton's own binder and cache key (issue 14: a decode-sized forward is five
launches, and the device waits for the host's first three). A CUDA path: Triton compiles
only there (on CPU its interpreter runs every launch, and `launch` is `kernel[grid]`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")

triton = pytest.importorskip("triton")

from fp8_reload.kernels.triton import runtime  # noqa: E402
from fp8_reload.kernels.triton.runtime import tl  # noqa: E402


@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=ok, other=0.0) * scale + n, mask=ok)


def _cases():
    """Arguments Triton specializes differently: a pointer 16-byte aligned or not, an integer
    equal to 1, a multiple of 16, or neither."""
    base = torch.arange(200, dtype=torch.float32, device="cuda")
    for offset in (0, 1):  # 4 bytes past an allocation: not 16-byte aligned
        for n in (1, 32, 37):
            yield base[offset:offset + n], n


def test_launch_equals_a_launch_through_triton_and_skips_it_once_compiled(monkeypatch):
    if runtime.INTERPRET or not runtime.FAST_LAUNCH:
        pytest.skip("launches go through Triton here (interpreter, FP8_RELOAD_FAST_LAUNCH=0)")
    through = []
    real_run = _affine_kernel.run
    monkeypatch.setattr(_affine_kernel, "run", lambda *a, **k: through.append(1) or real_run(*a, **k))
    for rounds in range(3):
        through.clear()
        for x, n in _cases():
            want, got = torch.full_like(x, -1.0), torch.full_like(x, -1.0)
            _affine_kernel[(1,)](x, want, n, 0.5, BLOCK=64)
            runtime.launch(_affine_kernel, (1,), x, got, n, 0.5, BLOCK=64)
            torch.cuda.synchronize()
            assert torch.equal(got, want) and torch.equal(want, x * 0.5 + n)
        # the first round binds each specialization through Triton; later ones skip it (only
        # the reference launches go through `run`)
        assert len(through) == (12 if rounds == 0 else 6), (rounds, len(through))
    compiled = _affine_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(compiled) == 6  # aligned or not x (1, a multiple of 16, neither)


def test_a_profilers_launch_hook_sends_launches_through_triton(monkeypatch):
    if runtime.INTERPRET or not runtime.FAST_LAUNCH:
        pytest.skip("launches go through Triton here")
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    runtime.launch(_affine_kernel, (1,), x, y, 64, 2.0, BLOCK=64)
    seen = []
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(seen.append) if hasattr(hook, "add") else monkeypatch.setattr(
        triton.knobs.runtime, "launch_enter_hook", seen.append)
    try:
        runtime.launch(_affine_kernel, (1,), x, y, 64, 3.0, BLOCK=64)
    finally:
        if hasattr(hook, "remove"):
            hook.remove(seen.append)
    torch.cuda.synchronize()
    assert len(seen) == 1 and torch.equal(y, x * 3.0 + 64)
