"""Host time of post-processing one reloaded expert, and where it goes (cProfile).

    python3 gpu/process_host_probe.py

For each checkpoint kind: the one-expert state of `benchmarks.common.UnprocessedLayer`,
200 rounds of restore, then `process()` timed on the host (perf_counter, no sync inside)
and by CUDA events; the profile covers the `process()` calls only.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"

import fp8_reload as fr  # noqa: E402
from benchmarks.common import UnprocessedLayer  # noqa: E402


def main():
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("fp8", "bf16"):
            path = fr.write_checkpoint(Path(tmp) / kind, cfg, kind=kind, progress=False, fill="fast")
            for scope in ("one", "all"):
                state = UnprocessedLayer.get(str(path), "fixed", scope)
                prof = cProfile.Profile()
                host, dev = [], []
                for _ in range(200):
                    state.restore()
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    t0 = time.perf_counter()
                    prof.enable()
                    state.process()
                    prof.disable()
                    host.append(time.perf_counter() - t0)
                    b.record()
                    torch.cuda.synchronize()
                    dev.append(a.elapsed_time(b))
                print(f"== {kind} {scope}: host {statistics.median(host) * 1e6:.1f} us, "
                      f"events {statistics.median(dev) * 1e3:.1f} us (median of 200)", flush=True)
                if scope == "one":
                    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            UnprocessedLayer._cache.clear()


if __name__ == "__main__":
    main()
