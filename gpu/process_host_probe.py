"""Where one reloaded expert's post-processing spends its time (host vs device).

    python3 gpu/process_host_probe.py

For each checkpoint kind, on the one-expert state of `benchmarks.common.UnprocessedLayer`:
`process()` timed on the host (perf_counter, no sync inside) and by CUDA events; then its
parts alone, each 500 times back to back: the Triton entry point, one cached launch, the
current-stream lookup, and the device time of the kernels (events around 500 launches).
"""

from __future__ import annotations

import os
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
from fp8_reload.kernels.triton import requant  # noqa: E402


def host_us(fn, n=500) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def device_us(fn, n=500) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def probe(kind: str, path) -> None:
    state = UnprocessedLayer.get(str(path), "fixed", "one")
    host, dev = [], []
    for _ in range(200):
        state.restore()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        state.process()
        host.append(time.perf_counter() - t0)
        b.record()
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    print(f"== {kind} one expert: process() host {statistics.median(host) * 1e6:.1f} us, "
          f"events {statistics.median(dev) * 1e3:.1f} us (median of 200)", flush=True)
    layer = state.layer
    stream = torch.cuda.current_stream()
    print(f"   torch.cuda.current_stream(): {host_us(lambda: torch.cuda.current_stream()):.1f} us; "
          f"(device) {host_us(lambda: torch.cuda.current_stream(layer.w13_weight.device)):.1f} us; "
          f".cuda_stream {host_us(lambda: stream.cuda_stream):.2f} us", flush=True)
    if kind == "fp8":
        ins = ((layer.w13_input_scale.data, layer.w13_input_scale_per_expert),
               (layer.w2_input_scale.data, layer.w2_input_scale_per_expert))

        def entry():
            requant.requantize_w13_(layer.w13_weight.data, layer.w13_weight_scale.data, [0], ins)

        print(f"   requantize_w13_(1 expert): host {host_us(entry):.1f} us, "
              f"device {device_us(entry):.1f} us per call", flush=True)
    state.restore()
    UnprocessedLayer._cache.clear()


def main():
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("fp8", "bf16"):
            probe(kind, fr.write_checkpoint(Path(tmp) / kind, cfg, kind=kind, progress=False, fill="fast"))


if __name__ == "__main__":
    main()
