"""Reload speed beside the machine's limits and the field's loaders, one run, one table.

    python3 gpu/reload_io.py --layers 4 --kinds fp8 --out $OUT/reload_io-fp8 [--whole]

(one process per checkpoint kind: a library's leftover threads slow the Python measured
after it; within a process fp8-reload's rows run before the libraries')

Per checkpoint (v2-lite slice, `fill="fast"`: valid values written at disk speed):
the pinned host-to-device limit and the page-cache read limit (measured here, same
bytes), InstantTensor / safetensors / fastsafetensors into preallocated device
tensors, and fp8-reload's `update_weights_from_disk`: staged engine, streaming first
reload (fresh stamps: nothing registered or checked), repeated reloads (registered
shards), a filtered reload of one expert per MoE layer; then cold (evicted) runs.
``--quick``: the limits and fp8-reload's streaming rows only. Writes table.md and rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from unittest.mock import patch

import torch

import fp8_reload as fr
import fp8_reload.reload.chunks as chunks
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as transaction
from fp8_reload.checkpoint.staging import held
from fp8_reload.testing import io_paths

GB = 1e9


def timed(fn, repeat=1):
    times, out = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def one_per_layer(cfg):
    return fr.generate_weight_name_filter({layer: [0] for layer in cfg.moe_layers})


def run_checkpoint(path, label, rows, whole=False, quick=False):
    files = io_paths.shard_files(path)
    ckpt = fr.Checkpoint(path)
    names = ckpt.names
    total = sum(ckpt.info(n).nbytes for n in names)
    file_bytes = io_paths.total_bytes(files)  # headers too: what the limits move
    limit = io_paths.PinnedCopy(file_bytes, "cuda")

    def row(what, seconds, nbytes=total, **extra):
        r = {"checkpoint": label, "path": what, "ms": seconds * 1e3,
             "GB/s": nbytes / seconds / GB if nbytes else None, "bytes": nbytes, **extra}
        rows.append(r)
        gbs = f"{r['GB/s']:.1f} GB/s" if nbytes else ""
        print(f"[{label}] {what:58s} {r['ms']:9.1f} ms {gbs} {extra.get('phases', '')}", flush=True)
        return r

    h2d, _ = timed(limit, repeat=5)
    row("host->device, one pinned buffer, one copy (limit)", h2d, file_bytes)
    if not whole:  # (three more copies of the checkpoint's size: not for the whole model)
        duplex = io_paths.DuplexCopy(file_bytes, "cuda")
        both, _ = timed(duplex, repeat=5)
        row("both ways at once, one copy each (limit with a host backup)", both, file_bytes)
        del duplex
    read, _ = timed(lambda: io_paths.page_cache_read(files, limit.src), repeat=3)
    row("page cache -> pinned, 16 threads preadv, 64 MiB (limit)", read, file_bytes)

    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)  # the fresh load's staging arena: not the reload's business
    phases = lambda rep: ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rep.seconds.items())  # noqa: E731
    firsts = []
    for _ in range(3):
        io_paths.touch(files)
        s, rep = timed(lambda: fr.update_weights_from_disk(model, path))
        firsts.append((s, rep))
    s, rep = sorted(firsts, key=lambda x: x[0])[1]
    row("fp8-reload streaming, first reload (new stamps)", s, rep.bytes_read, phases=phases(rep))
    # the rows below reload files at rest (as EPLB does): written more than `files.SETTLED_NS`
    # ago, else each reload re-reads their scales and re-checks their values
    io_paths.wait_settled(files)
    s, rep = timed(lambda: fr.update_weights_from_disk(model, path))  # 2nd read: registers
    row("fp8-reload streaming, second reload (registers shards)", s, rep.bytes_read, phases=phases(rep))
    s, rep = timed(lambda: fr.update_weights_from_disk(model, path), repeat=5)
    row("fp8-reload streaming, repeated reload (registered)", s, rep.bytes_read, phases=phases(rep))
    s, rep = timed(lambda: fr.update_weights_from_disk(model, path, backup="device"), repeat=5)
    row("  the same, backup in device memory (+1 model of device memory)", s, rep.bytes_read,
        phases=phases(rep))

    flt = one_per_layer(model.config)
    fr.update_weights_from_disk(model, path, flt)
    s, rep = timed(lambda: fr.update_weights_from_disk(model, path, flt), repeat=20)
    row("fp8-reload filtered, 1 expert per MoE layer", s, rep.bytes_read, phases=phases(rep),
        filtered=True)
    held(model)["registered"].release()  # the first two EPLB steps: through the readers' ring
    with patch.object(to_device, "REGISTER", "never"):
        s, rep = timed(lambda: fr.update_weights_from_disk(model, path, flt), repeat=20)
    row("  the same through the ring (shards not registered yet)", s, rep.bytes_read,
        phases=phases(rep), filtered=True)

    if quick:  # fp8-reload's rows and the limits only
        return _same_as_fresh(model, path, label, limit)
    if not whole:  # the engine before, after the streaming rows (what it leaves must not touch them)
        with patch.object(transaction, "ENGINE", "staged"):  # (put back whatever happens)
            fr.update_weights_from_disk(model, path)
            s, rep = timed(lambda: fr.update_weights_from_disk(model, path), repeat=3)
        row("fp8-reload, staged engine (before), full", s, rep.bytes_read, phases=phases(rep))

    # the field's loaders after fp8-reload's rows: threads a library leaves behind must not
    # slow the rows measured after it (fp8-reload's host work is Python)
    dst = io_paths.device_targets(path, names, "cuda")
    for io, fn in (("instanttensor", lambda: io_paths.load_instanttensor(files, dst)),
                   ("safetensors", lambda: io_paths.load_safetensors(files, dst)),
                   ("fastsafetensors", lambda: io_paths.load_fastsafetensors(files, dst))):
        if whole and io != "instanttensor":
            continue
        if not io_paths.available(io):
            print(f"[{label}] {io}: not installed, skipped")
            continue
        try:
            fn()  # warm-up: library init, buffers
            s, moved = timed(fn, repeat=3)
            row(f"{io} (buffered), all tensors into place", s, moved)
        except Exception as e:  # a library failing here is a result too
            print(f"[{label}] {io} failed: {type(e).__name__}: {e}")

    sel = [n for n in names if flt(n)]
    fdst = {n: dst[n] for n in sel}
    if io_paths.available("instanttensor"):
        s, moved = timed(lambda: io_paths.load_instanttensor(files, fdst), repeat=5)
        row("instanttensor, tensor filter, 1 expert per MoE layer", s, moved, filtered=True)

    # cold: files evicted (registrations released first: pinned pages cannot be dropped);
    # new stamps: a first reload, its values checked; FP8_RELOAD_IO's two ways
    for how in ("buffered", "direct"):
        if "registered" in held(model):
            held(model)["registered"].release()
        io_paths.touch(files)
        io_paths.evict(files)
        with patch.object(chunks, "READ_IO", how):
            s, rep = timed(lambda: fr.update_weights_from_disk(model, path))
        row(f"COLD fp8-reload streaming, {'buffered reads + readahead' if how == 'buffered' else 'O_DIRECT'}",
            s, rep.bytes_read, phases=phases(rep), direct_bytes=rep.bytes_direct)
    if io_paths.available("instanttensor"):
        for direct in (True, False):
            io_paths.evict(files)
            try:
                s, moved = timed(lambda d=direct: io_paths.load_instanttensor(files, dst, direct=d))
                row(f"COLD instanttensor ({'direct I/O default' if direct else 'buffered'})", s, moved)
            except Exception as e:
                print(f"[{label}] instanttensor cold failed: {type(e).__name__}: {e}")
    io_paths.evict(files)
    s, _ = timed(lambda: io_paths.page_cache_read(files, limit.src))
    row("COLD disk -> pinned, 16 threads preadv (limit)", s, file_bytes)
    limit.src = None  # (the O_DIRECT read puts each file on a block boundary: a little more)
    aligned = io_paths.pinned(io_paths.direct_bytes(files), io_paths.DIRECT_ALIGN)
    io_paths.evict(files)
    s, _ = timed(lambda: io_paths.page_cache_read(files, aligned, direct=True))
    row("COLD disk -> pinned, 16 threads preadv O_DIRECT (limit)", s, file_bytes)
    dst.clear()
    _same_as_fresh(model, path, label, limit)


def _same_as_fresh(model, path, label, limit) -> None:
    fr.release_staging(model)
    limit.src = limit.dst = None
    fresh = fr.load_model(path, device="cuda")
    fr.release_staging(fresh)
    same = all(torch.equal(fr.state.raw_bytes(a), fr.state.raw_bytes(b)) for a, b in
               zip((*model.parameters(), *model.buffers()), (*fresh.parameters(), *fresh.buffers())))
    print(f"[{label}] after all of it, reload == fresh load bit for bit: {same}", flush=True)
    assert same


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--whole", action="store_true", help="also the whole v2-lite (27 layers, fp8)")
    ap.add_argument("--quick", action="store_true",
                    help="fp8-reload's rows and the limits only (no staged engine, libraries or cold runs)")
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out") + "/reload_io")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    todo = [(kind, args.layers) for kind in args.kinds.split(",")]
    if args.whole:
        todo.append(("fp8", 27))
    for kind, layers in todo:
        cfg = fr.MoEConfig.preset("v2-lite", num_layers=layers)
        path = Path(args.dir) / f"v2-lite-{layers}-{kind}"
        t0 = time.perf_counter()
        if not (path / "config.json").exists():
            fr.write_checkpoint(path, cfg, kind=kind, fill="fast", progress=False)
        print(f"checkpoint {path.name}: {time.perf_counter() - t0:.1f} s to write", flush=True)
        try:
            run_checkpoint(path, f"v2-lite:{layers} {kind}", rows, whole=layers > 4, quick=args.quick)
        except Exception:  # the rows so far are kept; the next checkpoint still runs
            traceback.print_exc()
        torch.cuda.empty_cache()
        (out / "rows.json").write_text(json.dumps(rows, indent=1))
    lines = ["| checkpoint | path | ms | GB/s | of H2D limit |", "|---|---|---|---|---|"]
    limits = {r["checkpoint"]: r["GB/s"] for r in rows if r["path"].startswith("host->device")}
    for r in rows:
        whole = r["GB/s"] and not r.get("filtered")  # (a filtered reload moves other bytes)
        share = f"{100 * r['GB/s'] / limits[r['checkpoint']]:.0f}%" if whole else ""
        gbs = f"{r['GB/s']:.1f}" if r["GB/s"] else ""
        lines.append(f"| {r['checkpoint']} | {r['path']} | {r['ms']:.1f} | {gbs} | {share} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
