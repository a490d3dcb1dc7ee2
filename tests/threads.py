"""Running a call in a daemon thread, for tests of locks, hangs and interleavings."""

from __future__ import annotations

import threading


def start(fn, *args) -> tuple[threading.Thread, dict]:
    """fn(*args) in a started daemon thread; the dict gets "value" or "error" (any
    exception, surfaced to the test) when it returns."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # surfaced to the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result
