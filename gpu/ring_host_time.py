"""Where a ring reload's commit thread spends its time, per chunk (issue 13's first reload).

    python3 gpu/ring_host_time.py CKPT_DIR [first|ring]

`first`: each reload a first reload (new stamps: parsed, values checked, read through the
ring); `ring`: repeated reloads with registration off (the ring alone). The 4th of 4 reloads
is reported: its phases, and the host time of `_land` (one chunk queued) and of its calls.
Run it from another tree's root (its `fp8_reload` first on `sys.path`) to compare commits
in one run.
"""

import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

import fp8_reload as fr  # noqa: E402
from fp8_reload.checkpoint.staging import held  # noqa: E402
from fp8_reload.kernels.triton import copy_rows  # noqa: E402
from fp8_reload.reload import to_device  # noqa: E402
from fp8_reload.testing import io_paths  # noqa: E402

acc: dict = collections.defaultdict(list)


def timed(name, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name].append(time.perf_counter() - t)
    return wrapper


def main() -> None:
    path, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "first")
    files = io_paths.shard_files(path)
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    to_device._land = timed("land", to_device._land)
    to_device.copy_async = timed("copy_async", to_device.copy_async)
    copy_rows.launch_rows_ = timed("launch_rows", copy_rows.launch_rows_)
    if mode == "ring":
        to_device.REGISTER = "never"
    for _ in range(4):
        acc.clear()
        if mode == "first":
            io_paths.touch(files)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = fr.update_weights_from_disk(model, path)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    calls = "; ".join(f"{k} x{len(v)} {sum(v) * 1e3:.1f} ms (median {statistics.median(v) * 1e6:.0f} us, "
                      f"max {max(v) * 1e6:.0f} us)" for k, v in acc.items())
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in report.seconds.items())
    ring = held(model).get("ring")
    readers = "processes" if getattr(ring, "shared", None) is not None else "threads"
    print(f"[{mode}, {readers}] wall {wall * 1e3:.1f} ms: {phases}\n   {calls}", flush=True)


if __name__ == "__main__":
    main()
