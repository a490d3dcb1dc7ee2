"""Where each checkpoint tensor of a reload lands, worked out once from the modules' own
loader rules (`FusedMoE.slot_destination`, `FixedFp8LinearMethod.destination`), so the
streaming reload can copy bytes straight into place instead of calling a Python
loader per tensor. Both paths write through the same views: they cannot disagree.

Kinds of target:

* ``copy``: bytes go as they are into one or more contiguous views (FP8 weights of
  experts and linears, norms, the router);
* ``scalar``: a 0-dim scale, written from host values (read and checked first);
* ``quant``: a bf16 weight quantized on load, on the device where it landed: an expert's
  three pieces into its FP8 slot, or a linear's shards into its FP8 weight (one unit each);
* ``loader``: everything else, through the module's own ``weight_loader``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..checkpoint.header import TensorInfo
from ..knobs import env_choice
from ..layers import Fp8Linear, FusedMoE
from ..processing import FixedFp8LinearMethod, FixedFp8MoEMethod
from .filters import modules_by_name


@dataclass
class Target:
    info: TensorInfo
    kind: str  # copy | scalar | quant | loader
    views: list[torch.Tensor] = field(default_factory=list)  # one per destination
    module: nn.Module | None = None
    module_name: str = ""
    slots: list[int] = field(default_factory=list)  # FusedMoE local slots written
    shard: str | int | None = None  # quant targets: w1 | w2 | w3 of an expert, a linear's shard id


def _default_loaded(param) -> bool:
    return not hasattr(param, "weight_loader")


# The bf16 weights quantized inside the stream (a device slot, then `quantize_experts_`, or a
# linear's `quantize_shards_`), FP8_RELOAD_STREAM_QUANT: 1 (default) experts and linears,
# "experts" the experts only, 0 none; the others take their loaders (staged in pinned memory,
# quantized by post-processing).
STREAM_QUANT = {"1": ("experts", "linears"), "experts": ("experts",), "0": ()}[
    env_choice("FP8_RELOAD_STREAM_QUANT", "1", ("1", "experts", "0"))]


def plan_targets(model, infos: list[TensorInfo], quantize_on_device: bool,
                 cache: TargetCache | None = None, unit_bytes: int | None = None) -> list[Target]:
    """One `Target` per tensor that lands somewhere, in file order.

    Tensors of experts this rank does not hold land nowhere and are dropped. bf16 weights
    are quantized in the copy path only with `quantize_on_device` (a GPU with Triton) and
    when the tensors quantized together (an expert's three pieces, a linear's shards) are
    adjacent in one file, a linear's at most `unit_bytes` (the device buffer a chunk lands
    in holds them all); otherwise they take the loader, which stages them for
    post-processing. `cache` keeps what was worked out for each tensor between calls (see
    `TargetCache`).
    """
    cache = TargetCache() if cache is None else cache
    checked: dict[str, dict] = {}
    out = []
    for info in sorted(infos, key=lambda i: (i.file, i.offset)):
        known = cache.module_targets(model, info.name, checked)
        target = known.get(info.name, False)
        if target is False:
            target = known[info.name] = _landing(model, info)
        elif target is not None and target.info is not info:  # planned from another parse
            target = known[info.name] = replace(target, info=info)
        if target is not None:  # quant targets are decided per call: a copy of the cached one
            out.append(replace(target) if target.kind == "quant" else target)
    _quant_units_or_loader(out, quantize_on_device, unit_bytes)
    return out


class TargetCache:
    """Where tensors land, kept with the model between reloads of any checkpoint (a
    target planned from another parse is reused with this parse's `TensorInfo`: the
    layout check has made shape and dtype equal). A module's targets are views of its
    Parameters' memory at the slots its expert map gives: they are reused only while its
    quant method and Parameter objects are the same, over the same memory (pointer,
    shape, strides), with the same expert map (the modules themselves are fixed once the
    model is built). A Parameter replaced or rebound, or experts moved by a rebalance,
    and that module's targets are worked out again.

    It also keeps the full-reload plan of each parse (`full`, by its `Planned`: gone with
    the parse). Every target holds views of Parameter memory: `release` drops them all
    (`fr.release_staging`), so memory a Parameter no longer uses (rebound `.data`, as
    `model.to(other_device)` does) is given back."""

    def __init__(self):
        self.module_of: dict[str, str] = {}  # checkpoint name -> module name (the name decides)
        self.modules: dict[str, tuple[tuple, tuple, dict]] = {}  # name -> (*state, targets)
        # bumped whenever a module's targets are worked out anew: a plan kept whole (a full
        # reload's) holds targets of the state before, even once `unchanged` holds again
        self.version = 0
        # Planned -> (names, targets, version, the headers they came from) of a full
        # streaming reload (reload/plan.py)
        self.full: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.derived: dict[int, tuple[list, dict]] = {}  # id(names) -> (names, derived_of)

    def release(self) -> None:
        """Forget every target and kept plan (views of Parameter memory); the next
        reload works them out again."""
        self.modules.clear()
        self.full.clear()
        self.derived.clear()
        self.version += 1

    def derived_of(self, names: list[str]) -> dict:
        """Where to keep what a reload derives from a kept full plan's `names` (the slots
        its backup covers, the experts it reloads): the plan is reused only while its
        modules and expert maps are unchanged, and so is what is derived from it. Any
        other list gets a dict of its own, not kept."""
        entry = self.derived.get(id(names))
        if entry is not None and entry[0] is names:  # (the entry holds the list: its id is its own)
            return entry[1]
        live = {id(kept[0]) for kept in self.full.values()}
        if id(names) not in live:
            return {}
        self.derived = {k: v for k, v in self.derived.items() if k in live}  # plans replaced: gone
        self.derived[id(names)] = (names, {})
        return self.derived[id(names)][1]

    def module_targets(self, model, name: str, checked: dict[str, dict]) -> dict:
        """{name: Target or None} of the module of tensor `name`, its state checked once
        per call (`checked`)."""
        module_name = self.module_of.get(name)
        if module_name is None:
            module_name = self.module_of[name] = model.resolve(name)[1]
        known = checked.get(module_name)
        if known is None:
            refs, values = _state(modules_by_name(model)[module_name])
            cached = self.modules.get(module_name)
            if cached is None or not _same(cached[:2], (refs, values)):
                cached = self.modules[module_name] = (refs, values, {})
                self.version += 1
            known = checked[module_name] = cached[2]
        return known

    def unchanged(self, model) -> bool:
        """Whether every module planned so far is as it was."""
        named = modules_by_name(model)
        return all(_same(c[:2], _state(named[m])) for m, c in self.modules.items())


def _state(module) -> tuple[tuple, tuple]:
    """(objects compared by identity, values compared by equality) a module's targets
    are worked out from."""
    params = [(k, p) for k, p in module._parameters.items() if p is not None]
    slots = _attr(module, "expert_slots")
    refs = (module, _attr(module, "quant_method"), *[p for _, p in params])
    values = (None if slots is None else {e: tuple(s) for e, s in slots.items()},
              tuple([(k, p.data_ptr(), p.shape, p.stride(), p.dtype) for k, p in params]))
    return refs, values


def _attr(module, name: str):
    """`getattr(module, name, None)` without `Module.__getattr__`'s raised AttributeError for
    a module that lacks it (microseconds each, for every module of every repeated reload)."""
    found = module.__dict__.get(name, _attr)
    if found is not _attr:
        return found
    kind = type(module)  # (a property, a submodule, a class's own `__getattr__`: asked as usual)
    if hasattr(kind, name) or name in module._modules or kind.__getattr__ is not nn.Module.__getattr__:
        return getattr(module, name, None)
    return None


def _same(a: tuple[tuple, tuple], b: tuple[tuple, tuple]) -> bool:
    return len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0])) and a[1] == b[1]


def _landing(model, info: TensorInfo) -> Target | None:
    pname, module_name, kw = model.resolve(info.name)
    module = modules_by_name(model)[module_name]
    attr = pname[len(module_name) + 1:] if pname.startswith(module_name + ".") else ""
    # the module's own Parameter by name: get_parameter walks the path again, per tensor
    param = module._parameters.get(attr) if attr and "." not in attr else None
    target = _target(info, model.get_parameter(pname) if param is None else param, module, kw)
    target.module_name = module_name
    if target.kind in ("copy", "scalar") and not target.views:
        return None
    if target.kind == "quant" and isinstance(module, FusedMoE) and not target.slots:
        return None
    return target


def _quant_units_or_loader(targets: list[Target], quantize_on_device: bool, unit_bytes: int | None) -> None:
    """Quant targets whose expert or linear cannot be quantized in one piece become loader
    targets."""
    runs: list[list[Target]] = []
    last = None  # (unit, file, position) of the previous quant target
    for pos, t in enumerate(targets):
        if t.kind != "quant":
            continue
        here = ((t.module_name, tuple(t.slots)), t.info.file)
        if last is not None and last[:2] == here and last[2] + 1 == pos:
            runs[-1].append(t)
        else:
            runs.append([t])
        last = (*here, pos)
    for run in runs:
        module = run[0].module
        if isinstance(module, FusedMoE):
            what, whole = "experts", sorted(t.shard for t in run) == ["w1", "w2", "w3"]
        else:
            keys = module.quant_method.shard_keys(module)
            what = "linears"
            whole = (len(run) == len(keys) and {t.shard for t in run} == set(keys)
                     and (unit_bytes is None or sum(t.info.nbytes for t in run) <= unit_bytes))
        if not (quantize_on_device and what in STREAM_QUANT and whole):
            for t in run:
                t.kind = "loader"


def _target(info: TensorInfo, param, module, kw) -> Target:
    """Where `info` lands; bytes are copied as they are only into views of its dtype (a
    Parameter given another dtype since, even over the same memory, takes its loader, which
    converts the values as a load would)."""
    target = _destination(info, param, module, kw)
    if target.kind in ("copy", "scalar") and any(v.dtype != info.dtype for v in target.views):
        return Target(info, "loader", module=module)
    return target


def _destination(info: TensorInfo, param, module, kw) -> Target:
    if isinstance(module, FusedMoE) and isinstance(module.quant_method, FixedFp8MoEMethod):
        slots = module.local_slots(kw["expert_id"])
        views = [module.slot_destination(param, info.name, kw["shard_id"], s) for s in slots]
        if views and views[0] is None:
            return Target(info, "quant", [], module, slots=slots, shard=kw["shard_id"])
        kind = "scalar" if not info.shape else "copy"
        return Target(info, kind, views, module, slots=slots)
    if isinstance(module, Fp8Linear) and isinstance(module.quant_method, FixedFp8LinearMethod):
        shard = kw.get("loaded_shard_id")
        view = module.quant_method.destination(module, param, shard)
        if view is None:  # quantized on load: with its other shards, in the stream or by its loader
            return Target(info, "quant", [], module, shard=shard)
        return Target(info, "scalar" if not info.shape else "copy", [view], module)
    if _default_loaded(param) and param.shape == info.shape and param.data.is_contiguous():
        return Target(info, "copy", [param.data], module)
    return Target(info, "loader", module=module)


def mark_loaded(targets: list[Target]) -> set[str]:
    """What the loaders would have recorded: expert slots written, linear layers to
    process. Returns the names of the modules touched (the post-processing scope)."""
    touched = set()
    for t in targets:
        touched.add(t.module_name)
        if t.kind == "loader":
            continue  # its loader records what it wrote itself
        if isinstance(t.module, FusedMoE):
            t.module.loaded_experts.update(t.slots)
        elif hasattr(t.module, "needs_processing"):
            t.module.needs_processing = True
    return touched


def write_order(targets: list[Target]) -> list[tuple[str, int | None]]:
    """What `targets` write, in the order they first write it: (module name, slot) for a
    FusedMoE's experts, (module name, None) for anything else. The backup copies in this
    order, so each write waits for as little of it as it can. The streamed ones first, in
    file order; the scales (written last) and the loaders after."""
    targets = sorted(targets, key=lambda t: t.kind not in ("copy", "quant"))  # (a stable sort)
    units = ((t.module_name, s) for t in targets for s in (t.slots or (None,)))
    return list(dict.fromkeys(units))
