"""`fp8-reload write-checkpoint`: a synthetic HF-layout checkpoint of any preset."""

from __future__ import annotations

from ..checkpoint import write_checkpoint
from ..config import MoEConfig


def command(args) -> int:
    overrides = {"num_layers": args.num_layers} if args.num_layers else {}
    cfg = MoEConfig.preset(args.preset, **overrides)
    path = write_checkpoint(args.out, cfg, seed=args.seed, kind=args.kind, progress=True)
    print(f"wrote {args.kind} checkpoint of preset {args.preset!r} to {path}")
    return 0
