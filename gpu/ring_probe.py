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
import os
import statistics
import time
from pathlib import Path

import torch

import fp8_reload as fr
import fp8_reload.reload.chunks as ch
import fp8_reload.reload.ring as ring_mod
import fp8_reload.reload.to_device as to_device
from fp8_reload.checkpoint import ensure_checkpoint
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


def ring_alone(ckpt, files, slots: int, cmib: int, gb: float, h2d: float, beside=None) -> None:
    """`beside`: (device tensor, pinned tensor) of the files' size: a third run with one
    device-to-host copy of it queued first on another stream (a host backup's traffic)."""
    ring = ring_mod.Ring(slots, cmib * MiB, pin=True, shared=True)
    chunks = whole_file_chunks(ckpt, [Path(f) for f in files], cmib * MiB)
    dev = [torch.empty(cmib * MiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    turn = [0]

    def noop(chunk, buf, lo, last):
        return None

    def copy(chunk, buf, lo, last):
        d = dev[turn[0] % 2][:chunk.nbytes]
        turn[0] += 1
        with torch.cuda.stream(side):
            d.copy_(buf[:chunk.nbytes], non_blocking=True)
            e = torch.cuda.Event()
            e.record(side)
        return e

    d2h = torch.cuda.Stream()

    def backed_up(chunk, buf, lo, last):
        if chunk is chunks[0]:
            with torch.cuda.stream(d2h):
                beside[1].copy_(beside[0], non_blocking=True)
        return copy(chunk, buf, lo, last)

    ways = [("read only", noop), ("read + H2D copy", copy)]
    if beside is not None:
        ways.append(("read + H2D copy, D2H beside", backed_up))
    for name, land in ways:
        stats: dict = {}
        lo, med = best(lambda f=land, st=stats: ring_mod.stream_through_ring(ckpt, chunks, ring, f, st))
        print(f"[ring {slots}x{cmib} MiB, {name}] best {lo * 1e3:.1f} ms ({gb / lo:.1f} GB/s, "
              f"{h2d / lo:.0%} of H2D), median {med * 1e3:.1f}; read_wait/run "
              f"{stats.get('read_wait', 0) / 3 * 1e3:.1f} ms", flush=True)
    ring.release()


def timeline(model, path, files, label: str) -> None:
    """One first reload, per chunk (ms from its start): asked of the readers, read whole,
    landed (host), its host-to-device copy on the device (start-end, events around it)."""
    from fp8_reload.checkpoint import read_procs

    procs = read_procs.pool()
    real_submit, real_wait, real_landed = procs.submit, procs.wait, ring_mod._landed
    real_copy = to_device._from_host
    t0 = [0.0]
    rows: dict = {}
    copies: list = []

    def submit(chunk, pieces):
        rows.setdefault(chunk, {})["ask"] = time.perf_counter() - t0[0]
        return real_submit(chunk, pieces)

    def wait(chunk):
        out = real_wait(chunk)
        if chunk >= 0:
            rows.setdefault(chunk, {})["read"] = time.perf_counter() - t0[0]
        return out

    def landed(ring, q, chunks, parts, land, stats):
        real_landed(ring, q, chunks, parts, land, stats)
        rows.setdefault(q, {})["landed"] = time.perf_counter() - t0[0]

    def from_host(dst, src, stream, base, piece):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        real_copy(dst, src, stream, base, piece)
        b.record(stream)
        copies.append((a, b))

    real_commit = to_device.commit_cuda
    ahead: list = []

    def commit(*a, **k):
        inner = k.get("backup_ahead")
        if inner is not None:
            def timed_ahead():
                start = time.perf_counter() - t0[0]
                inner()
                ahead.append((start, time.perf_counter() - t0[0]))
            k["backup_ahead"] = timed_ahead
        return real_commit(*a, **k)

    procs.submit, procs.wait, ring_mod._landed, to_device._from_host = submit, wait, landed, from_host
    to_device.commit_cuda = commit
    try:
        io_paths.touch(files)
        torch.cuda.synchronize()
        base = torch.cuda.Event(enable_timing=True)
        t0[0] = time.perf_counter()
        base.record()
        rep = fr.update_weights_from_disk(model, path)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0[0]
    finally:
        procs.submit, procs.wait, ring_mod._landed, to_device._from_host = \
            real_submit, real_wait, real_landed, real_copy
        to_device.commit_cuda = real_commit
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items())
    queued = "; ".join(f"backup queued {a * 1e3:.2f}-{b * 1e3:.2f} ms" for a, b in ahead)
    print(f"[timeline {label}] wall {wall * 1e3:.1f} ms: {phases}; {queued}")
    print("  chunk   asked    read  landed |  h2d start    end")
    for k in sorted(rows):
        r = rows[k]
        dev = (f"{base.elapsed_time(copies[k][0]):9.2f} {base.elapsed_time(copies[k][1]):6.2f}"
               if k < len(copies) else "")
        print(f"  {k:5d} {r.get('ask', -1) * 1e3:7.2f} {r.get('read', -1) * 1e3:7.2f} "
              f"{r.get('landed', -1) * 1e3:7.2f} | {dev}", flush=True)


def ahead_ab(model, path, files, ways: list[str], rounds: int, h2d: float) -> None:
    """First reloads, `rounds` rounds of one per way, interleaved: one host, one A/B. A way is
    ``QUEUE[/pMiB][/sSLOTS][/cMiB]``: how the host backup is queued (all, start, lazy, pin:
    see --ahead), and the ring's part size (0: a slot per chunk), slots and chunk size
    (default: the package's). Each way keeps its own ring (no ring is made in the timing)."""
    from fp8_reload.checkpoint import read_procs
    from fp8_reload.checkpoint.staging import held

    real_commit = to_device.commit_cuda
    defaults = (ch.PART_BYTES, ch.RING_SLOTS, ch.CHUNK_BYTES)

    def commit_with(queue):
        def commit(*a, **k):
            inner = k.get("backup_ahead")
            if queue == "lazy":
                k["backup_ahead"] = None
            elif queue == "start" and inner is not None:
                k["backup_ahead"] = inner.__self__._start_if_asked
            return real_commit(*a, **k)
        return commit

    def shape(way):
        got = dict(zip("psc", defaults))
        for tok in way.split("/")[1:]:
            got[tok[0]] = int(tok[1:]) * (MiB if tok[0] in "pc" else 1)
        return got["p"], got["s"], got["c"]

    every = os.sched_getaffinity(0)

    def pin(on: bool) -> None:
        """"pin": the reader processes on every core but the first, this thread on it."""
        procs = read_procs.pool()
        for p in procs.procs:
            os.sched_setaffinity(p.pid, every - {min(every)} if on else every)
        os.sched_setaffinity(0, {min(every)} if on else every)

    walls: dict = {w: [] for w in ways}
    rings: dict = {}
    try:
        for r in range(rounds + 1):  # (round 0 makes each way's ring: not counted)
            for way in ways:
                queue = way.split("/")[0]
                to_device.commit_cuda = commit_with(queue)
                ch.PART_BYTES, ch.RING_SLOTS, ch.CHUNK_BYTES = shape(way)
                held(model)["ring"] = rings.get(way)
                pin(queue == "pin")
                io_paths.touch(files)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fr.update_weights_from_disk(model, path)
                torch.cuda.synchronize()
                if r:
                    walls[way].append(time.perf_counter() - t0)
                rings[way] = held(model)["ring"]
    finally:
        to_device.commit_cuda = real_commit
        ch.PART_BYTES, ch.RING_SLOTS, ch.CHUNK_BYTES = defaults
        pin(False)
    for way, ws in walls.items():
        print(f"[first reload, {way}] {rounds} interleaved: median {statistics.median(ws) * 1e3:.1f} ms "
              f"({h2d / statistics.median(ws):.0%} of H2D), best {min(ws) * 1e3:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kind", default="fp8")
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--slots", default="4,8")
    ap.add_argument("--chunks", default="64")
    ap.add_argument("--reloads", type=int, default=3)
    ap.add_argument("--alone", default=None,
                    help="ring shapes (SxMiB,...) of part 2; default: --slots x --chunks")
    ap.add_argument("--timeline", action="store_true",
                    help="then one first reload per shape, each chunk's times (host and host-to-device copy)")
    ap.add_argument("--ahead", default="",
                    help="then first reloads, rounds interleaved, per way QUEUE[/pMiB][/sSLOTS][/cMiB]: "
                         "QUEUE, how the backup is queued: all (the package's: all of it while the first "
                         "chunks are read), start (its start only; the rest as the writes ask), lazy "
                         "(all as the writes ask), pin (all, the readers kept off the core of the thread "
                         "landing the chunks); then the ring's part size, slots, chunk size")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    path = ensure_checkpoint(Path(args.dir) / f"v2-lite-{args.layers}-{args.kind}", "v2-lite", args.layers,
                             args.kind, fill="fast")
    files = io_paths.shard_files(path)
    nbytes = io_paths.total_bytes(files)
    gb = nbytes / 1e9
    shapes = [(int(s), int(c)) for s in args.slots.split(",") for c in args.chunks.split(",")]
    print(f"{torch.cuda.get_device_name()}, {gb:.2f} GB in {len(files)} files, "
          f"readers {ch.READ_THREADS}, piece {ch.piece_bytes(64 * MiB) / MiB:.1f} MiB of 64", flush=True)

    h2d = limits(files, nbytes)
    ckpt = fr.Checkpoint(path)
    alone = shapes if args.alone is None else [tuple(map(int, x.split("x"))) for x in args.alone.split(",")]
    beside = (torch.empty(nbytes, dtype=torch.uint8, device="cuda"), io_paths.pinned(nbytes))
    for slots, cmib in alone:
        ring_alone(ckpt, files, slots, cmib, gb, h2d, beside)
    del beside
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    to_device.REGISTER = "never"
    real_landed = ring_mod._landed
    lands: list = []

    def landed(ring, q, chunks, parts, land, stats):
        t0 = time.perf_counter()
        real_landed(ring, q, chunks, parts, land, stats)
        lands.append(time.perf_counter() - t0)
        slot = q % len(ring.buffers)
        if ring.events[slot] is not None:
            ring.events[slot] = TimedEvent(ring.events[slot])

    ring_mod._landed = landed
    real_stream = to_device.stream_through_ring
    ring_done = [0.0]

    def stream(*a, **k):
        real_stream(*a, **k)
        ring_done[0] = time.perf_counter()

    to_device.stream_through_ring = stream
    for slots, cmib in shapes:
        ch.RING_SLOTS, ch.CHUNK_BYTES = slots, cmib * MiB
        walls, after = [], []
        for _ in range(args.reloads + 1):
            io_paths.touch(files)
            lands.clear()
            TimedEvent.waited = 0.0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = fr.update_weights_from_disk(model, path)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            after.append(t0 + walls[-1] - ring_done[0])
        phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items())
        w = min(walls[1:])
        each = " ".join(f"{x * 1e3:.0f}" for x in walls)
        print(f"[first reload, ring {slots}x{cmib} MiB, parts {ch.PART_BYTES >> 20} MiB]"
              f" best {w * 1e3:.1f} ms ({h2d / w:.0%} of H2D), walls {each}"
              f"; last: {phases}; land x{len(lands)} {sum(lands) * 1e3:.1f} ms; slot events waited "
              f"{TimedEvent.waited * 1e3:.1f} ms; after the ring {after[-1] * 1e3:.1f} ms", flush=True)
    ring_mod._landed = real_landed
    if args.ahead:
        ch.RING_SLOTS, ch.CHUNK_BYTES = shapes[0][0], shapes[0][1] * MiB
        ahead_ab(model, path, files, args.ahead.split(","), args.rounds, h2d)
    to_device.stream_through_ring = real_stream
    if args.timeline:
        for slots, cmib in shapes:
            ch.RING_SLOTS, ch.CHUNK_BYTES = slots, cmib * MiB
            timeline(model, path, files, f"{slots}x{cmib} MiB")
    fr.release_staging(model)
    fresh = fr.load_model(path, device="cuda")
    same = all(torch.equal(fr.state.raw_bytes(a), fr.state.raw_bytes(b)) for a, b in
               zip((*model.parameters(), *model.buffers()), (*fresh.parameters(), *fresh.buffers())))
    print("after all of it, reload == fresh load bit for bit:", same, flush=True)


if __name__ == "__main__":
    main()
