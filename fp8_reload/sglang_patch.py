"""Apply the FP8 MoE hot-reload fix to an installed sglang, and take it back.

sglang 0.5.23 cannot hot-reload per-tensor FP8 MoE weights (EPLB's
``update_weights_from_disk(..., weight_name_filter=...)``): post-processing
replaces Parameters (the next load dies on ``weight_loader``), a filtered
reload reads the whole checkpoint, then post-processes every module (FP8
linears are transposed twice). `apply()` replaces a few functions of sglang's
own classes, keeping the originals so `revert()` restores them exactly:

==============================================  =============================================
``Fp8MoEMethod.create_weights``                 bf16 checkpoints: w13/w2 get FP8 storage from
                                                the start (no Parameter ever changes dtype)
``FusedMoE._weight_loader_impl``                records the local expert slots written; bf16
                                                expert weights are staged, not stored
``Fp8MoEMethod.process_weights_after_loading``  per-tensor branch in place, only the experts
                                                loaded since the last processing
``Fp8MoEMethod.get_triton_quant_info``          contiguous ``[E]`` w13 scale, scalar input scales
``Fp8MoEMethod.apply``                          DeepGEMM: ``[E, 2]`` collapsed before the block
                                                expansion
``WeightUpdater.update_weights_from_disk``      makes its ``weight_name_filter`` visible to the
                                                two loader functions below for the call
``DefaultModelLoader._get_weights_iterator``    with a filter: reads only matching tensors
``DefaultModelLoader.load_weights_and_postprocess``  with a filter: post-processes only the
                                                modules whose loaders were called
==============================================  =============================================

The tensor math is `fp8_reload.processing`'s (`requantize_w13_to_expert_max_`,
`quantize_experts_`, `merge_input_scales_`). Configurations the patch does not
cover (block quant, FP4 experts, ROCm, the CPU engine, FlashInfer TRT-LLM and
HPC-ops runners, non-gated experts) keep sglang's own code paths.

Servers: set ``FP8_RELOAD_SGLANG_PATCH=1``; sglang's plugin loader (entry point
group ``sglang.srt.plugins``, run by every sglang process) then calls
`sglang_plugin`, which applies the patch. ``fp8-reload sglang-launch -- ARGS``
does that for ``python -m sglang.launch_server ARGS``.

Importing this module does not import sglang; `apply()` does.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch.nn import Parameter

from .processing import (CHUNK_BYTES, merge_input_scales_, quantize_experts_,
                         requantize_w13_to_expert_max_)
from .quant import FP8_DTYPE

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.5.23",)
ENV_ENABLE = "FP8_RELOAD_SGLANG_PATCH"
DEEPGEMM_BLOCK = 128

# The weight_name_filter of the update_weights_from_disk call in progress.
_ACTIVE_FILTER: contextvars.ContextVar[Optional[Callable[[str], bool]]] = \
    contextvars.ContextVar("fp8_reload_active_filter", default=None)

# (owner class, attribute) -> the raw attribute as sglang defined it.
_ORIGINALS: dict[tuple[type, str], object] = {}


class UnsupportedSGLangVersion(RuntimeError):
    """The installed sglang is not one this patch was written against."""


# --------------------------------------------------------------------------
# Kernel views of the fixed layout (pure torch: usable without sglang)
# --------------------------------------------------------------------------

def kernel_w13_scale(scale: torch.Tensor) -> torch.Tensor:
    """The w13 scale as fused-MoE kernels read it (``scale_ptr + expert``): contiguous [E].

    The fixed layout keeps ``[E, 2]`` with equal columns; column 0 is taken.
    """
    return scale[:, 0].contiguous() if scale.dim() == 2 else scale


def per_tensor_block_scales(scale: torch.Tensor, weight_shape, block: int = DEEPGEMM_BLOCK) -> torch.Tensor:
    """Per-expert scales ([E], or [E, 2] with equal columns) as DeepGEMM's
    ``[E, ceil(N / block), ceil(K / block)]`` block scales."""
    from .kernels_deepgemm import expand_block_scales

    _, n, k = weight_shape
    return expand_block_scales(kernel_w13_scale(scale), n, k, block)


# --------------------------------------------------------------------------
# Version check, apply, revert
# --------------------------------------------------------------------------

def installed_version() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: Optional[str] = None) -> str:
    """Return the installed sglang version; raise `UnsupportedSGLangVersion` if not supported."""
    version = installed_version() if version is None else version
    if version is None:
        raise UnsupportedSGLangVersion("sglang is not installed; fp8_reload.sglang_patch patches "
                                       f"sglang {', '.join(SUPPORTED_VERSIONS)}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedSGLangVersion(
            f"fp8_reload.sglang_patch supports sglang {', '.join(SUPPORTED_VERSIONS)}, found "
            f"{version}: it replaces internals of fp8.py, fused_moe_triton/layer.py, loader.py "
            "and weight_updater.py that change between releases, so it refuses to guess. "
            "Pin sglang==0.5.23, or port the patch and add the version to SUPPORTED_VERSIONS.")
    return version


def is_applied() -> bool:
    return bool(_ORIGINALS)


PARTS = ("moe", "reload")


def _targets(parts=PARTS) -> list[tuple[type, str, object]]:
    """What each part replaces: ``moe`` is the fp8.py / FusedMoE half of the fix,
    ``reload`` the scoped reading and post-processing of filtered reloads."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader.loader import DefaultModelLoader

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    targets = []
    if "moe" in parts:
        targets += [
            (Fp8MoEMethod, "create_weights", _create_weights),
            (Fp8MoEMethod, "process_weights_after_loading", _process_weights_after_loading),
            (Fp8MoEMethod, "get_triton_quant_info", _get_triton_quant_info),
            (Fp8MoEMethod, "apply", _apply),
            (FusedMoE, "_weight_loader_impl", _weight_loader_impl),
        ]
    if "reload" in parts:
        targets += [
            (DefaultModelLoader, "_get_weights_iterator", _get_weights_iterator),
            (DefaultModelLoader, "load_weights_and_postprocess",
             staticmethod(_load_weights_and_postprocess)),
            (WeightUpdater, "update_weights_from_disk", _update_weights_from_disk),
        ]
    return targets


def apply(force: bool = False, parts=PARTS) -> list[str]:
    """Patch the installed sglang (idempotent). Returns the patched ``Class.attr`` names.

    `parts` selects halves of the fix (see `_targets`); both by default, one
    alone only to show what the other is for. Raises `UnsupportedSGLangVersion`
    unless sglang is a supported version (``force=True`` skips only that check)
    and has every attribute the patch replaces.
    """
    if not force:
        check_version()
    targets = _targets(parts)
    missing = [f"{cls.__name__}.{attr}" for cls, attr, _ in targets if attr not in cls.__dict__]
    if missing:
        raise UnsupportedSGLangVersion(f"sglang {installed_version()} lacks {', '.join(missing)}: "
                                       "the patch does not fit this release")
    for cls, attr, new in targets:
        if (cls, attr) not in _ORIGINALS:  # applying twice patches once
            _ORIGINALS[(cls, attr)] = cls.__dict__[attr]
            setattr(cls, attr, new)
    names = sorted(f"{c.__name__}.{a}" for c, a in _ORIGINALS)
    logger.info("fp8_reload: patched sglang %s: %s", installed_version(), ", ".join(names))
    return names


def revert() -> None:
    """Restore every patched attribute to the object sglang defined.

    Layers built while patched keep what the patch gave them (FP8 storage of
    bf16 checkpoints, per-expert input-scale buffers).
    """
    for (cls, attr), original in _ORIGINALS.items():
        setattr(cls, attr, original)
    _ORIGINALS.clear()


def _original(cls_name: str, attr: str):
    for (cls, a), fn in _ORIGINALS.items():
        if a == attr and cls.__name__ == cls_name:
            return fn.__func__ if isinstance(fn, staticmethod) else fn
    raise RuntimeError(f"fp8_reload.sglang_patch: {cls_name}.{attr} is not patched")


def sglang_plugin() -> None:
    """Entry point of sglang's plugin loader: patches only when ``FP8_RELOAD_SGLANG_PATCH=1``."""
    if os.environ.get(ENV_ENABLE, "0") not in ("1", "true", "yes"):
        return
    apply()


# --------------------------------------------------------------------------
# Fp8MoEMethod / FusedMoE
# --------------------------------------------------------------------------

def _handles(method, layer) -> bool:
    """Whether the layer runs the per-tensor path this patch fixes."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.layers.quantization import fp8

    if not isinstance(method, fp8.Fp8MoEMethod) or not hasattr(layer, "_fp8r_loaded"):
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


def _create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                    params_dtype, with_bias=False, **extra_weight_attrs):
    _original("Fp8MoEMethod", "create_weights")(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
        with_bias=with_bias, **extra_weight_attrs)
    layer._fp8r_loaded = set()
    layer._fp8r_processed = False
    if self.quant_config.is_checkpoint_fp8_serialized or self.block_quant or self.is_fp4_expert:
        return
    # bf16 checkpoint quantized on load: FP8 storage now, bf16 only in staging.
    layer._fp8r_fp8_storage = True
    layer._fp8r_staged = {}
    if _handles(self, layer):
        for p in (layer.w13_weight, layer.w2_weight):
            p.data = torch.empty(p.shape, dtype=FP8_DTYPE, device=p.device)
    else:
        layer._fp8r_fp8_storage = False


def _staging_param(layer, param, slot: int) -> Parameter:
    """A one-expert bf16 Parameter sglang's own loader can write into (TP slicing,
    gate/up halves), carrying the attributes of the real one."""
    entry = layer._fp8r_staged.setdefault(slot, {"shards": set()})
    key = "w13" if param is layer.w13_weight else "w2"
    if key not in entry:
        entry[key] = torch.empty(param.shape[1:], dtype=layer.params_dtype, device=param.device)
    staged = Parameter(entry[key].unsqueeze(0), requires_grad=False)
    staged.__dict__.update(param.__dict__)
    return staged


def _weight_loader_impl(self, param, loaded_weight, weight_name, shard_id, expert_id):
    impl = _original("FusedMoE", "_weight_loader_impl")
    if not _handles(self.quant_method, self):
        return impl(self, param, loaded_weight, weight_name, shard_id, expert_id)
    self._fp8r_loaded.add(int(expert_id))
    if getattr(self, "_fp8r_fp8_storage", False) and (param is self.w13_weight or param is self.w2_weight):
        staged = _staging_param(self, param, int(expert_id))
        impl(self, staged, loaded_weight, weight_name, shard_id, 0)
        self._fp8r_staged[int(expert_id)]["shards"].add(shard_id)
        return None
    return impl(self, param, loaded_weight, weight_name, shard_id, expert_id)


def _per_expert_input_scale(layer, name: str) -> torch.Tensor:
    """Per-expert static input scales as loaded (the Parameter holds their max)."""
    buf_name = f"{name}_per_expert"
    buf = getattr(layer, buf_name, None)
    if buf is None:
        param = getattr(layer, name)
        buf = torch.ones(param.shape[0], dtype=torch.float32, device=param.device)
        layer.register_buffer(buf_name, buf, persistent=False)
    return buf


def _process_weights_after_loading(self, layer) -> None:
    if not _handles(self, layer):
        return _original("Fp8MoEMethod", "process_weights_after_loading")(self, layer)
    if self.quant_config.is_checkpoint_fp8_serialized:
        first = not layer._fp8r_processed
        slots = range(layer.num_local_experts) if first else sorted(layer._fp8r_loaded)
        experts = torch.tensor(list(slots), dtype=torch.long)
        if self.quant_config.activation_scheme == "static":
            if layer.w13_input_scale is None or layer.w2_input_scale is None:
                raise ValueError("static activation scheme, but the layer has no input scales")
            for name in ("w13_input_scale", "w2_input_scale"):
                merge_input_scales_(getattr(layer, name).data, _per_expert_input_scale(layer, name),
                                    experts)
        requantize_w13_to_expert_max_(layer.w13_weight.data, layer.w13_weight_scale.data, experts,
                                      layer.intermediate_size_per_partition)
    else:
        _quantize_staged(layer)
    layer._fp8r_loaded.clear()
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
    slots = sorted(staged)
    per_expert = layer.w13_weight[0].numel() * 4
    step = max(1, CHUNK_BYTES // per_expert)
    for i in range(0, len(slots), step):
        chunk = slots[i:i + step]
        idx = torch.tensor(chunk, dtype=torch.long)
        quantize_experts_(layer.w13_weight.data, layer.w13_weight_scale.data, idx,
                          torch.stack([staged[s]["w13"] for s in chunk]))
        quantize_experts_(layer.w2_weight.data, layer.w2_weight_scale.data, idx,
                          torch.stack([staged[s]["w2"] for s in chunk]))
    staged.clear()


def _get_triton_quant_info(self, layer):
    info = _original("Fp8MoEMethod", "get_triton_quant_info")(self, layer)
    if not _handles(self, layer):
        return info
    a13, a2 = layer.w13_input_scale, layer.w2_input_scale
    return dataclasses.replace(
        info, w13_scale=kernel_w13_scale(layer.w13_weight_scale),
        a13_scale=None if a13 is None else a13.max(), a2_scale=None if a2 is None else a2.max())


def deepgemm_quant_info(method, layer):
    """DeepGEMM's quant info for the per-tensor layout: [E, 2] collapsed, then blocks."""
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo

    return DeepGemmMoeQuantInfo(
        w13_weight=layer.w13_weight, w2_weight=layer.w2_weight, use_fp8=True,
        w13_scale=per_tensor_block_scales(layer.w13_weight_scale, layer.w13_weight.shape),
        w2_scale=per_tensor_block_scales(layer.w2_weight_scale, layer.w2_weight.shape),
        block_shape=[DEEPGEMM_BLOCK, DEEPGEMM_BLOCK], is_fp4_experts=method.is_fp4_expert,
        use_mxfp8=method.use_mxfp8)


def _apply(self, layer, dispatch_output):
    runner = getattr(self, "runner", None)
    if runner is not None and runner.runner_backend.is_deep_gemm() and _handles(self, layer):
        return runner.run(dispatch_output, deepgemm_quant_info(self, layer))
    return _original("Fp8MoEMethod", "apply")(self, layer, dispatch_output)


# --------------------------------------------------------------------------
# Loader / updater: read only what the filter selects, process only what was loaded
# --------------------------------------------------------------------------

def _update_weights_from_disk(self, model_path, load_format, weight_name_filter=None,
                              recapture_cuda_graph=False):
    token = _ACTIVE_FILTER.set(weight_name_filter)
    try:
        return _original("WeightUpdater", "update_weights_from_disk")(
            self, model_path, load_format, weight_name_filter=weight_name_filter,
            recapture_cuda_graph=recapture_cuda_graph)
    finally:
        _ACTIVE_FILTER.reset(token)


def _get_weights_iterator(self, source, **kwargs):
    from sglang.srt.configs.load_config import LoadFormat

    original = _original("DefaultModelLoader", "_get_weights_iterator")
    flt = _ACTIVE_FILTER.get()
    if (flt is None or kwargs.get("resolved_source") is not None
            or self.load_config.load_format not in (LoadFormat.AUTO, LoadFormat.SAFETENSORS)
            or self.load_config.draft_model_idx is not None):
        return original(self, source, **kwargs)
    folder, files, use_safetensors = self._prepare_weights(
        source.model_or_path, source.revision, source.fall_back_to_pt,
        source.allow_patterns_overrides)
    if not use_safetensors:
        return original(self, source, **kwargs)
    return read_matching_safetensors(folder, files, source.prefix, flt)


def read_matching_safetensors(folder, files, prefix: str, flt: Callable[[str], bool]):
    """Yield (prefix + name, tensor) for the tensors `flt` selects, reading nothing else.

    With an index file, shards holding no selected tensor are not even opened.
    """
    import json
    from pathlib import Path

    from safetensors import safe_open

    index = Path(folder) / "model.safetensors.index.json"
    wanted: dict[str, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        by_name = {Path(f).name: f for f in files}
        for name, fname in weight_map.items():
            if fname in by_name and flt(prefix + name):
                wanted.setdefault(by_name[fname], []).append(name)
    else:
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                wanted[f] = [n for n in st.keys() if flt(prefix + n)]
    for f in sorted(wanted):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in wanted[f]:
                yield prefix + name, st.get_tensor(name)


@contextmanager
def _record_loaded_modules(model):
    """Yield a set that collects the quantized modules whose parameters' loaders run."""
    from sglang.srt.model_loader.loader import _modules_with_quant_method

    touched: set[int] = set()
    wrapped = []
    for module, _ in _modules_with_quant_method(model):
        for param in module._parameters.values():
            if param is None:
                continue
            attr = next((a for a in ("_weight_loader", "weight_loader") if a in param.__dict__), None)
            if attr is None:
                continue
            loader = param.__dict__[attr]

            def recording(*args, _loader=loader, _id=id(module), **kw):
                touched.add(_id)
                return _loader(*args, **kw)

            wrapped.append((param, attr, loader))
            param.__dict__[attr] = recording
    try:
        yield touched
    finally:
        for param, attr, loader in wrapped:
            param.__dict__[attr] = loader


def _load_weights_and_postprocess(model, weights, target_device):
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.model_loader.loader import (DefaultModelLoader, QuantizedRLModelLoader,
                                                _modules_with_quant_method,
                                                device_loading_context)

    if _ACTIVE_FILTER.get() is None:
        return _original("DefaultModelLoader", "load_weights_and_postprocess")(
            model, weights, target_device)
    with _record_loaded_modules(model) as touched:
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


# --------------------------------------------------------------------------
# Launcher (``fp8-reload sglang-launch``)
# --------------------------------------------------------------------------

PLUGIN = "fp8_reload.sglang_patch:sglang_plugin"


def plugin_registered() -> bool:
    from importlib import metadata

    return any(ep.value == PLUGIN for ep in metadata.entry_points(group="sglang.srt.plugins"))


def launch(server_args: list[str], check: bool = False) -> int:
    """Run ``python -m sglang.launch_server SERVER_ARGS`` with the patch on in every process.

    The environment variable reaches every process sglang spawns, and each of
    them runs its plugin loader, which applies the patch. ``check=True`` applies
    the patch here once, reports it, reverts, and launches nothing.
    """
    import sys

    try:
        version = check_version()
    except UnsupportedSGLangVersion as e:
        print(f"fp8-reload: {e}", file=sys.stderr)
        return 2
    if not plugin_registered():
        print("fp8-reload: the sglang plugin entry point is not registered: install this package "
              "into sglang's environment (pip install --no-deps -e .)", file=sys.stderr)
        return 2
    if check:
        names = apply()
        revert()
        print(f"sglang {version}: patch applies; with {ENV_ENABLE}=1 every sglang process patches:")
        for name in names:
            print(f"  {name}")
        return 0
    env = dict(os.environ, **{ENV_ENABLE: "1"})
    allowed = env.get("SGLANG_PLUGINS")
    if allowed and "fp8_reload" not in {x.strip() for x in allowed.split(",")}:
        env["SGLANG_PLUGINS"] = f"{allowed},fp8_reload"
    cmd = [sys.executable, "-m", "sglang.launch_server", *server_args]
    print(f"fp8-reload: {ENV_ENABLE}=1 {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached
