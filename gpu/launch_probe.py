"""Where a one-expert post-processing spends its time on this host (issue 14's <= 30 us).

    python3 gpu/launch_probe.py [--processing-only]

(``FP8_RELOAD_TREE=DIR``: DIR's `fp8_reload` is measured: another commit's, in the same run.)

1. Floors: an idle synchronize; a tiny torch op then a synchronize; an empty Triton kernel
   through Triton's launcher and through its compiled kernel's `run` (no binder), each
   synchronized per call and back to back (host time per launch).
2. One reloaded expert of a v2-lite:2 layer, fp8 and bf16, through the asv fixture
   (`UnprocessedLayer`): per call to the synchronize (what asv times), back to back, and
   back to back with the kernel launches stubbed out (the Python around them), then the
   top of a cProfile of the back-to-back calls.
3. The bf16 whole layer and the fp8 whole layer the same way.
4. One launch of the requantization kernel: host time through Triton's launcher and its
   compiled `run`, and what the compiled kernel asks of each launch.
5. Device time of the processing kernels by shape (elements per step, steps per program),
   each call captured in a CUDA graph: what the kernels cost without the host.
(Commits 7b2933e-77043fa also timed a grid-wide barrier and a one-launch cooperative bf16
quantization under several shapes: `results/h200/kernels-probe/launch_probe-*.txt`.)
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "gpu"))
if os.environ.get("FP8_RELOAD_TREE"):  # another commit's package (an A/B in one run)
    sys.path.insert(0, os.environ["FP8_RELOAD_TREE"])
os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"

from process_probe import back_to_back, per_call  # noqa: E402

import fp8_reload as fr  # noqa: E402
from benchmarks.fixtures import UnprocessedLayer  # noqa: E402
from fp8_reload.kernels.triton.runtime import tl, triton  # noqa: E402
from fp8_reload.processing import ops  # noqa: E402
from fp8_reload.testing import capture_graph, host_time_per_call  # noqa: E402


def synced_us(fn, n=500) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def b2b_us(fn, n=2000) -> float:
    return host_time_per_call(fn, n, warmup=20) * 1e6


@triton.jit
def _nop(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def floors() -> None:
    x = torch.zeros(1024, device="cuda")
    compiled = _nop[(1,)](x, 1024, BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream

    def raw():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     x, 1024, 1024)

    for name, fn in (("idle synchronize", lambda: None), ("torch x.add_(0)", lambda: x.add_(0)),
                     ("triton launcher", lambda: _nop[(1,)](x, 1024, BLOCK=1024)),
                     ("compiled.run", raw)):
        print(f"[floor] {name}: {synced_us(fn):.1f} us to the sync, {b2b_us(fn):.1f} us host back to back",
              flush=True)


class _NoLaunch:
    @staticmethod
    def requantize_w13_(*a, **k):
        pass

    @staticmethod
    def quantize_experts_(*a, **k):
        pass


def stubbed_b2b(state) -> float:
    real = ops._requant
    ops._requant = lambda: _NoLaunch
    try:
        return back_to_back(state)
    finally:
        ops._requant = real


def profile_top(state, n=300, top=18) -> str:
    layer = state.layer
    state.restore()
    staged = {s: dict(p) for s, p in getattr(layer, "staged", {}).items()}
    loaded = set(layer.loaded_experts)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        layer.loaded_experts = set(loaded)
        if staged:
            layer.staged = {s: dict(p) for s, p in staged.items()}
        state.process()
    prof.disable()
    torch.cuda.synchronize()
    state.restore()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def prepared_ab(state, kind: str, n: int = 300) -> None:
    """The same call with the processing kernels launched through their compiled kernels
    and through Triton's launcher, alternating call by call (host drift cancels): medians."""
    from fp8_reload.kernels.triton import requant

    if not hasattr(requant, "PREPARED"):
        return
    times: dict = {True: [], False: []}
    for i in range(2 * n):
        requant.PREPARED = i % 2 == 0
        state.restore()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        state.process()
        torch.cuda.synchronize()
        times[requant.PREPARED].append(time.perf_counter() - t0)
    requant.PREPARED = True
    on, off = (statistics.median(times[v]) * 1e6 for v in (True, False))
    print(f"[prepared] {kind} one expert to the sync, alternating: {on:.1f} us through the compiled kernel, "
          f"{off:.1f} us through Triton's launcher (medians of {n})", flush=True)


def _to_sync(prepare, call, sync, n: int = 300) -> float:
    """Median host us of `call` then `sync`, each after `prepare` and a synchronize."""
    times = []
    for _ in range(n):
        prepare()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def after_restore(state) -> None:
    """Where the one-expert figure's time beyond a bare launch goes: the same call after
    the fixture's whole-layer restore, after putting back only the expert's own bytes,
    and on the processed layer (the same launch, nothing moved), each ended by
    `torch.cuda.synchronize`, by `fp8_reload.device.synchronize` and by the raw call."""
    from fp8_reload.device import synchronize

    layer = state.layer
    state.restore()
    w13, s13 = layer.w13_weight.data, layer.w13_weight_scale.data
    a13, a2 = layer.w13_input_scale.data, layer.w2_input_scale.data
    saved = [t.clone() for t in (w13[0], s13, a13, a2)]
    loaded = set(layer.loaded_experts)

    def light():
        for t, v in zip((w13[0], s13, a13, a2), saved):
            t.copy_(v)
        layer.loaded_experts = set(loaded)

    def again():
        layer.loaded_experts = set(loaded)

    syncs = {"torch.cuda.synchronize": torch.cuda.synchronize, "device.synchronize": synchronize,
             "torch._C._cuda_synchronize": torch._C._cuda_synchronize}
    for name, fn in syncs.items():
        print(f"[sync] {name}, idle: {_to_sync(lambda: None, lambda: None, fn):.1f} us", flush=True)
    for label, prepare in (("whole-layer restore", state.restore), ("expert-only restore", light),
                           ("processed layer", again)):
        cells = [f"{name} {_to_sync(prepare, state.process, fn):.1f}" for name, fn in syncs.items()]
        print(f"[after] fp8 one expert after {label}, us to the sync: " + ", ".join(cells), flush=True)
    state.restore()


def processing(root: Path) -> None:
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    for kind in ("fp8", "bf16"):
        path = str(fr.write_checkpoint(root / kind, cfg, kind=kind, progress=False, fill="fast"))
        for scope in ("one", "all"):
            state = UnprocessedLayer.get(path, "fixed", scope)
            host, dev = per_call(state)
            b2b, py = back_to_back(state), stubbed_b2b(state)
            print(f"[process] {kind} {scope}: {host:.1f} us to the sync (events {dev:.1f} us); back to back "
                  f"{b2b:.1f} us host per call, {py:.1f} us of it with no launch", flush=True)
            print(profile_top(state), flush=True)
            if scope == "one":
                prepared_ab(state, kind)
            if kind == "fp8" and scope == "one":
                after_restore(state)
        UnprocessedLayer._cache.clear()
        torch.cuda.empty_cache()


def graph_us(fn, reps: int = 40) -> float:
    """Device us per call of `fn`: `reps` calls captured in one CUDA graph and replayed, so
    no host time is in the timing."""
    def many():
        for _ in range(reps):
            fn()

    graph, _ = capture_graph(many)
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * reps)


def b2b_events_us(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def kernel_shapes() -> None:
    """Device time of the processing kernels on the v2-lite layer shape, per (elements per
    step, steps per program): fp8 requantization of one expert (its scales put back before
    each call, a copy timed alone and taken off), bf16 quantization of one and 64 experts."""
    from fp8_reload.kernels.triton import requant

    e, inter, hidden = 64, 1408, 2048
    numel = inter * hidden
    w13 = torch.randn(e, 2 * inter, hidden, device="cuda").to(torch.float8_e4m3fn)
    w2 = torch.empty(e, hidden, inter, dtype=torch.float8_e4m3fn, device="cuda")
    s13 = torch.rand(e, 2, device="cuda") + 0.5
    s2 = torch.ones(e, device="cuda")
    a13, a2 = torch.rand(e, device="cuda"), torch.rand(e, device="cuda")
    raw13, raw2 = a13.clone(), a2.clone()
    saved = s13[5].clone()
    saved[0] = saved[1] * 0.5  # the gate half moves
    src = torch.randn(e, 3, numel, device="cuda").to(torch.bfloat16)
    row = ops.expert_rows(w13, s13, w2, s2)
    rows = [row(s, tuple(src[s, j].data_ptr() for j in range(3))) for s in range(e)]
    restore = lambda: s13[5].copy_(saved)  # noqa: E731
    copy = graph_us(restore)
    scales = ((a13, raw13), (a2, raw2))
    real_block, real_iters = requant.BLOCK, requant._iters
    for block in (4096, 8192):
        for iters in (1, 2, 4, 8, 16):
            requant.BLOCK, requant._iters = block, (lambda k, it=iters: it)
            fp8 = graph_us(lambda: (restore(), requant.requantize_w13_(w13, s13, [5], scales)))
            one = graph_us(lambda: requant.quantize_experts_(w13.device, numel, 2, rows[:1]))
            # 64 experts go through a table copied from pinned memory (not capturable safely):
            # timed back to back, the device far behind the host
            layer = b2b_events_us(lambda: requant.quantize_experts_(w13.device, numel, 2, rows))
            tbs = 64 * numel * 3 * 5 / layer / 1e6
            print(f"[shape] block {block} x {iters} per program: fp8 one expert {fp8 - copy:.1f} us, "
                  f"bf16 one expert {one:.1f} us, bf16 64 experts {layer:.1f} us ({tbs:.2f} TB/s of the "
                  "bytes the two passes move)", flush=True)
    requant.BLOCK, requant._iters = real_block, real_iters


def launch_costs() -> None:
    """Host time of one launch of the requantization kernel (one expert, nothing to move)
    through Triton's launcher and through its compiled `run`, back to back, and what the
    compiled kernel asks of each launch (scratch buffers, registers)."""
    from fp8_reload.kernels.triton import requant

    e, inter, hidden = 64, 1408, 2048
    w13 = torch.zeros(e, 2 * inter, hidden, dtype=torch.float8_e4m3fn, device="cuda")
    s13 = torch.ones(e, 2, device="cuda")
    a13, a2 = torch.rand(e, device="cuda"), torch.rand(e, device="cuda")
    raw13, raw2 = a13.clone(), a2.clone()
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    half = inter * hidden
    grid = (1, -(-half // (requant.BLOCK * 2)))
    args = (w13, s13, ticket, 5, 1, ticket, a13, raw13, a2, raw2, half, e, False, True, 2, requant.BLOCK,
            1, 64, requant.EXACT)
    compiled = requant._requant_w13_kernel[grid](*args)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream

    def raw():
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args)

    meta = compiled.metadata
    facts = {k: getattr(meta, k, None) for k in ("global_scratch_size", "profile_scratch_size", "shared",
                                                 "num_warps", "launch_cooperative_grid", "launch_pdl")}
    facts.update(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
    print(f"[launch] requant kernel: {facts}", flush=True)
    for name, fn in (("triton launcher", lambda: requant._requant_w13_kernel[grid](*args)),
                     ("compiled.run", raw)):
        print(f"[launch] requant, {name}: {b2b_us(fn):.1f} us host back to back, "
              f"{synced_us(fn):.1f} us to the sync", flush=True)


def main() -> None:
    print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0),
          "triton", triton.__version__, "fp8_reload from", Path(fr.__file__).parent, flush=True)
    if "--processing-only" not in sys.argv:
        floors()
        launch_costs()
        kernel_shapes()
    with tempfile.TemporaryDirectory() as tmp:
        processing(Path(tmp))


if __name__ == "__main__":
    main()
