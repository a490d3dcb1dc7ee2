"""Where a reload's (and a processing call's) time goes on the device timeline, from a
torch.profiler (CUPTI) trace: Nsight Systems cannot write reports on the H200 host.

    python3 gpu/trace_reload.py --out $OUT/trace [--layers 4]

Per traced call: wall time; per CUDA stream, the copies (by direction) and kernels with
their summed durations and the span from first start to last end; the host-side CUDA API
calls (count, summed time); and a 20-bin busy profile per stream, so a reader sees what
overlaps and what waits. Chrome traces are written beside (gzip).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import os
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fp8_reload as fr
from fp8_reload.reload import backup as backup_mod
from fp8_reload.reload import to_device
from fp8_reload.testing import io_paths


def kind_of(ev) -> str:
    name = ev.name.lower()
    if "memcpy" in name:
        for d in ("htod", "dtoh", "dtod"):
            if d in name.replace(" ", "").replace("_", ""):
                return "copy " + d
        return "copy"
    if "memset" in name:
        return "memset"
    return "kernel"


def summarize(prof, label: str, wall_ms: float, lines: list[str]) -> None:
    # (the profiler also puts each host range, e.g. "fp8_reload/ring", on the device timeline
    # of the streams it queued work on, spanning it all: not device work. Counted as kernels
    # up to e03fb49, they made the writes stream look busy throughout: its copy_rows launches
    # take 1.1-1.4 ms a reload, results/h200/reload-engine/copy_rows_probe-e03fb49.txt)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and not e.name.startswith("fp8_reload/")]
    host = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CUDA]
    lines.append(f"## {label}: wall {wall_ms:.2f} ms")
    if not events:
        lines.append("(no device events)")
        return
    t0 = min(e.time_range.start for e in events)
    t1 = max(e.time_range.end for e in events)
    per = collections.defaultdict(list)
    for e in events:
        per[(getattr(e, "device_resource_id", None) or 0, kind_of(e))].append(e)
    lines.append(f"device span {(t1 - t0) / 1e3:.2f} ms")
    lines.append("| stream | what | n | sum ms | span ms | top names |")
    lines.append("|---|---|---|---|---|---|")
    for (stream, kind), evs in sorted(per.items()):
        s = sum(e.time_range.end - e.time_range.start for e in evs) / 1e3
        span = (max(e.time_range.end for e in evs) - min(e.time_range.start for e in evs)) / 1e3
        names = collections.Counter(e.name[:40] for e in evs).most_common(2)
        lines.append(f"| {stream} | {kind} | {len(evs)} | {s:.2f} | {span:.2f} | {names} |")
    bins = 20
    width = max(1, (t1 - t0) / bins)
    lines.append(f"busy per stream, {bins} bins of {width / 1e3:.2f} ms (0-9: tenths busy)")
    for stream in sorted({k[0] for k in per}):
        busy = [0.0] * bins
        for (s, _), evs in per.items():
            if s != stream:
                continue
            for e in evs:
                a, b = e.time_range.start - t0, e.time_range.end - t0
                for i in range(int(a // width), min(bins, int(b // width) + 1)):
                    lo, hi = i * width, (i + 1) * width
                    busy[i] += max(0, min(b, hi) - max(a, lo))
        lines.append(f"  stream {stream:>3}: " + "".join(str(min(9, int(10 * x / width))) for x in busy))
    for stream in sorted({k[0] for k in per}):  # where a stream idles between its first and last op
        evs = sorted((e for (s, _), es in per.items() if s == stream for e in es),
                     key=lambda e: e.time_range.start)
        gaps = [(b.time_range.start - a.time_range.end, a.time_range.end - t0) for a, b in zip(evs, evs[1:])]
        gaps = sorted((g for g in gaps if g[0] > 5), reverse=True)
        if gaps:
            top = ", ".join(f"{g:.0f} us at {at / 1e3:.2f} ms" for g, at in gaps[:4])
            idle = sum(g for g, _ in gaps) / 1e3
            lines.append(f"  stream {stream:>3} idle: {len(gaps)} gaps > 5 us, {idle:.2f} ms in all; "
                         f"longest {top}")
    lines.append("host CUDA API: " + _top(host, ("cu",), 8))
    lines.append("host ops/ranges (inclusive): " + _top(host, ("aten::", "fp8_reload"), 10))
    lines.append("")


def _top(events, prefixes: tuple[str, ...], n: int) -> str:
    """The `n` event names (starting with one of `prefixes`) of most summed time."""
    total = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.name.startswith(prefixes):
            total[e.name][0] += 1
            total[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(total.items(), key=lambda kv: -kv[1][1])[:n]
    return "; ".join(f"{k} x{c} {ms:.2f} ms" for k, (c, ms) in top)


def traced(fn, label: str, out: Path, lines: list[str], warm: int = 2) -> None:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    summarize(prof, label, wall, lines)
    print("\n".join(lines[-40:]), flush=True)
    raw = out / (label.replace(" ", "_").replace("/", "-") + ".json")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out") + "/trace")
    ap.add_argument("--what", default="reload,process")
    ap.add_argument("--kinds", default="fp8,bf16")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    what = args.what.split(",")
    if "reload" in what:
        registering = to_device.REGISTER
        for kind in args.kinds.split(","):
            cfg = fr.MoEConfig.preset("v2-lite", num_layers=args.layers)
            path = Path(args.dir) / f"v2-lite-{args.layers}-{kind}"
            if not (path / "config.json").exists():
                fr.write_checkpoint(path, cfg, kind=kind, fill="fast", progress=False)
            model = fr.load_model(path, device="cuda")
            fr.release_staging(model)
            flt = fr.generate_weight_name_filter({layer: [0] for layer in cfg.moe_layers})
            reload = functools.partial(fr.update_weights_from_disk, model, path)
            traced(reload, f"{kind} full reload repeated", out, lines)
            share, backup_mod.ON_DEVICE = backup_mod.ON_DEVICE, 0
            try:
                traced(reload, f"{kind} full reload repeated, no backup on the device", out, lines)
            finally:
                backup_mod.ON_DEVICE = share
            traced(functools.partial(reload, backup="device"), f"{kind} full reload repeated, device backup",
                   out, lines)
            traced(functools.partial(reload, flt), f"{kind} filtered 1 per layer", out, lines)
            files = sorted(str(f) for f in path.glob("*.safetensors"))

            def first(reload=reload, files=files):  # new stamps: parsed, checked, read through the ring
                io_paths.touch(files)
                reload()

            traced(first, f"{kind} first reload", out, lines)
            to_device.REGISTER = "never"  # the ring without the first reload's parse and checks
            try:
                traced(reload, f"{kind} repeated reload through the ring", out, lines)
            finally:
                to_device.REGISTER = registering
            del model
            torch.cuda.empty_cache()
    if "process" in what:
        os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"
        from benchmarks.fixtures import UnprocessedLayer

        cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
        for kind in ("fp8", "bf16"):
            path = Path(args.dir) / f"v2-lite-2-{kind}"
            if not (path / "config.json").exists():
                fr.write_checkpoint(path, cfg, kind=kind, fill="fast", progress=False)
            for scope in ("all", "one"):
                state = UnprocessedLayer.get(str(path), "fixed", scope)

                def once(state=state):
                    state.restore()
                    torch.cuda.synchronize()
                    state.process()

                traced(once, f"process {kind} {scope}", out, lines)
            UnprocessedLayer._cache.clear()
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
