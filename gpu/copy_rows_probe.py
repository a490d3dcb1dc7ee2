"""How fast `copy_rows` moves a chunk on this GPU, alone and beside host-device copies.

    python3 gpu/copy_rows_probe.py

1. A 58 MiB chunk (a v2-lite:4 full reload's chunk size) copied from one device buffer into
   another as 1 row, as 64 rows, and as 1024 rows; each alone, then while a 1 GiB pinned
   host-to-device copy runs on another stream, then while a device-to-host one does.
2. The tables a v2-lite:4 fp8 model's repeated full reloads keep (one per chunk), each
   launched alone: rows, bytes, device time.
3. The same launches inside reloads (repeated, and first: new stamps): events recorded on
   the writes stream right before and after each launch (after the stream's waits for the
   chunk and its backup), their device time summed.
CUDA events around the launches: device time, GB/s of bytes read (HBM: ~4.8 TB/s).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())

import fp8_reload as fr  # noqa: E402
from fp8_reload.checkpoint.staging import held  # noqa: E402
from fp8_reload.kernels.triton import copy_rows  # noqa: E402
from fp8_reload.kernels.triton.copy_rows import launch_rows_, row_table  # noqa: E402
from fp8_reload.testing import io_paths  # noqa: E402


def timed(fn, reps=20) -> float:
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    dev = torch.device("cuda")
    n = 58 << 20
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    print("torch.copy_ of the chunk:", f"{timed(lambda: dst.copy_(src)):.3f} ms", flush=True)
    for rows in (1, 64, 1024):
        size = n // rows
        offs = torch.arange(rows, dtype=torch.int64) * size
        table = row_table(offs + src.data_ptr(), offs + dst.data_ptr(), torch.full((rows,), size), dev)
        run = lambda t=table: launch_rows_(t, dev)  # noqa: E731
        alone = timed(run)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            big.copy_(host, non_blocking=True)
        h2d = timed(run, reps=5)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            host.copy_(big, non_blocking=True)
        d2h = timed(run, reps=5)
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
        dst.zero_()
        print(f"copy_rows, {rows} rows: alone {alone:.3f} ms ({n / alone / 1e6:.0f} GB/s), beside a "
              f"host-to-device copy {h2d:.3f} ms, beside a device-to-host copy {d2h:.3f} ms", flush=True)
    del big, host
    path = "/tmp/c4"
    if not os.path.exists(f"{path}/config.json"):
        fr.write_checkpoint(path, fr.MoEConfig.preset("v2-lite", num_layers=4), kind="fp8", progress=False,
                            fill="fast")
    model = fr.load_model(path, device="cuda")
    for _ in range(2):
        fr.update_weights_from_disk(model, path)
    torch.cuda.synchronize()
    total, lines = 0.0, []
    for (_, copies), table in held(model)["row_tables"].tables.items():
        ms = timed(lambda t=table: launch_rows_(t, dev), reps=5)
        nbytes = sum(copies[2::3])
        total += ms
        lines.append(f"  {table.rows} rows, {nbytes / 2**20:.1f} MiB, {table.programs} programs: {ms:.3f} ms "
                     f"({nbytes / ms / 1e6:.0f} GB/s)")
    print(f"kept tables: {len(lines)}, {total:.2f} ms in all", *lines, sep="\n", flush=True)
    pairs = []

    def evented(rows, device):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch_rows_(rows, device)
        b.record()
        pairs.append((a, b))

    copy_rows.launch_rows_ = evented
    files = io_paths.shard_files(path)
    for label, first in (("repeated", False), ("first", True)):
        for _ in range(2):
            pairs.clear()
            if first:
                io_paths.touch(files)
            fr.update_weights_from_disk(model, path)
            torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in pairs]
        print(f"in a {label} reload: {len(ms)} launches, {sum(ms):.2f} ms in all, the longest "
              f"{max(ms):.3f} ms", flush=True)
    copy_rows.launch_rows_ = launch_rows_


if __name__ == "__main__":
    main()
