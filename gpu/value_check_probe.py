"""The value check (`checkpoint.values.ValueCheck`): torch reductions vs one Triton launch per batch.

    python3 gpu/value_check_probe.py [--kinds fp8,bf16] [--layers 4] [--dir /tmp/ckpt_vc]

Per checkpoint (v2-lite slice, `fill="fast"`): every tensor read into the pinned
staging arena and copied to the device once; then `ValueCheck` timed (median of
`--repeat`, host clock around add + first_invalid, which waits for the device) with the
torch path forced (``kernel=False``) and with the kernel (``kernel=None``: Triton where
it runs), on tensors resident on the device and from the pinned arena (copied batch by
batch, as the staged engine checks); a full reload (`update_weights_from_disk`, same
checkpoint) is timed beside them, the goal being a check <= 3% of it. Both paths must
flag the same tensors, on the clean checkpoint and with invalid values planted (FP8
NaN bytes, inf, NaN, a zero and a negative scale): the probe asserts it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8_reload as fr  # noqa: E402
from fp8_reload.checkpoint import PinnedArena  # noqa: E402
from fp8_reload.checkpoint.values import ValueCheck, invalid_flags  # noqa: E402
from fp8_reload.kernels.registry import triton_unavailable  # noqa: E402


def timed_ms(fn, repeat: int) -> float:
    fn()  # warm-up (compiles the kernel once)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def validate(named, kernel):
    check = ValueCheck("cuda", kernel=kernel)
    for name, t in named:
        check.add(name, t)
    return check.first_invalid()


def flagged(named, kernel) -> set[str]:
    names, flags = invalid_flags(named, kernel=kernel)
    return {n for n, f in zip(names, flags.tolist()) if f}


def planted(resident):
    """A copy of some tensors with one invalid value each; the names expected flagged."""
    out, bad = list(resident), set()
    want = {torch.float8_e4m3fn: 0, torch.bfloat16: 0, "scale0": 0, "scale-": 0}
    for i, (name, t) in enumerate(out):
        if t.numel() == 0 or not t.is_floating_point():
            continue
        t = t.clone()
        if t.dtype == torch.float8_e4m3fn and want[t.dtype] < 2:
            t.view(torch.uint8).view(-1)[t.numel() // 2] = 0x7F if want[t.dtype] else 0xFF
            want[t.dtype] += 1
        elif t.dtype == torch.bfloat16 and want[t.dtype] < 2 and not name.endswith("_scale"):
            t.view(-1)[-1] = float("inf") if want[t.dtype] else float("nan")
            want[t.dtype] += 1
        elif name.endswith("_scale") and t.dtype == torch.float32 and want["scale0"] < 1:
            t.view(-1)[0] = 0.0
            want["scale0"] += 1
        elif name.endswith("_scale") and t.dtype == torch.float32 and want["scale-"] < 1:
            t.view(-1)[0] = -1.0
            want["scale-"] += 1
        else:
            continue
        out[i] = (name, t)
        bad.add(name)
    return out, bad


def full_reload_ms(path: Path, repeat: int) -> float:
    model = fr.load_model(path, device="cuda")
    return timed_ms(lambda: fr.update_weights_from_disk(model, path), repeat)


def probe(path: Path, label: str, repeat: int) -> None:
    ckpt = fr.Checkpoint(path)
    staged = list(ckpt.read(ckpt.names, {}, into=PinnedArena()))
    resident = [(n, t.to("cuda")) for n, t in staged]
    nbytes = sum(t.numel() * t.element_size() for _, t in staged)
    print(f"== {label}: {len(staged)} tensors, {nbytes / 2**30:.2f} GiB", flush=True)

    for what, named in (("clean", resident), ("planted", None)):
        if named is None:
            named, want = planted(resident)
        else:
            want = set()
        torch_bad, kernel_bad = flagged(named, False), flagged(named, True)
        assert torch_bad == kernel_bad == want, (what, torch_bad ^ kernel_bad, want)
        found = validate(named, False), validate(named, None)
        assert found[0] == found[1], found
        print(f"   {what}: both paths flag the same {len(want)} tensors; first: {found[0]}", flush=True)

    reload_ms = full_reload_ms(path, max(3, repeat // 4))
    print(f"   full reload (update_weights_from_disk): {reload_ms:.1f} ms", flush=True)
    for where, named in (("resident", resident), ("from pinned", staged)):
        for name, kernel in (("torch", False), ("triton", None)):
            ms = timed_ms(lambda named=named, kernel=kernel: validate(named, kernel), repeat)
            print(f"   {where:12s} {name:7s} {ms:8.2f} ms  ({100 * ms / reload_ms:5.1f}% of a reload)",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/ckpt_vc")
    args = ap.parse_args()
    why = triton_unavailable()
    if why is not None:
        print(f"value_check_probe: nothing to measure here: {why}")
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for kind in args.kinds.split(","):
        cfg = fr.MoEConfig.preset("v2-lite", num_layers=args.layers)
        path = Path(args.dir) / f"v2-lite-{args.layers}-{kind}"
        if not (path / "config.json").exists():
            fr.write_checkpoint(path, cfg, kind=kind, fill="fast", progress=False)
        probe(path, f"v2-lite:{args.layers} {kind}", args.repeat)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
