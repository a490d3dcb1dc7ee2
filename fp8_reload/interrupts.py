"""Ctrl-C held back while something must not be cut short."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager


@contextmanager
def sigint_deferred(then: Callable[[], None] | None = None):
    """Hold Ctrl-C back while the block runs (main thread only: a backup restored, a read
    into memory the next reload reuses waited for), then hand it to the handler that was
    installed before, as if it arrived just then.

    Handing over means putting that handler back and raising SIGINT again, so it
    does exactly what it would have done: an application's Python handler is
    called (with SIGINT and the current frame), Python's default one raises
    KeyboardInterrupt, SIG_DFL ends the process (after the restore, not in the
    middle of it). Under SIG_IGN nothing can interrupt the restore and nothing is
    installed. A handler not installed from Python (`signal.getsignal` returns
    None) could not be put back once replaced: then nothing is installed and
    nothing is deferred. What was there before is always what is there after.
    `then()`, if given, runs when a Ctrl-C is held back (to cut the block short).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        old = signal.getsignal(signal.SIGINT)
    except ValueError:  # signals are not available here
        old = None
    if old is None or old is signal.SIG_IGN:
        yield
        return
    received = []

    def hold(signum, frame) -> None:
        received.append(signum)
        if then is not None:
            then()

    try:
        signal.signal(signal.SIGINT, hold)
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if received:
            signal.raise_signal(signal.SIGINT)
