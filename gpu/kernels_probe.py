"""Where the post-processing and the decode-sized MoE forward stand on this GPU (a probe).

    python3 gpu/kernels_probe.py [--sweep] [--out DIR]

1. Post-processing of one v2-lite MoE layer (64 experts), both checkpoint kinds: sglang's
   per-expert loop (upstream) vs the fixed mode, all experts and one expert, through the
   asv benchmark's own fixture (`benchmarks.fixtures.UnprocessedLayer`: both sides start from
   the same unprocessed state on the device), CUDA events around `process()` only.
2. The Triton MoE forward at 128 / 1024 / 4096 tokens: eager (CUDA events), host time per
   call, CUDA-graph replay, and the roofline (bytes and FLOPs over this GPU's HBM copy
   and FP8 GEMM rates, measured first in the same process).
3. Host time of one launch, Triton against torch (what bounds one-expert processing).
4. With --sweep: tile configurations of the up and down GEMMs at 128 and 4096 tokens,
   timed by graph replay, best first.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # (kept where an importer put it)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_reload as fr  # noqa: E402
from fp8_reload.kernels.scales import cached_kernel_scales  # noqa: E402
from fp8_reload.kernels.triton import default_config, fused_moe  # noqa: E402
from fp8_reload.testing import (  # noqa: E402
    capture_graph,
    cuda_time_ms,
    host_time_per_call,
    measure_device_limits,
    moe_bytes,
    moe_flop,
    roofline_ms,
    routed_tokens,
    synthetic_moe_layer,
)


def event_ms(fn, before=None, n=20) -> float:
    times = []
    for _ in range(n):
        if before:
            before()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def processing(root: Path, rows: list) -> None:
    os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"
    from benchmarks.fixtures import UnprocessedLayer

    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    for kind in ("fp8", "bf16"):
        t0 = time.perf_counter()
        path = fr.write_checkpoint(root / kind, cfg, kind=kind, progress=False, fill="fast")
        print(f"[probe] wrote v2-lite:2 {kind} in {time.perf_counter() - t0:.1f}s", flush=True)
        for impl, processing_mode, scope in (("upstream", "upstream", "all"), ("fixed", "fixed", "all"),
                                             ("fixed-1-expert", "fixed", "one")):
            state = UnprocessedLayer.get(str(path), processing_mode, scope)
            ms = event_ms(state.process, before=state.restore)
            rows.append({"what": "process", "kind": kind, "impl": impl, "ms": round(ms, 4)})
            print(f"[probe] process {kind} {impl}: {ms:.4f} ms", flush=True)
        UnprocessedLayer._cache.clear()
        torch.cuda.empty_cache()


def launch_overhead(rows: list) -> None:
    """Host time of one launch: an empty Triton kernel (its Python launcher) against a
    tiny torch op, 2000 launches each, the device never the bottleneck."""
    from fp8_reload.kernels.triton.runtime import tl, triton

    @triton.jit
    def _nop(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(1024, device="cuda")
    for name, fn in (("triton", lambda: _nop[(1,)](x, 1024, BLOCK=1024)), ("torch", lambda: x.add_(0))):
        us = host_time_per_call(fn, 2000, warmup=50) * 1e6
        rows.append({"what": "launch", "impl": name, "host_us_per_launch": round(us, 2)})
        print(f"[probe] launch {name}: {us:.2f} us host per launch", flush=True)


def forward(rows: list) -> None:
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    layer = synthetic_moe_layer(cfg, "cuda")
    limits = measure_device_limits()
    rows.append({"what": "limits", "describe": limits.describe()})
    print(f"[probe] roofline limits: {limits.describe()}", flush=True)
    for tokens in (128, 1024, 4096):
        x, w, ids = routed_tokens(cfg, tokens, "cuda")
        fn = functools.partial(fr.kernels.run_moe, layer, x, w, ids, backend="triton")
        fn()
        eager = cuda_time_ms(fn, 50, warmup=5)
        host = host_time_per_call(fn, 50) * 1e3
        graph, _ = capture_graph(fn)
        replay = cuda_time_ms(graph.replay, 50, warmup=5)
        limit = roofline_ms(moe_bytes(cfg, ids), moe_flop(cfg, tokens), limits)
        rows.append({"what": "forward", "tokens": tokens, "eager_ms": round(eager, 4),
                     "host_ms_per_call": round(host, 4), "graph_ms": round(replay, 4),
                     "roofline_ms": round(limit, 4), "of_roofline": round(limit / min(eager, replay), 3)})
        print(f"[probe] forward {tokens}: {rows[-1]}", flush=True)


def sweep(rows: list) -> None:
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    layer = synthetic_moe_layer(cfg, "cuda")
    w13_s, w2_s, a13, a2 = cached_kernel_scales(layer)
    for tokens in (128, 4096):
        x, w, ids = routed_tokens(cfg, tokens, "cuda")
        base = default_config(ids.numel(), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

        def run(c, x=x, w=w, ids=ids):
            return fused_moe(x, layer.w13_weight, layer.w2_weight, w13_s, w2_s, a13, a2, w, ids, c)

        results = []
        grid = list(itertools.product((16, 32, 64) if tokens > 512 else (16, 32), (32, 64, 128),
                                      (128, 256), (64, 128), (128, 256), (4, 8), (3, 4)))
        for bm, un, uk, dn, dk, warps, stages in random.Random(0).sample(grid, 40 if tokens < 512 else 24):
            tile = {"num_warps": warps, "num_stages": stages}
            c = {"BLOCK_M": bm, "up": {"BLOCK_N": un, "BLOCK_K": uk, **tile},
                 "down": {"BLOCK_N": dn, "BLOCK_K": dk, **tile}}
            try:
                fn = functools.partial(run, c)
                fn()
                graph, _ = capture_graph(fn)
                results.append((cuda_time_ms(graph.replay, 20, warmup=3), c))
            except Exception as e:  # out of shared memory, ...
                results.append((float("inf"), {**c, "error": type(e).__name__}))
        results.sort(key=lambda r: r[0])
        graph, _ = capture_graph(functools.partial(run, base))
        rows.append({"what": "sweep", "tokens": tokens, "default": base,
                     "default_ms": round(cuda_time_ms(graph.replay, 20, warmup=3), 4),
                     "best": [(round(t, 4), c) for t, c in results[:5]]})
        print(f"[probe] sweep {tokens}: {json.dumps(rows[-1])}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-processing", action="store_true")
    args = ap.parse_args()
    rows: list = []
    launch_overhead(rows)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_processing:
            processing(Path(tmp), rows)
    forward(rows)
    if args.sweep:
        sweep(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
