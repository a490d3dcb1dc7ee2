"""The suite's parameter lists, from the ``FP8_RELOAD_BENCH_*`` environment (see `common`).

Kept free of torch: a process that only looks up values measured elsewhere
(`grouped`) imports this, not torch, when ``FP8_RELOAD_BENCH_DEVICE`` is set
(`gpu/asv_suite.sh` sets it). Without it the default device needs torch's answer
to "is CUDA available", so torch is imported then.
"""

from __future__ import annotations

import os


def env_list(name: str, default: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, default).split(",") if v.strip()]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE = os.environ.get("FP8_RELOAD_BENCH_DEVICE") or _default_device()
ON_CUDA = DEVICE.startswith("cuda")

PRESETS = env_list("FP8_RELOAD_BENCH_PRESETS", "v2-lite:4" if ON_CUDA else "small")
KINDS = env_list("FP8_RELOAD_BENCH_KINDS", "fp8,bf16")
TOKENS = [int(t) for t in env_list("FP8_RELOAD_BENCH_TOKENS", "128,1024,4096" if ON_CUDA else "16,128")]
# Share of each MoE layer's routed experts a filtered reload moves ("1/layer": one expert).
FRACTIONS = ["1/layer", "10%", "50%", "100%"]
# Every forward backend the project knows; the ones missing here are skipped.
BACKENDS = ["torch", "triton", "deep_gemm", "deep_gemm_masked"]
# Page-cache states of the I/O group's cases (`grouped` measures these; "warm" alone skips
# the minutes of cold disk reads, e.g. to run the reload and I/O groups in one device call).
IO_CACHES = env_list("FP8_RELOAD_BENCH_IO_CACHES", "warm,cold")
if not IO_CACHES or set(IO_CACHES) - {"warm", "cold"}:
    raise ValueError(f"FP8_RELOAD_BENCH_IO_CACHES={os.environ.get('FP8_RELOAD_BENCH_IO_CACHES')!r}: "
                     "expected warm, cold or warm,cold")
# Tokens of the accuracy benchmark (one count: calc_diff hardly depends on it).
ACCURACY_TOKENS = [512] if ON_CUDA else [64]
