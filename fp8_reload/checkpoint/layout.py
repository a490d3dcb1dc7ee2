"""The checkpoint layout: which tensors a model of a given shape has, in file order.

Names follow the HF DeepSeek-V2 checkpoints (``model.layers.{L}.mlp.experts.{e}.gate_proj.weight``);
kind ``fp8`` adds a per-tensor ``weight_scale`` and a static ``input_scale`` to every
projection, kind ``bf16`` stores plain weights that are quantized on load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import MoEConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
KINDS = ("fp8", "bf16")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose one of {', '.join(KINDS)}")


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class Projection:
    """One linear map of the model: its checkpoint prefix and shape."""

    prefix: str  # e.g. model.layers.1.mlp.experts.3.gate_proj
    out_features: int
    in_features: int
    role: str  # expert_gate | expert_up | expert_down | gate | up | down | attn_in | attn_out


def projections(cfg: MoEConfig) -> list[Projection]:
    h = cfg.hidden_size
    out: list[Projection] = []
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        nh = cfg.num_heads
        out += [Projection(f"{p}.self_attn.q_proj", nh * cfg.qk_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.k_proj", nh * cfg.qk_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.v_proj", nh * cfg.v_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.o_proj", h, nh * cfg.v_head_dim, "attn_out")]
        if not cfg.is_moe_layer(layer):
            i = cfg.intermediate_size
            out += [Projection(f"{p}.mlp.gate_proj", i, h, "gate"),
                    Projection(f"{p}.mlp.up_proj", i, h, "up"),
                    Projection(f"{p}.mlp.down_proj", h, i, "down")]
            continue
        if cfg.num_shared_experts:
            i = cfg.shared_intermediate_size
            out += [Projection(f"{p}.mlp.shared_experts.gate_proj", i, h, "gate"),
                    Projection(f"{p}.mlp.shared_experts.up_proj", i, h, "up"),
                    Projection(f"{p}.mlp.shared_experts.down_proj", h, i, "down")]
        i = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            out += [Projection(f"{p}.mlp.experts.{e}.gate_proj", i, h, "expert_gate"),
                    Projection(f"{p}.mlp.experts.{e}.up_proj", i, h, "expert_up"),
                    Projection(f"{p}.mlp.experts.{e}.down_proj", h, i, "expert_down")]
    return out


def tensor_layout(cfg: MoEConfig, kind: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor in file order: (name, shape, dtype)."""
    check_kind(kind)
    h = cfg.hidden_size
    norms = lambda layer: [(f"model.layers.{layer}.input_layernorm.weight", (h,), torch.bfloat16),  # noqa: E731
                           (f"model.layers.{layer}.post_attention_layernorm.weight", (h,), torch.bfloat16)]
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    by_layer: dict[int, list[Projection]] = {}
    for proj in projections(cfg):
        by_layer.setdefault(int(proj.prefix.split(".")[2]), []).append(proj)
    for layer in range(cfg.num_layers):
        out += norms(layer)
        if cfg.is_moe_layer(layer):
            out.append((f"model.layers.{layer}.mlp.gate.weight", (cfg.num_experts, h), torch.bfloat16))
        for proj in by_layer[layer]:
            shape = (proj.out_features, proj.in_features)
            if kind == "fp8":
                out += [(f"{proj.prefix}.weight", shape, torch.float8_e4m3fn),
                        (f"{proj.prefix}.weight_scale", (), torch.float32),
                        (f"{proj.prefix}.input_scale", (), torch.float32)]
            else:
                out.append((f"{proj.prefix}.weight", shape, torch.bfloat16))
    out.append(("model.norm.weight", (h,), torch.bfloat16))
    return out
