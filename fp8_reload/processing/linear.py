"""FP8 linear methods: sglang 0.5.23's Fp8LinearMethod (per tensor) and the fixed one."""

from __future__ import annotations

import torch
from torch.nn import Parameter

from .. import trace
from ..layers import set_weight_attrs
from ..quant import (
    FP8_DTYPE,
    amax_scale,
    amax_scale_of,
    by_row_blocks_,
    dequantize,
    quantize_dynamic,
    quantize_static,
    requantize,
)
from .ops import on_triton, process_fp8_experts_


def _new_scale(n: int, device, fill: float, loader=None) -> Parameter:
    p = Parameter(torch.full((n,), fill, dtype=torch.float32, device=device),
                  requires_grad=False)
    if loader is not None:
        set_weight_attrs(p, {"weight_loader": loader})
    return p


def _shard_rows(layer, shard_id: int | None) -> tuple[int, int]:
    if shard_id is None:
        return 0, layer.output_size
    return sum(layer.logical_widths[:shard_id]), layer.logical_widths[shard_id]


@trace.range("fp8_reload/linear")
def _linear_forward(x: torch.Tensor, w_kn: torch.Tensor, w_scale: torch.Tensor,
                    a_scale: torch.Tensor | None) -> torch.Tensor:
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
    def shard_keys(layer) -> list[int | None]:
        """The shard ids a checkpoint's tensors of the weight come with: None for a weight
        of one, else one per logical width."""
        n = len(layer.logical_widths)
        return [None] if n == 1 else list(range(n))

    def quantize_shards_(self, layer, shards: dict) -> None:
        """bf16 `shards` (``{shard id: tensor}``, every one of `shard_keys`, on the weight's
        device) into the FP8 weight with one dynamic scale, the amax of all of them: what a
        fresh load computes. Post-processing calls it on the staged tensors, the streaming
        reload on the tensors where they landed in device memory. What was staged before is
        superseded (a loaded but unprocessed layer reloaded: review s20)."""
        layer.staged.clear()
        w = self.checkpoint_view(layer)
        scale = amax_scale_of(shards.values())
        for k, src in shards.items():
            start, rows = _shard_rows(layer, k)
            by_row_blocks_(w.narrow(0, start, rows), src, lambda block: quantize_static(block, scale))
        layer.weight_scale.data.fill_(scale)

    @staticmethod
    def checkpoint_view(layer) -> torch.Tensor:
        w = layer.weight.data
        return w.t() if layer.kernel_layout else w

    def destination(self, layer, param, shard_id) -> torch.Tensor | None:
        """Where a checkpoint tensor goes: rows of the checkpoint-layout view of the weight
        (contiguous in its storage whatever `.data` is bound to), one scale slot, or None
        for a bf16 weight quantized on load (staged). The loader and the streaming reload
        both write through it."""
        if param is layer.weight:
            if param.quantize_on_load:
                return None
            start, rows = _shard_rows(layer, shard_id)
            return self.checkpoint_view(layer).narrow(0, start, rows)
        return param.data[0 if shard_id is None else shard_id]

    def load_linear(self, layer, param, loaded, shard_id):
        layer.needs_processing = True
        dst = self.destination(layer, param, shard_id)
        if dst is None:
            layer.staged[shard_id] = loaded  # stays in host staging memory until processed
        else:
            dst.copy_(loaded, non_blocking=True)

    def process_weights_after_loading(self, layer) -> None:
        if not layer.needs_processing:
            return
        w = self.checkpoint_view(layer)
        if self.fp8_checkpoint:
            # one scale (a single width, or one input scale) is its own max: nothing to do,
            # and on a GPU nothing queued (a full reload processes every module at its end)
            s = layer.weight_scale.data
            widths = layer.logical_widths
            if (len(widths) == 2 and widths[0] == widths[1] and w.is_contiguous() and s.is_contiguous()
                    and on_triton(w)):
                # gate | up is one expert's w13: one launch of its requantization (the
                # torch loop below is a dozen launches and float32 temporaries of a half);
                # what it checked is kept with the layer (kept globally, a dropped model's
                # stayed: the soak on CUDA counted a ticket per linear and model loaded)
                process_fp8_experts_(w.view(1, *w.shape), s.view(1, 2), [0], widths[0],
                                     cache=layer.__dict__.setdefault("requant_cache", {}))
            elif s.numel() > 1:
                m = s.max()
                start = 0
                for i, width in enumerate(layer.logical_widths):
                    # on a device every width goes (no host sync to ask which; a width at
                    # the max is an exact identity, see `requantize`); on a CPU those that move
                    if not w.is_cpu or bool(s[i] != m):
                        rows = w.narrow(0, start, width)
                        by_row_blocks_(rows, rows, lambda r, old=s[i]: requantize(r, old, m))
                    start += width
                s.fill_(m)
            a = layer.input_scale.data
            if a.numel() > 1:
                a.fill_(a.max())
        elif layer.staged:  # (nothing staged: the streaming reload quantized it where it landed)
            keys = self.shard_keys(layer)
            missing = [k for k in keys if k not in layer.staged]
            if missing:
                raise RuntimeError(f"quantize-on-load: shards {missing} of the layer were not loaded")
            self.quantize_shards_(layer, {k: layer.staged[k].to(w.device, non_blocking=True) for k in keys})
        if not layer.kernel_layout:
            layer.weight.data = layer.weight.data.t()
            layer.kernel_layout = True
        layer.needs_processing = False

    def apply(self, layer, x):
        a = None if layer.input_scale is None else layer.input_scale[0]
        return _linear_forward(x, layer.weight, layer.weight_scale[0], a)

