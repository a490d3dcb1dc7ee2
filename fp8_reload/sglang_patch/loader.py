"""The loader / updater half of the fix: a filtered reload reads only what the filter
selects and post-processes only the modules whose loaders ran.

Replaces ``WeightUpdater.update_weights_from_disk`` (makes its filter visible for
the call), ``DefaultModelLoader._get_weights_iterator`` (with a filter: reads only
matching tensors) and ``DefaultModelLoader.load_weights_and_postprocess`` (with a
filter: post-processes only the modules that received weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .originals import ACTIVE_FILTER, original
from .rollback import ExpertBackup


def update_weights_from_disk(self, model_path, load_format, weight_name_filter=None,
                             recapture_cuda_graph=False):
    """sglang's, with the filter visible to the loader; a filtered call that fails
    (returns False or raises) leaves the patched MoE layers as they were (`rollback`).

    A call without a filter is not backed up (a copy of every expert); one that fails after
    writing experts leaves them unprocessed, and filtered calls are then refused until a
    full reload succeeds (processing their experts would make the failed checkpoint's
    experts live; review s29)."""
    model = self.get_model()
    if weight_name_filter is not None:
        spoiled = spoiled_by_a_failed_full_reload(model)
        if spoiled:
            return False, (f"refusing a filtered reload: {spoiled}; only a full reload (no "
                           f"weight_name_filter) can repair them")
    token = ACTIVE_FILTER.set(weight_name_filter)
    backup = None if weight_name_filter is None else ExpertBackup(model)
    ok = False
    try:
        ok, message = original("WeightUpdater", "update_weights_from_disk")(
            self, model_path, load_format, weight_name_filter=weight_name_filter,
            recapture_cuda_graph=recapture_cuda_graph)
        if not ok and backup is not None:
            backup.restore()
        return ok, message
    except BaseException:
        if backup is not None:
            backup.restore()
        raise
    finally:
        if backup is not None:
            backup.close()
        else:
            _note_full_reload(model, ok, model_path)
        ACTIVE_FILTER.reset(token)


def _patched_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "_fp8r_loaded")]


def _note_full_reload(model, ok: bool, path) -> None:
    """After a call without a filter: a success repairs every layer; a failure spoils the
    layers it left with experts written and not processed."""
    for layer in _patched_layers(model):
        pending = sorted(set(layer._fp8r_loaded) | set(getattr(layer, "_fp8r_staged", ())))
        if ok:
            layer.__dict__.pop("_fp8r_spoiled", None)
        elif pending:
            layer._fp8r_spoiled = (f"{getattr(layer, 'layer_name', 'an MoE layer')}: a full reload "
                                   f"from {path} failed after writing experts (local slots) "
                                   f"{pending}, which were not processed")


def spoiled_by_a_failed_full_reload(model) -> str | None:
    """Why a filtered reload must not run now, or None."""
    why = [layer._fp8r_spoiled for layer in _patched_layers(model) if getattr(layer, "_fp8r_spoiled", None)]
    return "; ".join(why) if why else None


def get_weights_iterator(self, source, **kwargs):
    from sglang.srt.configs.load_config import LoadFormat

    sglang_iterator = original("DefaultModelLoader", "_get_weights_iterator")
    flt = ACTIVE_FILTER.get()
    if (flt is None or kwargs.get("resolved_source") is not None
            or self.load_config.load_format not in (LoadFormat.AUTO, LoadFormat.SAFETENSORS)
            or self.load_config.draft_model_idx is not None):
        return sglang_iterator(self, source, **kwargs)
    folder, files, use_safetensors = self._prepare_weights(
        source.model_or_path, source.revision, source.fall_back_to_pt,
        source.allow_patterns_overrides)
    if not use_safetensors:
        return sglang_iterator(self, source, **kwargs)
    return read_matching_safetensors(folder, files, source.prefix, flt)


def read_matching_safetensors(folder, files, prefix: str, flt: Callable[[str], bool]):
    """Yield (prefix + name, tensor) for the tensors `flt` selects, reading nothing else.

    With an index file, shards holding no selected tensor are not even opened. Each shard
    opened is checked against the index: if it lacks a name the index gives it, or holds a
    selected name the index does not list, or the index selects nothing at all, every shard's
    own header decides instead, as for sglang's reader (which reads each shard's own names:
    an index that leaves a tensor out or names another shard for it made a filtered reload
    skip the tensor, or fail, where a fresh load reads it). The order is sglang's reader's
    (`files` as given, each shard's names sorted): tensors that land in one slot (an
    expert's gate and up input scales) must be written in the order of a fresh load.
    """
    from safetensors import safe_open

    index = Path(folder) / "model.safetensors.index.json"
    wanted: dict[str, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        by_name = {Path(f).name: f for f in files}
        for name, fname in weight_map.items():
            if fname in by_name and flt(prefix + name):
                wanted.setdefault(by_name[fname], []).append(name)
    with ExitStack() as opened:  # each shard opened once: checked, then read
        shards = {}

        def selected_in(f):
            if f not in shards:
                shards[f] = opened.enter_context(safe_open(f, framework="pt", device="cpu"))
            return [n for n in shards[f].keys() if flt(prefix + n)]

        trusted = bool(wanted) and all(sorted(selected_in(f)) == sorted(wanted[f]) for f in wanted)
        if not trusted:  # no index, it selects nothing, or it is wrong about a shard it names
            wanted = {f: selected_in(f) for f in files}
        for f in files:
            for name in sorted(wanted.get(f, ())):
                yield prefix + name, shards[f].get_tensor(name)


@contextmanager
def record_loaded_modules(model):
    """Yield a set that collects the quantized modules whose parameters' loaders run.

    A Parameter shared by several modules (an output head tied to the embedding) is wrapped
    once, recording every module that owns it, and given back its own loader: wrapped once
    per module, its loader came back as the first wrapper, one more layer every reload."""
    from sglang.srt.model_loader.loader import _modules_with_quant_method

    touched: set[int] = set()
    wrapped: dict[int, tuple] = {}  # id(param) -> (param, attr, its loader, its modules' ids)
    for module, _ in _modules_with_quant_method(model):
        for param in module._parameters.values():
            if param is None:
                continue
            if id(param) in wrapped:
                wrapped[id(param)][3].append(id(module))
                continue
            attr = next((a for a in ("_weight_loader", "weight_loader") if a in param.__dict__), None)
            if attr is None:
                continue
            loader, owners = param.__dict__[attr], [id(module)]

            def recording(*args, _loader=loader, _owners=owners, **kw):
                touched.update(_owners)
                return _loader(*args, **kw)

            wrapped[id(param)] = (param, attr, loader, owners)
            param.__dict__[attr] = recording
    try:
        yield touched
    finally:
        for param, attr, loader, _ in wrapped.values():
            param.__dict__[attr] = loader


def load_weights_and_postprocess(model, weights, target_device):
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        QuantizedRLModelLoader,
        _modules_with_quant_method,
        device_loading_context,
    )

    if ACTIVE_FILTER.get() is None:
        return original("DefaultModelLoader", "load_weights_and_postprocess")(
            model, weights, target_device)
    with record_loaded_modules(model) as touched:
        DefaultModelLoader.load_weights_only(model, weights, target_device)
    if QuantizedRLModelLoader.is_reload_scenario(model):
        return None
    for module, quant_method in _modules_with_quant_method(model):
        # A method whose layout sglang undid before loading must redo it.
        undone = (isinstance(quant_method, QuantizeMethodBase)
                  and type(quant_method).restore_weights_before_loading
                  is not QuantizeMethodBase.restore_weights_before_loading)
        if id(module) in touched or undone:
            with device_loading_context(module, target_device):
                quant_method.process_weights_after_loading(module)
    return None

