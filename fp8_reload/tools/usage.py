"""What every command shares: the error for "cannot run as asked" and progress lines.

Light on purpose (no torch): the command line imports it to build its parser.
"""

from __future__ import annotations

import sys


class UsageError(Exception):
    """The command cannot run as asked: a file that is not there, a tool that is not
    installed, an option this machine cannot honour. `fp8-reload` prints the message as
    one line and exits 2, as argparse does for a bad option; nothing was written."""


def progress(message: str) -> None:
    """One progress line on stderr (flushed), so stdout keeps only the command's result."""
    print(message, file=sys.stderr, flush=True)
