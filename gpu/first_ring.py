"""A first reload (new stamps: read through the ring, values checked) under ring shapes and
reader counts: which one reads at the page cache's speed (issue 13's first-reload goal).

    python3 gpu/first_ring.py CKPT_DIR

Each shape runs in its own process (the tunables are read at import): 4 first reloads, the
middle two averaged; "read_wait" is the time the commit waited for the reader threads.
"""

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ((4, 64, None), (8, 32, None), (8, 64, None), (16, 16, None), (4, 64, 8))  # slots, MiB, readers


def one(path: str) -> None:
    sys.path.insert(0, ROOT)
    import torch

    import fp8_reload as fr
    from fp8_reload.testing import io_paths

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    res = []
    for _ in range(4):
        io_paths.touch(files)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rep = fr.update_weights_from_disk(model, path)
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t0, rep.seconds.get("load", 0), rep.seconds.get("read_wait", 0)))
    wall, load, wait = (1e3 * statistics.mean(r[i] for r in sorted(res)[1:3]) for i in range(3))
    env = os.environ.get
    print(f"[ring] slots={env('FP8_RELOAD_RING_SLOTS', '4')} "
          f"chunk={int(env('FP8_RELOAD_CHUNK_BYTES', 64 << 20)) >> 20} MiB "
          f"readers={env('FP8_RELOAD_READ_THREADS', 'default')}: first reload {wall:.1f} ms, "
          f"load {load:.1f}, read_wait {wait:.1f}", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "one":
        one(sys.argv[1])
        return
    for slots, mib, readers in SHAPES:
        env = dict(os.environ, FP8_RELOAD_RING_SLOTS=str(slots), FP8_RELOAD_CHUNK_BYTES=str(mib << 20))
        if readers:
            env["FP8_RELOAD_READ_THREADS"] = str(readers)
        p = subprocess.run([sys.executable, __file__, sys.argv[1], "one"], env=env, capture_output=True,
                           text=True, timeout=90)
        print(p.stdout.strip() or f"[ring] {slots} x {mib} MiB failed: {p.stderr[-400:]}", flush=True)


if __name__ == "__main__":
    main()
