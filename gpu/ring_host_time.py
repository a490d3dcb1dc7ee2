"""Where a ring reload's commit thread spends its time, per chunk (issue 13's first reload).

    python3 gpu/ring_host_time.py CKPT_DIR [first|ring|repeated] [--profile]

`first`: each reload a first reload (new stamps: parsed, values checked, read through the
ring); `ring`: repeated reloads with registration off (the ring alone); `repeated`: repeated
reloads as they run by default (registered shards). The 4th of 4 reloads is reported: its
phases, and the host time of `_land` (one chunk queued) and of its calls; `--profile`: also
the top of a cProfile of it (what the host does before the first copy and after the last).
Run it from another tree's root (its `fp8_reload` first on `sys.path`) to compare commits
in one run.
"""

import collections
import cProfile
import io
import os
import pstats
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
    args = [a for a in sys.argv[1:] if a != "--profile"]
    path, mode = args[0], (args[1] if len(args) > 1 else "first")
    prof = cProfile.Profile() if "--profile" in sys.argv else None
    files = io_paths.shard_files(path)
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    to_device._land = timed("land", to_device._land)
    to_device.copy_async = timed("copy_async", to_device.copy_async)
    copy_rows.launch_rows_ = timed("launch_rows", copy_rows.launch_rows_)
    if mode == "ring":
        to_device.REGISTER = "never"
    for i in range(4):
        acc.clear()
        if mode == "first":
            io_paths.touch(files)
        torch.cuda.synchronize()
        if prof is not None and i == 3:
            prof.enable()
        t0 = time.perf_counter()
        report = fr.update_weights_from_disk(model, path)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    calls = "; ".join(f"{k} x{len(v)} {sum(v) * 1e3:.1f} ms (median {statistics.median(v) * 1e6:.0f} us, "
                      f"max {max(v) * 1e6:.0f} us)" for k, v in acc.items())
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in report.seconds.items())
    ring = held(model).get("ring")
    readers = "processes" if getattr(ring, "shared", None) is not None else "threads"
    print(f"[{mode}, {readers}] wall {wall * 1e3:.1f} ms: {phases}\n   {calls}", flush=True)
    if prof is not None:  # (the wall above is the profiled reload's: slower than without)
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
