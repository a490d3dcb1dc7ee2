"""Post-load processing of FP8 layers: sglang 0.5.23 as shipped, and the fix.

Three processing modes (see `MODES`):

* ``upstream`` reproduces sglang 0.5.23: post-processing replaces scale (and on
  the bf16 path, weight) Parameters with new objects that lack `weight_loader`,
  collapses ``w13_weight_scale`` to ``[E]`` and the input scales to 0-dim, the
  linear layers take new transposed Parameters, every module is re-processed on
  every reload, and a filtered reload reads the whole checkpoint first.
* ``identity-only`` is sglang with only the ``fp8.py`` half of the fix: the MoE
  layers keep their Parameters, but every module is still re-processed, so the
  FP8 linear layers are transposed a second time (bug 2).
* ``fixed`` keeps every Parameter object and attribute, writes in place,
  processes only what a reload loaded, and reads only matching tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .. import trace
from .linear import FixedFp8LinearMethod, UpstreamFp8LinearMethod
from .moe import FixedFp8MoEMethod, IdentityOnlyFp8MoEMethod, UpstreamFp8MoEMethod


@dataclass(frozen=True)
class ProcessingMode:
    name: str
    linear_method: type
    moe_method: type
    postprocess_all: bool  # re-process every quantized module on every reload
    scan_all: bool  # read every checkpoint tensor, filter afterwards
    expand_units: bool  # a matched tensor pulls in the rest of its expert / module
    description: str


MODES = {
    "upstream": ProcessingMode(
        "upstream", UpstreamFp8LinearMethod, UpstreamFp8MoEMethod, True, True, False,
        "sglang 0.5.23 as shipped"),
    "identity-only": ProcessingMode(
        "identity-only", UpstreamFp8LinearMethod, IdentityOnlyFp8MoEMethod, True, True, False,
        "sglang 0.5.23 + in-place MoE processing only (no scoped post-processing)"),
    "fixed": ProcessingMode(
        "fixed", FixedFp8LinearMethod, FixedFp8MoEMethod, False, False, True,
        "identity kept, only loaded modules processed, only matching tensors read"),
}


def get_mode(name) -> ProcessingMode:
    if isinstance(name, ProcessingMode):
        return name
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown processing mode {name!r}; choose one of {', '.join(MODES)}") from None


def process_modules(modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Run each module's post-processing; returns the names processed."""
    done = []
    for name, module in modules:
        experts = getattr(module, "loaded_experts", None)  # None: an Fp8Linear
        with trace.range("fp8_reload/process_linear" if experts is None else "fp8_reload/process_moe",
                         payload=None if experts is None else len(experts)):
            module.quant_method.process_weights_after_loading(module)
        done.append(name)
    return done
