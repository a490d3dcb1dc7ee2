"""An A/B of two package trees on the reload figures of issue 13, rounds interleaved.

    python3 gpu/ab_reload.py OLD_TREE [NEW_TREE=.] [--kinds fp8,bf16] [--rounds 4] [--figures first,...]

Each round runs one process per tree (its `fp8_reload` first on `sys.path`), tree order
alternating from round to round: a model loaded on the GPU, two reloads (the second
registers the shards), then per figure the median of a few: repeated full reloads (host
backup, device backup), first reloads (files touched: parsed, checked, read through the
ring; backup in host or in device memory), filtered reloads (1 expert per MoE layer);
and the second reload of each process (its shards registered then). The first reloads run
last in each process, and every process waits until the files are at rest before its first
reload (a reload of files touched less than 2 s ago re-reads scales and re-checks values, as
a first reload does). The H2D limit (one pinned copy of the files' size, best of 5) is measured
once in this run, by the parent before the rounds; filtered reloads move other bytes and get
no share of it. Every reload is checked bit for bit against a fresh load once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = "--child"


FIGURES = ("repeated", "device backup", "filtered", "first", "first device backup")


def child(tree: str, path: str, reps: int, figures: list[str]) -> dict:
    sys.path.insert(0, tree)
    import torch

    import fp8_reload as fr
    from fp8_reload.testing import io_paths

    assert Path(fr.__file__).resolve().is_relative_to(Path(tree).resolve()), fr.__file__
    files = io_paths.shard_files(path)
    model = fr.load_model(path, device="cuda")
    fr.release_staging(model)
    cfg = fr.Checkpoint(path).config
    flt = fr.generate_weight_name_filter({layer: [0] for layer in cfg.moe_layers})

    def wall(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def first(backup="host"):
        io_paths.touch(files)
        fr.update_weights_from_disk(model, path, backup=backup)

    # files at rest (the previous child's first reloads touched them), then the first two
    # reloads of the process (kernels compiled; the second registers the shards)
    io_paths.wait_settled(files)
    warm = [wall(lambda: fr.update_weights_from_disk(model, path)) for _ in range(2)]
    ways = {
        "repeated": lambda: fr.update_weights_from_disk(model, path),
        "device backup": lambda: fr.update_weights_from_disk(model, path, backup="device"),
        "filtered": lambda: fr.update_weights_from_disk(model, path, flt),
        "first": first,
        "first device backup": lambda: first("device"),
    }
    # the first reloads last: they touch the files, after which a reload is not a repeated
    # one for `SETTLED_NS`
    order = sorted(figures, key=lambda name: name.startswith("first"))
    out = {name: [wall(ways[name]) for _ in range(reps)] for name in order}
    out["second (registers)"] = warm[1:]
    fresh = fr.load_model(path, device="cuda")
    out["bit for bit"] = fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []
    return out


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split(","))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=".")
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/ckpt_io")
    ap.add_argument("--figures", default=",".join(FIGURES), help="comma list of: " + ", ".join(FIGURES))
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    import torch

    from fp8_reload.checkpoint import ensure_checkpoint
    from fp8_reload.testing import io_paths

    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for kind in args.kinds.split(","):
        path = ensure_checkpoint(Path(args.dir) / f"v2-lite-{args.layers}-{kind}", "v2-lite", args.layers,
                                 kind, fill="fast")
        nbytes = io_paths.total_bytes(io_paths.shard_files(path))
        copy = io_paths.PinnedCopy(nbytes, "cuda")
        limit = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            limit.append((time.perf_counter() - t) * 1e3)
        h2d = min(limit)
        del copy
        print(f"[{kind}] {nbytes / 1e9:.2f} GB; host->device limit {h2d:.1f} ms", flush=True)
        got: dict = {name: {} for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                cmd = [sys.executable, __file__, CHILD, trees[name], str(path), str(args.reps), args.figures]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    print(res.stderr[-3000:], flush=True)
                    raise SystemExit(f"{name} failed")
                one = json.loads(res.stdout.strip().splitlines()[-1])
                assert one.pop("bit for bit"), f"{name}: the reload is not bit for bit a fresh load"
                for fig, walls in one.items():
                    got[name].setdefault(fig, []).extend(walls)
                print(f"  round {r} {name}: " + ", ".join(f"{k} {statistics.median(v):.1f}"
                                                          for k, v in one.items()), flush=True)
        for fig in got["old"]:
            row = []
            for name in trees:
                ws = got[name][fig]
                med = statistics.median(ws)
                share = "" if fig == "filtered" else f" ({h2d / med:.0%} of H2D)"  # (other bytes)
                row.append(f"{name} median {med:.1f} ms{share}, best {min(ws):.1f}")
            print(f"[{kind}] {fig:>13}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
