"""`fp8-reload bench-kernels`: the MoE forward kernels on a GPU, timed and checked.

Three tables, written as Markdown and CSV:

* **scales**: DeepGEMM MoE forward (contiguous) at the v2-lite shape fed block
  scales three ways: precomputed (what a block-quantized checkpoint stores, the
  upper bound), cached per weights version (this project: collapse ``[E, 2]``
  once, expand once) and expanded by ``repeat_interleave`` on every forward
  (sglang 0.5.23). Target: cached >= 97% of precomputed throughput.
* **gemm**: DeepGEMM's grouped contiguous FP8 GEMM at DeepSeek shapes, 8 groups
  x 4096 rows, per-tensor weight scales expanded to blocks, per-token-group
  activations; GPU kernel time and TFLOPS. Target: >= 1300 TFLOPS.
* **forward**: the whole MoE layer at the v2-lite shape (hidden 2048, 64
  experts, intermediate 1408, top-6) for each backend: wall time per forward
  (CUDA events), GPU kernel time (profiler), TFLOPS and calc_diff against the
  float32 reference.

Timing: `cuda_time_ms` brackets each call with CUDA events after an optional
L2 flush and takes the median (what a caller waits, launch overhead
included); `kernel_time_ms` sums the durations of the GPU kernels the profiler
saw per call (DeepGEMM's bench_kineto idea: no launch gaps, no host work).
Working sets here (>= 235 MB of weights) are far above the H200's 50 MB L2.

DeepGEMM and Triton compile kernels on first use; `prewarm` runs every case
once in parallel worker processes first so the JIT caches are warm and the
timed run measures kernels, not compilers.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import MoEConfig
from .kernels import GEMM_BOUND, MOE_LAYER_BOUND, moe_forward_torch
from .quant import FP8_DTYPE, FP8_MAX, calc_diff

FORWARD_TOKENS = (128, 1024, 4096)
FORWARD_BACKENDS = ("torch", "triton", "deep_gemm", "deep_gemm_masked")
GEMM_SHAPES = ((8, 4096, 4096, 7168), (8, 4096, 7168, 2048))  # groups, rows per group, N, K
SCALE_TARGET = 0.97
GEMM_TARGET_TFLOPS = 1300.0


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

def _flush(buf: Optional[torch.Tensor]) -> None:
    if buf is not None:
        buf.zero_()


def cuda_time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3,
                 flush_mb: int = 0, device="cuda") -> float:
    """Median wall time of one call on the GPU stream, CUDA events around each call.

    With `flush_mb`, that many MiB are zeroed before each call (outside the
    events) so the call starts with a cold L2. On CPU: median perf_counter time.
    """
    if not str(device).startswith("cuda"):
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[warmup:])
    buf = torch.empty(flush_mb << 18, dtype=torch.float32, device="cuda") if flush_mb else None
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(iters):
        _flush(buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


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
        torch.cuda.synchronize()
        return {k: statistics.median(s.elapsed_time(e) for s, e in v) / calls
                for k, v in samples.items()}
    return {k: statistics.median(v) / calls for k, v in samples.items()}


def kernel_time_ms(fn: Callable[[], object], iters: int = 10,
                   match: Optional[Callable[[str], bool]] = None,
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
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us, count = 0.0, 0
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        if match is not None and not match(evt.name):
            continue
        total_us += evt.time_range.elapsed_us()
        count += 1
    return total_us / iters / 1e3, count / iters


def tflops(flop: float, ms: float) -> float:
    """flop / time in TFLOP/s, rounded to 1 decimal (3 significant digits below 10)."""
    if not ms > 0:
        return float("nan")
    v = flop / (ms * 1e-3) / 1e12
    return round(v, 1) if v >= 10 else float(f"{v:.3g}")


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------

def v2_lite_moe() -> MoEConfig:
    return MoEConfig.preset("v2-lite", num_layers=2)


def moe_flop(cfg: MoEConfig, tokens: int) -> float:
    """Routed FLOPs of one MoE layer (2 per multiply-add; padding rows not counted)."""
    pairs = tokens * cfg.top_k
    return 2.0 * pairs * (2 * cfg.moe_intermediate_size * cfg.hidden_size
                          + cfg.hidden_size * cfg.moe_intermediate_size)


def synthetic_moe_layer(cfg: MoEConfig, device="cuda", seed: int = 0, kind: str = "fp8"):
    """A FusedMoE built the way a checkpoint load builds it, with the fixed processing.

    Weights follow the checkpoint writer's statistics (per-expert gains that make
    gate and up scales differ, static input scales with headroom) but are drawn
    on the device, so a v2-lite layer takes milliseconds instead of a checkpoint.
    """
    from .checkpoint import Projection, _gain, _input_amax
    from .layers import FusedMoE
    from .processing import MODES

    fp8 = kind == "fp8"
    layer = FusedMoE(cfg, cfg.first_dense_layers, MODES["fixed"].moe_method(fp8), device=device)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for ex in range(e):
            base = f"model.layers.{cfg.first_dense_layers}.mlp.experts.{ex}"
            parts = {}
            for proj, role, rows, cols in (("gate_proj", "expert_gate", i, h),
                                           ("up_proj", "expert_up", i, h),
                                           ("down_proj", "expert_down", h, i)):
                std = _gain(seed, f"{base}.{proj}", role) / math.sqrt(cols)
                w = torch.randn(rows, cols, generator=g, device=device) * std
                s = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
                parts[proj] = (w, s, Projection(f"{base}.{proj}", rows, cols, role))
            if fp8:
                for proj, sl in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
                    w, s, p = parts[proj]
                    layer.w13_weight.data[ex, sl] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                    layer.w13_weight_scale.data[ex, 0 if proj == "gate_proj" else 1] = s
                    layer.w13_input_scale.data[ex] = _input_amax(seed, p) / FP8_MAX
                w, s, p = parts["down_proj"]
                layer.w2_weight.data[ex] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                layer.w2_weight_scale.data[ex] = s
                layer.w2_input_scale.data[ex] = _input_amax(seed, p) / FP8_MAX
            else:
                layer.staged[ex] = {"w1": parts["gate_proj"][0], "w3": parts["up_proj"][0],
                                    "w2": parts["down_proj"][0]}
            layer.loaded_experts.add(ex)
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def routed_tokens(cfg: MoEConfig, tokens: int, device="cuda", seed: int = 0):
    """RMS-scale tokens and a softmax top-k routing over random router logits."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, cfg.hidden_size, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(tokens, cfg.num_experts, generator=g, device=device) * 2.0
    w, ids = logits.softmax(-1).topk(cfg.top_k, dim=-1)
    return x, w, ids


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

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
    _layers: dict = field(default_factory=dict)

    def layer(self, kind: str = "fp8"):
        if kind not in self._layers:
            self._layers[kind] = synthetic_moe_layer(self.cfg, self.device, seed=0, kind=kind)
        return self._layers[kind]

    def forward_fn(self, backend: str) -> Callable:
        from .kernels import BACKENDS, run_moe
        from .kernels_deepgemm import moe_forward_deepgemm

        if self.gemm is not None and backend.startswith("deep_gemm"):
            layout = "masked" if backend == "deep_gemm_masked" else "contiguous"
            return lambda *a: moe_forward_deepgemm(*a, layout=layout, gemm=self.gemm)
        if backend == "triton" and backend not in BACKENDS and self.device == "cpu":
            from .kernels_triton import moe_forward_triton
            return moe_forward_triton  # Triton's interpreter
        return lambda *a: run_moe(*a, backend=backend)

    def build(self, spec) -> tuple[Callable[[], torch.Tensor], dict]:
        """(callable, facts) for a case spec."""
        if spec[0] == "gemm":
            return self._gemm(spec)
        from .kernels_deepgemm import _build_block_scales, moe_forward_deepgemm

        _, arg, tokens, _preset = spec
        layer = self.layer()
        x, w, ids = routed_tokens(self.cfg, tokens, self.device)
        facts = {"flop": moe_flop(self.cfg, tokens), "inputs": (layer, x, w, ids)}
        if spec[0] == "forward":
            fwd = self.forward_fn(arg)
            return (lambda: fwd(layer, x, w, ids)), facts
        pre = _build_block_scales(layer) if arg == "precomputed" else None
        return (lambda: moe_forward_deepgemm(layer, x, w, ids, scale_mode=arg,
                                             precomputed_scales=pre, gemm=self.gemm)), facts

    def _gemm(self, spec):
        from .kernels_deepgemm import deep_gemm_lib

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
            torch.cuda.synchronize()
            return f"n/a ({type(e).__name__})"

    def measure(self, case: Case, log=print) -> dict:
        row = dict(case.label)
        try:
            t0 = time.perf_counter()
            fn, facts = self.build(case.spec)
            out = fn()
            _sync(self.device)
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
                layer, x, w, ids = facts["inputs"]
                diff = calc_diff(out, moe_forward_torch(layer, x, w, ids, quantize_activations=False))
                row["calc_diff"] = f"{diff:.2e}"
                row["within_bound"] = "yes" if diff < MOE_LAYER_BOUND else "NO"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        log(f"[{case.table}] {case.label}: " + ", ".join(f"{k}={v}" for k, v in row.items()
                                                         if k not in case.label))
        return row


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def gemm_operands(groups: int, m_per: int, n: int, k: int, device="cuda", seed: int = 0):
    """Grouped contiguous operands: per-token-group activations, per-tensor weights as blocks.

    Returns (x bf16, w bf16, (a, sfa), (b, sfb), d, m_indices); x and w are the
    unquantized values the accuracy is measured against.
    """
    from .kernels_deepgemm import expand_block_scales
    from .kernels_triton import group_quant

    g = torch.Generator(device=device).manual_seed(seed)
    m = groups * m_per
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    wt = (torch.randn(groups, n, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)
    scale = (wt.float().abs().amax(dim=(1, 2)) / FP8_MAX).clamp(min=1e-12)
    b = (wt.float() / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    a, sfa = group_quant(x)
    m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m_per)
    d = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    return x, wt, (a, sfa), (b, expand_block_scales(scale, n, k)), d, m_indices


def gemm_reference_diff(x, wt, d, m_per) -> float:
    """calc_diff of the grouped GEMM output against float64 products of the unquantized operands."""
    num, den = 0.0, 0.0
    for gi in range(wt.shape[0]):
        rows = slice(gi * m_per, (gi + 1) * m_per)
        ref = x[rows].double() @ wt[gi].double().t()
        y = d[rows].double()
        num += float((y * ref).sum())
        den += float((y * y + ref * ref).sum())
    return 1 - 2 * num / den


def _warm(spec) -> tuple[tuple, float, Optional[str]]:
    """Worker: run one case once (compiles its kernels into the on-disk JIT caches)."""
    t0 = time.perf_counter()
    try:
        bench = Bench() if spec[0] == "gemm" else Bench(cfg=MoEConfig.preset(spec[3], num_layers=2))
        fn, _ = bench.build(spec)
        fn()
        torch.cuda.synchronize()
    except Exception as e:
        return spec, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return spec, time.perf_counter() - t0, None


def prewarm(cases: list[Case], procs: int, log=print) -> list[tuple[tuple, float, Optional[str]]]:
    """Compile every case's kernels in `procs` parallel processes (DeepGEMM's nvcc JIT
    and Triton both cache on disk, so the timed run starts warm)."""
    import multiprocessing as mp

    specs = list(dict.fromkeys(c.spec for c in cases))
    # nothing to compile for torch; the scales cases share the deep_gemm forward's kernels
    specs = [s for s in specs if s[:2] != ("forward", "torch")
             and (s[0] != "scales" or ("forward", "deep_gemm") + s[2:] not in specs)]
    t0 = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=max(1, min(procs, len(specs))),
                             mp_context=mp.get_context("spawn")) as pool:
        for spec, secs, err in pool.map(_warm, specs):
            log(f"[prewarm] {spec}: {secs:.1f}s" + (f"  ERROR {err}" if err else ""))
            results.append((spec, secs, err))
    log(f"[prewarm] {len(specs)} cases in {time.perf_counter() - t0:.1f}s with {procs} processes")
    return results


def _scale_ratios(rows: list[dict]) -> None:
    by = {(r["tokens"], r["scales"]): r for r in rows}
    for r in rows:
        pre = by.get((r["tokens"], "precomputed"), {}).get("ms")
        if pre and r.get("ms"):
            r["vs_precomputed"] = f"{pre / r['ms']:.1%}"
            if r["scales"] == "cached":
                r["target"] = "ok" if pre / r["ms"] >= SCALE_TARGET else "MISS"


def environment() -> dict:
    env = {"python": sys.version.split()[0], "torch": torch.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count,
                   capability=f"sm{p.major}{p.minor}", cuda=torch.version.cuda)
    from importlib.metadata import PackageNotFoundError, version

    try:  # not `import triton`: on CPU kernels_triton must import it first (interpreter mode)
        env["triton"] = version("triton")
    except PackageNotFoundError:
        env["triton"] = "missing"
    from .kernels_gpu import deep_gemm_unavailable

    why = deep_gemm_unavailable()
    if why is None:
        from .kernels_deepgemm import deep_gemm_lib
        env["deep_gemm"] = deep_gemm_lib().describe()
    else:
        env["deep_gemm"] = f"unavailable: {why}"
    return env


def all_cases(tokens=FORWARD_TOKENS, backends=FORWARD_BACKENDS, gemm: bool = True,
              gemm_shapes=GEMM_SHAPES) -> list[Case]:
    return (scale_cases(tokens) + (gemm_cases(gemm_shapes) if gemm else [])
            + forward_cases(tokens, backends))


def run(cases: list[Case], bench: Optional[Bench] = None, jit_procs: int = 0, log=print) -> dict:
    """Measure `cases`: {"env": ..., "prewarm": ..., "scales": rows, "gemm": rows, "forward": rows}."""
    bench = bench or Bench()
    c = bench.cfg
    out = {"env": environment(), "prewarm": [],
           "shape": f"{c.name} shape: hidden {c.hidden_size}, {c.num_experts} experts, "
                    f"inter {c.moe_intermediate_size}, top-{c.top_k}"}
    log("[env] " + ", ".join(f"{k}={v}" for k, v in out["env"].items()))
    if jit_procs:
        out["prewarm"] = prewarm(cases, jit_procs, log)
    for table in ("scales", "gemm", "forward"):
        out[table] = [bench.measure(c, log) for c in cases if c.table == table]
    _interleave_scales(out["scales"], [c for c in cases if c.table == "scales"], bench, log)
    _scale_ratios(out["scales"])
    return out


def _interleave_scales(rows: list[dict], cases: list[Case], bench: Bench, log=print) -> None:
    """Re-time the scale modes of each token count against each other, interleaved."""
    by_tokens: dict[int, list[tuple[dict, Case]]] = {}
    for row, case in zip(rows, cases):
        if "error" not in row:
            by_tokens.setdefault(case.spec[2], []).append((row, case))
    for tokens, group in by_tokens.items():
        fns = {row["scales"]: bench.build(case.spec)[0] for row, case in group}
        rounds = max(3, bench.iters)
        ms = interleaved_ms(fns, rounds=rounds, calls=1 if bench.iters < 3 else 4,
                            device=bench.device)
        for row, _ in group:
            row["ms"] = round(ms[row["scales"]], 4)
            row["tflops"] = tflops(moe_flop(bench.cfg, tokens), ms[row["scales"]])
        log(f"[scales] tokens={tokens} interleaved: " + ", ".join(f"{k} {v:.4f} ms" for k, v in ms.items()))


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

TITLES = {
    "scales": "DeepGEMM MoE forward (contiguous, {shape}): where the block scales come from",
    "gemm": "DeepGEMM grouped contiguous FP8 GEMM, per-tensor weight scales as 128x128 blocks",
    "forward": "Whole MoE layer forward, {shape}",
}
NOTES = {
    "scales": (f"`ms`: median CUDA-event time per forward, the three modes timed in alternating "
               "batches. `vs_precomputed`: throughput relative to "
               f"precomputed block scales; target for `cached` >= {SCALE_TARGET:.0%}. `per-forward` "
               "is sglang 0.5.23's repeat_interleave expansion on every call."),
    "gemm": (f"`kernel_ms`: GPU time of the GEMM kernel (profiler). `calc_diff` against the float64 "
             f"product of the unquantized bf16 operands (bound {GEMM_BOUND:g}). Target "
             f">= {GEMM_TARGET_TFLOPS:g} TFLOPS."),
    "forward": ("`ms`: median CUDA-event time per eager forward (launch overhead included); "
                "`kernel_ms`: sum of GPU kernel times per forward; `kernels`: launches per forward; "
                "`graph_ms`: one replay of the forward captured in a CUDA graph. TFLOPS (from `ms`) count "
                "routed rows only (6 x tokens x top_k x hidden x inter). `calc_diff` against the "
                f"float32 reference of the same FP8 weights (bound {MOE_LAYER_BOUND:g})."),
}


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir) -> list[Path]:
    """kernels.md (all tables) and kernels_<table>.csv in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    md = ["# MoE forward kernels", "",
          "Environment: " + ", ".join(f"{k} `{v}`" for k, v in result["env"].items()), ""]
    if result.get("prewarm"):
        total = sum(s for _, s, _ in result["prewarm"])
        md += [f"JIT prewarm: {len(result['prewarm'])} cases, {total:.0f} s of compile work in "
               "parallel processes before timing.", ""]
    for table in ("scales", "gemm", "forward"):
        rows = result.get(table) or []
        if not rows:
            continue
        title = TITLES[table].format(shape=result.get("shape", ""))
        md += [f"## {title}", "", NOTES[table], "", markdown_table(rows)]
        path = out / f"kernels_{table}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=_columns(rows))
            writer.writeheader()
            writer.writerows(rows)
        written.append(path)
    path = out / "kernels.md"
    path.write_text("\n".join(md))
    written.insert(0, path)
    return written


def verdict(result: dict) -> tuple[bool, list[str]]:
    """Targets and accuracy bounds, one line each."""
    lines, ok = [], True
    for table, key in (("scales", "target"), ("gemm", "target"), ("forward", "within_bound")):
        for r in result.get(table) or []:
            if "error" in r:
                ok = False
                lines.append(f"ERROR {table} {r}")
            elif r.get(key) in ("MISS", "NO"):
                ok = False
                lines.append(f"MISS  {table} {r}")
    return ok, lines


def main(out_dir, tokens=FORWARD_TOKENS, backends=FORWARD_BACKENDS, gemm=True, iters=20,
         jit_procs=0, jit_only=False, jit_extra=()) -> int:
    """`jit_extra`: ("preset", tokens) forwards to compile as well (e.g. the GPU tests' shapes)."""
    if not torch.cuda.is_available():
        print("bench-kernels needs a CUDA GPU (none visible to torch)", file=sys.stderr)
        return 2
    cases = all_cases(tokens, backends, gemm)
    if jit_only:
        extra = [c for preset, t in jit_extra
                 for c in forward_cases((t,), ("triton", "deep_gemm", "deep_gemm_masked"), preset)]
        errors = [r for r in prewarm(cases + extra, max(1, jit_procs or os.cpu_count() or 1))
                  if r[2]]
        return 1 if errors else 0
    result = run(cases, Bench(iters=iters), jit_procs)
    for path in write_results(result, out_dir):
        print(f"wrote {path}")
    print()
    print(Path(out_dir, "kernels.md").read_text())
    ok, lines = verdict(result)
    print("\n".join(lines) if lines else "all targets met, all backends within the accuracy bound")
    return 0 if ok else 1
