"""A float32 reference forward of the whole model, written independently of `kernels`.

It dequantizes every weight the way its stored state means it (its own
dequantization, not `kernels.scales`), so a scale bug shared by every backend
still shows; activations are not quantized. The accuracy gate compares every
backend against it, and the weights themselves against the checkpoint's tensors read
with safetensors (`checkpoint_weight_diff`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers import Fp8Linear, FP8MoEModel, FusedMoE, MoEBlock
from ..processing import FixedFp8LinearMethod


def dequantized_linear_weight(linear: Fp8Linear) -> torch.Tensor:
    """The layer's weight as float32 ``[out, in]``, read the way its stored state means it.

    Fixed layers keep one scale per logical shard and a checkpoint-layout view;
    upstream layers hold the transposed ``[in, out]`` weight and a per-channel
    scale. Either way the result is what the FP8 GEMM should compute with.
    """
    qm = linear.quant_method
    if isinstance(qm, FixedFp8LinearMethod):
        w = qm.checkpoint_view(linear).float()
        widths = torch.tensor(linear.logical_widths, device=w.device)
        scale = torch.repeat_interleave(linear.weight_scale.float(), widths)
        return w * scale[:, None]
    w = linear.weight.float().t()
    scale = linear.weight_scale.float().reshape(-1)
    if scale.numel() not in (1, w.shape[0]):
        raise RuntimeError(f"weight {tuple(linear.weight.shape)} does not fit its "
                           f"{tuple(linear.weight_scale.shape)} scale")
    return w * (scale[:, None] if scale.numel() > 1 else scale)


def dequantized_expert(layer: FusedMoE, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) float32 of one expert, each half of w13 with its own
    scale column when the layer keeps the ``[E, 2]`` layout."""
    inter = layer.intermediate_size
    s13 = layer.w13_weight_scale.float()
    w13 = layer.w13_weight[slot].float()
    if s13.dim() == 2:
        w13 = torch.cat([w13[:inter] * s13[slot, 0], w13[inter:] * s13[slot, 1]])
    else:
        w13 = w13 * s13[slot]
    return w13, layer.w2_weight[slot].float() * layer.w2_weight_scale[slot].float()


def reference_moe(layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Float32 fused-MoE on the dequantized experts, activations not quantized.

    Written independently of `kernels` (its own dequantization, no
    `moe_kernel_scales`), so a scale bug shared by every backend still shows.
    """
    x = x.float()
    inter = layer.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = dequantized_expert(layer, e)
        h = x.index_select(0, tok) @ w13.t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def _ref_norm(norm, x):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return x * norm.weight.float()


def _ref_linear(linear, x):
    return x @ dequantized_linear_weight(linear).t()


def _ref_mlp(mlp, x):
    g, u = _ref_linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
    return _ref_linear(mlp.down_proj, F.silu(g) * u)


def _ref_attention(attn, x):
    t = x.shape[0]
    q = _ref_linear(attn.q_proj, x).view(t, attn.nh, attn.qk).transpose(0, 1)
    k = _ref_linear(attn.k_proj, x).view(t, attn.nh, attn.qk).transpose(0, 1)
    v = _ref_linear(attn.v_proj, x).view(t, attn.nh, attn.v).transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _ref_linear(attn.o_proj, o.transpose(0, 1).reshape(t, attn.nh * attn.v))


def _ref_route(router, x, topk_ids: torch.Tensor | None):
    """The router's weights in float32 for the given expert choice (its own if None)."""
    if topk_ids is None:
        return router(x)
    probs = (x @ router.weight.float().t()).softmax(dim=-1)
    w = probs.gather(1, topk_ids)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * router.scaling, topk_ids


@torch.no_grad()
def reference_forward(model: FP8MoEModel, x: torch.Tensor,
                      routing: list[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, list[tuple[MoEBlock, torch.Tensor, torch.Tensor]]]:
    """The whole model in float32 on its dequantized weights, no activation quantization.

    `routing` (one ``topk_ids`` per MoE block, as `forward_with_routing` records
    them) makes the reference take the FP8 model's expert choices: top-k is
    discontinuous, and a token near a tie flips experts under any perturbation,
    which is not an accuracy error. Returns the output and, per MoE block, the
    float32 input it saw and the expert choice the reference made on it.
    """
    h = x.float()
    moe_inputs = []
    blocks = 0
    for layer in model.model.layers:
        h = h + _ref_attention(layer.self_attn, _ref_norm(layer.input_layernorm, h))
        n = _ref_norm(layer.post_attention_layernorm, h)
        if isinstance(layer.mlp, MoEBlock):
            forced = None if routing is None else routing[blocks]
            blocks += 1
            w, ids = _ref_route(layer.mlp.gate, n, forced)
            moe_inputs.append((layer.mlp, n, layer.mlp.gate(n)[1]))
            y = reference_moe(layer.mlp.experts, n, w, ids)
            if layer.mlp.shared_experts is not None:
                y = y + _ref_mlp(layer.mlp.shared_experts, n)
        else:
            y = _ref_mlp(layer.mlp, n)
        h = h + y
    return _ref_norm(model.model.norm, h), moe_inputs


def forward_with_routing(model: FP8MoEModel, x: torch.Tensor
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """model(x) plus the ``topk_ids`` each MoE router chose (recorded by forward hooks)."""
    routing: list[torch.Tensor] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out: routing.append(out[1]))
             for m in model.modules() if isinstance(m, MoEBlock)]
    try:
        with torch.no_grad():
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return y, routing


def checkpoint_weight_diff(model: FP8MoEModel, path) -> tuple[float, str]:
    """The worst `calc_diff` between the model's dequantized weights (every expert in every
    slot, every FP8 linear) and the checkpoint's own tensors read with safetensors (an FP8
    checkpoint's bytes times its scale; a bf16 one's values). Nothing of this package reads
    them or maps their names, so a loader or processing bug that a fresh load shares (the
    gate's other checks compare with one) still shows. NaN counts as the worst.
    Returns (worst, where)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from .numeric import calc_diff, worse

    path = Path(path)
    index = path / "model.safetensors.index.json"
    where_is = (json.loads(index.read_text())["weight_map"] if index.is_file() else
                dict.fromkeys(safe_open(str(path / "model.safetensors"), "pt").keys(),
                              "model.safetensors"))
    shards: dict = {}

    def read(name: str) -> torch.Tensor:
        f = where_is[name]
        if f not in shards:
            shards[f] = safe_open(str(path / f), "pt")
        return shards[f].get_tensor(name).float()

    def stored(prefix: str) -> torch.Tensor:  # [out, in] float32, as the checkpoint means it
        w = read(f"{prefix}.weight")
        scale = f"{prefix}.weight_scale"
        return w * read(scale) if scale in where_is else w

    worst, at = 0.0, "nothing"

    def compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        nonlocal worst, at
        d = calc_diff(got.cpu(), want)
        if worse(d, worst):
            worst, at = d, what

    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):  # gate_up_proj holds the checkpoint's gate and up
            parts = ([name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
                     if name.endswith("gate_up_proj") else [name])
            compare(dequantized_linear_weight(module), torch.cat([stored(p) for p in parts]), name)
    for _, layer in model.moe_layers():
        inter = layer.intermediate_size
        for e in range(model.config.num_experts):
            prefix = f"model.layers.{layer.layer_id}.mlp.experts.{e}"
            want = {proj: stored(f"{prefix}.{proj}") for proj in ("gate_proj", "up_proj", "down_proj")}
            for slot in layer.local_slots(e):
                w13, w2 = dequantized_expert(layer, slot)
                for proj, got in (("gate_proj", w13[:inter]), ("up_proj", w13[inter:]),
                                  ("down_proj", w2)):
                    compare(got, want[proj], f"{prefix}.{proj} (slot {slot})")
    return worst, at
