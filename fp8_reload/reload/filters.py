"""What a reload selects: EPLB's name filters, reload units, the model's expected layout."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ..checkpoint import tensor_layout
from ..layers import EXPERT_RE

NameFilter = Callable[[str], bool]


class ExpertFilter:
    """EPLB's filter: matches checkpoint tensors of the given experts of the given layers.

    A callable like any filter, that also carries its (layer, expert) pairs: the planner
    then takes the matching tensors from a per-checkpoint index (`key` of every name,
    computed once) instead of calling the filter on every name of the checkpoint, so a
    small reload costs what it reloads, not what the checkpoint holds. Both answer the
    same, by construction: the index is built with `key`, and `__call__` is `key`.
    """

    __slots__ = ("wanted", "layer_experts")
    _pattern = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")

    def __init__(self, layer_experts: dict[int, Iterable[int]]):
        if not isinstance(layer_experts, Mapping):
            raise TypeError(f"generate_weight_name_filter takes {{layer: experts}}, got {layer_experts!r}")
        merged: dict[int, set[int]] = {}  # keys naming one layer ({1: .., "1": ..}) add up
        for layer, es in layer_experts.items():
            merged.setdefault(_whole(layer, "layer"), set()).update(
                _whole(e, f"layer {layer}: expert") for e in _collection(layer, es))
        self.layer_experts = {layer: sorted(es) for layer, es in merged.items()}
        self.wanted = frozenset((layer, e) for layer, es in self.layer_experts.items() for e in es)

    @staticmethod
    def key(name: str) -> tuple[int, int] | None:
        """(layer, expert) of an expert tensor's name, None for any other name."""
        m = ExpertFilter._pattern.search(name)
        return None if m is None else (int(m.group(1)), int(m.group(2)))

    def __call__(self, name: str) -> bool:
        return self.key(name) in self.wanted

    def __repr__(self) -> str:
        return f"generate_weight_name_filter({self.layer_experts!r})"


def _whole(value, what: str) -> int:
    """`value` as an int where it is one: an int, a numpy or 0-d tensor integer, or decimal
    digits (the keys of a plan read from JSON). A float is refused: ``int(2.7)`` would quietly
    name another expert; so is a bool (``True`` would name expert 1), and an array of one."""
    if type(value).__name__ in ("bool", "bool_") or getattr(value, "dtype", None) == torch.bool:
        raise TypeError(f"generate_weight_name_filter: {what} {value!r} is a bool, not an id")
    if getattr(value, "ndim", 0) != 0:  # (torch takes a one-element tensor as an index, numpy not)
        raise TypeError(f"generate_weight_name_filter: {what} {value!r} is not a whole number")
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"generate_weight_name_filter: {what} {value!r} is not a whole number") from None


def _collection(layer, experts):
    """A layer's experts, refused unless a collection: a string would be read a digit at a
    time ("12": experts 1 and 2)."""
    if isinstance(experts, (str, bytes)) or not isinstance(experts, Iterable):
        raise TypeError(f"generate_weight_name_filter: layer {layer}'s experts must be a collection of "
                        f"whole numbers (a list, a set, a range), got {experts!r}")
    return experts


def generate_weight_name_filter(layer_experts: dict[int, Iterable[int]]) -> ExpertFilter:
    """EPLB's filter: matches checkpoint tensors of the given experts of the given layers."""
    return ExpertFilter(layer_experts)


def eplb_filter(cfg, experts_per_layer: int) -> tuple[NameFilter, dict[int, list[int]]]:
    """`experts_per_layer` experts of every MoE layer, spread over the layer (a rebalance
    step); returns the filter and the chosen {layer: experts}."""
    step = max(1, cfg.num_experts // experts_per_layer)
    chosen = {layer: list(range(0, cfg.num_experts, step))[:experts_per_layer]
              for layer in cfg.moe_layers}
    return generate_weight_name_filter(chosen), chosen


def expected_layout(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)} of every tensor the model loads, cached on it."""
    cached = getattr(model, "_expected_layout", None)
    if cached is None:
        cached = {n: (s, d) for n, s, d in tensor_layout(model.config, model.checkpoint_kind)}
        model._expected_layout = cached
    return cached


def unit_of(model, name: str) -> tuple[str, int | None]:
    """The smallest set of tensors that must be reloaded together.

    An expert (all its gate/up/down weights and scales) or a whole module: the
    post-processing of either needs every one of its tensors.
    """
    _, module, kw = model.resolve(name)
    return module, kw.get("expert_id")


def units(model) -> tuple[dict, dict, dict]:
    """(name -> unit, unit -> names in layout order, name -> position in the layout) of the
    model's layout, cached."""
    cached = model.__dict__.get("_units_cache")
    if cached is None:
        of, members, position = {}, {}, {}
        for k, n in enumerate(expected_layout(model)):
            u = of[n] = unit_of(model, n)
            members.setdefault(u, []).append(n)
            position[n] = k
        cached = model.__dict__["_units_cache"] = (of, members, position)
    return cached


def modules_by_name(model) -> dict[str, nn.Module]:
    """{name: module} of the whole model, cached (its modules are fixed once built): a
    reload looks its modules up here, not by walking the model or by `get_submodule`
    (whose attribute lookups with fresh strings fill the interpreter's type cache)."""
    cached = model.__dict__.get("_modules_by_name")
    if cached is None:
        cached = model.__dict__["_modules_by_name"] = dict(model.named_modules())
    return cached


def processing_order(model) -> dict[str, tuple[int, nn.Module]]:
    """{name: (position, module)} of the model's quantized modules, in the order
    `quantized_modules` gives (the post-processing order), cached: a reload then orders
    the modules it touched without walking the whole model."""
    cached = model.__dict__.get("_processing_order")
    if cached is None:
        cached = {n: (k, m) for k, (n, m) in enumerate(model.quantized_modules())}
        model.__dict__["_processing_order"] = cached
    return cached


def experts_by_layer(names: Iterable[str]) -> dict[int, list[int]]:
    """{layer: sorted expert ids} of the expert tensors among `names`."""
    out: dict[int, set[int]] = {}
    for n in names:
        m = EXPERT_RE.match(n)
        if m:
            layer = int(n.split(".")[2])
            out.setdefault(layer, set()).add(int(m.group(2)))
    return {k: sorted(v) for k, v in sorted(out.items())}

