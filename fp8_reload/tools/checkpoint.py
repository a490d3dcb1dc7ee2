"""`fp8-reload write-checkpoint`: a synthetic HF-layout checkpoint of any preset."""

from __future__ import annotations

from ..checkpoint import write_checkpoint
from ..config import MoEConfig
from .usage import UsageError


def command(args) -> int:
    """Progress is tqdm's bar on stderr; a directory that cannot be written is exit 2."""
    cfg = MoEConfig.preset(args.preset, num_layers=args.num_layers)
    try:
        path = write_checkpoint(args.out, cfg, seed=args.seed, kind=args.kind, progress=True)
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.kind} checkpoint of preset {args.preset!r} to {path}")
    return 0
