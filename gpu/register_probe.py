"""Does registering a shard (`cudaHostRegister`, what a reload does before the weights lock)
hold up forwards running in other threads? The CUDA driver may serialize its API calls
while it pins the pages; this measures it.

A thread runs a forward-sized step (a bf16 matmul, then a synchronize) back to back; the
main thread maps a page-cached file of `--gib` GiB and registers it, three ways, each
twice: torch's binding (which holds the GIL), `device.host_register` (ctypes, the GIL let
go: what `checkpoint.registered` uses), and the same after `madvise(MADV_POPULATE_READ)`
(the pages faulted in before the driver's call, the GIL let go too). Printed: the step's
latencies before and during the registration, and the registration's own time.

    python3 gpu/register_probe.py [--gib 1.7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from fp8_reload.device import host_register, host_unregister

READ_ONLY, POPULATE_READ = 0x08, 22  # cudaHostRegisterReadOnly, MADV_POPULATE_READ (Linux 5.14)


def _torch_binding(ptr: int, n: int) -> bool:
    rt = torch.cuda.cudart()
    return rt.cudaHostRegister(ptr, n, READ_ONLY) == rt.cudaError.success


def _populated(ptr: int, n: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ptr, n, POPULATE_READ) != 0:
        print(f"    madvise: errno {ctypes.get_errno()}")
    return host_register(ptr, n, READ_ONLY)


WAYS = {"torch binding (holds the GIL)": _torch_binding,
        "device.host_register (GIL let go)": lambda ptr, n: host_register(ptr, n, READ_ONLY),
        "madvise(POPULATE_READ), then host_register": _populated}


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
    size = path.stat().st_size
    for attempt in range(6):
        name, way = list(WAYS.items())[attempt % 3]
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        view = torch.frombuffer(mapped, dtype=torch.uint8)
        ptr = view.data_ptr()
        stop, seen = threading.Event(), []
        worker = threading.Thread(target=_steps, args=(stop, seen))
        worker.start()
        time.sleep(1.0)  # the baseline
        t0 = time.perf_counter()
        ok = way(ptr, size)
        t1 = time.perf_counter()
        time.sleep(0.2)
        stop.set()
        worker.join()
        assert ok, f"{name}: registration refused"
        host_unregister(ptr)
        del view
        mapped.close()
        before = [d for t, d in seen if t + d < t0]
        during = [d for t, d in seen if t < t1 and t + d > t0]
        print(f"[{attempt}] {name}: {1e3 * (t1 - t0):.1f} ms ({size / (t1 - t0) / 1e9:.1f} GB/s)")
        print(f"    steps before: {_summary(before)}")
        print(f"    steps overlapping it: {_summary(during)}")
    os.unlink(path)


if __name__ == "__main__":
    main()
