"""Does registering a shard (`cudaHostRegister`, what a reload does before the weights lock)
hold up forwards running in other threads? The CUDA driver may serialize its API calls
while it pins the pages; this measures it.

A thread runs a forward-sized step (a bf16 matmul, then a synchronize) back to back; the
main thread registers a page-cached file of `--gib` GiB, then releases it. Printed: the
step's latencies before and during the registration, the steps that ran during it, and
the registration's own time.

    python3 gpu/register_probe.py [--gib 1.7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from fp8_reload.checkpoint.registered import register


def _file(path: Path, nbytes: int) -> Path:
    if not path.exists() or path.stat().st_size != nbytes:
        block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    return path


def _steps(stop: threading.Event, out: list) -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        t = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        out.append((t, time.perf_counter() - t))


def _summary(lat: list[float]) -> str:
    if not lat:
        return "no step ran"
    lat = sorted(x * 1e3 for x in lat)
    return (f"{len(lat)} steps, median {statistics.median(lat):.3f} ms, "
            f"p99 {lat[int(0.99 * (len(lat) - 1))]:.3f} ms, max {lat[-1]:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.7)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    path = _file(Path(args.dir) / "register_probe.bin", int(args.gib * (1 << 30)) // (64 << 20) * (64 << 20))
    print(f"file {path}: {path.stat().st_size / 2**30:.2f} GiB, page-cached")
    for attempt in range(2):
        stop, seen = threading.Event(), []
        worker = threading.Thread(target=_steps, args=(stop, seen))
        worker.start()
        time.sleep(1.0)  # the baseline
        t0 = time.perf_counter()
        reg = register(path)
        t1 = time.perf_counter()
        time.sleep(0.2)
        stop.set()
        worker.join()
        assert reg is not None, "registration refused"
        reg.release()
        before = [d for t, d in seen if t + d < t0]
        during = [d for t, d in seen if t < t1 and t + d > t0]
        print(f"[{attempt}] registration {1e3 * (t1 - t0):.1f} ms "
              f"({path.stat().st_size / (t1 - t0) / 1e9:.1f} GB/s)")
        print(f"    steps before: {_summary(before)}")
        print(f"    steps overlapping it: {_summary(during)}")
    os.unlink(path)


if __name__ == "__main__":
    main()
