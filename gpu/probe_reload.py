"""Where the time of a reload goes on this machine (v2-lite slice): a probe, not a benchmark.

Prints: checkpoint size, read bandwidth (safetensors -> host), H2D bandwidth (pageable and
pinned), and the phases of full / filtered / upstream-style reloads.
"""

import argparse
import tempfile
import time

import torch

import fp8_reload as fr
from fp8_reload.checkpoint import Checkpoint


def timed(fn, n=3):
    best = float("inf")
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    cfg = fr.MoEConfig.preset("v2-lite", num_layers=args.layers)
    root = args.dir or tempfile.mkdtemp(prefix="probe-")
    t0 = time.perf_counter()
    path = fr.write_checkpoint(f"{root}/fp8", cfg, kind="fp8", progress=False)
    print(f"write {time.perf_counter() - t0:.1f}s")
    ck = Checkpoint(path)
    total = ck.total_bytes()
    print(f"checkpoint {total / 2**30:.2f} GiB, {len(ck.names)} tensors, "
          f"{len(set(ck.weight_map.values()))} shards")

    t_read, tensors = timed(lambda: list(ck.read(ck.names)), 2)
    print(f"safetensors read: {t_read:.3f}s = {total / t_read / 1e9:.1f} GB/s")
    dev = torch.device("cuda")

    def h2d(pin):
        out = []
        for _, t in tensors:
            src = t.pin_memory() if pin else t
            out.append(src.to(dev, non_blocking=pin))
        return out

    big = torch.empty(total, dtype=torch.uint8)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(total, dtype=torch.uint8, device=dev)
    t_pg, _ = timed(lambda: gpu.copy_(big))
    t_pn, _ = timed(lambda: gpu.copy_(pinned, non_blocking=True))
    t_d2h, _ = timed(lambda: pinned.copy_(gpu, non_blocking=True))
    print(f"one-shot H2D pageable {total / t_pg / 1e9:.1f} GB/s, pinned {total / t_pn / 1e9:.1f} GB/s, "
          f"D2H pinned {total / t_d2h / 1e9:.1f} GB/s")
    t_per, _ = timed(lambda: h2d(False), 2)
    print(f"per-tensor H2D pageable {total / t_per / 1e9:.1f} GB/s")
    t_raw, _ = timed(lambda: [t.to(dev) for _, t in ck.read(ck.names)], 2)
    print(f"raw bound (read + copy, per tensor): {t_raw:.3f}s")
    gpu = big = pinned = tensors = None  # free the buffers before loading the model

    model = fr.load_model(path, device="cuda")
    print("fresh load:", model.load_report.summary())
    flt = fr.generate_weight_name_filter({layer: [3] for layer in cfg.moe_layers})
    for label, kw in [("full", dict(weight_name_filter=None)),
                      ("1 expert/layer", dict(weight_name_filter=flt)),
                      ("1 expert/layer, scan_all", dict(weight_name_filter=flt, scan_all=True)),
                      ("1 expert/layer, upstream-style", dict(weight_name_filter=flt, scan_all=True,
                                                              postprocess_all=True))]:
        t, rep = timed(lambda kw=kw: fr.update_weights_from_disk(model, path, **kw), 2)
        print(f"{label:32s} {t * 1e3:8.1f} ms  {rep.summary()}")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fr.update_weights_from_disk(model, path)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"full reload device peak above model: {peak:.1f} MiB")


if __name__ == "__main__":
    main()
