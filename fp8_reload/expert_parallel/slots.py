"""A rank's share of an expert-parallel model, and a slot's state as one row of bytes.

A slot's complete post-processed state is: FP8 ``w13``/``w2`` weights,
``w13_weight_scale[s]`` (both columns), ``w2_weight_scale[s]`` and, for FP8
checkpoints, the raw per-expert input scales (``w*_input_scale_per_expert[s]``).
`pack_slots` copies slots into a flat buffer and `write_slots` scatters one back
in place, so Parameters keep their identity.
"""

from __future__ import annotations

import torch

from ..checkpoint import Checkpoint
from ..errors import ReloadError
from ..layers import FP8MoEModel, FusedMoE
from ..reload import load_model
from .placement import Placement


class RebalanceError(ReloadError):
    """A rebalance failed on some rank; every rank rolled back to the old placement, or the
    message names the ranks that could not (marked ``weights_undefined``)."""


def load_rank_model(path, placement: Placement, rank: int, device="cpu",
                    processing: str = "fixed") -> FP8MoEModel:
    """A fresh load of `rank`'s share of the model under `placement` (one of the checkpoint's
    experts and MoE layers: else ValueError, before anything is loaded)."""
    placement.check_unedited()  # (its cached dispatch tables would describe other slots)
    ckpt = Checkpoint(path)
    placement.check_fits(ckpt.config)
    model = load_model(ckpt, device=device, processing=processing, **placement.model_kwargs(rank))
    placement.check_fits(model.config)  # (the directory may have been replaced meanwhile)
    model.placement = placement
    model.ep_rank = rank
    return model


def moe_layer_map(model: FP8MoEModel) -> dict[int, FusedMoE]:
    return {layer.layer_id: layer for _, layer in model.moe_layers()}


def slot_tensors(layer: FusedMoE) -> list[torch.Tensor]:
    """Every tensor of a layer indexed by local slot whose slice a slot owns.

    The merged input scales (one value for the whole layer) are not among them:
    they are recomputed from the raw per-expert buffers after a commit.
    """
    ts = [layer.w13_weight.data, layer.w2_weight.data,
          layer.w13_weight_scale.data, layer.w2_weight_scale.data]
    for name in ("w13_input_scale_per_expert", "w2_input_scale_per_expert"):
        buf = getattr(layer, name, None)
        if buf is not None:
            ts.append(buf)
    return ts


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A `[slots, bytes]` uint8 view of `t` (writes go to `t`'s storage)."""
    if not t.is_contiguous():
        raise RebalanceError(f"slot tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(t.shape[0], -1).view(torch.uint8)


# Integer widths a [slots, bytes] view is reinterpreted as for gathers and scatters.
_WORDS = (torch.int64, torch.int32, torch.int16)


def as_words(*views: torch.Tensor) -> list[torch.Tensor]:
    """`views` ([k, n] uint8, row-contiguous) as the widest integer type all of them allow.

    A gather or scatter then moves 8 bytes per element instead of 1: on a GPU,
    byte-wise `index_select` runs far below copy bandwidth. Falls back to bytes
    when a row width or offset is not a multiple of 2.
    """
    for dtype in _WORDS:
        w = dtype.itemsize
        if all(v.shape[1] % w == 0 and v.storage_offset() % w == 0 and v.stride(0) % w == 0
               for v in views):
            return [v.view(dtype) for v in views]
    return list(views)


def row_bytes(layer: FusedMoE) -> int:
    """Bytes of one slot's complete state."""
    return sum(_rows(t).shape[1] for t in slot_tensors(layer))


def refresh_merged_input_scales(layers) -> None:
    """Layer-max input scales from the raw per-expert values, as a fresh load sets them
    (`processing.ops.merge_input_scales_` with nothing loaded), for every layer of `layers`
    in a few launches whatever their number: per (shape, dtype) group, one stack of the
    raw buffers, one max per row and one `_foreach_copy_` of the maxes into the merged
    Parameters (in place)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for layer in layers:
        for name in ("w13", "w2"):
            raw = getattr(layer, f"{name}_input_scale_per_expert", None)
            if raw is not None:
                param = getattr(layer, f"{name}_input_scale").data
                key = (raw.shape, raw.dtype, raw.device, param.shape, param.dtype)
                params, raws = groups.setdefault(key, ([], []))
                params.append(param)
                raws.append(raw)
    for (_, _, _, shape, dtype), (params, raws) in groups.items():
        top = torch.stack(raws).flatten(1).amax(1).to(dtype)  # each raw's max, as `.max()`
        vals = top.view(-1, *([1] * len(shape))).expand(len(params), *shape).contiguous()
        torch._foreach_copy_(params, list(vals.unbind(0)))
