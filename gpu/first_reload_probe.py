"""Where a first full reload's time goes: each driver registration and unregistration and
each chunk landed, timed on the host, in reloads of a v2-lite slice whose files were just
touched (new stamps, page cache warm), under each ``FP8_RELOAD_REGISTER`` policy given.
Commit 72d364f registered a shard on its first read, a piece at a time as the commit
streamed it; this showed each piece pinning 3x slower than on an idle device, and the
reload slower than through the ring (`results/h200/reload-engine/first_reload_probe-72d364f.txt`).

    python3 gpu/first_reload_probe.py [--layers 4] [--kind fp8] [--policies never,auto]"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fp8_reload as fr
import fp8_reload.checkpoint.registered as registered_mod
import fp8_reload.reload.to_device as to_device
from fp8_reload.checkpoint import ensure_checkpoint
from fp8_reload.testing import io_paths


def _timed_calls(module, name, log):
    real = getattr(module, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            log.append((name, t0, time.perf_counter() - t0))

    setattr(module, name, wrapper)
    return real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kind", default="fp8")
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--policies", default="never,auto")
    args = ap.parse_args()
    path = ensure_checkpoint(Path(args.dir) / f"v2-lite-{args.layers}-{args.kind}", "v2-lite", args.layers,
                             args.kind, fill="fast")
    files = io_paths.shard_files(path)
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    log: list = []
    reals = [(registered_mod, "host_register", _timed_calls(registered_mod, "host_register", log)),
             (registered_mod, "host_unregister", _timed_calls(registered_mod, "host_unregister", log)),
             (to_device, "_land", _timed_calls(to_device, "_land", log))]
    for policy in args.policies.split(",") * 2:
        to_device.REGISTER = policy
        io_paths.touch(files)
        log.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rep = fr.update_weights_from_disk(model, path)
        total = time.perf_counter() - t0
        phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items())
        print(f"[{policy}] first reload {total * 1e3:.1f} ms: {phases}")
        for name in ("host_register", "host_unregister", "_land"):
            ds = [d for n, _, d in log if n == name]
            if ds:
                print(f"    {name}: {len(ds)} calls, {sum(ds) * 1e3:.1f} ms, median "
                      f"{statistics.median(ds) * 1e3:.2f} ms, max {max(ds) * 1e3:.2f} ms")
        lands = [(t, d) for n, t, d in log if n == "_land"]
        if lands:
            print(f"    first land at {(lands[0][0] - t0) * 1e3:.1f} ms, last ends at "
                  f"{(lands[-1][0] + lands[-1][1] - t0) * 1e3:.1f} ms")
        seq = [f"{n[5:8] if n != '_land' else 'L'}{d * 1e3:.1f}" for n, _, d in log[:40]]
        print("    order:", " ".join(seq))
    for module, name, real in reals:
        setattr(module, name, real)


if __name__ == "__main__":
    main()
