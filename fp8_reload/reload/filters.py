"""What a reload selects: EPLB's name filters, reload units, the model's expected layout."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from ..checkpoint import tensor_layout
from ..layers import EXPERT_RE

NameFilter = Callable[[str], bool]


def generate_weight_name_filter(layer_experts: dict[int, Iterable[int]]) -> NameFilter:
    """EPLB's filter: matches checkpoint tensors of the given experts of the given layers."""
    wanted = {(int(layer), int(e)) for layer, experts in layer_experts.items() for e in experts}
    pattern = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")

    def weight_name_filter(name: str) -> bool:
        m = pattern.search(name)
        return m is not None and (int(m.group(1)), int(m.group(2))) in wanted

    weight_name_filter.layer_experts = {k: sorted(set(v)) for k, v in layer_experts.items()}
    return weight_name_filter


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


def units(model) -> tuple[dict, dict]:
    """(name -> unit, unit -> names in checkpoint order) of the model's layout, cached."""
    cached = model.__dict__.get("_units_cache")
    if cached is None:
        of, members = {}, {}
        for n in expected_layout(model):
            u = of[n] = unit_of(model, n)
            members.setdefault(u, []).append(n)
        cached = model.__dict__["_units_cache"] = (of, members)
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

