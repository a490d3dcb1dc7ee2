"""What every command shares: the error for "cannot run as asked" and progress lines.

Light on purpose (no torch): the command line imports it to build its parser.
"""

from __future__ import annotations

import argparse
import os
import sys


class UsageError(Exception):
    """The command cannot run as asked: a file that is not there, a tool that is not
    installed, an option this machine cannot honour. `fp8-reload` prints the message as
    one line and exits 2, as argparse does for a bad option; nothing was written."""


def progress(message: str) -> None:
    """One progress line on stderr (flushed), so stdout keeps only the command's result."""
    print(message, file=sys.stderr, flush=True)


def output_file(value: str) -> str:
    """argparse type of a file a command writes when it is done: its folder must exist and be
    writable now, not found missing after a run of minutes whose results would be lost."""
    folder = os.path.dirname(os.path.abspath(value))
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value} is a directory, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{value}: no such directory {folder} (create it first)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{value}: directory {folder} is not writable")
    return value


def work_dir(value: str) -> str:
    """argparse type of a directory a command creates or reuses."""
    if os.path.exists(value) and not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value} exists and is not a directory")
    return value
