"""The building blocks: sglang-layout linear and MoE modules, attention, the decoder stack."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import trace
from ..config import MoEConfig
from ..kernels import run_moe

# sglang's FusedMoeWeightScaleSupported.TENSOR.value
PER_TENSOR = "tensor"


def set_weight_attrs(param: torch.Tensor, attrs: dict) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"overwriting existing attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """sglang's fallback for parameters without their own loader."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    if param.size() != loaded_weight.size():
        raise AssertionError(
            f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})"
        )
    param.data.copy_(loaded_weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(torch.bfloat16)


class Fp8Linear(nn.Module):
    """y = x @ W^T with W stored FP8; `logical_widths` > 1 entry for merged gate_up."""

    def __init__(self, input_size: int, logical_widths: list[int], quant_method, device=None):
        super().__init__()
        self.input_size = input_size
        self.logical_widths = list(logical_widths)
        self.output_size = sum(self.logical_widths)
        self.quant_method = quant_method
        quant_method.create_weights(self, device=device)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        self.quant_method.load_linear(self, param, loaded_weight, loaded_shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class FusedMoE(nn.Module):
    """Routed experts of one MoE layer, sglang's FusedMoE parameter layout.

    `expert_slots` maps a logical (checkpoint) expert id to the local slots that
    hold it; the default is the identity over `num_experts`. Experts not held
    locally are skipped by the loader, as in sglang's expert-parallel loader.
    A callable `layer_id -> map` gives each layer its own map (placements differ
    per layer, see `expert_parallel.Placement.expert_slots_for`).
    """

    def __init__(self, cfg: MoEConfig, layer_id: int, quant_method, device=None,
                 num_local_experts: int | None = None,
                 expert_slots: dict[int, list[int]] | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.moe_intermediate_size
        self.num_experts = cfg.num_experts
        self.num_local_experts = num_local_experts or cfg.num_experts
        self.top_k = cfg.top_k
        if callable(expert_slots):
            expert_slots = expert_slots(layer_id)
        self.expert_slots = expert_slots
        self.quant_method = quant_method
        # Local slots written since the last post-processing (the reload scope).
        self.loaded_experts: set[int] = set()
        # Bumped by every post-processing: forward caches key on it.
        self.weights_version = 0
        self.backend: str | None = None
        quant_method.create_weights(self, device=device)

    @property
    def expert_slots(self) -> dict[int, list[int]] | None:
        return self._expert_slots

    @expert_slots.setter
    def expert_slots(self, slots: dict[int, list[int]] | None) -> None:
        self._expert_slots = slots
        self._plain_checked = None  # (the `weights_version` the plain forward was checked at)

    def _slot_is_expert(self) -> bool:
        """Whether slot e holds expert e, and only it, for every expert: the plain forward
        indexes slots by logical id."""
        slots = self._expert_slots
        if slots is None or self.num_local_experts < self.num_experts:
            return self.num_local_experts >= self.num_experts
        owner: dict[int, int] = {}
        for e, held in slots.items():
            for s in held:
                if owner.setdefault(s, e) != e:  # (two experts in one slot: the last one loaded)
                    return False
        return all(owner.get(e) == e for e in range(self.num_experts))

    # ----- loading (sglang's FusedMoE.weight_loader semantics) -----
    def local_slots(self, expert_id: int) -> list[int]:
        if self.expert_slots is None:
            return [expert_id] if 0 <= expert_id < self.num_local_experts else []
        return self.expert_slots.get(expert_id, [])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      weight_name: str, shard_id: str, expert_id: int) -> None:
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"shard_id must be one of w1, w2, w3, got {shard_id!r}")
        for slot in self.local_slots(expert_id):
            self._load_into_slot(param, loaded_weight, weight_name, shard_id, slot)

    def slot_destination(self, param: nn.Parameter, weight_name: str, shard_id: str,
                         slot: int) -> torch.Tensor | None:
        """Where a checkpoint tensor of local `slot` goes: a view of `param`, or None when
        the weight is quantized on load (staged, see `stage_expert_weight`). The loader
        copies into it; the streaming reload DMAs into it: one rule for both."""
        if "input_scale" in weight_name:
            return param.data[slot]
        if "scale" in weight_name:
            if getattr(param, "quant_method", None) != PER_TENSOR:
                raise ValueError(f"unsupported scale layout for {weight_name}")
            if shard_id == "w2":
                return param.data[slot]
            return param.data[slot][0 if shard_id == "w1" else 1]  # gate (w1) -> column 0, up -> 1
        if getattr(param, "quantize_on_load", False):
            return None
        if shard_id == "w2":
            return param.data[slot]
        rows = self.intermediate_size
        return param.data[slot].narrow(0, 0 if shard_id == "w1" else rows, rows)

    def _load_into_slot(self, param, loaded_weight, weight_name, shard_id, slot):
        # Copies are non_blocking: a pinned source (GPU reloads stage into pinned
        # memory) becomes one async DMA; the reload synchronizes before the staging
        # memory is reused. From pageable or CPU memory the copy is synchronous anyway.
        self.loaded_experts.add(slot)
        dst = self.slot_destination(param, weight_name, shard_id, slot)
        if dst is None:
            self.quant_method.stage_expert_weight(self, param, loaded_weight, shard_id, slot)
        else:
            dst.copy_(loaded_weight, non_blocking=True)

    # ----- forward -----
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                backend: str | None = None) -> torch.Tensor:
        if self._plain_checked != self.weights_version:  # checked once per load (the map may
            if not self._slot_is_expert():                  # be edited in place, then reloaded)
                raise ValueError(
                    f"layer {self.layer_id} holds an expert-parallel rank's slots (slot e does not "
                    f"hold expert e): the plain forward would compute with other experts; use "
                    f"expert_parallel.ep_moe_forward (all ranks) or local_expert_forward")
            self._plain_checked = self.weights_version
        return run_moe(self, x, topk_weights, topk_ids, backend=backend or self.backend)


class Router(nn.Module):
    """DeepSeek-V2 gate: softmax over experts, greedy top-k, bf16 weight (not quantized)."""

    def __init__(self, cfg: MoEConfig, device=None):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, dtype=torch.bfloat16, device=device),
            requires_grad=False)

    @trace.range("fp8_reload/routing")
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x.float() @ self.weight.float().t()
        probs = logits.softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scaling, ids


class MLP(nn.Module):
    """SiLU-gated MLP of FP8 linears: dense layers and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, make_method, device=None):
        super().__init__()
        self.gate_up_proj = Fp8Linear(hidden, [intermediate, intermediate], make_method(), device)
        self.down_proj = Fp8Linear(intermediate, [hidden], make_method(), device)

    @trace.range("fp8_reload/mlp")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x).float()
        g, u = gu.chunk(2, dim=-1)
        return self.down_proj((F.silu(g) * u).to(torch.bfloat16))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int, make_linear_method, make_moe_method,
                 device=None, **moe_kwargs):
        super().__init__()
        self.gate = Router(cfg, device)
        self.experts = FusedMoE(cfg, layer_id, make_moe_method(), device, **moe_kwargs)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.shared_intermediate_size, make_linear_method, device)
            if cfg.num_shared_experts else None)

    def forward(self, x: torch.Tensor, backend: str | None = None,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`routing` (topk_weights, topk_ids) replaces the gate's choice (benchmarks skew it)."""
        topk_weights, topk_ids = self.gate(x) if routing is None else routing
        return self.combine(x, self.experts(x, topk_weights, topk_ids, backend=backend))

    def combine(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The block's output from the routed experts' output: plus the shared experts.
        The expert-parallel forward (`expert_parallel.forward`) ends here too."""
        y = routed.float()
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(torch.bfloat16)


class Attention(nn.Module):
    """Causal multi-head attention over the token sequence, FP8 projections.

    A stand-in for DeepSeek's MLA with the same projection widths: it exists so
    that FP8 linear layers (whose post-processing transposes the weight) sit
    beside the MoE layers, as in the real model.
    """

    def __init__(self, cfg: MoEConfig, make_method, device=None):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.nh, self.qk, self.v = nh, cfg.qk_head_dim, cfg.v_head_dim
        self.q_proj = Fp8Linear(h, [nh * self.qk], make_method(), device)
        self.k_proj = Fp8Linear(h, [nh * self.qk], make_method(), device)
        self.v_proj = Fp8Linear(h, [nh * self.v], make_method(), device)
        self.o_proj = Fp8Linear(nh * self.v, [h], make_method(), device)

    @trace.range("fp8_reload/attention")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).float().view(t, self.nh, self.qk).transpose(0, 1)
        k = self.k_proj(x).float().view(t, self.nh, self.qk).transpose(0, 1)
        v = self.v_proj(x).float().view(t, self.nh, self.v).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(0, 1).reshape(t, self.nh * self.v).to(torch.bfloat16))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int, make_linear_method, make_moe_method,
                 device=None, **moe_kwargs):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, make_linear_method, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoEBlock(cfg, layer_id, make_linear_method, make_moe_method, device,
                                **moe_kwargs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, make_linear_method, device)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        normed = self.post_attention_layernorm(h)
        return h + (self.mlp(normed, backend=backend) if isinstance(self.mlp, MoEBlock)
                    else self.mlp(normed))


class DecoderStack(nn.Module):
    def __init__(self, cfg: MoEConfig, make_linear_method, make_moe_method, device=None,
                 **moe_kwargs):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_linear_method, make_moe_method, device, **moe_kwargs)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, backend=backend)
        return self.norm(x)
