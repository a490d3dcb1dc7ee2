"""`fp8-reload gate`: run the gate, print the report, exit 0 / 1 / 2."""

from __future__ import annotations

from ..usage import progress
from .report import format_report, write_json
from .result import GateError
from .run import run_gate


def command(args) -> int:
    """0: every check passed; 1: some check failed; 2 (`GateError`, turned into one line by
    the command line): the gate cannot run as asked."""
    result = run_gate(preset=args.preset, processing=args.processing, backends=args.backend,
                      device=args.device, bounds=args.bounds, kinds=args.kind,
                      num_layers=args.num_layers, workdir=args.workdir, log=progress)
    print(format_report(result))
    if args.json:
        try:
            write_json(result, args.json)
        except OSError as e:  # the gate ran, its record did not land: cannot do as asked
            raise GateError(f"--json {args.json}: cannot write it ({e})") from None
        print(f"wrote {args.json}")
    return 0 if result.passed else 1
