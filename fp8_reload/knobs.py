"""Settings from the environment (`FP8_RELOAD_*`), read once at import.

A value that is not a whole number, or is outside what the setting can work with, or a word
that is not one of a setting's choices, is refused with a message naming it: a typo such as
``FP8_RELOAD_CHUNK_BYTES=64M`` fails at import instead of deep inside the first reload, and
``0`` chunk bytes cannot make a reload spin.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int, minimum: int | None = 0, maximum: int | None = None) -> int:
    """`name` from the environment as an integer of at least `minimum` (None: any) and at most
    `maximum` (None: any); `default` when unset or empty. Underscores may group digits
    (``67_108_864``)."""
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
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={raw!r}: must be at most {maximum}")
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """`name` from the environment, one of `choices`; `default` when unset. A typo is refused
    by name, not taken as some other choice."""
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw
