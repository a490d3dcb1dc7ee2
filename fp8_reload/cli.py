"""`fp8-reload` command line. Each subcommand lives in its own function; heavy
imports happen inside them so `fp8-reload --help` is instant."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args) -> int:
    from .demo import format_rows, run_demo, verdict

    rows = run_demo(preset=args.preset, device=args.device, experts_per_layer=args.experts,
                    num_layers=args.num_layers)
    print()
    print(format_rows(rows))
    ok, text = verdict(rows)
    print()
    print(text)
    return 0 if ok else 1


def _cmd_write(args) -> int:
    from .checkpoint import write_checkpoint
    from .config import MoEConfig

    overrides = {"num_layers": args.num_layers} if args.num_layers else {}
    cfg = MoEConfig.preset(args.preset, **overrides)
    path = write_checkpoint(args.out, cfg, seed=args.seed, kind=args.kind, progress=True)
    print(f"wrote {args.kind} checkpoint of preset {args.preset!r} to {path}")
    return 0


def _cmd_bench_kernels(args) -> int:
    from .bench_kernels import main

    tokens = tuple(int(t) for t in args.tokens.split(","))
    backends = tuple(args.backends.split(","))
    extra = [(e.split(":")[0], int(e.split(":")[1])) for e in args.jit_extra]
    return main(args.out, tokens=tokens, backends=backends, gemm=not args.no_gemm,
                iters=args.iters, jit_procs=args.jit_procs, jit_only=args.jit_only,
                jit_extra=extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8-reload", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the whole story: upstream vs fixed reloads, side by side")
    d.add_argument("--preset", default="small", help="model shape (tiny, small, v2-lite)")
    d.add_argument("--num-layers", type=int, default=None, help="take a slice of the preset's layers")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.add_argument("--experts", type=int, default=2, help="experts per MoE layer in the EPLB step")
    d.set_defaults(func=_cmd_demo)

    w = sub.add_parser("write-checkpoint", help="write a synthetic HF-layout checkpoint")
    w.add_argument("out")
    w.add_argument("--preset", default="tiny")
    w.add_argument("--num-layers", type=int, default=None)
    w.add_argument("--kind", choices=("fp8", "bf16"), default="fp8")
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(func=_cmd_write)

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
    b.set_defaults(func=_cmd_bench_kernels)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
