"""sglang's `WeightUpdater.update_weights_from_disk` with an EPLB filter, on `ServedModel`.

The updater, its `DefaultModelLoader`, `ModelConfig`, the FP8 linear and the
FusedMoE are sglang's; `ServedModel` is the smallest model they can drive (an
FP8 ``q_proj`` beside the experts). The linear's post-processing is sglang's
own, so every test here takes the CPU `scaled_fp8_quant` stand-in.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import fp8_reload as fr
from fp8_reload import sglang_patch

from .conftest import CFG
from .sgl_model import (
    EXPERTS_PREFIX,
    MOE_LAYER,
    Q_PROJ,
    ServedModel,
    byte_diffs,
    changed_since,
    fresh_experts,
    same_bytes,
    snapshot,
)

E = CFG.num_experts
RELOADED = [0, 3]


def _loader():
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    return DefaultModelLoader(LoadConfig(load_format="safetensors"))


def _model_config(server_args, path):
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_server_args(server_args)
    mc.model_path = str(path)
    return mc


def served(server_args, kind: str, path, cutlass: bool = False) -> ServedModel:
    """A ServedModel loaded the way sglang loads one at startup."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = ServedModel(CFG, kind, cutlass=cutlass)
    loader = _loader()
    source = DefaultModelLoader.Source.init_new(_model_config(server_args, path), model)
    loader.load_weights_and_postprocess(model, loader._get_weights_iterator(source),
                                        torch.device("cpu"))
    return model


def updater(server_args, model, path):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0,
                         model_config=_model_config(server_args, path), custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                         recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)


def eplb_filter():
    return fr.generate_weight_name_filter({MOE_LAYER: RELOADED})


def _experts(model):
    return model.model.layers[MOE_LAYER].mlp.experts


def _q_proj(model):
    return model.model.layers[0].self_attn.q_proj


def test_unpatched_filtered_update_fails_on_weight_loader(unpatched, cpu_scaled_fp8_quant,
                                                          server_args, ckpts):
    path = ckpts[("fp8", 1)]
    model = served(server_args, "fp8", ckpts[("fp8", 0)])
    # sglang's rollback re-runs the same failing load, so the error escapes it
    with pytest.raises(AttributeError, match="weight_loader"):
        updater(server_args, model, path).update_weights_from_disk(
            str(path), "safetensors", weight_name_filter=eplb_filter())


def test_moe_half_alone_transposes_the_linear_again(cpu_scaled_fp8_quant, server_args, ckpts):
    """With only the fp8.py half of the fix the experts reload, but sglang post-processes the
    untouched q_proj a second time. On its Hopper branch that transposes the weight back
    ([K, N] -> [N, K]): the next forward would fail on the shape."""
    path = ckpts[("fp8", 1)]
    sglang_patch.apply(parts=("moe",))
    try:
        model = served(server_args, "fp8", ckpts[("fp8", 0)], cutlass=True)
        q = _q_proj(model)
        kernel_shape = tuple(q.weight.shape)
        ok, msg = updater(server_args, model, path).update_weights_from_disk(
            str(path), "safetensors", weight_name_filter=eplb_filter())
    finally:
        sglang_patch.revert()
    assert ok, msg
    assert kernel_shape == (CFG.hidden_size, CFG.num_heads * CFG.qk_head_dim)
    assert tuple(q.weight.shape) == kernel_shape[::-1]


def test_moe_half_alone_reprocesses_the_linear(cpu_scaled_fp8_quant, server_args, ckpts):
    """The same on sglang's non-CUTLASS branch (this CPU): the second processing of q_proj
    fails on the 0-dim scale its first processing left."""
    path = ckpts[("fp8", 1)]
    sglang_patch.apply(parts=("moe",))
    try:
        model = served(server_args, "fp8", ckpts[("fp8", 0)])
        with pytest.raises(IndexError):
            updater(server_args, model, path).update_weights_from_disk(
                str(path), "safetensors", weight_name_filter=eplb_filter())
    finally:
        sglang_patch.revert()


@pytest.mark.parametrize("kind,cutlass", [("fp8", False), ("fp8", True), ("bf16", False)])
def test_patched_filtered_update_touches_only_the_experts(patched, cpu_scaled_fp8_quant,
                                                          server_args, ckpts, kind, cutlass):
    base, donor = ckpts[(kind, 0)], ckpts[(kind, 1)]
    model = served(server_args, kind, base, cutlass=cutlass)
    before = snapshot(model)
    ok, msg = updater(server_args, model, donor).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=eplb_filter())
    assert ok, msg

    replaced, changed = changed_since(model, before)
    assert replaced == []
    assert changed and all(n.startswith(EXPERTS_PREFIX + ".") for n in changed)
    assert not any(n.startswith(Q_PROJ) for n in changed)  # q_proj untouched, not re-processed
    expected = fresh_experts(CFG, kind, {e: (donor if e in RELOADED else base) for e in range(E)})
    assert byte_diffs(_experts(model), expected) == []


def test_patched_filtered_update_reads_only_matching_tensors(patched, cpu_scaled_fp8_quant,
                                                             server_args, ckpts, tmp_path):
    """Shards holding no reloaded expert are never opened: corrupt them and reload."""
    base = ckpts[("fp8", 0)]
    donor = shutil.copytree(ckpts[("fp8", 1)], tmp_path / "donor")
    ckpt = fr.Checkpoint(donor)
    wanted = [n for n in ckpt.names if eplb_filter()(n)]
    needed = {ckpt.weight_map[n] for n in wanted}
    unrelated = sorted(set(ckpt.weight_map.values()) - needed)
    assert unrelated  # the tiny checkpoint has shards without any expert of layer 1
    for fname in unrelated:
        (donor / fname).write_bytes(b"\xff" * 64)

    model = served(server_args, "fp8", base)
    ok, msg = updater(server_args, model, donor).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=eplb_filter())
    assert ok, msg
    expected = fresh_experts(CFG, "fp8", {e: (ckpts[("fp8", 1)] if e in RELOADED else base)
                                          for e in range(E)})
    assert byte_diffs(_experts(model), expected) == []


def test_patched_reader_yields_exactly_the_filtered_tensors(ckpts):
    path = ckpts[("fp8", 1)]
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    got = dict(sglang_patch.read_matching_safetensors(path, files, "", eplb_filter()))
    ckpt = fr.Checkpoint(path)
    assert sorted(got) == sorted(n for n in ckpt.names if eplb_filter()(n))
    for name, tensor in ckpt.read(sorted(got), {}):
        assert same_bytes(got[name], tensor)


def test_patched_unfiltered_update_keeps_sglang_behaviour(patched, cpu_scaled_fp8_quant,
                                                          server_args, ckpts):
    """No filter: sglang's own load-and-process-everything path runs (the patch only scopes
    filtered reloads); sglang's FP8 linear cannot be reloaded in 0.5.23, patch or not."""
    path = ckpts[("fp8", 1)]
    model = served(server_args, "fp8", ckpts[("fp8", 0)])
    with pytest.raises(AssertionError, match="Attempted to load weight"):
        updater(server_args, model, path).update_weights_from_disk(str(path), "safetensors")
