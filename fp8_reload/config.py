"""Model shapes: a DeepSeek-V2-Lite-like decoder with FP8 MoE layers.

The presets fix every dimension the loader, the kernels and the benchmarks
depend on. `to_hf_config`/`from_hf_config` round-trip through the
`config.json` written next to a checkpoint, so a checkpoint on disk fully
describes the model that loads it.
"""

from __future__ import annotations

import dataclasses
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
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoEConfig:
        try:
            cfg = cls(
                name=hf.get("fp8_reload_preset", "custom"),
                hidden_size=int(hf["hidden_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_experts=int(hf["n_routed_experts"]),
                num_shared_experts=int(hf.get("n_shared_experts") or 0),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                top_k=int(hf["num_experts_per_tok"]),
                first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
                num_heads=int(hf["num_attention_heads"]),
                qk_head_dim=int(hf["qk_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks field {e.args[0]!r}") from None
        cfg.validate()
        return cfg
