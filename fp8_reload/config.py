"""Model shapes: a DeepSeek-V2-Lite-like decoder with FP8 MoE layers.

The presets fix every dimension the loader, the kernels and the benchmarks
depend on. `to_hf_config`/`from_hf_config` round-trip through the
`config.json` written next to a checkpoint, so a checkpoint on disk fully
describes the model that loads it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    name: str
    hidden_size: int
    num_layers: int
    num_experts: int  # routed experts per MoE layer
    moe_intermediate_size: int
    top_k: int
    intermediate_size: int  # dense MLP of the first `first_dense_layers` layers
    num_shared_experts: int = 1
    first_dense_layers: int = 1
    num_heads: int = 2
    qk_head_dim: int = 32
    v_head_dim: int = 32
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6

    PRESETS = ("tiny", "small", "v2-lite")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoEConfig:
        """Named shapes. `overrides` (e.g. ``num_layers=4``) take a slice of a shape; an
        override of None keeps the preset's value (what an omitted command-line option gives)."""
        presets = {
            # CPU tests: loads in well under a second.
            "tiny": dict(hidden_size=64, num_layers=3, num_experts=8,
                         moe_intermediate_size=32, top_k=2, intermediate_size=96,
                         num_shared_experts=1, num_heads=2, qk_head_dim=48,
                         v_head_dim=32),
            # CPU benchmarks: large enough that reading and copying dominate.
            "small": dict(hidden_size=512, num_layers=4, num_experts=16,
                          moe_intermediate_size=256, top_k=4, intermediate_size=1024,
                          num_shared_experts=1, num_heads=4, qk_head_dim=128,
                          v_head_dim=128),
            # DeepSeek-V2-Lite / Coder-V2-Lite: 27 layers, first dense, 64 routed + 2
            # shared experts, top-6. Attention is a plain MHA stand-in with the
            # same projection widths (16 heads, qk 192, v 128), not MLA.
            "v2-lite": dict(hidden_size=2048, num_layers=27, num_experts=64,
                            moe_intermediate_size=1408, top_k=6,
                            intermediate_size=10944, num_shared_experts=2,
                            num_heads=16, qk_head_dim=192, v_head_dim=128),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(presets)}")
        # a slice, never a deeper model: 99,999 layers of v2-lite would be 59 TB on disk
        layers, whole = overrides.get("num_layers"), presets[name]["num_layers"]
        if layers is not None and layers > whole:
            raise ValueError(f"num_layers={layers}: preset {name!r} has {whole} layers (a slice of "
                             "it takes at most that many)")
        fields = {"name": name, **presets[name],
                  **{k: v for k, v in overrides.items() if v is not None}}
        cfg = cls(**fields)
        cfg.validate()
        return cfg

    @classmethod
    def from_spec(cls, spec: str) -> MoEConfig:
        """``"v2-lite:4"`` -> the v2-lite preset cut to 4 layers; ``"small"`` -> the preset.

        The form benchmarks, reports and command lines name a model shape in.
        """
        name, _, layers = str(spec).partition(":")
        if layers and not layers.isdigit():
            raise ValueError(f"bad preset spec {spec!r}: expected PRESET or PRESET:NUM_LAYERS")
        return cls.preset(name, **({"num_layers": int(layers)} if layers else {}))

    def validate(self) -> None:
        for f in ("hidden_size", "num_layers", "num_experts", "moe_intermediate_size",
                  "intermediate_size", "num_heads", "qk_head_dim", "v_head_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_shared_experts < 0:
            raise ValueError("num_shared_experts must be >= 0")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError("first_dense_layers must lie in [0, num_layers]")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must lie in [1, num_experts]")

    def replace(self, **changes: Any) -> MoEConfig:
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_dense_layers, self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def to_hf_config(self) -> dict[str, Any]:
        """The DeepSeek-V2 style `config.json` fields (plus our preset name)."""
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "fp8_reload_preset": self.name,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "n_routed_experts": self.num_experts,
            "n_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "num_experts_per_tok": self.top_k,
            "first_k_dense_replace": self.first_dense_layers,
            "num_attention_heads": self.num_heads,
            "qk_head_dim": self.qk_head_dim,
            "v_head_dim": self.v_head_dim,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "rms_norm_eps": self.rms_norm_eps,
            **{key: allowed[0] for key, allowed in COMPUTED_AS.items()},
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoEConfig:
        """Parse `config.json` fields strictly: ValueError naming the field otherwise.

        A size must be a JSON integer (not a string, not a float such as 64.0 or 64.9,
        not a boolean) within `_INT_FIELDS`' bounds; a float field a finite number in
        its range (an integer is accepted: ``"routed_scaling_factor": 1``); a flag a
        JSON boolean. ``null`` stands for a missing optional field. Nothing is
        coerced, so ``"-inf"`` or ``"nan"`` can no longer become a NaN forward.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"config is not an object: {type(hf).__name__}")
        values: dict[str, Any] = {}
        for key, (attr, lo, hi, default) in _INT_FIELDS.items():
            values[attr] = _int_field(hf, key, lo, hi, default)
        for key, (attr, lo, hi, default) in _FLOAT_FIELDS.items():
            values[attr] = _float_field(hf, key, lo, hi, default)
        flag = hf.get("norm_topk_prob")
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"field 'norm_topk_prob' must be true or false, got {_show(flag)}")
        values["norm_topk_prob"] = bool(flag)
        for key, allowed in COMPUTED_AS.items():
            got = hf.get(key)
            if got is not None and not any(got == a and type(got) is type(a) for a in allowed):
                raise UnsupportedConfigError(f"field {key!r} is {_show(got)}: the model computes "
                                             f"{' or '.join(map(repr, allowed))} only (its outputs "
                                             "would not be this checkpoint's)")
        name = hf.get("fp8_reload_preset", "custom")
        if not isinstance(name, str) or not 0 < len(name) <= 100:
            raise ValueError(f"field 'fp8_reload_preset' must be a short string, got {_show(name)}")
        if not values["first_dense_layers"] <= values["num_layers"]:
            raise ValueError(f"field 'first_k_dense_replace' ({values['first_dense_layers']}) exceeds "
                             f"'num_hidden_layers' ({values['num_layers']})")
        if not values["top_k"] <= values["num_experts"]:
            raise ValueError(f"field 'num_experts_per_tok' ({values['top_k']}) exceeds "
                             f"'n_routed_experts' ({values['num_experts']})")
        experts = values["num_layers"] * values["num_experts"]
        if experts > MAX_EXPERTS_IN_ALL:  # the layout lists every expert's tensors by name
            raise ValueError(f"fields 'num_hidden_layers' x 'n_routed_experts' give {experts} "
                             f"experts in all, more than {MAX_EXPERTS_IN_ALL}")
        cfg = cls(name=name, **values)
        cfg.validate()
        return cfg


class UnsupportedConfigError(ValueError):
    """config.json asks for what the model does not compute (another activation or routing)."""


# config.json fields of what the forward computes -> the values it computes (DeepSeek-V2-Lite's):
# a checkpoint asking for another (V2's grouped top-k, V3's sigmoid scores and
# bias-corrected top-k, another activation) would load bit for bit and serve other outputs.
COMPUTED_AS: dict[str, tuple] = {"hidden_act": ("silu",), "scoring_func": ("softmax",),
                                 "topk_method": ("greedy",), "moe_layer_freq": (1,)}

# config.json field -> (MoEConfig attribute, min, max, default; None: required).
# The maxima are far above any real model (DeepSeek-V3: hidden 7168, 61 layers, 256
# experts) and keep every size computation far from overflow; a config beyond them
# is corrupt, not a model to build.
_INT_FIELDS = {
    "hidden_size": ("hidden_size", 1, 2**20, None),
    "num_hidden_layers": ("num_layers", 1, 2**12, None),
    "n_routed_experts": ("num_experts", 1, 2**16, None),
    "n_shared_experts": ("num_shared_experts", 0, 2**10, 0),
    "moe_intermediate_size": ("moe_intermediate_size", 1, 2**20, None),
    "intermediate_size": ("intermediate_size", 1, 2**22, None),
    "num_experts_per_tok": ("top_k", 1, 2**16, None),
    "first_k_dense_replace": ("first_dense_layers", 0, 2**12, 0),
    "num_attention_heads": ("num_heads", 1, 2**12, None),
    "qk_head_dim": ("qk_head_dim", 1, 2**16, None),
    "v_head_dim": ("v_head_dim", 1, 2**16, None),
}
MAX_EXPERTS_IN_ALL = 2**20
_FLOAT_FIELDS = {
    "routed_scaling_factor": ("routed_scaling_factor", 0.0, 1e6, 1.0),
    "rms_norm_eps": ("rms_norm_eps", 0.0, 1.0, 1e-6),
}


def _show(v: Any) -> str:
    return f"{str(v)[:40]!r} ({type(v).__name__})" if isinstance(v, str) else \
        f"{str(v)[:40]} ({type(v).__name__})"


def _int_field(hf: dict, key: str, lo: int, hi: int, default: int | None) -> int:
    v = hf.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"config.json lacks field {key!r}" if key not in hf else
                             f"field {key!r} must be an integer, got null")
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"field {key!r} must be an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise ValueError(f"field {key!r} must lie in [{lo}, {hi}], got {str(v)[:40]}")
    return v


def _float_field(hf: dict, key: str, lo: float, hi: float, default: float) -> float:
    """A finite number in (lo, hi]."""
    v = hf.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ValueError(f"field {key!r} must be a number, got {_show(v)}")
    f = float(v) if abs(v) < 2**1000 else math.inf  # float() of a huge JSON integer overflows
    if not (math.isfinite(f) and lo < f <= hi):
        raise ValueError(f"field {key!r} must be a finite number in ({lo:g}, {hi:g}], got {str(v)[:40]}")
    return f
