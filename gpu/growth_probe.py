"""Where device memory that alternating full and filtered reloads keep comes from.

    python3 gpu/growth_probe.py [--kind fp8] [--reloads 600]

The soak's pattern on the tiny model (full reloads alternating two seeds, filtered
reloads of 1-4 random experts, a fresh model loaded and dropped every 100): after a
warm-up, torch's allocator records the stack of every allocation; at the end the blocks
still allocated that were made after the warm-up are printed with the frames of this
package that made them, grouped by site. (Without the fresh models it found nothing at
7634324 while the soak counted 27 new tickets: those came from the models it loads.)
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import tempfile

import torch

import fp8_reload as fr


def reload_pattern(model, paths, cfg, reloads: int, rng) -> None:
    experts = [(layer, e) for layer in cfg.moe_layers for e in range(cfg.num_experts)]
    for i in range(reloads):
        if i % 100 == 99:  # as the soak's checks: a fresh model loaded beside it, then dropped
            fresh = fr.load_model(paths[0], device="cuda")
            del fresh
        if i % 2 == 0:
            fr.update_weights_from_disk(model, paths[(i // 2) % 2])
            continue
        spec: dict = {}
        for layer, e in rng.sample(experts, rng.randint(1, 4)):
            spec.setdefault(layer, []).append(e)
        fr.update_weights_from_disk(model, paths[rng.randint(0, 1)], fr.generate_weight_name_filter(spec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="fp8")
    ap.add_argument("--reloads", type=int, default=600)
    args = ap.parse_args()
    cfg = fr.MoEConfig.preset("tiny")
    root = tempfile.mkdtemp()
    paths = [fr.write_checkpoint(f"{root}/{s}", cfg, seed=s, kind=args.kind, progress=False) for s in (0, 1)]
    model = fr.load_model(paths[0], device="cuda")
    rng = random.Random(1234)
    reload_pattern(model, paths, cfg, 100, rng)  # warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    reload_pattern(model, paths, cfg, args.reloads, rng)
    gc.collect()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"{args.kind}: {args.reloads} reloads after warm-up; allocated {before} -> "
          f"{torch.cuda.memory_allocated()} bytes")
    sites: collections.Counter = collections.Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            frames = blk.get("frames") or []
            if blk["state"] != "active_allocated" or not frames:
                continue
            ours = [f"{f['filename'].split('fp8_reload/')[-1]}:{f['line']} {f['name']}"
                    for f in frames if "fp8_reload/" in f["filename"]][:6]
            sites[(blk["size"], tuple(ours))] += 1
    for (size, ours), n in sites.most_common(10):
        print(f"  {n} blocks of {size} B kept, made at:")
        for line in ours:
            print(f"      {line}")
    if not sites:
        print("  no block made after the warm-up is still allocated")


if __name__ == "__main__":
    main()
