"""The measured cases of `fp8-reload bench-kernels` and the bench that builds and times them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...config import MoEConfig
from ...device import synchronize
from ...kernels import BACKENDS, MOE_LAYER_BOUND, moe_forward_torch, run_moe
from ...kernels.scales import build_block_scales
from ...testing.bench import (
    H200_DATASHEET,
    DeviceLimits,
    capture_graph,
    cuda_time_ms,
    kernel_time_ms,
    measure_device_limits,
    roofline_ms,
    tflops,
)
from ...testing.numeric import calc_diff
from ...testing.workloads import (
    gemm_operands,
    gemm_reference_diff,
    moe_bytes,
    moe_flop,
    routed_tokens,
    synthetic_moe_layer,
    v2_lite_moe,
)

FORWARD_TOKENS = (128, 1024, 4096)
FORWARD_BACKENDS = ("torch", "triton", "deep_gemm", "deep_gemm_masked")
GEMM_SHAPES = ((8, 4096, 4096, 7168), (8, 4096, 7168, 2048))  # groups, rows per group, N, K
SCALE_TARGET = 0.97
GEMM_TARGET_TFLOPS = 1300.0


@dataclass
class Case:
    """One measured configuration; `spec` is picklable so a worker process can rebuild it."""

    table: str
    spec: tuple
    label: dict = field(default_factory=dict)


def forward_cases(tokens=FORWARD_TOKENS, backends=FORWARD_BACKENDS,
                  preset: str = "v2-lite") -> list[Case]:
    return [Case("forward", ("forward", b, t, preset), {"tokens": t, "backend": b})
            for t in tokens for b in backends]


def scale_cases(tokens=FORWARD_TOKENS, preset: str = "v2-lite") -> list[Case]:
    return [Case("scales", ("scales", m, t, preset), {"tokens": t, "scales": m})
            for t in tokens for m in ("precomputed", "cached", "per-forward")]


def gemm_cases(shapes=GEMM_SHAPES) -> list[Case]:
    return [Case("gemm", ("gemm",) + s, {"groups": s[0], "m_per_group": s[1], "n": s[2], "k": s[3]})
            for s in shapes]


@dataclass
class Bench:
    """Where the cases run: the MoE shape, the device and the grouped-GEMM provider.

    The defaults are the H200 run (v2-lite, CUDA, the installed DeepGEMM); the
    tests run the same code on CPU with a small shape, Triton's interpreter and
    the emulated grouped GEMM.
    """

    cfg: MoEConfig = field(default_factory=v2_lite_moe)
    device: str = "cuda"
    gemm: object = None  # None: deep_gemm_lib()
    iters: int = 20
    limits: DeviceLimits | None = None  # None: measured on first use (CUDA), else the datasheet
    _layers: dict = field(default_factory=dict)

    def device_limits(self) -> DeviceLimits:
        """The roofline's rates: measured once on the GPU the cases run on."""
        if self.limits is None:
            on_cuda = str(self.device).startswith("cuda")
            self.limits = measure_device_limits(self.device) if on_cuda else H200_DATASHEET
        return self.limits

    def layer(self, kind: str = "fp8"):
        if kind not in self._layers:
            self._layers[kind] = synthetic_moe_layer(self.cfg, self.device, seed=0, kind=kind)
        return self._layers[kind]

    def forward_fn(self, backend: str) -> Callable:
        from ...kernels.deep_gemm import moe_forward_deepgemm

        if self.gemm is not None and backend.startswith("deep_gemm"):
            layout = "masked" if backend == "deep_gemm_masked" else "contiguous"
            return lambda *a: moe_forward_deepgemm(*a, layout=layout, gemm=self.gemm)
        if backend == "triton" and backend not in BACKENDS and self.device == "cpu":
            from ...kernels.triton import moe_forward_triton

            return moe_forward_triton  # Triton's interpreter
        return lambda *a: run_moe(*a, backend=backend)

    def build(self, spec) -> tuple[Callable[[], torch.Tensor], dict]:
        """(callable, facts) for a case spec."""
        if spec[0] == "gemm":
            return self._gemm(spec)
        from ...kernels.deep_gemm import moe_forward_deepgemm

        _, arg, tokens, _preset = spec
        layer = self.layer()
        x, w, ids = routed_tokens(self.cfg, tokens, self.device)
        facts = {"flop": moe_flop(self.cfg, tokens), "bytes": moe_bytes(self.cfg, ids),
                 "inputs": (layer, x, w, ids)}
        if spec[0] == "forward":
            fwd = self.forward_fn(arg)
            return (lambda: fwd(layer, x, w, ids)), facts
        pre = build_block_scales(layer) if arg == "precomputed" else None
        return (lambda: moe_forward_deepgemm(layer, x, w, ids, scale_mode=arg,
                                             precomputed_scales=pre, gemm=self.gemm)), facts

    def _gemm(self, spec):
        from ...kernels.deep_gemm import deep_gemm_lib

        _, groups, m_per, n, k = spec
        gemm = self.gemm or deep_gemm_lib()
        x, wt, a, b, d, m_indices = gemm_operands(groups, m_per, n, k, self.device)
        facts = {"flop": 2.0 * groups * m_per * n * k, "ref": (x, wt, d, m_per)}
        return (lambda: gemm.contiguous(a, b, d, m_indices)), facts

    def _graph_ms(self, backend: str, fn) -> object:
        if not str(self.device).startswith("cuda"):
            return "n/a"
        if backend == "torch":
            return "n/a (host syncs)"
        try:
            graph, _ = capture_graph(fn)
            return round(cuda_time_ms(graph.replay, self.iters, warmup=2), 4)
        except Exception as e:
            synchronize(self.device)
            return f"n/a ({type(e).__name__})"

    def measure(self, case: Case, log=print) -> dict:
        row = dict(case.label)
        try:
            t0 = time.perf_counter()
            fn, facts = self.build(case.spec)
            out = fn()
            synchronize(self.device)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            if case.table == "gemm":
                ms, launches = kernel_time_ms(fn, self.iters, device=self.device)
                row.update(kernel_ms=round(ms, 4), kernels=round(launches, 1),
                           tflops=tflops(facts["flop"], ms),
                           calc_diff=f"{gemm_reference_diff(*facts['ref']):.2e}")
                row["target"] = "ok" if row["tflops"] >= GEMM_TARGET_TFLOPS else "MISS"
            else:
                ms = cuda_time_ms(fn, self.iters, warmup=min(3, self.iters), device=self.device)
                kms, launches = kernel_time_ms(fn, max(3, self.iters // 4), device=self.device)
                row.update(ms=round(ms, 4), kernel_ms=round(kms, 4), kernels=round(launches, 1),
                           tflops=tflops(facts["flop"], ms))
                if case.table == "forward":
                    row["graph_ms"] = self._graph_ms(case.spec[1], fn)
                    best = min(v for v in (ms, row["graph_ms"]) if isinstance(v, float))
                    limit = roofline_ms(facts["bytes"], facts["flop"], self.device_limits())
                    row.update(gb_s=round(facts["bytes"] / best / 1e6, 1), roofline_ms=round(limit, 4),
                               of_roofline=f"{limit / best:.0%}")
                layer, x, w, ids = facts["inputs"]
                diff = calc_diff(out, moe_forward_torch(layer, x, w, ids, quantize_activations=False))
                row["calc_diff"] = f"{diff:.2e}"
                row["within_bound"] = "yes" if diff < MOE_LAYER_BOUND else "NO"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        log(f"[{case.table}] {case.label}: " + ", ".join(f"{k}={v}" for k, v in row.items()
                                                         if k not in case.label))
        return row
