"""`fp8-reload` command line: argparse wiring only.

Each subcommand is a `command(args) -> int` in its own tools module, imported
when that subcommand runs, so `fp8-reload --help` imports no model code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = ("Benchmark, profile and gate hot reloads of FP8 MoE weights the way SGLang's "
               "expert load balancer does them, with the fix for SGLang 0.5.23.")


def _run(module: str):
    """The handler of a subcommand: `fp8_reload.tools.<module>.command`, imported on call."""
    def handler(args) -> int:
        return importlib.import_module(f"fp8_reload.tools.{module}").command(args)
    return handler


def _sglang_launch(args) -> int:
    from ..sglang_patch import launch

    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    return launch(server_args, check=args.check)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8-reload", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the whole story: upstream vs fixed reloads, side by side")
    d.add_argument("--preset", default="small", help="model shape (tiny, small, v2-lite)")
    d.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.add_argument("--experts", type=int, default=2, help="experts per MoE layer in the EPLB step")
    d.set_defaults(func=_run("demo"))

    g = sub.add_parser("gate", help="accuracy gate: scripted reloads, every step checked against "
                       "a fresh load and a float32 reference; exit 0 only if all pass")
    g.add_argument("--preset", default="tiny", help="model shape (tiny, small, v2-lite)")
    g.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    g.add_argument("--processing", default="fixed", choices=("fixed", "upstream", "identity-only"),
                   help="post-load processing under test (upstream must fail the gate)")
    g.add_argument("--backend", default="all",
                   help="MoE forward backend(s), comma-separated, or 'all' (every available one)")
    g.add_argument("--kind", default="fp8,bf16", help="checkpoint kinds, comma-separated")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--bounds", default=None, help="bounds TOML (default: the versioned "
                   "fp8_reload/kernels/bounds.toml)")
    g.add_argument("--json", default=None, metavar="OUT", help="also write the full results as JSON")
    g.add_argument("--workdir", default=None, help="keep checkpoints here (default: a temp dir)")
    g.set_defaults(func=_run("gate"))

    w = sub.add_parser("write-checkpoint", help="write a synthetic HF-layout checkpoint")
    w.add_argument("out")
    w.add_argument("--preset", default="tiny")
    w.add_argument("--num-layers", type=int, default=None)
    w.add_argument("--kind", choices=("fp8", "bf16"), default="fp8")
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(func=_run("checkpoint"))

    r = sub.add_parser("rebalance", help="expert-parallel forward and rebalance across ranks "
                       "(torch.distributed), checked against a fresh load and the single-device "
                       "forward on every rank")
    r.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn (under torchrun: taken from WORLD_SIZE)")
    r.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl when there is one GPU per rank, else gloo (CPU)")
    r.add_argument("--mode", default="p2p",
                   help="p2p | disk | hybrid, a comma list, or all")
    r.add_argument("--preset", default="tiny", help="model shape (tiny, small, v2-lite)")
    r.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    r.add_argument("--kind", default="fp8", help="checkpoint kind: fp8, bf16 or fp8,bf16")
    r.add_argument("--checkpoint", default=None, help="use this checkpoint instead of writing one")
    r.add_argument("--slots-per-rank", type=int, default=None,
                   help="physical expert slots per rank (default: ceil(experts / ranks) + 1)")
    r.add_argument("--exclude-sources", type=int, nargs="*", default=[1],
                   help="hybrid only: ranks that may not serve experts by P2P, so experts only "
                        "they hold come from disk (default: 1)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--alpha", type=float, default=1.2, help="Zipf skew of the synthetic routing")
    r.add_argument("--tokens", type=int, default=256,
                   help="tokens per rank routed through every MoE layer (default 256)")
    r.add_argument("--moe-backend", default=None,
                   help="MoE forward backend of the ranks' local experts (default: torch)")
    r.add_argument("--forward-bound", type=float, default=4e-3,
                   help="calc_diff the EP forward may differ from the single-device forward by "
                        "(default 4e-3, CROSS_SCHEME_BOUND: ranks quantize activations with their "
                        "own scales; 0 demands bitwise equality)")
    r.add_argument("--no-check", action="store_true",
                   help="skip the fresh-load and single-device comparisons")
    r.add_argument("--json", default=None, help="also write per-rank results to this JSON file")
    r.set_defaults(func=_run("rebalance"))
    b = sub.add_parser("bench-kernels", help="time and check the MoE forward kernels on a GPU "
                                             "(Markdown + CSV tables)")
    b.add_argument("--out", default="results/kernels", help="directory for kernels.md and CSVs")
    b.add_argument("--tokens", default="128,1024,4096", help="comma-separated token counts")
    b.add_argument("--backends", default="torch,triton,deep_gemm,deep_gemm_masked")
    b.add_argument("--iters", type=int, default=20, help="timed calls per case")
    b.add_argument("--no-gemm", action="store_true", help="skip the grouped GEMM table")
    b.add_argument("--jit-procs", type=int, default=0,
                   help="compile every case's kernels first in this many parallel processes")
    b.add_argument("--jit-only", action="store_true", help="only compile (fill the JIT caches)")
    b.add_argument("--jit-extra", action="append", default=[], metavar="PRESET:TOKENS",
                   help="with --jit-only, also compile the GPU backends' kernels for this "
                        "preset and token count (repeatable), e.g. small:64 for the GPU tests")
    b.set_defaults(func=_run("bench_kernels"))
    s = sub.add_parser("sglang-launch",
                       help="python -m sglang.launch_server ARGS with the FP8 MoE reload fix applied",
                       description="Checks the installed sglang, then runs its server with "
                                   "FP8_RELOAD_SGLANG_PATCH=1 so every sglang process applies "
                                   "fp8_reload.sglang_patch (see README, 'SGLang patch').")
    s.add_argument("--check", action="store_true",
                   help="apply the patch once here, list what it replaces, launch nothing")
    s.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="arguments for sglang.launch_server (after --)")
    s.set_defaults(func=_sglang_launch)
    from .profile.options import add_arguments as profile_arguments

    pr = sub.add_parser("profile", help="profile a reload / forward (nsys if present, else torch.profiler)")
    profile_arguments(pr)
    pr.set_defaults(func=_run("profile"))

    r = sub.add_parser("report", help="headline table, CSV and plots from the asv results")
    r.add_argument("--results", default="results/asv", help="asv results directory")
    r.add_argument("--out", default="results/report", help="where to write tables and plots")
    r.add_argument("--machine", default=None, help="only this asv machine (default: all)")
    r.add_argument("--commit", default=None, help="this commit (hash prefix) instead of the newest run")
    r.add_argument("--stat", choices=("best", "median"), default="best",
                   help="times: best sample (default, where samples were recorded) or asv's median")
    r.set_defaults(func=_run("report"))

    g = sub.add_parser("regress", help="run the asv suite on two commits; exit 1 on a slowdown",
                       description="Run this checkout's asv suite against the code of BASE and "
                       "HEAD (git worktrees, no environment builds) and exit 1 if any benchmark "
                       "is >= --threshold slower (or fails) in HEAD. With --files, BASE and HEAD "
                       "are two asv result files to compare instead.")
    g.add_argument("base", help="base commit (or result file with --files)")
    g.add_argument("head", help="head commit (or result file with --files)")
    g.add_argument("--threshold", type=float, default=0.10, help="relative slowdown that fails (0.10)")
    g.add_argument("-b", "--bench", action="append", default=None,
                   help="asv --bench regex (repeatable; default: the whole suite)")
    g.add_argument("--quick", action="store_true", help="one sample per benchmark (asv --quick)")
    g.add_argument("--launch-method", default="spawn", choices=("spawn", "forkserver"),
                   help="spawn (default; the one to take numbers with) or forkserver (faster "
                        "start on CPU, but fork artifacts distort times: smoke tests only)")
    g.add_argument("--rounds", type=int, default=3,
                   help="interleaved BASE/HEAD run pairs; a slowdown must show in every one (3)")
    g.add_argument("--machine", default=None, help="asv machine name")
    g.add_argument("--keep", default=None, help="keep worktrees/results in this directory")
    g.add_argument("--files", action="store_true", help="compare two existing asv result files")
    g.add_argument("--all", action="store_true", help="with --files: list unchanged benchmarks too")
    g.add_argument("asv_args", nargs="*", help="extra `asv run` arguments after --")
    g.set_defaults(func=_run("regress"))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
