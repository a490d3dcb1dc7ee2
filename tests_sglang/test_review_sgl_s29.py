"""Review s29 of the sglang patch (helper 66, real sglang 0.5.23 on the CPU). Each case failed
before its fix:

* an update without a filter that failed after writing experts (a tensor it cannot load
  after them) left them unprocessed, with no rollback (none is taken without a filter: it
  would copy every expert); the next EPLB reload processed them all and reported success,
  the failed checkpoint's experts now live. Filtered reloads are now refused until a full
  reload succeeds;
* an expert reloaded without up's input scale passed the whole-expert check (gate's and
  up's input scales land in one slot; a fresh load keeps up's): it kept gate's;
* a layer built for sglang's fused loader (GPT-OSS with ``--quantization fp8``) got FP8
  storage from the patch while that loader, which the patch does not wrap, cast bf16
  values straight into it (scales left at 1.0): such layers now keep sglang's own code.
"""

from __future__ import annotations

import shutil

import torch

import fp8_reload as fr

from .conftest import CFG
from .sgl_model import (
    EXPERTS_PREFIX,
    MOE_LAYER,
    ServedModel,
    byte_diffs,
    changed_since,
    fp8_config,
    load_experts,
    make_experts,
    snapshot,
)
from .test_weight_updater import _experts, _loader, _model_config, updater

E = CFG.num_experts


def _experts_only(server_args, path) -> ServedModel:
    """ServedModel without its FP8 linear (sglang 0.5.23 cannot reload one): a full reload of
    it can succeed."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model = ServedModel(CFG, "fp8")
    del model.model.layers[0].self_attn
    loader = _loader()
    source = DefaultModelLoader.Source.init_new(_model_config(server_args, path), model)
    loader.load_weights_and_postprocess(model, loader._get_weights_iterator(source), torch.device("cpu"))
    return model


def _with_a_bad_last_expert(src, dst):
    """A copy of `src` whose last expert's down weight scale holds three values: a full reload
    fails after writing the other experts."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    name = f"{EXPERTS_PREFIX}.{E - 1}.down_proj.weight_scale"
    shard = fr.Checkpoint(dst).info(name).file
    tensors = load_file(dst / shard)
    tensors[name] = tensors[name].reshape(1).repeat(3)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    return dst


def _update(server_args, model, path, flt=None):
    try:
        return updater(server_args, model, path).update_weights_from_disk(
            str(path), "safetensors", weight_name_filter=flt)
    except Exception as e:  # noqa: BLE001 (sglang raises some failures, returns others)
        return False, f"{type(e).__name__}: {e}"


def test_a_failed_full_reload_refuses_filtered_ones_until_a_full_reload_succeeds(
        patched, server_args, ckpts, tmp_path):
    a, b = ckpts[("fp8", 0)], ckpts[("fp8", 1)]
    model = _experts_only(server_args, a)
    ok, _ = _update(server_args, model, _with_a_bad_last_expert(b, tmp_path / "bad"))
    assert not ok
    after_failure = snapshot(model)
    eplb = fr.generate_weight_name_filter({MOE_LAYER: [5]})
    ok, message = _update(server_args, model, a, eplb)
    assert not ok and "a full reload from" in message and "failed after writing experts" in message
    assert "only a full reload" in message
    assert changed_since(model, after_failure) == ([], [])  # the refused call wrote nothing
    ok, message = _update(server_args, model, a)  # the repair
    assert ok, message
    ok, message = _update(server_args, model, b, eplb)
    assert ok, message
    fresh = _experts(_experts_only(server_args, a))
    load_experts(fresh, {5: b})
    fresh.quant_method.process_weights_after_loading(fresh)
    assert byte_diffs(_experts(model), fresh) == []


def test_an_expert_reloaded_without_one_input_scale_is_refused(patched, server_args, ckpts):
    a, b = ckpts[("fp8", 0)], ckpts[("fp8", 1)]
    model = _experts_only(server_args, a)
    before = snapshot(model)
    whole = fr.generate_weight_name_filter({MOE_LAYER: [3]})
    missing = f"{EXPERTS_PREFIX}.3.up_proj.input_scale"
    ok, message = _update(server_args, model, b, lambda n: whole(n) and n != missing)
    assert not ok and "loaded only in part" in message, message
    assert changed_since(model, before) == ([], [])


def test_a_layer_on_sglangs_fused_loader_keeps_sglangs_code(patched):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from fp8_reload.sglang_patch.moe import handles

    fused = FusedMoE(num_experts=E, hidden_size=CFG.hidden_size,
                     intermediate_size=CFG.moe_intermediate_size, layer_id=MOE_LAYER,
                     top_k=CFG.top_k, params_dtype=torch.bfloat16, quant_config=fp8_config("bf16"),
                     prefix=EXPERTS_PREFIX, use_weight_loader_fused=True)
    assert fused.w13_weight.dtype == torch.bfloat16 and not handles(fused.quant_method, fused)
    plain = make_experts(CFG, "bf16")  # the patched path, for contrast
    assert plain.w13_weight.dtype == torch.float8_e4m3fn and handles(plain.quant_method, plain)
