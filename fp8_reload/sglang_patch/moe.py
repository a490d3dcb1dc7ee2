"""The fp8.py / FusedMoE half of the fix: sglang's Fp8MoEMethod per-tensor branch in place.

Replaces ``Fp8MoEMethod.create_weights`` (bf16 checkpoints: FP8 storage from the
start), ``FusedMoE._weight_loader_impl`` (records the slots written; stages bf16
experts), ``Fp8MoEMethod.process_weights_after_loading`` (in place, only the
experts loaded since the last processing), ``get_triton_quant_info``
(contiguous ``[E]`` scale), ``apply`` (DeepGEMM: ``[E, 2]`` collapsed before
the block expansion) and ``FusedMoEWithLoRA._forward_with_lora`` (that quant info
taken for every forward, not once). Layers this does not cover keep sglang's own code.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch.nn import Parameter

from ..kernels.scales import BLOCK, collapse_w13_scale, expand_block_scales
from ..processing.ops import quantize_staged_experts_, requantize_w13_to_expert_max_
from ..quant import FP8_DTYPE
from .originals import original


def per_tensor_block_scales(scale: torch.Tensor, weight_shape, block: int = BLOCK) -> torch.Tensor:
    """Per-expert scales ([E], or [E, 2] with equal columns) as DeepGEMM's
    ``[E, ceil(N / block), ceil(K / block)]`` block scales."""
    _, n, k = weight_shape
    return expand_block_scales(collapse_w13_scale(scale), n, k, block)


def handles(method, layer) -> bool:
    """Whether the layer runs the per-tensor path this patch fixes."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.layers.quantization import fp8

    if not isinstance(method, fp8.Fp8MoEMethod) or not hasattr(layer, "_fp8r_loaded"):
        return False
    if getattr(layer, "_fp8r_fused_loader", False):  # (its loader is not the one patched)
        return False
    if method.block_quant or method.is_fp4_expert or not layer.moe_runner_config.is_gated:
        return False
    if fp8._is_hip or fp8._is_cpu or fp8._is_fp8_fnuz:
        return False
    backend = get_moe_runner_backend()
    if backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed() or backend.is_hpc_ops():
        return False
    if not method.quant_config.is_checkpoint_fp8_serialized:
        return getattr(layer, "_fp8r_fp8_storage", False)  # built with the patch applied
    return True


def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                    params_dtype, with_bias=False, **extra_weight_attrs):
    original("Fp8MoEMethod", "create_weights")(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
        with_bias=with_bias, **extra_weight_attrs)
    layer._fp8r_loaded = set()
    layer._fp8r_parts = {}  # FP8 checkpoints: slot -> the (parameter, shard) pairs loaded
    layer._fp8r_processed = False
    # sglang's fused loader (GPT-OSS) writes whole [E, ...] tensors past `_weight_loader_impl`:
    # no slots recorded, bf16 cast straight into FP8 storage. Such layers keep sglang's code.
    loader = extra_weight_attrs.get("weight_loader")
    layer._fp8r_fused_loader = getattr(loader, "__name__", "") == "weight_loader_fused"
    if self.quant_config.is_checkpoint_fp8_serialized or self.block_quant or self.is_fp4_expert:
        return
    # bf16 checkpoint quantized on load: FP8 storage now, bf16 only in staging.
    layer._fp8r_fp8_storage = True
    layer._fp8r_staged = {}
    layer._fp8r_staging_lock = threading.Lock()  # sglang's loaders may run in a thread pool
    if handles(self, layer):
        for p in (layer.w13_weight, layer.w2_weight):
            p.data = torch.empty(p.shape, dtype=FP8_DTYPE, device=p.device)
    else:
        layer._fp8r_fp8_storage = False


def _staging_param(layer, param, slot: int) -> Parameter:
    """A one-expert bf16 Parameter sglang's own loader can write into (TP slicing,
    gate/up halves), carrying the attributes of the real one. Gate and up of one expert
    may be loaded at once (DeepSeek's loader submits host tensors to a thread pool): they
    must get the same buffer, so it is made under the layer's lock."""
    key = "w13" if param is layer.w13_weight else "w2"
    with layer._fp8r_staging_lock:
        entry = layer._fp8r_staged.setdefault(slot, {"shards": set()})
        if key not in entry:
            entry[key] = torch.empty(param.shape[1:], dtype=layer.params_dtype, device=param.device)
    staged = Parameter(entry[key].unsqueeze(0), requires_grad=False)
    staged.__dict__.update(param.__dict__)
    return staged


def weight_loader_impl(self, param, loaded_weight, weight_name, shard_id, expert_id):
    impl = original("FusedMoE", "_weight_loader_impl")
    if not handles(self.quant_method, self):
        return impl(self, param, loaded_weight, weight_name, shard_id, expert_id)
    backup = getattr(self, "_fp8r_backup", None)  # a filtered update in progress
    if backup is not None:
        backup.save(self, int(expert_id))
    self._fp8r_loaded.add(int(expert_id))
    name = next((n for n in _FP8_PART_NAMES if getattr(self, n, None) is param), None)
    if name is not None:
        self._fp8r_parts.setdefault(int(expert_id), set()).add((name, shard_id))
    if getattr(self, "_fp8r_fp8_storage", False) and (param is self.w13_weight or param is self.w2_weight):
        staged = _staging_param(self, param, int(expert_id))
        impl(self, staged, loaded_weight, weight_name, shard_id, 0)
        self._fp8r_staged[int(expert_id)]["shards"].add(shard_id)
        return None
    return impl(self, param, loaded_weight, weight_name, shard_id, expert_id)


# An FP8 checkpoint's expert: gate/up/down weights and weight scales; input scales too
# when static (gate's and up's land in one slot, the later one kept, as a fresh load does:
# both are needed, else the slot keeps gate's where a fresh load has up's).
_FP8_PARTS = {("w13_weight", "w1"), ("w13_weight", "w3"), ("w2_weight", "w2"),
              ("w13_weight_scale", "w1"), ("w13_weight_scale", "w3"), ("w2_weight_scale", "w2")}
_INPUT_PARTS = {("w13_input_scale", "w1"), ("w13_input_scale", "w3"), ("w2_input_scale", "w2")}
_FP8_PART_NAMES = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                   "w13_input_scale", "w2_input_scale")


def _check_whole_fp8_experts(method, layer) -> None:
    """A reload of part of an expert (its weights without their scales, say) would be
    requantized under the scales of before: refused, as for bf16 checkpoints."""
    need = set(_FP8_PARTS)
    if method.quant_config.activation_scheme == "static":
        need |= _INPUT_PARTS
    partial = sorted(s for s in layer._fp8r_loaded if not need <= layer._fp8r_parts.get(s, set()))
    if partial:
        layer._fp8r_parts.clear()
        raise RuntimeError(f"{layer.layer_name}: experts (local slots) {partial} were loaded only "
                           "in part (an FP8 expert needs its weights, weight scales and static "
                           "input scales together); reload whole experts")


def process_weights_after_loading(self, layer) -> None:
    if not handles(self, layer):
        return original("Fp8MoEMethod", "process_weights_after_loading")(self, layer)
    if self.quant_config.is_checkpoint_fp8_serialized:
        first = not layer._fp8r_processed
        if not first:
            _check_whole_fp8_experts(self, layer)
        slots = range(layer.num_local_experts) if first else sorted(layer._fp8r_loaded)
        experts = torch.tensor(list(slots), dtype=torch.long)
        # Static input scales stay each expert's own, as loaded: the kernels take their max
        # (`get_triton_quant_info`), so an expert that EPLB moves to another rank takes its
        # scale with it and both ranks' max follow.
        if self.quant_config.activation_scheme == "static" and (
                layer.w13_input_scale is None or layer.w2_input_scale is None):
            raise ValueError("static activation scheme, but the layer has no input scales")
        requantize_w13_to_expert_max_(layer.w13_weight.data, layer.w13_weight_scale.data, experts,
                                      layer.intermediate_size_per_partition)
    else:
        _quantize_staged(layer)
    layer._fp8r_loaded.clear()
    layer._fp8r_parts.clear()
    layer._fp8r_processed = True
    dispatcher = getattr(layer, "dispatcher", None)
    if dispatcher is not None:  # the dispatcher learns the weight dtype from processing
        declared = getattr(getattr(layer, "w13_kernel", None), "DISPATCHER_QUANT_CONFIG", None)
        dispatcher.set_quant_config(declared or {"weight_dtype": layer.w13_weight.dtype,
                                                 "use_mxfp8": self.use_mxfp8})
    return None


def _quantize_staged(layer) -> None:
    """Quantize staged bf16 experts into the FP8 storage: one dynamic scale per expert."""
    staged = layer._fp8r_staged
    partial = sorted(s for s, e in staged.items() if e["shards"] != {"w1", "w2", "w3"})
    if partial:
        raise RuntimeError(f"{layer.layer_name}: quantize-on-load: experts (local slots) {partial} "
                           "were loaded only in part; reload whole experts")
    inter = layer.w13_weight.shape[1] // 2
    quantize_staged_experts_(layer.w13_weight.data, layer.w13_weight_scale.data, layer.w2_weight.data,
                             layer.w2_weight_scale.data,
                             {s: {"w1": e["w13"][:inter], "w3": e["w13"][inter:], "w2": e["w2"]}
                              for s, e in staged.items()})
    staged.clear()


def get_triton_quant_info(self, layer):
    info = original("Fp8MoEMethod", "get_triton_quant_info")(self, layer)
    if not handles(self, layer):
        return info
    a13, a2 = layer.w13_input_scale, layer.w2_input_scale
    return dataclasses.replace(
        info, w13_scale=collapse_w13_scale(layer.w13_weight_scale),
        a13_scale=None if a13 is None else a13.max(), a2_scale=None if a2 is None else a2.max())


def forward_with_lora(self, hidden_states, topk_output, lora_info, **kwargs):
    """sglang's LoRA wrapper keeps the Triton quant info it got when it was built; for a
    patched layer that holds copies (the contiguous ``[E]`` w13 scale, the input scales'
    max) a reload or an EPLB move would not reach: taken anew for every forward."""
    base = self.base_layer
    if self._lora_runner_backend.is_triton() and handles(base.quant_method, base):
        self._quant_info = base.quant_method.get_triton_quant_info(base)
    return original("FusedMoEWithLoRA", "_forward_with_lora")(
        self, hidden_states, topk_output, lora_info, **kwargs)


def deepgemm_quant_info(method, layer):
    """DeepGEMM's quant info for the per-tensor layout: [E, 2] collapsed, then blocks."""
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo

    return DeepGemmMoeQuantInfo(
        w13_weight=layer.w13_weight, w2_weight=layer.w2_weight, use_fp8=True,
        w13_scale=per_tensor_block_scales(layer.w13_weight_scale, layer.w13_weight.shape),
        w2_scale=per_tensor_block_scales(layer.w2_weight_scale, layer.w2_weight.shape),
        block_shape=[BLOCK, BLOCK], is_fp4_experts=method.is_fp4_expert,
        use_mxfp8=method.use_mxfp8)


def apply(self, layer, dispatch_output):
    runner = getattr(self, "runner", None)
    if runner is not None and runner.runner_backend.is_deep_gemm() and handles(self, layer):
        return runner.run(dispatch_output, deepgemm_quant_info(self, layer))
    return original("Fp8MoEMethod", "apply")(self, layer, dispatch_output)

