"""Version check, apply, revert, and the plugin entry point sglang calls."""

from __future__ import annotations

import logging
import os
from importlib import metadata

from . import loader, moe
from .originals import ORIGINALS

logger = logging.getLogger("fp8_reload.sglang_patch")

SUPPORTED_VERSIONS = ("0.5.23",)
ENV_ENABLE = "FP8_RELOAD_SGLANG_PATCH"
PARTS = ("moe", "reload")


class UnsupportedSGLangVersion(RuntimeError):
    """The installed sglang is not one this patch was written against."""


def installed_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> str:
    """Return the installed sglang version; raise `UnsupportedSGLangVersion` if not supported."""
    version = installed_version() if version is None else version
    if version is None:
        raise UnsupportedSGLangVersion("sglang is not installed; fp8_reload.sglang_patch patches "
                                       f"sglang {', '.join(SUPPORTED_VERSIONS)}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedSGLangVersion(
            f"fp8_reload.sglang_patch supports sglang {', '.join(SUPPORTED_VERSIONS)}, found "
            f"{version}: it replaces internals of fp8.py, fused_moe_triton/layer.py, loader.py "
            "and weight_updater.py that change between releases, so it refuses to guess. "
            "Pin sglang==0.5.23, or port the patch and add the version to SUPPORTED_VERSIONS.")
    return version


def is_applied() -> bool:
    return bool(ORIGINALS)


PARTS = ("moe", "reload")


def targets(parts=PARTS) -> list[tuple[type, str, object]]:
    """What each part replaces: ``moe`` is the fp8.py / FusedMoE half of the fix,
    ``reload`` the scoped reading and post-processing of filtered reloads."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.lora.layers import FusedMoEWithLoRA
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    out = []
    if "moe" in parts:
        out += [
            (Fp8MoEMethod, "create_weights", moe.create_weights),
            (Fp8MoEMethod, "process_weights_after_loading", moe.process_weights_after_loading),
            (Fp8MoEMethod, "get_triton_quant_info", moe.get_triton_quant_info),
            (Fp8MoEMethod, "apply", moe.apply),
            (FusedMoE, "_weight_loader_impl", moe.weight_loader_impl),
            (FusedMoEWithLoRA, "_forward_with_lora", moe.forward_with_lora),
        ]
    if "reload" in parts:
        out += [
            (DefaultModelLoader, "_get_weights_iterator", loader.get_weights_iterator),
            (DefaultModelLoader, "load_weights_and_postprocess",
             staticmethod(loader.load_weights_and_postprocess)),
            (WeightUpdater, "update_weights_from_disk", loader.update_weights_from_disk),
        ]
    return out


def apply(force: bool = False, parts=PARTS) -> list[str]:
    """Patch the installed sglang (idempotent). Returns the patched ``Class.attr`` names.

    `parts` selects halves of the fix (see `targets`); both by default, one
    alone only to show what the other is for. Raises `UnsupportedSGLangVersion`
    unless sglang is a supported version (``force=True`` skips only that check)
    and has every attribute the patch replaces.
    """
    if not force:
        check_version()
    todo = targets(parts)
    missing = [f"{cls.__name__}.{attr}" for cls, attr, _ in todo if attr not in cls.__dict__]
    if missing:
        raise UnsupportedSGLangVersion(f"sglang {installed_version()} lacks {', '.join(missing)}: "
                                       "the patch does not fit this release")
    for cls, attr, new in todo:
        if (cls, attr) not in ORIGINALS:  # applying twice patches once
            ORIGINALS[(cls, attr)] = cls.__dict__[attr]
            setattr(cls, attr, new)
    names = sorted(f"{c.__name__}.{a}" for c, a in ORIGINALS)
    logger.info("fp8_reload: patched sglang %s: %s", installed_version(), ", ".join(names))
    return names


def revert() -> None:
    """Restore every patched attribute to the object sglang defined.

    Layers built while patched keep what the patch gave them (FP8 storage of
    bf16 checkpoints, ``[E, 2]`` w13 scales, per-expert input scales).
    """
    for (cls, attr), original in ORIGINALS.items():
        setattr(cls, attr, original)
    ORIGINALS.clear()


def sglang_plugin() -> None:
    """Entry point of sglang's plugin loader: patches only when ``FP8_RELOAD_SGLANG_PATCH=1``."""
    if os.environ.get(ENV_ENABLE, "0") not in ("1", "true", "yes"):
        return
    apply()

