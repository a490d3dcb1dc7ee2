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


def _cmd_rebalance(args) -> int:
    import json
    import os
    import tempfile

    from .rebalance import (MODES, DemoSpec, default_backend, demo_rank, format_demo,
                            launched_by_torchrun, run_ranks)

    modes = list(MODES) if args.mode == "all" else args.mode.split(",")
    kinds = args.kind.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown --mode {m!r}; choose from {', '.join(MODES)} or all")
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    backend = args.backend or default_backend(world)
    with tempfile.TemporaryDirectory(prefix="fp8-reload-rebalance-") as tmp:
        if args.checkpoint:
            if len(kinds) > 1:
                raise SystemExit("--checkpoint takes one checkpoint: give a single --kind")
            ckpts = {kinds[0]: args.checkpoint}
        else:  # under torchrun every rank must name the same directory
            root = (os.path.join(tempfile.gettempdir(), f"fp8-reload-rebalance-{os.environ['MASTER_PORT']}")
                    if torchrun else tmp)
            tag = f"{args.preset}-{args.num_layers or 'all'}-seed{args.seed}"
            ckpts = {k: os.path.join(root, f"{tag}-{k}") for k in kinds}
        spec = DemoSpec(checkpoints=ckpts, preset=args.preset, num_layers=args.num_layers,
                        modes=modes, slots_per_rank=args.slots_per_rank,
                        exclude_sources=tuple(args.exclude_sources), seed=args.seed,
                        alpha=args.alpha, check=not args.no_check)
        results = run_ranks(demo_rank, world, backend, spec)
    rows = results[0]
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if format_demo(rows, backend)[0] else 1
    ok, text = format_demo(rows, backend)
    print(text)
    if args.json:
        out = [{"kind": r["kind"], "mode": r["mode"], "rank": r["rank"], "world": r["world"],
                "backend": backend, "device": r["device"], "wall_s": r["wall_s"],
                "equals_fresh_load": (not r.get("diffs")) and r.get("identity_kept", False),
                **{k: v for k, v in vars(r["report"]).items() if k not in ("disk_report",)}}
               for r in rows]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


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

    r = sub.add_parser("rebalance", help="expert-parallel rebalance across ranks (torch.distributed), "
                       "checked against a fresh load on every rank")
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
    r.add_argument("--alpha", type=float, default=1.2, help="Zipf skew of the synthetic load")
    r.add_argument("--no-check", action="store_true", help="skip the fresh-load comparison")
    r.add_argument("--json", default=None, help="also write per-rank results to this JSON file")
    r.set_defaults(func=_cmd_rebalance)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
