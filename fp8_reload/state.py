"""Snapshots of a model's state, compared bit for bit.

The central invariant is stated in these terms: after a reload every parameter
and buffer has the bytes a fresh load gives, every Parameter is the same object
with the same loader attributes, and untouched slices did not move.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint.layout import tensor_layout

LOADER_ATTRS = ("weight_loader", "quant_method", "quantize_on_load")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (what "bit for bit" compares)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


_SERIALS: dict[int, int] = {}
_NEXT_SERIAL = itertools.count()


def object_serial(obj) -> int:
    """A number no other object ever gets. `id()` is not that: once a replaced
    Parameter dies, CPython hands its address to the next one, so comparing ids
    could call a replacement "the same object"."""
    key = id(obj)
    serial = _SERIALS.get(key)
    if serial is None:
        serial = _SERIALS[key] = next(_NEXT_SERIAL)
        weakref.finalize(obj, _SERIALS.pop, key, None)  # runs before the address is reused
    return serial


@dataclass
class Snapshot:
    tensors: dict[str, torch.Tensor]  # CPU copies, every parameter and buffer
    ids: dict[str, int]  # object_serial() of each Parameter object
    attrs: dict[str, dict]  # loader attributes present on each Parameter


def snapshot(model: nn.Module) -> Snapshot:
    tensors, ids, attrs = {}, {}, {}
    for name, p in model.named_parameters():
        tensors[name] = p.detach().to("cpu", copy=True)
        ids[name] = object_serial(p)
        attrs[name] = {a: getattr(p, a) for a in LOADER_ATTRS if hasattr(p, a)}
    for name, b in model.named_buffers():
        tensors[name] = b.detach().to("cpu", copy=True)
    return Snapshot(tensors, ids, attrs)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw_bytes(a), raw_bytes(b))


def compare_states(a: Snapshot, b: Snapshot, *, identity: bool = False) -> list[str]:
    """Differences between two snapshots, one line each; empty when bit-identical.

    With ``identity=True`` also require the same Parameter objects and loader
    attributes (only meaningful for two snapshots of one model).
    """
    diffs = []
    for name in sorted(set(a.tensors) | set(b.tensors)):
        if name not in a.tensors or name not in b.tensors:
            diffs.append(f"{name}: present in only one state")
            continue
        x, y = a.tensors[name], b.tensors[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            diffs.append(f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(raw_bytes(x), raw_bytes(y)):
            n = int((raw_bytes(x) != raw_bytes(y)).sum())
            diffs.append(f"{name}: {n} of {x.numel() * x.element_size()} bytes differ")
    if identity:
        for name in sorted(set(a.ids) | set(b.ids)):
            if a.ids.get(name) != b.ids.get(name):
                diffs.append(f"{name}: Parameter object replaced")
            elif set(a.attrs.get(name, {})) != set(b.attrs.get(name, {})):
                diffs.append(f"{name}: loader attributes {sorted(a.attrs[name])} -> {sorted(b.attrs[name])}")
            else:  # the same objects: a loader swapped for another is not sglang's any more
                swapped = sorted(k for k, v in a.attrs.get(name, {}).items() if b.attrs[name][k] is not v)
                if swapped:
                    diffs.append(f"{name}: loader attributes {swapped} replaced")
    return diffs


def missing_loaders(model) -> list[str]:
    """Parameters a reload must reach through `param.weight_loader` that lack it."""
    params = dict(model.named_parameters())
    missing = set()
    for name, _, _ in tensor_layout(model.config, model.checkpoint_kind):
        pname, _, kw = model.resolve(name)
        strict = "expert_id" in kw or "loaded_shard_id" in kw
        p = params.get(pname)
        if p is None or (strict and not hasattr(p, "weight_loader")):
            missing.add(pname)
    return sorted(missing)
