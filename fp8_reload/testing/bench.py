"""Timing on a GPU: CUDA events, graph replay, profiler kernel time, interleaved comparisons.

`cuda_time_ms` brackets each call with CUDA events after an optional L2 flush
and takes the median (what a caller waits, launch overhead included);
`kernel_time_ms` sums the durations of the GPU kernels the profiler saw per
call (DeepGEMM's bench_kineto idea: no launch gaps, no host work). On CPU the
same calls fall back to `time.perf_counter`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device import synchronize


def flush_l2(buf: torch.Tensor | None) -> None:
    """Overwrite `buf` (sized above the L2) so the next call starts with a cold cache."""
    if buf is not None:
        buf.zero_()


def cuda_time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3,
                 flush_mb: int = 0, device="cuda", stat=statistics.median) -> float:
    """Median (`stat`) wall time of one call on the GPU stream, CUDA events around each call.

    With `flush_mb`, that many MiB are zeroed before each call (outside the
    events) so the call starts with a cold L2. On CPU: median perf_counter time.
    """
    if not str(device).startswith("cuda"):
        times = []
        for _ in range(warmup + iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return stat(times[warmup:])
    buf = torch.empty(flush_mb << 18, dtype=torch.float32, device="cuda") if flush_mb else None
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(iters):
        flush_l2(buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    synchronize()
    return stat([s.elapsed_time(e) for s, e in pairs])


def host_time_per_call(fn: Callable[[], object], n: int, warmup: int = 0, to_sync: bool = False) -> float:
    """Seconds per call of `fn` called `n` times back to back, the device synchronized before
    the calls and after them, not between: the host's cost of a call when the device never
    makes it wait. `to_sync`: the final synchronize counted too (the device's pace, when it
    is the slower)."""
    if n < 1:
        raise ValueError(f"host_time_per_call needs n >= 1 calls, got {n}")
    for _ in range(warmup):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    synchronize()
    return (time.perf_counter() - t0 if to_sync else host) / n


def capture_graph(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, output) with `fn` captured after a warm-up on a side stream; replay the graph
    to rerun `fn` with no CPU work (how engines run decode-sized MoE layers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 15, calls: int = 4,
                   device="cuda") -> dict[str, float]:
    """Median ms per call of each fn, measured in alternating batches of `calls` calls.

    For comparisons a few percent apart: alternating cancels clock and
    thermal drift that back-to-back medians would attribute to one side.
    """
    cuda = str(device).startswith("cuda")
    for fn in fns.values():
        fn()
    samples: dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                samples[name].append((start, end))
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        synchronize()
        return {k: statistics.median(s.elapsed_time(e) for s, e in v) / calls
                for k, v in samples.items()}
    return {k: statistics.median(v) / calls for k, v in samples.items()}


def kernel_time_ms(fn: Callable[[], object], iters: int = 10,
                   match: Callable[[str], bool] | None = None,
                   device="cuda") -> tuple[float, float]:
    """(GPU kernel time per call in ms, kernels per call) from the PyTorch profiler.

    Sums the device durations of the kernels (optionally only those whose name
    `match`es) launched during `iters` calls, after one untimed call. NaN on CPU.
    """
    if not str(device).startswith("cuda"):
        return float("nan"), float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        synchronize()
    total_us, count = 0.0, 0
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        if match is not None and not match(evt.name):
            continue
        total_us += evt.time_range.elapsed_us()
        count += 1
    return total_us / iters / 1e3, count / iters


# H200 SXM datasheet limits: HBM3e bandwidth and dense FP8 tensor-core throughput. The
# roofline of a kernel is the larger of its bytes and its FLOPs over a device's limits;
# `measure_device_limits` measures them on the GPU the kernel runs on instead.
H200_HBM_BYTES_PER_S = 4.8e12
H200_FP8_FLOP_PER_S = 1979e12


@dataclass(frozen=True)
class DeviceLimits:
    """The rates a roofline divides by, and where each came from."""

    hbm_bytes_per_s: float
    fp8_flop_per_s: float
    source: str

    def describe(self) -> str:
        return (f"HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s, FP8 "
                f"{self.fp8_flop_per_s / 1e12:.0f} TFLOPS ({self.source})")


H200_DATASHEET = DeviceLimits(H200_HBM_BYTES_PER_S, H200_FP8_FLOP_PER_S, "H200 SXM datasheet")


def measure_device_limits(device="cuda", copy_bytes: int = 1 << 30, gemm_size: int = 8192,
                          iters: int = 10) -> DeviceLimits:
    """HBM and FP8 rates of the CUDA `device`, best of `iters` each.

    HBM: one device-to-device copy of `copy_bytes` (each byte read once and written once).
    FP8: one e4m3 x e4m3 -> bf16 `torch._scaled_mm` of `gemm_size` cubed (cuBLAS), which
    is what a well-tuned dense FP8 GEMM reaches here. Where this GPU or torch has no FP8
    GEMM, the H200 datasheet's FP8 rate stands in and `source` says so; running out of
    memory is raised, not hidden. The allocator's cache is emptied before returning.
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        best = dict(iters=iters, warmup=1, device=device, stat=min)  # a limit: the best it did
        hbm = 2 * copy_bytes / (cuda_time_ms(lambda: dst.copy_(src), **best) * 1e-3)
        src = dst = None  # 2 GiB back before the GEMM's operands
        source = f"measured: {copy_bytes >> 20} MiB device copy"
        n = gemm_size
        try:
            a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            ms = cuda_time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16), **best)
            fp8 = 2.0 * n ** 3 / (ms * 1e-3)
            source += f", {n}^3 FP8 torch._scaled_mm"
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, AttributeError) as e:  # no FP8 GEMM on this GPU or torch
            fp8 = H200_FP8_FLOP_PER_S
            source += f"; FP8 rate from the H200 datasheet ({type(e).__name__}: {str(e)[:80]})"
        a = b = None
        torch.cuda.empty_cache()
    return DeviceLimits(hbm, fp8, source)


def roofline_ms(nbytes: float, flop: float, limits: DeviceLimits = H200_DATASHEET) -> float:
    """The least time a device with `limits` needs to move `nbytes` and compute `flop` (ms)."""
    return 1e3 * max(nbytes / limits.hbm_bytes_per_s, flop / limits.fp8_flop_per_s)


def tflops(flop: float, ms: float) -> float:
    """flop / time in TFLOP/s, rounded to 1 decimal (3 significant digits below 10)."""
    if not ms > 0:
        return float("nan")
    v = flop / (ms * 1e-3) / 1e12
    return round(v, 1) if v >= 10 else float(f"{v:.3g}")


