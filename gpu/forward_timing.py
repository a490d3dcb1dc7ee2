"""The Triton MoE forward at 128 and 4096 tokens timed four ways in one process, to show
what each benchmark's method measures (v2-lite layer shape, synthetic weights):

    python3 gpu/forward_timing.py

* CUDA events around each call, calls queued back to back (`bench-kernels`, the probes);
* wall time per call of 200 calls back to back, one synchronization at the end;
* each call between two synchronizations (asv: `benchmarks.common.synchronized`), median;
* the same after 50 ms of an idle device (what one call per asv sample measured).
"""

import statistics
import time

import torch

import fp8_reload as fr
from fp8_reload.testing import routed_tokens, synthetic_moe_layer
from fp8_reload.testing.bench import cuda_time_ms, host_time_per_call


def main() -> None:
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
    layer = synthetic_moe_layer(cfg, "cuda")
    for tokens in (128, 4096):
        x, w, ids = routed_tokens(cfg, tokens, "cuda")

        def fn(x=x, w=w, ids=ids):
            return fr.kernels.run_moe(layer, x, w, ids, backend="triton")

        for _ in range(10):
            fn()
        events = cuda_time_ms(fn, 100, warmup=5)
        queued = host_time_per_call(fn, 200, to_sync=True) * 1e3
        each, idle = [], []
        for n, pause, out in ((200, 0.0, each), (20, 0.05, idle)):
            for _ in range(n):
                torch.cuda.synchronize()
                time.sleep(pause)
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                out.append((time.perf_counter() - t) * 1e3)
        print(f"[forward {tokens} tokens] events back to back {events:.3f} ms; "
              f"wall back to back {queued:.3f}; "
              f"synchronized each call: median {statistics.median(each):.3f}, min {min(each):.3f}; "
              f"after 50 ms idle: median {statistics.median(idle):.3f}, min {min(idle):.3f}", flush=True)


if __name__ == "__main__":
    main()
