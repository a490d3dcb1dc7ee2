"""Where the host time of one reloaded FP8 expert's processing goes, on this GPU's host.

    python3 gpu/expert_host_probe.py

Through the asv benchmark's fixture (`benchmarks.fixtures.UnprocessedLayer`, v2-lite:2 fp8,
one expert loaded again), medians in microseconds:
  wall     process() from the restored state to the end of a sync (what asv times;
           `process_probe.per_call`)
  python   process() back to back with the launch replaced by nothing (the Python around it)
  launch   the captured launch alone, back to back (`requant._launch` with its arguments)
  sync     torch.cuda.synchronize() with nothing queued (the benchmark's closing sync)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "gpu")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["FP8_RELOAD_BENCH_DEVICE"] = "cuda"

from process_probe import per_call  # noqa: E402

import fp8_reload as fr  # noqa: E402
from benchmarks.fixtures import UnprocessedLayer  # noqa: E402
from fp8_reload.kernels.triton import requant  # noqa: E402
from fp8_reload.testing import host_time_per_call  # noqa: E402


def main() -> None:
    print("tree", ROOT, "torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
        path = str(fr.write_checkpoint(Path(tmp) / "fp8", cfg, kind="fp8", progress=False, fill="fast"))
        state = UnprocessedLayer.get(path, "fixed", "one")
        layer, loaded = state.layer, set(state.layer.loaded_experts)

        def again():
            layer.loaded_experts = set(loaded)
            state.process()

        rows = {"wall": per_call(state, 300)[0]}
        real, captured = requant._launch, []
        requant._launch = lambda *a: captured.append(a) if not captured else None
        try:
            rows["python"] = host_time_per_call(again, 2000, warmup=10) * 1e6
        finally:
            requant._launch = real
        rows["launch"] = host_time_per_call(lambda: real(*captured[0]), 800, warmup=10) * 1e6
        torch.cuda.synchronize()
        rows["sync"] = host_time_per_call(torch.cuda.synchronize, 2000, warmup=10) * 1e6
        rows["wall again"] = per_call(state, 300)[0]
        state.restore()
    print("[expert host] " + ", ".join(f"{k} {v:.1f} us" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
