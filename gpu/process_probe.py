"""Post-processing of reloaded experts on this GPU, then its CUDA tests (issue 14's check).

    python3 gpu/process_probe.py [--no-tests]

On a v2-lite:2 checkpoint of each kind, through the asv benchmark's own fixture
(`benchmarks.fixtures.UnprocessedLayer`, the loaded-but-unprocessed state on the device):

1. one expert (what an EPLB reload processes): `process()` timed per call from the
   restored state (host wall to the sync, and CUDA events; median of 200), and back to
   back (the same expert marked loaded again, 500 calls, one sync at the end: the host
   time per call when the device never waits);
2. the whole layer (64 experts): fixed vs sglang's per-expert loop (upstream), CUDA events;
3. a Triton launch's and a torch op's host time on this host;
4. the CUDA tests of these kernels (test_requant, test_kernels_gpu, the stream-quantize
   and rollback cases).
Goals: one expert <= 30 us (fp8 and bf16), bf16 layer <= 1 ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "gpu")):  # (kept where an importer put them: launch_probe's A/B)
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"

from kernels_probe import launch_overhead  # noqa: E402

import fp8_reload as fr  # noqa: E402
from benchmarks.fixtures import UnprocessedLayer  # noqa: E402
from fp8_reload.testing import host_time_per_call  # noqa: E402


def per_call(state, n=200) -> tuple[float, float]:
    """(host us to the end of the sync, event us), medians over `n` restored calls."""
    host, dev = [], []
    for _ in range(n):
        state.restore()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        state.process()
        b.record()
        torch.cuda.synchronize()
        host.append(time.perf_counter() - t0)
        dev.append(a.elapsed_time(b) * 1e3)
    return statistics.median(host) * 1e6, statistics.median(dev)


def back_to_back(state, n=500) -> float:
    """Host us per call of `process()` with the same expert marked loaded again each time
    (its bytes already processed: the same launches), one sync at the end."""
    layer = state.layer
    state.restore()
    staged = {s: dict(p) for s, p in getattr(layer, "staged", {}).items()}
    loaded = set(layer.loaded_experts)

    def again():
        layer.loaded_experts = set(loaded)
        if staged:
            layer.staged = {s: dict(p) for s, p in staged.items()}
        state.process()

    us = host_time_per_call(again, n, warmup=1) * 1e6
    state.restore()
    return us


def processing(root: Path) -> list[str]:
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    lines = []
    for kind in ("fp8", "bf16"):
        path = str(fr.write_checkpoint(root / kind, cfg, kind=kind, progress=False, fill="fast"))
        state = UnprocessedLayer.get(path, "fixed", "one")
        host, dev = per_call(state)
        b2b = back_to_back(state)
        lines.append(f"{kind} one expert: {host:.1f} us host to sync, {dev:.1f} us events (median of 200); "
                     f"{b2b:.1f} us host per call back to back (goal <= 30 us)")
        print("[process]", lines[-1], flush=True)
        for impl in ("fixed", "upstream"):
            state = UnprocessedLayer.get(path, impl, "all")
            host, dev = per_call(state, n=20)
            lines.append(f"{kind} whole layer {impl}: {dev / 1e3:.3f} ms events, "
                         f"{host / 1e3:.3f} ms host to sync")
            print("[process]", lines[-1], flush=True)
        UnprocessedLayer._cache.clear()
        torch.cuda.empty_cache()
    return lines


TESTS = [["tests/test_requant.py", "tests/test_kernels_gpu.py", "tests/test_stream.py"],
         ["tests/test_reliability.py", "-k", "cuda and kernel"]]  # rollback around the kernels


def main() -> int:
    print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), flush=True)
    rows: list = []
    launch_overhead(rows)
    with tempfile.TemporaryDirectory() as tmp:
        lines = processing(Path(tmp))
    rc = 0
    if "--no-tests" not in sys.argv:
        for args in TESTS:
            cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
            rc = rc or subprocess.run(cmd, cwd=ROOT, timeout=300).returncode
    print("\n== summary", *lines, f"tests rc={rc}", sep="\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
