"""The gate's scripted sequence of reloads, and which checkpoint each part of the model
should hold after each step."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import MoEConfig
from .result import GateError


@dataclass(frozen=True)
class ScriptStep:
    what: str  # short description of the filter
    seed: int  # which checkpoint it reloads from
    experts: dict[int, tuple[int, ...]] | None  # None: full reload

    @property
    def label(self) -> str:
        return f"{self.what} <- s{self.seed}"


def _spec(experts: dict[int, tuple[int, ...]], num_experts: int) -> str:
    return " ".join(f"L{layer}:" + ("all" if len(es) == num_experts else ",".join(map(str, es)))
                    for layer, es in sorted(experts.items()))


def default_script(cfg: MoEConfig) -> list[ScriptStep]:
    """Full and filtered reloads, back and forth between seeds 0 and 1 (model starts on 0)."""
    layers, e = cfg.moe_layers, cfg.num_experts
    if not layers:
        raise GateError(f"preset {cfg.name!r} with {cfg.num_layers} layers has no MoE layer")
    first, last = layers[0], layers[-1]
    one = {first: (min(3, e - 1),)}
    several: dict[int, set[int]] = {}
    for layer, es in ((first, {0, max(e - 3, 0)}), (last, {min(2, e - 1), e - 1})):
        several.setdefault(layer, set()).update(es)
    several_t = {k: tuple(sorted(v)) for k, v in several.items()}
    layer_all = {last: tuple(range(e))}

    def s(what, seed, ex):
        return ScriptStep(what if ex is None else f"{what} {_spec(ex, e)}", seed, ex)

    return [
        s("full", 1, None),
        s("one expert", 0, one),
        s("experts of layers", 0, several_t),
        s("all of a layer", 0, layer_all),
        s("one expert", 1, one),
        s("same again", 1, one),  # the model already holds this: nothing may change
        s("full", 0, None),
        s("experts of layers", 1, several_t),
    ]


@dataclass(frozen=True)
class Provenance:
    """Which checkpoint each part of the model should hold: `base` for everything
    except `other` (layer, expert) pairs, which come from the other seed."""

    base: int
    other: frozenset = frozenset()

    def after(self, step: ScriptStep) -> Provenance:
        if step.experts is None:
            return Provenance(step.seed)
        pairs = {(layer, e) for layer, es in step.experts.items() for e in es}
        other = self.other - pairs if step.seed == self.base else self.other | pairs
        return Provenance(self.base, frozenset(other))



