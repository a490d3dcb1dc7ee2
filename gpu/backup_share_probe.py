"""How much of a host backup to keep on the device (`backup.ON_DEVICE`): both sides, one run.

    python3 gpu/backup_share_probe.py [--layers 4] [--kind fp8] [--shares 0,64,128,256,512,1024]
                                      [--rounds 4] [--reps 4]

One process, one model on the GPU, its shards registered (two reloads first). Per round,
shares in rotated order: the median wall time of `--reps` repeated full reloads with the
host backup, its first `share` MiB of pieces copied on the device; then the filtered reload
(1 expert per MoE layer) at the smallest and largest share, and the full device backup.
Beside each, the device memory the reload added above the model (peak). The limits are
measured in the same process: one pinned host-to-device copy of the files' size, and the
same both ways at once. Ends with reload == fresh load, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kind", default="fp8")
    ap.add_argument("--shares", default="0,64,128,256,512,1024", help="MiB, comma list")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    import torch

    import fp8_reload as fr
    import fp8_reload.reload.backup as bk
    from fp8_reload.checkpoint import ensure_checkpoint
    from fp8_reload.testing import io_paths

    path = ensure_checkpoint(Path(args.dir) / f"v2-lite-{args.layers}-{args.kind}", "v2-lite", args.layers,
                             args.kind, fill="fast")
    nbytes = io_paths.total_bytes(io_paths.shard_files(path))

    def wall(fn) -> tuple[float, int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, torch.cuda.max_memory_allocated() - base

    limits = {}
    for name, make in (("host->device", io_paths.PinnedCopy), ("both ways", io_paths.DuplexCopy)):
        copy = make(nbytes, "cuda")
        limits[name] = min(wall(copy)[0] for _ in range(5))
        del copy
    torch.cuda.empty_cache()
    h2d = limits["host->device"]
    print(f"[{args.kind}] v2-lite:{args.layers}, {nbytes / 1e9:.2f} GB; host->device {h2d:.1f} ms, "
          f"both ways {limits['both ways']:.1f} ms ({h2d / limits['both ways']:.0%})", flush=True)

    model = fr.load_model(path, device="cuda")
    cfg = fr.Checkpoint(path).config
    flt = fr.generate_weight_name_filter({layer: [0] for layer in cfg.moe_layers})
    for _ in range(2):
        fr.update_weights_from_disk(model, path)
    shares = [int(s) for s in args.shares.split(",")]

    def at(share, **kw):
        def run():
            bk.ON_DEVICE = share << 20
            fr.update_weights_from_disk(model, path, **kw)
        return run

    ways = {f"host, {s} MiB on device": at(s) for s in shares}
    ways |= {f"filtered, {s} MiB on device": at(s, weight_name_filter=flt) for s in (shares[0], shares[-1])}
    ways["device backup"] = at(0, backup="device")
    got: dict[str, list[tuple[float, int]]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name] += [wall(ways[name]) for _ in range(args.reps)]
        print(f"  round {r}: " + ", ".join(f"{k} {statistics.median(t for t, _ in v):.1f}"
                                           for k, v in got.items()), flush=True)
    for name, samples in got.items():
        ms = statistics.median(t for t, _ in samples)
        peak = max(p for _, p in samples) / 2**20
        share = "" if name.startswith("filtered") else (f" ({h2d / ms:.0%} of host->device, "
                                                         f"{limits['both ways'] / ms:.0%} of both ways)")
        print(f"[{args.kind}] {name:>28}: median {ms:.1f} ms{share}, best "
              f"{min(t for t, _ in samples):.1f}; device peak above the model {peak:.0f} MiB", flush=True)
    bk.ON_DEVICE = shares[0] << 20
    fresh = fr.load_model(path, device="cuda")
    same = fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []
    print(f"[{args.kind}] reload == fresh load, bit for bit: {same}", flush=True)
    assert same


if __name__ == "__main__":
    main()
