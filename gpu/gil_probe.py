"""What a thread's short, asynchronous CUDA calls cost while reader threads run (why the
ring's commit thread was slow): host time per call with no readers, 4 and 15 threads of
`preadv` (4 MiB, page-cached shards), through torch (which lets the GIL go), ctypes.CDLL
(lets it go) and ctypes.PyDLL (keeps it).

    python3 gpu/gil_probe.py CKPT_DIR
"""

import ctypes
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

PIECE = 4 << 20


def main() -> None:
    path = sys.argv[1]
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    torch.empty(1, device="cuda")
    with open("/proc/self/maps") as maps:
        lib_path = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})[0]
    releasing, holding = ctypes.CDLL(lib_path), ctypes.PyDLL(lib_path)
    for lib in (releasing, holding):
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(stream)
    torch.cuda.synchronize()
    ev, st = ctypes.c_void_p(event.cuda_event), ctypes.c_void_p(stream.cuda_stream)
    a = torch.empty(4096, dtype=torch.uint8, device="cuda")
    dst, src = a.data_ptr(), torch.empty_like(a).data_ptr()
    calls = {"torch Event.record": lambda: event.record(stream),
             "CDLL cudaEventRecord": lambda: releasing.cudaEventRecord(ev, st),
             "PyDLL cudaEventRecord": lambda: holding.cudaEventRecord(ev, st),
             "CDLL cudaMemcpyAsync 4 KiB": lambda: releasing.cudaMemcpyAsync(dst, src, 4096, 4, st),
             "PyDLL cudaMemcpyAsync 4 KiB": lambda: holding.cudaMemcpyAsync(dst, src, 4096, 4, st),
             "torch Stream.wait_event": lambda: stream.wait_event(event)}
    stop = threading.Event()
    buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(16)]

    def reader(i: int) -> int:
        fd = os.open(files[i % len(files)], os.O_RDONLY)
        size, view, off, moved = os.fstat(fd).st_size, memoryview(buffers[i].numpy()), 0, 0
        while not stop.is_set():
            moved += os.preadv(fd, [view], off)
            off = (off + PIECE) % max(1, size - PIECE)
        os.close(fd)
        return moved

    def measure(label: str) -> None:
        lines = []
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            times = []
            for _ in range(2000):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            times.sort()
            lines.append(f"{name}: median {statistics.median(times) * 1e6:.1f}, p90 {times[1800] * 1e6:.1f}, "
                         f"mean {statistics.mean(times) * 1e6:.1f} us")
        print(f"== {label}\n  " + "\n  ".join(lines), flush=True)

    measure("no readers")
    for threads in (4, 15):
        stop.clear()
        with ThreadPoolExecutor(threads) as pool:
            running = [pool.submit(reader, i) for i in range(threads)]
            time.sleep(0.2)
            measure(f"{threads} preadv readers running")
            stop.set()
            for f in running:
                f.result()


if __name__ == "__main__":
    main()
