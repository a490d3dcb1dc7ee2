"""FP8 MoE methods: sglang 0.5.23's Fp8MoEMethod (per-tensor branch) and the fixed one."""

from __future__ import annotations

import torch
from torch.nn import Parameter

from ..layers import PER_TENSOR, set_weight_attrs
from ..quant import FP8_DTYPE, quantize_dynamic, quantize_static
from .ops import process_fp8_experts_, quantize_staged_experts_


def _moe_param(shape, dtype, device, fill=None) -> Parameter:
    t = torch.empty(*shape, dtype=dtype, device=device) if fill is None else \
        torch.full(shape, fill, dtype=dtype, device=device)
    return Parameter(t, requires_grad=False)


def _new_weights_version(layer) -> None:
    """Forward caches keyed on the version rebuild. Written to the instance dict:
    `nn.Module.__setattr__` costs a reloaded expert's processing a few microseconds."""
    layer.__dict__["weights_version"] = layer.weights_version + 1


class _MoEMethodBase:
    def __init__(self, fp8_checkpoint: bool):
        self.fp8_checkpoint = fp8_checkpoint

    def _create(self, layer, device, weight_dtype, quantize_on_load: bool):
        e, i2, h, i = (layer.num_local_experts, 2 * layer.intermediate_size,
                       layer.hidden_size, layer.intermediate_size)
        loader = {"weight_loader": layer.weight_loader}
        w13 = _moe_param((e, i2, h), weight_dtype, device)
        w2 = _moe_param((e, h, i), weight_dtype, device)
        for name, p in (("w13_weight", w13), ("w2_weight", w2)):
            layer.register_parameter(name, p)
            set_weight_attrs(p, {**loader, "quantize_on_load": quantize_on_load})
        w13_s = _moe_param((e, 2), torch.float32, device, 1.0)
        w2_s = _moe_param((e,), torch.float32, device, 1.0)
        layer.register_parameter("w13_weight_scale", w13_s)
        layer.register_parameter("w2_weight_scale", w2_s)
        if self.fp8_checkpoint:
            scale_attrs = {**loader, "quant_method": PER_TENSOR}
            set_weight_attrs(w13_s, scale_attrs)
            set_weight_attrs(w2_s, scale_attrs)
            for name in ("w13_input_scale", "w2_input_scale"):
                p = _moe_param((e,), torch.float32, device, 1.0)
                layer.register_parameter(name, p)
                set_weight_attrs(p, scale_attrs)
        else:
            layer.w13_input_scale = None
            layer.w2_input_scale = None


class UpstreamFp8MoEMethod(_MoEMethodBase):
    """sglang 0.5.23 Fp8MoEMethod, per-tensor branch, as shipped (per-expert loops)."""

    def create_weights(self, layer, device=None):
        dtype = FP8_DTYPE if self.fp8_checkpoint else torch.bfloat16
        self._create(layer, device, dtype, quantize_on_load=False)

    def process_weights_after_loading(self, layer) -> None:
        if not self.fp8_checkpoint:
            w13 = torch.empty_like(layer.w13_weight.data, dtype=FP8_DTYPE)
            w2 = torch.empty_like(layer.w2_weight.data, dtype=FP8_DTYPE)
            layer.w13_weight_scale = Parameter(
                torch.ones(layer.num_local_experts, dtype=torch.float32, device=w13.device),
                requires_grad=False)
            for e in range(layer.num_local_experts):
                w13[e], layer.w13_weight_scale[e] = quantize_dynamic(layer.w13_weight.data[e])
                w2[e], layer.w2_weight_scale[e] = quantize_dynamic(layer.w2_weight.data[e])
            layer.w13_weight = Parameter(w13, requires_grad=False)
            layer.w2_weight = Parameter(w2, requires_grad=False)
        else:
            layer.w13_input_scale = Parameter(layer.w13_input_scale.max(), requires_grad=False)
            layer.w2_input_scale = Parameter(layer.w2_input_scale.max(), requires_grad=False)
            shard = layer.intermediate_size
            max_w13 = layer.w13_weight_scale.max(dim=1).values
            for e in range(layer.num_local_experts):
                start = 0
                for shard_id in range(2):
                    # sglang's per_tensor_dequantize works in float16
                    dq = layer.w13_weight[e][start:start + shard, :].to(torch.float16) \
                        * layer.w13_weight_scale[e][shard_id]
                    layer.w13_weight[e][start:start + shard, :] = quantize_static(dq, max_w13[e])
                    start += shard
            layer.w13_weight_scale = Parameter(max_w13, requires_grad=False)
        layer.loaded_experts.clear()
        _new_weights_version(layer)


class FixedFp8MoEMethod(_MoEMethodBase):
    """Identity-preserving Fp8MoEMethod.

    * FP8 checkpoint: input scales merged in place (per-expert values kept in a
      buffer), ``w13_weight_scale`` stays ``[E, 2]`` with both columns the
      per-expert max, w13 halves requantized in place.
    * bf16 checkpoint: weights live in FP8 storage from the start; the loader
      stages bf16 tensors per expert and post-processing quantizes them in.
    * Only experts loaded since the last processing are touched, vectorized.
    """

    process_all_experts = False

    def create_weights(self, layer, device=None):
        self._create(layer, device, FP8_DTYPE, quantize_on_load=not self.fp8_checkpoint)
        e = layer.num_local_experts
        if self.fp8_checkpoint:
            layer.register_buffer("w13_input_scale_per_expert",
                                  torch.ones(e, dtype=torch.float32, device=device))
            layer.register_buffer("w2_input_scale_per_expert",
                                  torch.ones(e, dtype=torch.float32, device=device))
        layer.staged = {}

    def stage_expert_weight(self, layer, param, loaded, shard_id, slot):
        # Kept where the reload staged it (host memory on a GPU reload, valid until the
        # reload ends): device memory then holds one processing chunk, not every expert.
        layer.staged.setdefault(slot, {})[shard_id] = loaded

    def _scope(self, layer) -> list[int]:
        if self.process_all_experts:
            return list(range(layer.num_local_experts))
        return sorted(layer.loaded_experts)

    def process_weights_after_loading(self, layer) -> None:
        # the Parameters themselves (no `.data` views, no `Module.__getattr__`): one reloaded
        # expert's processing is a few microseconds of host time in all
        params, buffers = layer._parameters, layer._buffers
        if self.fp8_checkpoint:
            process_fp8_experts_(params["w13_weight"], params["w13_weight_scale"], self._scope(layer),
                                 layer.intermediate_size,
                                 ((params["w13_input_scale"], buffers["w13_input_scale_per_expert"]),
                                  (params["w2_input_scale"], buffers["w2_input_scale_per_expert"])),
                                 cache=layer.__dict__.setdefault("requant_cache", {}))
        else:
            incomplete = sorted(s for s, pieces in layer.staged.items() if set(pieces) != {"w1", "w2", "w3"})
            if incomplete:
                raise RuntimeError(f"quantize-on-load: experts {incomplete} were loaded only in part")
            quantize_staged_experts_(params["w13_weight"], params["w13_weight_scale"], params["w2_weight"],
                                     params["w2_weight_scale"], layer.staged)
            layer.staged.clear()
        layer.loaded_experts.clear()
        _new_weights_version(layer)


class IdentityOnlyFp8MoEMethod(FixedFp8MoEMethod):
    """The ``fp8.py`` half of the fix alone: in place, but every expert, every time."""

    process_all_experts = True

