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

The tensor-level helpers (`requantize_w13_to_expert_max_`, `quantize_experts_`,
`merge_input_scales_`) are what `sglang_patch` applies to sglang's own classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn
from torch.nn import Parameter

from . import trace
from .layers import PER_TENSOR, set_weight_attrs
from .quant import (FP8_DTYPE, amax_scale, dequantize, index_copy_, quantize_dynamic,
                    quantize_static, requantize)

# Bound on float32 temporaries while (re)quantizing experts: experts are
# processed in chunks of at most this many bytes of float32.
CHUNK_BYTES = 128 << 20


# --------------------------------------------------------------------------
# Tensor-level helpers (shared with sglang_patch)
# --------------------------------------------------------------------------

def _gather_to(device, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Stack ``rows[k]`` (pieces concatenated along dim 0) into one new tensor on `device`.

    The pieces are copied straight into their slices (one async copy each from pinned
    staging memory): no host-side concatenation, and device memory holds only the result.
    """
    first = rows[0][0]
    height = sum(p.shape[0] for p in rows[0])
    out = torch.empty((len(rows), height, *first.shape[1:]), dtype=first.dtype, device=device)
    for k, pieces in enumerate(rows):
        start = 0
        for p in pieces:
            out[k].narrow(0, start, p.shape[0]).copy_(p, non_blocking=True)
            start += p.shape[0]
    return out


def _chunks(idx: torch.Tensor, per_item_bytes: int) -> Iterable[torch.Tensor]:
    step = max(1, CHUNK_BYTES // max(per_item_bytes, 1))
    for i in range(0, idx.numel(), step):
        yield idx[i:i + step]


def requantize_w13_to_expert_max_(w13: torch.Tensor, w13_scale: torch.Tensor,
                                  experts: torch.Tensor, shard_size: int) -> None:
    """Give each listed expert one w13 scale, in place, vectorized over experts.

    `w13` is ``[E, 2*shard_size, H]`` FP8 holding gate rows then up rows, each
    quantized with its own scale in ``w13_scale[e, 0|1]``. Both halves move to
    ``max(scale[e])`` and both columns of ``w13_scale[e]`` are set to it, so the
    ``[E, 2]`` Parameter keeps its shape, its object and its loader. A half whose
    scale already is the max is left untouched (exact identity), so processing an
    expert twice changes nothing.
    """
    if experts.numel() == 0:
        return
    e_all, rows, hidden = w13.shape
    experts = experts.to(w13.device)
    for idx in _chunks(experts, rows * hidden * 4):
        s = w13_scale.index_select(0, idx)  # [k, 2]
        m = s.amax(dim=1)  # [k]
        for half in (0, 1):
            moving = (s[:, half] != m).nonzero().flatten()
            if moving.numel() == 0:
                continue
            sel = idx.index_select(0, moving)
            block = w13.index_select(0, sel).narrow(1, half * shard_size, shard_size)
            new = requantize(block, s.index_select(0, moving)[:, half, None, None],
                             m.index_select(0, moving)[:, None, None])
            index_copy_(w13.narrow(1, half * shard_size, shard_size), 0, sel, new)
        w13_scale.index_copy_(0, idx, m[:, None].expand(-1, 2).contiguous())


def quantize_experts_(w: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                      values: torch.Tensor) -> None:
    """Quantize ``values[k]`` (high precision) into FP8 slots ``w[experts[k]]``.

    One dynamic per-tensor scale per expert (amax / 448), written into
    ``scale[experts]`` in place: every column of a ``[E, 2]`` scale gets it.
    """
    s = amax_scale(values, dims=tuple(range(1, values.dim())))  # [k]
    q = quantize_static(values, s.view(-1, *([1] * (values.dim() - 1))))
    idx = experts.to(w.device)
    index_copy_(w, 0, idx, q)
    if scale.dim() == 2:
        scale.index_copy_(0, idx, s[:, None].expand(-1, scale.shape[1]).contiguous())
    else:
        scale.index_copy_(0, idx, s)


def merge_input_scales_(param: torch.Tensor, raw: torch.Tensor,
                        experts: torch.Tensor) -> None:
    """Static input scales: kernels take one per layer, the max over experts.

    ``param`` ([E], loaded per expert) is overwritten in place with that max. The
    per-expert values are kept in ``raw`` so a reload of some experts recomputes
    the max from the true per-expert values, exactly as a fresh load would.
    """
    if experts.numel():
        idx = experts.to(param.device)
        raw.index_copy_(0, idx, param.index_select(0, idx).to(raw.dtype))
    param.fill_(raw.max())


# --------------------------------------------------------------------------
# Linear methods
# --------------------------------------------------------------------------

def _new_scale(n: int, device, fill: float, loader=None) -> Parameter:
    p = Parameter(torch.full((n,), fill, dtype=torch.float32, device=device),
                  requires_grad=False)
    if loader is not None:
        set_weight_attrs(p, {"weight_loader": loader})
    return p


def _shard_rows(layer, shard_id: Optional[int]) -> tuple[int, int]:
    if shard_id is None:
        return 0, layer.output_size
    return sum(layer.logical_widths[:shard_id]), layer.logical_widths[shard_id]


@trace.range("fp8_reload/linear")
def _linear_forward(x: torch.Tensor, w_kn: torch.Tensor, w_scale: torch.Tensor,
                    a_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Reference W8A8 GEMM: x [M, K] bf16, w_kn [K, N] FP8, per-tensor or [1, N] scales."""
    if a_scale is None:
        xq, a_scale = quantize_dynamic(x)
    else:
        xq = quantize_static(x, a_scale)
    y = dequantize(xq, a_scale) @ dequantize(w_kn, w_scale)
    return y.to(torch.bfloat16)


class UpstreamFp8LinearMethod:
    """sglang 0.5.23 Fp8LinearMethod, per-tensor, on the CUTLASS (Hopper) branch.

    Post-processing converts per-shard scales to per-channel ``[N, 1]`` and
    replaces ``weight`` with a new Parameter holding the transposed view, so a
    second pass transposes it back.
    """

    def __init__(self, fp8_checkpoint: bool):
        self.fp8_checkpoint = fp8_checkpoint

    def create_weights(self, layer, device=None):
        dtype = FP8_DTYPE if self.fp8_checkpoint else torch.bfloat16
        weight = Parameter(torch.empty(layer.output_size, layer.input_size, dtype=dtype,
                                       device=device), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)
        if self.fp8_checkpoint:
            fmin = torch.finfo(torch.float32).min
            n = len(layer.logical_widths)
            layer.register_parameter("weight_scale", _new_scale(n, device, fmin, layer.weight_loader))
            layer.register_parameter("input_scale", _new_scale(n, device, fmin, layer.weight_loader))
        else:
            layer.register_parameter("weight_scale", None)
            layer.register_parameter("input_scale", None)

    def load_linear(self, layer, param, loaded, shard_id):
        if param is layer.weight:
            start, rows = _shard_rows(layer, shard_id)
            param.data.narrow(0, start, rows).copy_(loaded)
        else:
            param.data[0 if shard_id is None else shard_id] = loaded

    def process_weights_after_loading(self, layer) -> None:
        if self.fp8_checkpoint:
            ws = layer.weight_scale
            channel = torch.empty(layer.output_size, 1, dtype=torch.float32, device=ws.device)
            if ws.dim() == 0:
                channel.fill_(ws.item())
            else:
                start = 0
                for i, width in enumerate(layer.logical_widths):
                    channel[start:start + width, :] = ws[i]
                    start += width
            layer.weight = Parameter(layer.weight.data.t(), requires_grad=False)
            layer.weight_scale = Parameter(channel, requires_grad=False)
            layer.input_scale = Parameter(layer.input_scale.max(), requires_grad=False)
        else:
            w = layer.weight.data
            scale = amax_scale(w, dims=(1,)).unsqueeze(1)  # per output row [N, 1]
            qweight = quantize_static(w, scale)
            layer.weight = Parameter(qweight.t(), requires_grad=False)
            layer.weight_scale = Parameter(scale.t().contiguous(), requires_grad=False)
            layer.input_scale = None

    def apply(self, layer, x):
        return _linear_forward(x, layer.weight, layer.weight_scale.reshape(1, -1),
                               layer.input_scale)


class FixedFp8LinearMethod:
    """Identity-preserving Fp8LinearMethod.

    The weight stays one Parameter; post-processing requantizes merged shards to
    their max scale in place, fills the per-shard scales with it, and rebinds
    ``weight.data`` to the transposed view of the same storage. The loader writes
    through the checkpoint-layout view of that storage, and processing runs only
    on a layer that received weights since it was last processed. A bf16
    checkpoint is quantized on load: tensors are staged and quantized into the
    FP8 storage by post-processing, so the Parameter never changes dtype.
    """

    def __init__(self, fp8_checkpoint: bool):
        self.fp8_checkpoint = fp8_checkpoint

    def create_weights(self, layer, device=None):
        weight = Parameter(torch.empty(layer.output_size, layer.input_size, dtype=FP8_DTYPE,
                                       device=device), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader,
                                  "quantize_on_load": not self.fp8_checkpoint})
        layer.register_parameter("weight", weight)
        n = len(layer.logical_widths)
        if self.fp8_checkpoint:
            fmin = torch.finfo(torch.float32).min
            layer.register_parameter("weight_scale", _new_scale(n, device, fmin, layer.weight_loader))
            layer.register_parameter("input_scale", _new_scale(n, device, fmin, layer.weight_loader))
        else:
            layer.register_parameter("weight_scale", _new_scale(n, device, 1.0))
            layer.register_parameter("input_scale", None)
        layer.kernel_layout = False  # weight.data is [out, in] until processed
        layer.needs_processing = False
        layer.staged = {}

    @staticmethod
    def checkpoint_view(layer) -> torch.Tensor:
        w = layer.weight.data
        return w.t() if layer.kernel_layout else w

    def load_linear(self, layer, param, loaded, shard_id):
        layer.needs_processing = True
        if param is layer.weight:
            if param.quantize_on_load:
                layer.staged[shard_id] = loaded  # stays in host staging memory until processed
                return
            start, rows = _shard_rows(layer, shard_id)
            self.checkpoint_view(layer).narrow(0, start, rows).copy_(loaded, non_blocking=True)
        else:
            param.data[0 if shard_id is None else shard_id].copy_(loaded, non_blocking=True)

    def process_weights_after_loading(self, layer) -> None:
        if not layer.needs_processing:
            return
        w = self.checkpoint_view(layer)
        if self.fp8_checkpoint:
            s = layer.weight_scale.data
            m = s.max()
            start = 0
            for i, width in enumerate(layer.logical_widths):
                if s[i] != m:
                    rows = w.narrow(0, start, width)
                    rows.copy_(requantize(rows, s[i], m))
                start += width
            s.fill_(m)
            layer.input_scale.data.fill_(layer.input_scale.data.max())
        else:
            keys = [None] if len(layer.logical_widths) == 1 else list(range(len(layer.logical_widths)))
            missing = [k for k in keys if k not in layer.staged]
            if missing:
                raise RuntimeError(f"quantize-on-load: shards {missing} of the layer were not loaded")
            full = _gather_to(w.device, [[layer.staged[k] for k in keys]])[0]
            q, scale = quantize_dynamic(full)
            w.copy_(q)
            layer.weight_scale.data.fill_(scale)
            layer.staged.clear()
        if not layer.kernel_layout:
            layer.weight.data = layer.weight.data.t()
            layer.kernel_layout = True
        layer.needs_processing = False

    def apply(self, layer, x):
        a = None if layer.input_scale is None else layer.input_scale[0]
        return _linear_forward(x, layer.weight, layer.weight_scale[0], a)


# --------------------------------------------------------------------------
# MoE methods
# --------------------------------------------------------------------------

def _moe_param(shape, dtype, device, fill=None) -> Parameter:
    t = torch.empty(*shape, dtype=dtype, device=device) if fill is None else \
        torch.full(shape, fill, dtype=dtype, device=device)
    return Parameter(t, requires_grad=False)


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
        layer.weights_version += 1


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

    def _scope(self, layer) -> torch.Tensor:
        if self.process_all_experts:
            ids = range(layer.num_local_experts)
        else:
            ids = sorted(layer.loaded_experts)
        return torch.tensor(list(ids), dtype=torch.long)

    def process_weights_after_loading(self, layer) -> None:
        experts = self._scope(layer)
        if self.fp8_checkpoint:
            merge_input_scales_(layer.w13_input_scale.data, layer.w13_input_scale_per_expert, experts)
            merge_input_scales_(layer.w2_input_scale.data, layer.w2_input_scale_per_expert, experts)
            requantize_w13_to_expert_max_(layer.w13_weight.data, layer.w13_weight_scale.data,
                                          experts, layer.intermediate_size)
        else:
            self._quantize_staged(layer)
        layer.loaded_experts.clear()
        layer.weights_version += 1

    def _quantize_staged(self, layer) -> None:
        slots = sorted(layer.staged)
        incomplete = [s for s in slots if set(layer.staged[s]) != {"w1", "w2", "w3"}]
        if incomplete:
            raise RuntimeError(f"quantize-on-load: experts {incomplete} were loaded only in part")
        per_expert = 2 * layer.intermediate_size * layer.hidden_size * 4
        for idx in _chunks(torch.tensor(slots, dtype=torch.long), per_expert):
            ids = idx.tolist()
            dev = layer.w13_weight.device
            w13 = _gather_to(dev, [[layer.staged[s]["w1"], layer.staged[s]["w3"]] for s in ids])
            quantize_experts_(layer.w13_weight.data, layer.w13_weight_scale.data, idx, w13)
            del w13
            w2 = _gather_to(dev, [[layer.staged[s]["w2"]] for s in ids])
            quantize_experts_(layer.w2_weight.data, layer.w2_weight_scale.data, idx, w2)
            del w2
        layer.staged.clear()


class IdentityOnlyFp8MoEMethod(FixedFp8MoEMethod):
    """The ``fp8.py`` half of the fix alone: in place, but every expert, every time."""

    process_all_experts = True


# --------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------

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
