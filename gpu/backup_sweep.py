"""How much of a host backup to keep on the device: repeated and first full reloads under
`FP8_RELOAD_BACKUP_ON_DEVICE` values, rounds interleaved, beside the limits of the same run.

    python3 gpu/backup_sweep.py [--kinds fp8,bf16] [--values 0,256,512,768,1024] [--rounds 3]

A host backup copies the old weights device-to-host while the new ones go host-to-device:
the link carries both directions. The first `ON_DEVICE` bytes (in the order the commit
writes) are copied on the device instead, so the host-to-device stream starts at once and
the device-to-host one carries that much less. Per value (MiB): the median wall of
repeated full reloads (registered shards), of first reloads (files touched), the device
memory the reload added above the model (peak), and `report.backup_device_bytes`. The
limits: one pinned host-to-device copy of the files' bytes, and both directions at once.
Each kind ends with a bit-for-bit check against a fresh load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_reload as fr  # noqa: E402
from fp8_reload.checkpoint import ensure_checkpoint  # noqa: E402
from fp8_reload.reload import backup  # noqa: E402
from fp8_reload.testing import host_time_per_call, io_paths  # noqa: E402


def wall(fn) -> float:
    """ms of one call of `fn`, the device synchronized before and after."""
    return host_time_per_call(fn, 1, to_sync=True) * 1e3


def best(fn, n: int = 5) -> float:
    return min(wall(fn) for _ in range(n))


def sweep(path: Path, values: list[int], rounds: int, reps: int, firsts: int) -> None:
    files = io_paths.shard_files(path)
    nbytes = io_paths.total_bytes(files)
    model = fr.load_model(path, device="cuda")
    io_paths.wait_settled(files)  # (just written: a reload sooner would be a first one)
    fr.update_weights_from_disk(model, path)
    fr.update_weights_from_disk(model, path)  # registers the shards
    # the limits, with the model and its registered shards in place (as the reloads run)
    h2d = best(io_paths.PinnedCopy(nbytes, "cuda"))
    both = best(io_paths.DuplexCopy(nbytes, "cuda"))
    print(f"[{path.name}] {nbytes / 1e9:.2f} GB; H2D limit {h2d:.1f} ms, both ways {both:.1f} ms", flush=True)
    got: dict[int, dict[str, list]] = {v: {"repeated": [], "first": [], "peak": [], "on device": []}
                                       for v in values}
    for r in range(rounds):
        for v in values if r % 2 == 0 else values[::-1]:
            backup.ON_DEVICE = v << 20
            g = got[v]
            for _ in range(reps):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t = time.perf_counter()
                rep = fr.update_weights_from_disk(model, path)
                torch.cuda.synchronize()
                g["repeated"].append((time.perf_counter() - t) * 1e3)
                g["peak"].append((torch.cuda.max_memory_allocated() - base) / 2**20)
                g["on device"].append(rep.backup_device_bytes / 2**20)
            for _ in range(firsts):
                io_paths.touch(files)
                g["first"].append(wall(lambda: fr.update_weights_from_disk(model, path)))
            # at rest again, then registered again: the next value's repeated reloads are ones
            io_paths.wait_settled(files)
            fr.update_weights_from_disk(model, path)
    for v in values:
        g = got[v]
        rep, first = statistics.median(g["repeated"]), statistics.median(g["first"])
        print(f"[{path.name}] on device {v:>5} MiB: repeated {rep:6.1f} ms ({h2d / rep:.0%} of H2D, "
              f"{both / rep:.0%} of both ways; best {min(g['repeated']):.1f}), first {first:6.1f} ms "
              f"({h2d / first:.0%}); peak above the model {max(g['peak']):.0f} MiB, "
              f"backup on device {max(g['on device']):.0f} MiB", flush=True)
    fresh = fr.load_model(path, device="cuda")
    print(f"[{path.name}] bit for bit: {fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--values", default="0,256,512,768,1024", help="MiB, comma list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--firsts", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    args = ap.parse_args()
    values = [int(v) for v in args.values.split(",")]
    for kind in args.kinds.split(","):
        path = ensure_checkpoint(Path(args.dir) / f"v2-lite-{args.layers}-{kind}", "v2-lite", args.layers,
                                 kind, fill="fast")
        sweep(Path(path), values, args.rounds, args.reps, args.firsts)


if __name__ == "__main__":
    main()
