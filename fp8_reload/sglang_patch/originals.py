"""What the patch replaced, and the filter of the reload in progress (shared by its parts)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable

# (owner class, attribute) -> the raw attribute as sglang defined it.
ORIGINALS: dict[tuple[type, str], object] = {}

# The weight_name_filter of the update_weights_from_disk call in progress.
ACTIVE_FILTER: contextvars.ContextVar[Callable[[str], bool] | None] = \
    contextvars.ContextVar("fp8_reload_active_filter", default=None)


def original(cls_name: str, attr: str):
    """sglang's own `cls_name.attr`, as it was before the patch replaced it."""
    for (cls, a), fn in ORIGINALS.items():
        if a == attr and cls.__name__ == cls_name:
            return fn.__func__ if isinstance(fn, staticmethod) else fn
    raise RuntimeError(f"fp8_reload.sglang_patch: {cls_name}.{attr} is not patched")
