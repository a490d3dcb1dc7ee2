"""Where a repeated reload's host time goes, step by step (issue 13): no profiler.

    python3 gpu/host_timeline.py fp8,bf16 [--filtered]

Per checkpoint kind (v2-lite:4, page-cached, shards registered), the 4th of four repeated
full reloads with the backup on the host, then on the device: when each instrumented
step started and how long it ran (ms from the reload's start, the thread it ran on), runs
of the same per-chunk step merged. The steps: planning, registration, `prepare`, the
backup's capture, plan (`kept_plan`), begin, start and queueing, each chunk's copy in
(`_to_slot`) and writes (`_write_out`, `_quantize_chunk`), the loaders' read
(`_read_checked`, on its own thread), post-processing. `--filtered`: reloads of one
expert per MoE layer (EPLB's step, issue 13's "<= 3 ms"), with the commit's own steps
too (the copy tables, the value checks, the backup's completion) and the wall time to
the device's end. torch.profiler's own work inflates these several times
(`trace_reload.py`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

import fp8_reload as fr  # noqa: E402
import fp8_reload.kernels.triton.copy_rows as copy_rows  # noqa: E402
import fp8_reload.reload.backup as bk  # noqa: E402
import fp8_reload.reload.stream as st  # noqa: E402
import fp8_reload.reload.to_device as td  # noqa: E402
import fp8_reload.reload.transaction as tx  # noqa: E402
from fp8_reload.checkpoint import Checkpoint, ensure_checkpoint  # noqa: E402

STEPS = ((bk.Backup, "start"), (bk, "kept_plan"), (bk.Backup, "begin"), (bk.Backup, "_queue"),
         (td, "_to_slot"), (td, "_write_out"), (td, "_quantize_chunk"), (st, "_read_checked"), (st, "commit"),
         (tx, "process_modules"), (tx, "prepare"), (tx, "capture_backup"), (tx, "registered_files"),
         (tx, "plan_reload"), (tx, "synchronize"), (tx, "open_checkpoint"), (tx, "registered_now"),
         (tx, "checkpoint_stamp"), (tx, "release_dropped"), (td, "commit_cuda"), (td.RowTables, "get"),
         (td, "nonfinite_flags"), (bk.Backup, "complete"), (bk.Backup, "run"), (st, "_write_scalars"),
         (st, "mark_loaded"), (bk, "copy_async"), (bk.staging, "typed_slice"), (td, "copy_async"),
         (Checkpoint, "settled"), (copy_rows, "launch_rows_"))
PER_CHUNK = ("_to_slot", "_write_out", "_queue", "_quantize_chunk", "copy_async", "typed_slice",
             "settled")  # merged while they repeat


def instrument(log: list, t0: list) -> None:
    """Wrap every step of `STEPS` to append (name, thread, start, duration) to `log`."""
    for owner, name in STEPS:
        real = getattr(owner, name)

        @functools.wraps(real)
        def timed(*a, _real=real, _name=name, **k):
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                thread = threading.current_thread().name[:6]
                log.append((_name, thread, t - t0[0], time.perf_counter() - t))

        setattr(owner, name, timed)


def merged(log: list) -> list:
    out = []
    for name, thread, t, d in sorted(log, key=lambda x: x[2]):
        if out and out[-1][:2] == (name, thread) and name in PER_CHUNK:
            _, _, start, total, n, _ = out[-1]
            out[-1] = (name, thread, start, total + d, n + 1, t + d)
        else:
            out.append((name, thread, t, d, 1, t + d))
    return out


def main() -> None:
    log: list = []
    t0 = [0.0]
    instrument(log, t0)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    filtered = "--filtered" in sys.argv
    for kind in (args[0] if args else "fp8,bf16").split(","):
        path = ensure_checkpoint(Path("/tmp/ckpt_io") / f"v2-lite-4-{kind}", "v2-lite", 4, kind, fill="fast")
        model = fr.load_model(path, device="cuda")
        fr.release_staging(model)
        flt = fr.generate_weight_name_filter({n: [0] for n in model.config.moe_layers}) if filtered else None
        if filtered:
            time.sleep(fr.checkpoint.files.SETTLED_NS / 1e9 + 0.1)  # files at rest, as EPLB reads them
        for backup in ("host", "device"):
            for _ in range(4 if not filtered else 12):
                log.clear()
                torch.cuda.synchronize()
                t0[0] = time.perf_counter()
                rep = fr.update_weights_from_disk(model, path, flt, backup=backup)
                returned = (time.perf_counter() - t0[0]) * 1e3
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0[0]) * 1e3
            print(f"== {kind} {backup}{' filtered' if filtered else ''}: wall {wall:.2f} ms "
                  f"(returned at {returned:.2f}); " + rep.summary())
            for name, thread, t, d, n, end in merged(log)[:90]:
                print(f"  {t * 1e3:8.2f} .. {end * 1e3:8.2f}  {name:<18} x{n:<3} {d * 1e3:7.2f} ms"
                      f"  [{thread}]")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
