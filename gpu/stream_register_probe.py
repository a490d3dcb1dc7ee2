"""Can a first reload register a page-cached shard as it streams it? Registering a
piece (`cudaHostRegister`) is CPU work; the DMA out of the piece before it is the link's:
done by turns on one thread, the two overlap. Printed, for one page-cached file of
`--gib` GiB, best of `--repeat`:

* the limit: one host-to-device copy out of a pinned buffer of the same size;
* registered first, then copied (what a second reload does today, in two phases);
* registered piece by piece, each piece's copies queued as soon as it is pinned,
  for several piece sizes;
* what unregistering and `mincore` (is the file in the page cache?) cost.

    python3 gpu/stream_register_probe.py [--gib 1.74] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time
from pathlib import Path

import torch

from fp8_reload.device import host_register, host_unregister

READ_ONLY = 0x08
CHUNK = 64 << 20


def _map(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m, torch.frombuffer(m, dtype=torch.uint8)


def _copy_range(dst, view, start, end):
    for at in range(start, end, CHUNK):
        n = min(CHUNK, end - at)
        dst[at:at + n].copy_(view[at:at + n], non_blocking=True)


def pipelined(view, dst, piece, busy=None):
    """Register piece k, queue its copies, register piece k+1, ... `busy(off, end)`: more
    work queued after each piece's copies (what a reload queues besides them)."""
    base, n, done = view.data_ptr(), view.numel(), []
    t0 = time.perf_counter()
    for off in range(0, n, piece):
        size = min(piece, n - off)
        assert host_register(base + off, size, READ_ONLY)
        done.append(base + off)
        _copy_range(dst, view, off, off + size)
        if busy is not None:
            busy(off, off + size)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    t1 = time.perf_counter()
    for p in done:
        host_unregister(p)
    return total, time.perf_counter() - t1


def two_phase(view, dst, piece):
    base, n, done = view.data_ptr(), view.numel(), []
    t0 = time.perf_counter()
    for off in range(0, n, piece):
        assert host_register(base + off, min(piece, n - off), READ_ONLY)
        done.append(base + off)
    t1 = time.perf_counter()
    for off in range(0, n, piece):  # a copy never crosses two registrations
        _copy_range(dst, view, off, min(n, off + piece))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for p in done:
        host_unregister(p)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def mincore_resident(view) -> tuple[float, float]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (view.numel() + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    t0 = time.perf_counter()
    assert libc.mincore(view.data_ptr(), view.numel(), vec) == 0, ctypes.get_errno()
    dt = time.perf_counter() - t0
    flags = bytes(vec)
    resident = sum(b & 1 for b in flags) / pages
    return dt, resident


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.74)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    path = Path(args.dir) / "stream_register_probe.bin"
    if not path.exists() or path.stat().st_size != nbytes:
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tofile(path)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gb = nbytes / 1e9
    best = []
    for _ in range(args.repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    limit = min(best[1:])
    print(f"file {gb:.2f} GB, page-cached; limit (one pinned copy): {limit * 1e3:.1f} ms, "
          f"{gb / limit:.1f} GB/s")
    m, view = _map(path)
    dt, res = mincore_resident(view)
    print(f"mincore over the mapping: {dt * 1e3:.2f} ms, {res:.1%} resident")
    for piece in (256 << 20, 128 << 20, 64 << 20):
        runs = [two_phase(view, dst, piece) for _ in range(args.repeat)]
        reg, cp, unreg = (min(r[i] for r in runs) for i in range(3))
        print(f"two phases, pieces of {piece >> 20} MiB: register {reg * 1e3:.1f} ms, copy {cp * 1e3:.1f} ms "
              f"({limit / cp:.0%} of the limit), sum {(reg + cp) * 1e3:.1f} ms ({limit / (reg + cp):.0%}); "
              f"unregister {unreg * 1e3:.1f} ms")
        runs = [pipelined(view, dst, piece) for _ in range(args.repeat)]
        tot, unreg = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"pipelined, pieces of {piece >> 20} MiB: {tot * 1e3:.1f} ms ({limit / tot:.0%} of limit), "
              f"runs {', '.join(f'{r[0] * 1e3:.1f}' for r in runs)}; unregister {unreg * 1e3:.1f} ms")
        torch.cuda.synchronize()
    # what a reload queues besides: a kernel on another stream after each piece, waiting
    # for its copies (the scatter), and a device-to-host copy of the same size (the backup)
    side, back = torch.cuda.Stream(), torch.cuda.Stream()
    scratch = torch.empty_like(dst)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def scatter(off, end):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            scratch[off:end].copy_(dst[off:end])

    def backup_too(off, end):
        if off == 0:
            back.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(back):
                host.copy_(scratch, non_blocking=True)
        scatter(off, end)

    for what, busy in (("a kernel on another stream after each piece", scatter),
                       ("that, and a device-to-host copy beside", backup_too)):
        runs = [pipelined(view, dst, 64 << 20, busy) for _ in range(args.repeat)]
        tot = min(r[0] for r in runs)
        print(f"pipelined, 64 MiB, {what}: {tot * 1e3:.1f} ms ({limit / tot:.0%} of limit), runs "
              f"{', '.join(f'{r[0] * 1e3:.1f}' for r in runs)}")
    ok = torch.equal(dst[:1 << 20].cpu(), view[:1 << 20])  # the last copy's first bytes
    print(f"bytes equal: {ok}")
    del view
    m.close()


if __name__ == "__main__":
    main()
