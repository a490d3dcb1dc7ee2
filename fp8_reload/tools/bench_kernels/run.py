"""Running `fp8-reload bench-kernels`: compile in parallel first, then time every case."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ...config import MoEConfig
from ...kernels.registry import BACKEND_NAMES, deep_gemm_unavailable
from ...testing.bench import interleaved_ms, tflops
from ...testing.workloads import moe_flop
from ..usage import UsageError
from .cases import (
    FORWARD_BACKENDS,
    FORWARD_TOKENS,
    GEMM_SHAPES,
    SCALE_TARGET,
    Bench,
    Case,
    forward_cases,
    gemm_cases,
    scale_cases,
)
from .output import verdict, write_results


def _warm(spec) -> tuple[tuple, float, str | None]:
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


def prewarm(cases: list[Case], procs: int, log=print) -> list[tuple[tuple, float, str | None]]:
    """Compile every case's kernels in `procs` parallel processes (DeepGEMM's nvcc JIT
    and Triton both cache on disk, so the timed run starts warm)."""
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
    try:  # not `import triton`: on CPU kernels.triton must import it first (interpreter mode)
        env["triton"] = version("triton")
    except PackageNotFoundError:
        env["triton"] = "missing"
    why = deep_gemm_unavailable()
    if why is None:
        from ...kernels.deep_gemm import deep_gemm_lib

        env["deep_gemm"] = deep_gemm_lib().describe()
    else:
        env["deep_gemm"] = f"unavailable: {why}"
    return env


def all_cases(tokens=FORWARD_TOKENS, backends=FORWARD_BACKENDS, gemm: bool = True,
              gemm_shapes=GEMM_SHAPES) -> list[Case]:
    return (scale_cases(tokens) + (gemm_cases(gemm_shapes) if gemm else [])
            + forward_cases(tokens, backends))


def run(cases: list[Case], bench: Bench | None = None, jit_procs: int = 0, log=print) -> dict:
    """Measure `cases`: {"env": ..., "prewarm": ..., "scales": rows, "gemm": rows, "forward": rows}."""
    bench = bench or Bench()
    c = bench.cfg
    out = {"env": environment(), "prewarm": [],
           "shape": f"{c.name} shape: hidden {c.hidden_size}, {c.num_experts} experts, "
                    f"inter {c.moe_intermediate_size}, top-{c.top_k}"}
    log("[env] " + ", ".join(f"{k}={v}" for k, v in out["env"].items()))
    if any(c.table == "forward" for c in cases):
        out["limits"] = bench.device_limits().describe()
        log(f"[limits] {out['limits']}")
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


def main(out_dir, tokens=FORWARD_TOKENS, backends=FORWARD_BACKENDS, gemm=True, iters=20,
         jit_procs=0, jit_only=False, jit_extra=()) -> int:
    """`jit_extra`: ("preset", tokens) forwards to compile as well (e.g. the GPU tests' shapes)."""
    if not torch.cuda.is_available():
        raise UsageError("bench-kernels needs a CUDA GPU (none visible to torch)")
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


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"{option} {text}: expected comma-separated whole numbers") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{option} {text}: token counts must be at least 1")
    return values


def command(args) -> int:
    """`fp8-reload bench-kernels`; options are checked before anything is compiled."""
    tokens = _ints("--tokens", args.tokens)
    backends = tuple(b for b in args.backend.split(",") if b)
    unknown = [b for b in backends if b not in BACKEND_NAMES]
    if unknown or not backends:
        raise UsageError(f"--backend {args.backend}: unknown MoE backend "
                         f"{(unknown or [''])[0]!r}; choose from {', '.join(BACKEND_NAMES)}")
    extra = []
    for e in args.jit_extra:
        preset, _, t = e.partition(":")
        if preset not in MoEConfig.PRESETS:
            raise UsageError(f"--jit-extra {e}: unknown preset {preset!r}; choose from "
                             f"{', '.join(MoEConfig.PRESETS)}")
        extra.append((preset, _ints("--jit-extra", t)[0]))
    return main(args.out, tokens=tokens, backends=backends, gemm=not args.no_gemm,
                iters=args.iters, jit_procs=args.jit_procs, jit_only=args.jit_only,
                jit_extra=extra)
