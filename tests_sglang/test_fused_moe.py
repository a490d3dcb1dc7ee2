"""sglang's own FusedMoE + Fp8MoEMethod: reload unpatched (fails) and patched (a fresh load).

Every layer here is sglang's; checkpoint tensors go through its real
`weight_loader` (see `sgl_model`). The patched tests run without the CPU
`scaled_fp8_quant` stand-in: the patched MoE processing needs no sglang kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8_reload import sglang_patch
from fp8_reload.kernels.scales import collapse_w13_scale
from fp8_reload.testing import calc_diff

from .conftest import CFG
from .sgl_model import (
    EXPERTS_PREFIX,
    byte_diffs,
    changed_since,
    fresh_experts,
    load_experts,
    read_tensors,
    snapshot,
)

E = CFG.num_experts


def _all(path):
    return {e: path for e in range(E)}


def _mixed(base, donor, experts):
    return {e: (donor if e in experts else base) for e in range(E)}


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_unpatched_reload_dies_on_weight_loader(unpatched, cpu_scaled_fp8_quant, ckpts, kind):
    moe = fresh_experts(CFG, kind, _all(ckpts[(kind, 0)]))
    if kind == "fp8":  # the facts behind the failure: new, collapsed Parameters
        assert moe.w13_weight_scale.shape == (E,)
        assert moe.w13_input_scale.dim() == 0
    with pytest.raises(AttributeError, match="weight_loader"):
        load_experts(moe, {0: ckpts[(kind, 1)]})


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("experts", [None, (0, 3)], ids=["full", "experts-0-3"])
def test_patched_reload_is_a_fresh_load(patched, ckpts, kind, experts):
    base, donor = ckpts[(kind, 0)], ckpts[(kind, 1)]
    moe = fresh_experts(CFG, kind, _all(base))
    before = snapshot(moe)
    sources = _all(donor) if experts is None else {e: donor for e in experts}
    assert load_experts(moe, sources) > 0
    moe.quant_method.process_weights_after_loading(moe)

    replaced, changed = changed_since(moe, before)
    assert replaced == []  # every Parameter and buffer is the same object
    assert changed  # and the reload did change bytes
    expected = _all(donor) if experts is None else _mixed(base, donor, experts)
    assert byte_diffs(moe, fresh_experts(CFG, kind, expected)) == []
    assert moe.w13_weight_scale.shape == (E, 2)
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    for name, p in moe.named_parameters():
        if kind == "fp8" or name in ("w13_weight", "w2_weight"):
            assert callable(p.weight_loader), name


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_patched_reloads_in_a_row(patched, ckpts, kind):
    """Several filtered reloads alternating checkpoints: always a fresh load of the mix."""
    a, b = ckpts[(kind, 0)], ckpts[(kind, 1)]
    moe = fresh_experts(CFG, kind, _all(a))
    current = _all(a)
    for step, (src, experts) in enumerate([(b, [1, 5]), (b, [5, 6, 7]), (a, [5]), (a, range(E)),
                                           (b, [0])]):
        load_experts(moe, {e: src for e in experts})
        moe.quant_method.process_weights_after_loading(moe)
        current.update({e: src for e in experts})
        assert byte_diffs(moe, fresh_experts(CFG, kind, current)) == [], f"step {step}"


def test_patched_processing_without_new_weights_is_a_no_op(patched, ckpts):
    moe = fresh_experts(CFG, "fp8", _all(ckpts[("fp8", 0)]))
    before = snapshot(moe)
    moe.quant_method.process_weights_after_loading(moe)
    assert changed_since(moe, before) == ([], [])


def test_patched_bf16_partial_expert_is_refused(patched, ckpts):
    moe = fresh_experts(CFG, "bf16", _all(ckpts[("bf16", 0)]))
    params = dict(moe.named_parameters())
    from fp8_reload.checkpoint import Checkpoint

    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    (_, tensor), = Checkpoint(ckpts[("bf16", 1)]).read([name], {})
    params["w13_weight"].weight_loader(params["w13_weight"], tensor, "experts.w13_weight",
                                       shard_id="w1", expert_id=2)
    with pytest.raises(RuntimeError, match=r"experts \(local slots\) \[2\] were loaded only in part"):
        moe.quant_method.process_weights_after_loading(moe)


def test_patched_first_load_matches_upstream(cpu_scaled_fp8_quant, ckpts):
    """Same scales as sglang's own processing; weights within FP8 rounding of it."""
    path = ckpts[("fp8", 0)]
    upstream = fresh_experts(CFG, "fp8", _all(path))
    sglang_patch.apply()
    try:
        fixed = fresh_experts(CFG, "fp8", _all(path))
    finally:
        sglang_patch.revert()
    assert torch.equal(fixed.w13_weight_scale[:, 0], upstream.w13_weight_scale)
    assert torch.equal(fixed.w13_weight_scale[:, 1], upstream.w13_weight_scale)
    assert torch.equal(fixed.w2_weight_scale, upstream.w2_weight_scale)
    for name in ("w13_input_scale", "w2_input_scale"):  # per expert; the kernels take the max
        assert getattr(fixed, name).shape == (E,)
        assert torch.equal(getattr(fixed, name).max(), getattr(upstream, name))
    # each expert's own, as sglang's loader wrote it (w13: up_proj's, read after gate_proj's)
    for name, proj in (("w13_input_scale", "up_proj"), ("w2_input_scale", "down_proj")):
        names = [f"{EXPERTS_PREFIX}.{e}.{proj}.input_scale" for e in range(E)]
        loaded = dict(read_tensors(path, names))
        assert torch.equal(getattr(fixed, name), torch.stack([loaded[n].float() for n in names]))
    assert byte_diffs(fixed, upstream, ["w2_weight"]) == []
    w_fixed = fixed.w13_weight.float() * fixed.w13_weight_scale[:, :1, None]
    w_up = upstream.w13_weight.float() * upstream.w13_weight_scale[:, None, None]
    assert calc_diff(w_fixed, w_up) < 1e-5
    differing = (fixed.w13_weight.view(torch.uint8) != upstream.w13_weight.view(torch.uint8))
    assert differing.float().mean() < 0.01  # at most rare last-bit rounding differences


def test_patched_triton_quant_info_is_contiguous_per_expert(patched, ckpts):
    moe = fresh_experts(CFG, "fp8", _all(ckpts[("fp8", 0)]))
    info = moe.quant_method.get_triton_quant_info(moe)
    assert info.w13_scale.shape == (E,) and info.w13_scale.is_contiguous()
    assert torch.equal(info.w13_scale, moe.w13_weight_scale[:, 0])
    assert info.w2_scale is moe.w2_weight_scale
    assert info.a13_scale.dim() == 0 and info.a13_scale == moe.w13_input_scale.max()
    assert info.a2_scale.dim() == 0 and info.a2_scale == moe.w2_input_scale.max()
    assert info.w13_weight is moe.w13_weight and info.use_fp8_w8a8


def test_patched_deepgemm_quant_info_collapses_before_blocks(patched, ckpts):
    moe = fresh_experts(CFG, "fp8", _all(ckpts[("fp8", 0)]))
    info = sglang_patch.deepgemm_quant_info(moe.quant_method, moe)
    nb13 = -(-moe.w13_weight.shape[1] // 128)
    kb13 = -(-moe.w13_weight.shape[2] // 128)
    assert info.w13_scale.shape == (E, nb13, kb13)
    assert torch.equal(info.w13_scale, moe.w13_weight_scale[:, :1, None].expand(E, nb13, kb13))
    assert info.w2_scale.shape[0] == E and info.w2_scale.dim() == 3
    assert info.block_shape == [128, 128] and info.use_fp8


def test_block_scales_of_wide_weights():
    scale = torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.5, 0.5]])
    blocks = sglang_patch.per_tensor_block_scales(scale, (3, 300, 129))
    assert blocks.shape == (3, 3, 2) and blocks.is_contiguous()
    assert torch.equal(blocks[:, 2, 1], scale[:, 0])
    assert collapse_w13_scale(scale[:, 0]) is not None


def test_patched_apply_hands_deepgemm_collapsed_block_scales(patched, ckpts, monkeypatch):
    """The DeepGEMM branch of apply(): the real runner object of that backend receives
    [E, N/128, K/128] scales. Its grouped-GEMM kernels need a Hopper GPU, so `run` is
    replaced by a recorder here (gpu/issue7.sh runs DeepGEMM on such scales)."""
    from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend

    moe = fresh_experts(CFG, "fp8", _all(ckpts[("fp8", 0)]))
    method = moe.quant_method
    runner = MoeRunner(MoeRunnerBackend.DEEP_GEMM, method.moe_runner_config)
    handed = []
    monkeypatch.setattr(runner, "run", lambda dispatch, info: handed.append(info) or "out")
    monkeypatch.setattr(method, "runner", runner)
    dispatch = SimpleNamespace(hidden_states=torch.zeros(4, CFG.hidden_size, dtype=torch.bfloat16))

    assert method.apply(moe, dispatch) == "out"
    (info,) = handed
    assert info.w13_scale.dim() == 3 and info.w13_scale.shape[0] == E
    assert torch.equal(info.w13_scale[:, 0, 0], moe.w13_weight_scale[:, 0])
    # sglang's own branch, given the [E, 2] layout, would expand it to a 4-D tensor
    sglang_patch.original("Fp8MoEMethod", "apply")(method, moe, dispatch)
    assert handed[-1].w13_scale.dim() == 4
