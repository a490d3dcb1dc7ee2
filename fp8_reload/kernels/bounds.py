"""Accuracy bounds of the MoE forward backends, in one place.

Two kinds:

* the per-GEMM and per-layer bounds below, DeepGEMM's `calc_diff` against the
  float32 reference of the same FP8 weights (`reference.moe_forward_torch(...,
  quantize_activations=False)`). The weights are the same bytes on both sides,
  so all error comes from quantizing activations;
* the versioned per-backend, per-checkpoint-kind bounds of the accuracy gate
  (`bounds.toml`, read by `load_bounds`), each with the reason it is what it is.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

GEMM_BOUND = 1e-3  # one FP8 x FP8 GEMM (DeepGEMM's own test bound)
# A MoE layer quantizes activations twice in series (tokens before gate/up, and
# silu(gate) * up before down): two FP8 GEMMs' independent errors, whose calc_diffs
# add. Measured 0.9e-3 .. 1.4e-3 on the synthetic checkpoints.
MOE_LAYER_BOUND = 2 * GEMM_BOUND
# Backends with the same activation scheme (torch and triton: per-tensor scales) differ
# only by summation order and bf16 rounding of per-expert outputs, which flips a few
# FP8 roundings; measured ~2e-5.
SAME_SCHEME_BOUND = 1e-4
# Backends with different schemes (per-tensor vs DeepGEMM's per-token-group) each err
# independently from the reference: their distance adds up to both bounds.
CROSS_SCHEME_BOUND = 2 * MOE_LAYER_BOUND

BOUNDS_FILE = Path(__file__).with_name("bounds.toml")
KINDS = ("fp8", "bf16")
BOUND_KEYS = ("fresh_forward", "ref_model", "ref_moe")  # calc_diff bounds, 0 = bitwise
# calc_diff 1e-2 is ~14 % relative RMS error, far beyond any FP8 rounding: a bound
# above it would not gate anything (see bounds.toml for what the bounds catch).
MAX_BOUND = 1e-2


class BoundsError(ValueError):
    """A bounds file is unreadable or malformed, or lacks an entry that is asked for."""


@dataclass(frozen=True)
class Bound:
    fresh_forward: float
    ref_model: float
    ref_moe: float
    reason: str


@dataclass
class Bounds:
    path: Path
    version: int
    entries: dict[tuple[str, str], Bound]

    def get(self, backend: str, kind: str) -> Bound:
        try:
            return self.entries[backend, kind]
        except KeyError:
            raise BoundsError(f"{self.path}: no bounds for backend {backend!r} and checkpoint kind "
                              f"{kind!r}; add a [{backend}.{kind}] table with "
                              f"{', '.join(BOUND_KEYS)} and reason") from None


def load_bounds(path=None) -> Bounds:
    """Read and validate a bounds file (default: the versioned one in the package)."""
    path = Path(path) if path is not None else BOUNDS_FILE
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise BoundsError(f"{path}: cannot read bounds: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise BoundsError(f"{path}: not valid TOML: {e}") from None
    version = data.pop("version", None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise BoundsError(f"{path}: needs an integer top-level `version`")
    entries = {}
    for backend, kinds in data.items():
        if not isinstance(kinds, dict):
            raise BoundsError(f"{path}: {backend!r} must be a table of checkpoint kinds")
        for kind, table in kinds.items():
            where = f"{path}: [{backend}.{kind}]"
            if kind not in KINDS or not isinstance(table, dict):
                raise BoundsError(f"{where}: unknown checkpoint kind (use {', '.join(KINDS)})")
            need = set(BOUND_KEYS) | {"reason"}
            if set(table) != need:
                raise BoundsError(f"{where}: needs exactly {', '.join(sorted(need))}; "
                                  f"missing {sorted(need - set(table))}, unknown {sorted(set(table) - need)}")
            for key in BOUND_KEYS:
                v = table[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BOUND:
                    raise BoundsError(f"{where}: {key} = {v!r} must be a number in [0, {MAX_BOUND:g}]")
            if not isinstance(table["reason"], str) or not table["reason"].strip():
                raise BoundsError(f"{where}: reason must say why the bound is what it is")
            entries[backend, kind] = Bound(*(float(table[k]) for k in BOUND_KEYS),
                                           table["reason"].strip())
    return Bounds(path, version, entries)
