"""Does registering a shard (`cudaHostRegister`, what a reload does before the weights lock)
hold up forwards running in other threads? It does: the driver holds the process's
other CUDA calls while it pins (`results/h200/reload-engine/register_probe-*.txt`).

A thread runs a forward-sized step (a bf16 matmul, then a synchronize) back to back; the
main thread maps a page-cached file of `--gib` GiB and registers it, four ways, each
twice: in one call through torch's binding (which holds the GIL), through
`device.host_register` (ctypes, the GIL let go), the same after
`madvise(MADV_POPULATE_READ)` (the pages faulted in before the driver's call), and as
`checkpoint.registered.register` does it: in pieces, the other threads let in between.
Printed: the step's latencies before and during the registration, and its own time.

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

from fp8_reload.checkpoint.registered import PIECE_BYTES, register
from fp8_reload.device import host_register, host_unregister

READ_ONLY, POPULATE_READ = 0x08, 22  # cudaHostRegisterReadOnly, MADV_POPULATE_READ (Linux 5.14)


def _torch_binding(view: torch.Tensor, path: Path):
    rt = torch.cuda.cudart()
    ok = rt.cudaHostRegister(view.data_ptr(), view.numel(), READ_ONLY) == rt.cudaError.success
    return ok and (lambda: host_unregister(view.data_ptr()))


def _one_piece(view: torch.Tensor, path: Path):
    ok = host_register(view.data_ptr(), view.numel(), READ_ONLY)
    return ok and (lambda: host_unregister(view.data_ptr()))


def _populated(view: torch.Tensor, path: Path):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(view.data_ptr(), view.numel(), POPULATE_READ) != 0:
        print(f"    madvise: errno {ctypes.get_errno()}")
    return _one_piece(view, path)


def _in_pieces(view: torch.Tensor, path: Path):
    reg = register(path)  # its own mapping of the file
    return reg is not None and reg.release


WAYS = {"torch binding, one call (holds the GIL)": _torch_binding,
        "device.host_register, one call (GIL let go)": _one_piece,
        "madvise(POPULATE_READ), then one call": _populated,
        f"registered.register: pieces of {PIECE_BYTES >> 20} MiB": _in_pieces}


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
    for attempt in range(2 * len(WAYS)):
        name, way = list(WAYS.items())[attempt % len(WAYS)]
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        view = torch.frombuffer(mapped, dtype=torch.uint8)
        stop, seen = threading.Event(), []
        worker = threading.Thread(target=_steps, args=(stop, seen))
        worker.start()
        time.sleep(1.0)  # the baseline
        t0 = time.perf_counter()
        release = way(view, path)
        t1 = time.perf_counter()
        time.sleep(0.2)
        stop.set()
        worker.join()
        assert release, f"{name}: registration refused"
        release()
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
