"""`kernels.triton.launch`: a compiled kernel launched again without Triton's per-call binding
gives what Triton's own launch gives, for every specialization Triton would make."""

from __future__ import annotations

import pytest
import torch

from .conftest import CUDA

triton_runtime = pytest.importorskip("fp8_reload.kernels.triton.runtime")
launch = pytest.importorskip("fp8_reload.kernels.triton.launch")
tl = triton_runtime.tl


def _axpb(x_ptr, y_ptr, n, b, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=ok) * scale + b, mask=ok)


@CUDA
def test_fast_launches_equal_tritons_own_for_each_specialization(monkeypatch):
    kernel = launch.Launcher(triton_runtime.triton.jit(_axpb))
    through_triton = []
    real = kernel.fn.run

    def counted(*a, **k):
        through_triton.append(1)
        return real(*a, **k)

    monkeypatch.setattr(kernel.fn, "run", counted)
    base = torch.arange(4096, dtype=torch.float32, device="cuda")
    cases = []
    for n in (1, 16, 1000, 4096):  # Triton specializes n == 1 and n % 16 == 0
        for off in (0, 1, 4):  # 16-byte aligned or not
            for b in (1, 2, 32):
                cases.append((n, off, b))
    counts = []
    for _ in range(2):  # the second round: every specialization seen, launched fast
        for n, off, b in cases:
            x = base[off:off + n]
            y = torch.full((n + 3,), -1.0, device="cuda")[3:] if off else torch.empty(n, device="cuda")
            kernel[(triton_runtime.cdiv(n, 256),)](x, y, n, b, 0.5, BLOCK=256)
            torch.testing.assert_close(y, x * 0.5 + b, rtol=0, atol=0)
        counts.append(len(through_triton))
    assert 0 < counts[0] <= len(cases)  # at most once per specialization
    assert counts[1] == counts[0]  # then never again
    assert all(v is not None for v in kernel.compiled.values())  # every one launchable fast


def test_the_interpreter_keeps_tritons_kernels():
    fn = launch.host_kernel(_axpb)
    if triton_runtime.INTERPRET:
        assert not isinstance(fn, launch.Launcher)
    else:
        assert isinstance(fn, launch.Launcher) == launch.FAST
