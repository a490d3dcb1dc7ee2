"""Where a filtered reload's host time goes (one expert per MoE layer, the EPLB step of
issue 13's "<= 3 ms" goal): phases of 20 reloads, then the same 20 under cProfile, the
functions by their own time and with their callees, so a blocking call (an event wait, a
read-back, a pageable copy) shows up by name.

    python3 gpu/filtered_probe.py [--layers 4] [--kinds fp8,bf16] [--dir /tmp/ckpt_io]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import fp8_reload as fr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    for kind in args.kinds.split(","):
        path = Path(args.dir) / f"v2-lite-{args.layers}-{kind}"
        if not (path / "config.json").exists():
            cfg = fr.MoEConfig.preset("v2-lite", num_layers=args.layers)
            fr.write_checkpoint(path, cfg, kind=kind, fill="fast", progress=False)
        model = fr.load_model(path, device="cuda")
        flt = fr.generate_weight_name_filter({layer: [0] for layer in model.config.moe_layers})
        time.sleep(fr.checkpoint.files.SETTLED_NS / 1e9 + 0.1)  # files at rest, as EPLB reads them
        for _ in range(5):  # registered from the second on; tables, kernels warm
            fr.update_weights_from_disk(model, path, flt)
        walls, phases = [], {}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            rep = fr.update_weights_from_disk(model, path, flt)
            walls.append(time.perf_counter() - t0)
            for k, v in rep.seconds.items():
                phases.setdefault(k, []).append(v)
        med = ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in phases.items())
        print(f"[{kind}] filtered reload: best {min(walls) * 1e3:.2f} ms, median "
              f"{statistics.median(walls) * 1e3:.2f} ms; phases (median): {med}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeat):
            fr.update_weights_from_disk(model, path, flt)
        prof.disable()
        for order, label in (("tottime", "own time"), ("cumulative", "time with callees")):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
            print(f"[{kind}] cProfile, {args.repeat} reloads, by {label}:")
            print("\n".join(text.getvalue().splitlines()[:40]))
        fr.release_staging(model)


if __name__ == "__main__":
    main()
