"""sglang's real layers around the tiny checkpoints, and byte-level state comparison.

`make_experts` builds sglang's `FusedMoE` (layer 1 of the checkpoint) with
`Fp8Config`; `load_experts` feeds it checkpoint tensors through its real
`weight_loader` with sglang's own expert mapping. `ServedModel` is the smallest
model sglang's `DefaultModelLoader` and `WeightUpdater` can drive: an FP8
`ReplicatedLinear` (``q_proj`` of layer 0) beside the `FusedMoE`, with a
`load_weights` written the way sglang's models write theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import fp8_reload as fr

MOE_LAYER = 1
EXPERTS_PREFIX = f"model.layers.{MOE_LAYER}.mlp.experts"
Q_PROJ = "model.layers.0.self_attn.q_proj"


def fp8_config(kind: str):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if kind == "fp8":
        return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    return Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")


def make_experts(cfg: fr.MoEConfig, kind: str):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return FusedMoE(num_experts=cfg.num_experts, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.moe_intermediate_size, layer_id=MOE_LAYER,
                    top_k=cfg.top_k, params_dtype=torch.bfloat16, quant_config=fp8_config(kind),
                    prefix=EXPERTS_PREFIX)


def expert_mapping(num_experts: int):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj",
                                               ckpt_down_proj_name="down_proj",
                                               ckpt_up_proj_name="up_proj",
                                               num_experts=num_experts)


def read_tensors(path: Path, names: Iterable[str]):
    ckpt = fr.Checkpoint(path)
    return list(ckpt.read([n for n in ckpt.names if n in set(names)], {}))


def expert_tensor_names(path: Path, experts: Iterable[int]) -> list[str]:
    wanted = {f"{EXPERTS_PREFIX}.{e}." for e in experts}
    return [n for n in fr.Checkpoint(path).names
            if any(n.startswith(w) for w in wanted)]


def load_experts(moe, sources: dict[int, Path], slot_of: dict[int, int] | None = None) -> int:
    """Load expert e from checkpoint ``sources[e]`` through ``param.weight_loader``, into
    local slot ``slot_of[e]`` (default: slot e; a layer holding a rank's share of experts)."""
    params = dict(moe.named_parameters())
    mapping = expert_mapping(max(sources) + 1 if slot_of else moe.num_experts)
    n = 0
    for path in sorted(set(sources.values())):
        names = expert_tensor_names(path, [e for e, p in sources.items() if p == path])
        for name, tensor in read_tensors(path, names):
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name in name:
                    local = name.replace(weight_name, param_name).rsplit("experts.", 1)[1]
                    param = params[local]
                    param.weight_loader(param, tensor, f"{EXPERTS_PREFIX}.{local}",
                                        shard_id=shard_id,
                                        expert_id=expert_id if slot_of is None else slot_of[expert_id])
                    n += 1
                    break
    return n


def eplb_move(moe, old: list[int], new: list[int], rank: int = 0, world: int = 1) -> None:
    """sglang's EPLB weight move of one layer (physical -> logical maps `old` -> `new`), called
    as its ExpertLocationUpdater does: every ``[E]`` Parameter, by P2P between ranks."""
    from sglang.srt.eplb.expert_location_updater import (
        create_temp_buffers,
        update_expert_weights_single_layer,
    )
    from sglang.srt.layers.moe.utils import filter_moe_weight_param_global_expert

    local = moe.num_local_experts
    weights = [p.data for name, p in moe.named_parameters()
               if filter_moe_weight_param_global_expert(name, p, local)]
    update_expert_weights_single_layer(weights, create_temp_buffers(weights), old, new,
                                       num_local_physical_experts=local, num_gpu_per_node=world,
                                       rank=rank, world_size=world)


def fresh_experts(cfg, kind: str, sources: dict[int, Path]):
    """A FusedMoE freshly loaded (one load, one post-processing) from `sources`."""
    moe = make_experts(cfg, kind)
    load_experts(moe, sources)
    moe.quant_method.process_weights_after_loading(moe)
    return moe


class ServedModel(nn.Module):
    """``model.layers.0.self_attn.q_proj`` (FP8 linear) and ``model.layers.1.mlp.experts``.

    ``cutlass=True`` sends the linear down the branch sglang takes on Hopper, where
    `cutlass_fp8_supported()` is true (per-channel scales); it is plain torch code.
    """

    def __init__(self, cfg: fr.MoEConfig, kind: str, cutlass: bool = False):
        from sglang.srt.layers.linear import ReplicatedLinear

        super().__init__()
        self.quant_config = fp8_config(kind)
        self.num_experts = cfg.num_experts
        attn = nn.Module()
        attn.q_proj = ReplicatedLinear(cfg.hidden_size, cfg.num_heads * cfg.qk_head_dim, bias=False,
                                       params_dtype=torch.bfloat16, quant_config=self.quant_config,
                                       prefix=Q_PROJ)
        attn.q_proj.quant_method.cutlass_fp8_supported = cutlass
        dense = nn.Module()
        dense.self_attn = attn
        mlp = nn.Module()
        mlp.experts = make_experts(cfg, kind)
        moe = nn.Module()
        moe.mlp = mlp
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([dense, moe])

    def load_weights(self, weights):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        mapping = expert_mapping(self.num_experts)
        for name, tensor in weights:
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name in name:
                    pname = name.replace(weight_name, param_name)
                    param = params[pname]
                    param.weight_loader(param, tensor, pname, shard_id=shard_id, expert_id=expert_id)
                    break
            else:
                if name not in params:  # tensors of modules this model leaves out
                    continue
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)


# --------------------------------------------------------------------------
# State comparison
# --------------------------------------------------------------------------

def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, by name (non-persistent buffers included)."""
    out = dict(module.named_parameters())
    out.update(module.named_buffers())
    return out


def snapshot(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the Parameter/buffer object itself, a copy of its bytes)."""
    return {n: (t, t.detach().clone()) for n, t in tensors(module).items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def byte_diffs(a: nn.Module, b: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Names whose tensors differ (dtype, shape or any byte) between two modules."""
    ta, tb = tensors(a), tensors(b)
    names = sorted(set(ta) | set(tb)) if names is None else names
    return [n for n in names if n not in ta or n not in tb or not same_bytes(ta[n], tb[n])]


def changed_since(module: nn.Module, snap: dict) -> tuple[list[str], list[str]]:
    """(names whose Parameter/buffer object was replaced, names whose bytes changed)."""
    now = tensors(module)
    replaced = sorted(n for n in snap if n not in now or now[n] is not snap[n][0])
    changed = sorted(n for n in snap if n in now and not same_bytes(now[n], snap[n][1]))
    return replaced, changed
