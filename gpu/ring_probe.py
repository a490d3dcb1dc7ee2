"""Where the readers' ring loses against the page cache's read limit (issue 13's first reload).

    python3 gpu/ring_probe.py [--layers 4] [--kind fp8] [--slots 4,8] [--chunks 64]

One process, one page-cached v2-lite slice, in this order:
1. the limits: one pinned host-to-device copy of the files' size; 16 threads of 64 MiB
   `preadv` into one pinned buffer (`io_paths.page_cache_read`); the same with the ring's
   piece size (`chunks.piece_bytes`) instead of 64 MiB pieces;
2. the ring alone (`ring.stream_through_ring` over whole-file chunks): `land` doing
   nothing, then `land` queueing one host-to-device copy per chunk (two device buffers by
   turns), per ring shape (slots x chunk MiB);
3. first reloads (new stamps) per ring shape, with the host time of what the commit thread
   waits on: the readers (`read_wait`), `land`, and the ring's slot events before a refill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fp8_reload as fr
import fp8_reload.reload.chunks as ch
import fp8_reload.reload.ring as ring_mod
from fp8_reload.testing import io_paths

MiB = 1 << 20


def best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


class TimedEvent:
    """A slot's event whose waits are added up (what a refill waited for the device)."""

    waited = 0.0

    def __init__(self, event):
        self.event = event

    def synchronize(self):
        t0 = time.perf_counter()
        self.event.synchronize()
        TimedEvent.waited += time.perf_counter() - t0


def whole_file_chunks(ckpt, files, chunk_bytes):
    out = []
    for f in files:
        size = Path(f).stat().st_size
        name = Path(f).name
        out += [ch.Chunk(name, [], spans=[(off, min(chunk_bytes, size - off), 0)])
                for off in range(0, size, chunk_bytes)]
    return out


def limits(files, nbytes: int) -> float:
    gb = nbytes / 1e9
    limit = io_paths.PinnedCopy(nbytes, "cuda")
    h2d, med = best(limit, 5)
    print(f"[limit] host->device one copy: best {h2d * 1e3:.1f} ms ({gb / h2d:.1f} GB/s), "
          f"median {med * 1e3:.1f}")
    piece = ch.piece_bytes(64 * MiB)
    for threads, size in ((16, 64 * MiB), (ch.READ_THREADS, piece)):
        lo, med = best(lambda t=threads, z=size: io_paths.page_cache_read(files, limit.src, t, z))
        print(f"[limit] page cache, {threads} threads x {size / MiB:.1f} MiB: best {lo * 1e3:.1f} ms "
              f"({gb / lo:.1f} GB/s), median {med * 1e3:.1f}", flush=True)
    return h2d


def ring_alone(ckpt, files, slots: int, cmib: int, gb: float, h2d: float) -> None:
    ring = ring_mod.Ring(slots, cmib * MiB, pin=True, shared=True)
    chunks = whole_file_chunks(ckpt, [Path(f) for f in files], cmib * MiB)
    dev = [torch.empty(cmib * MiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    turn = [0]

    def noop(chunk, buf):
        return None

    def copy(chunk, buf):
        d = dev[turn[0] % 2][:chunk.nbytes]
        turn[0] += 1
        with torch.cuda.stream(side):
            d.copy_(buf[:chunk.nbytes], non_blocking=True)
            e = torch.cuda.Event()
            e.record(side)
        return e

    for name, land in (("read only", noop), ("read + H2D copy", copy)):
        stats: dict = {}
        lo, med = best(lambda f=land, st=stats: ring_mod.stream_through_ring(ckpt, chunks, ring, f, st))
        print(f"[ring {slots}x{cmib} MiB, {name}] best {lo * 1e3:.1f} ms ({gb / lo:.1f} GB/s, "
              f"{h2d / lo:.0%} of H2D), median {med * 1e3:.1f}; read_wait/run "
              f"{stats.get('read_wait', 0) / 3 * 1e3:.1f} ms", flush=True)
    ring.release()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kind", default="fp8")
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--slots", default="4,8")
    ap.add_argument("--chunks", default="64")
    ap.add_argument("--reloads", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.dir) / f"v2-lite-{args.layers}-{args.kind}"
    if not (path / "config.json").exists():
        cfg = fr.MoEConfig.preset("v2-lite", num_layers=args.layers)
        fr.write_checkpoint(path, cfg, kind=args.kind, fill="fast", progress=False)
    files = io_paths.shard_files(path)
    nbytes = io_paths.total_bytes(files)
    gb = nbytes / 1e9
    shapes = [(int(s), int(c)) for s in args.slots.split(",") for c in args.chunks.split(",")]
    print(f"{torch.cuda.get_device_name()}, {gb:.2f} GB in {len(files)} files, "
          f"readers {ch.READ_THREADS}, piece {ch.piece_bytes(64 * MiB) / MiB:.1f} MiB of 64", flush=True)

    h2d = limits(files, nbytes)
    ckpt = fr.Checkpoint(path)
    for slots, cmib in shapes:
        ring_alone(ckpt, files, slots, cmib, gb, h2d)
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    import fp8_reload.reload.to_device as to_device
    to_device.REGISTER = "never"
    real_landed = ring_mod._landed
    lands: list = []

    def landed(ring, k, chunk, land, stats):
        t0 = time.perf_counter()
        real_landed(ring, k, chunk, land, stats)
        lands.append(time.perf_counter() - t0)
        slot = k % len(ring.buffers)
        if ring.events[slot] is not None:
            ring.events[slot] = TimedEvent(ring.events[slot])

    ring_mod._landed = landed
    for slots, cmib in shapes:
        ch.RING_SLOTS, ch.CHUNK_BYTES = slots, cmib * MiB
        walls = []
        for _ in range(args.reloads + 1):
            io_paths.touch(files)
            lands.clear()
            TimedEvent.waited = 0.0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = fr.update_weights_from_disk(model, path)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items())
        w = min(walls[1:])
        print(f"[first reload, ring {slots}x{cmib} MiB] best {w * 1e3:.1f} ms ({h2d / w:.0%} of H2D), "
              f"walls {' '.join(f'{x * 1e3:.0f}' for x in walls)}; last: {phases}; land x{len(lands)} "
              f"{sum(lands) * 1e3:.1f} ms; slot events waited {TimedEvent.waited * 1e3:.1f} ms", flush=True)
    ring_mod._landed = real_landed
    fr.release_staging(model)
    fresh = fr.load_model(path, device="cuda")
    same = all(torch.equal(fr.state.raw_bytes(a), fr.state.raw_bytes(b)) for a, b in
               zip((*model.parameters(), *model.buffers()), (*fresh.parameters(), *fresh.buffers())))
    print("after all of it, reload == fresh load bit for bit:", same, flush=True)


if __name__ == "__main__":
    main()
