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


def _cmd_profile(args) -> int:
    from .profile import run_profile

    return run_profile(args)


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

    from .profile import add_arguments as _profile_arguments  # light: no model code imported
    pr = sub.add_parser("profile", help="profile a reload / forward (nsys if present, else torch.profiler)")
    _profile_arguments(pr)
    pr.set_defaults(func=_cmd_profile)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
