"""Does unregistering a shard (`cudaHostUnregister`, what dropping a registration does)
wait for unrelated device work, and hold other threads' CUDA calls meanwhile? It does
(review, helper 34, `results/h200/reload-engine/unregister_probe-1886efb.txt`): so the
reload unregisters under the weights lock once the device is idle (`release_dropped`).

Printed: one registration of a 2 GiB page-cached file released with the device idle and
behind ~0.45 s of matmuls queued on another stream; then, with another thread launching
small kernels back to back, its longest gap between launches during a release behind the
same load, the same without a release, and during a release on an idle device.

    python3 gpu/unregister_probe.py
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from fp8_reload.checkpoint.registered import register

PATH = Path("/tmp/unregister_probe.bin")


def main() -> None:
    with open(PATH, "wb") as f:
        block = os.urandom(64 << 20)
        for _ in range(32):  # 2 GiB: 32 pieces of 64 MiB, page-cached
            f.write(block)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    forward = torch.cuda.Stream()

    def busy(n: int) -> None:  # n matmuls queued on the "forward" stream
        with torch.cuda.stream(forward):
            for _ in range(n):
                torch.mm(a, a)

    busy(5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    busy(100)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 100
    print(f"one matmul {per * 1e3:.2f} ms")
    for label, n in (("idle device", 0), (f"{300 * per * 1e3:.0f} ms of matmuls queued", 300)):
        reg = register(PATH)
        torch.cuda.synchronize()
        busy(n)
        t0 = time.perf_counter()
        reg.release()
        took = time.perf_counter() - t0
        done = torch.cuda.Event()
        done.record(forward)
        print(f"{label}: release of 32 pieces {took * 1e3:.1f} ms; the matmuls done by then: {done.query()}")
        torch.cuda.synchronize()

    gaps, stop = [], threading.Event()
    x = torch.zeros(1, device="cuda")

    def launcher() -> None:  # another thread's small launches, back to back
        side, last = torch.cuda.Stream(), time.perf_counter()
        while not stop.is_set():
            with torch.cuda.stream(side):
                x.add_(1)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    for label, load, release in (("release behind the matmuls", 300, True),
                                 ("no release, the same matmuls (control)", 300, False),
                                 ("release, idle device", 0, True)):
        reg = register(PATH) if release else None
        torch.cuda.synchronize()
        busy(load)
        stop.clear()
        thread = threading.Thread(target=launcher)
        thread.start()
        time.sleep(0.05)
        gaps.clear()
        t0 = time.perf_counter()
        if reg is not None:
            reg.release()
        else:
            time.sleep(0.45)
        took = time.perf_counter() - t0
        time.sleep(0.02)
        stop.set()
        thread.join()
        torch.cuda.synchronize()
        print(f"{label}: {took * 1e3:.1f} ms; the other thread's longest gap {max(gaps) * 1e3:.2f} ms "
              f"over {len(gaps)} launches")
    PATH.unlink()


if __name__ == "__main__":
    main()
