"""Whole-number settings from the environment (`FP8_RELOAD_*`), read once at import.

A value that is not a whole number, or is below what the setting can work with, is refused
with a message naming it: a typo such as ``FP8_RELOAD_CHUNK_BYTES=64M`` fails at import
instead of deep inside the first reload, and ``0`` chunk bytes cannot make a reload spin.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int, minimum: int | None = 0) -> int:
    """`name` from the environment as an integer of at least `minimum` (None: any); `default`
    when unset or empty. Underscores may group digits (``67_108_864``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number (in bytes where it is a size), "
                         f"such as the default {default}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r}: must be at least {minimum}")
    return value
