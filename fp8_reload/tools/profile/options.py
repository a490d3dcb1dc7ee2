"""The options and names of `fp8-reload profile` (light: imported by the command line)."""

from __future__ import annotations

import argparse

from ...config import MoEConfig

SCENARIOS = ("reload-full", "reload-filtered", "forward")
SCENARIO_PREFIX = "fp8_reload/scenario/"
PROFILE_RANGE = "fp8_reload/profile"
TOOLS = ("auto", "nsys", "torch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=False, default=None, help="output directory (created)")
    p.add_argument("--scenario", default="all",
                   help="reload-full | reload-filtered | forward | all (or a comma list)")
    p.add_argument("--tool", choices=TOOLS, default="auto",
                   help="auto: nsys when on PATH (falls back to torch.profiler if it fails)")
    p.add_argument("--backend", default=None, help="MoE forward backend (default: torch reference)")
    p.add_argument("--preset", default="small", choices=MoEConfig.PRESETS, help="model shape")
    p.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    p.add_argument("--kind", choices=("fp8", "bf16"), default="fp8", help="checkpoint kind")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--processing", default="fixed", help="processing mode (fixed, upstream, ...)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per forward")
    p.add_argument("--experts", type=int, default=2, help="experts per MoE layer in reload-filtered")
    p.add_argument("--repeat", type=int, default=3, help="profiled runs of each scenario")
    p.add_argument("--checkpoint", default=None, help="existing checkpoint (default: write one under --out)")
    p.add_argument("--summarize", default=None, metavar="TRACE",
                   help="only summarize an existing trace.json / .sqlite into --out")
    p.add_argument("--overhead", action="store_true",
                   help="measure the cost of the ranges with no tool attached instead of profiling")
