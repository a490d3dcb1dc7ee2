"""The central invariant on real checkpoints: a reload is indistinguishable from a fresh load."""

from __future__ import annotations

import os
import re

import pytest
import torch

import fp8_reload as fr
from fp8_reload.layers import expert_of

from .conftest import mix_checkpoints, tokens

KINDS = ["fp8", "bf16"]
FILTERS = {
    "full": None,
    "one-expert": {1: [3]},
    "several": {1: [0, 3], 2: [7]},
}


def _filter(spec):
    return None if spec is None else fr.generate_weight_name_filter(spec)


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_load_is_deterministic(device, ckpts, kind):
    a = fr.load_model(ckpts[kind, 0], device=device)
    b = fr.load_model(ckpts[kind, 0], device=device)
    assert fr.compare_states(fr.snapshot(a), fr.snapshot(b)) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", list(FILTERS))
def test_reload_same_checkpoint_changes_nothing_repeatedly(device, ckpts, tiny_cfg, kind, which):
    path = ckpts[kind, 0]
    model = fr.load_model(path, device=device)
    before = fr.snapshot(model)
    x = tokens(tiny_cfg).to(device)
    y0 = model(x)
    for _ in range(3):
        report = fr.update_weights_from_disk(model, path, _filter(FILTERS[which]))
        assert report.tensors_loaded > 0
        assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    assert torch.equal(model(x), y0)


@pytest.mark.parametrize("kind", KINDS)
def test_full_reload_from_other_checkpoint_equals_its_fresh_load(device, ckpts, kind):
    model = fr.load_model(ckpts[kind, 0], device=device)
    ids = fr.snapshot(model)
    for seed in (1, 0, 1):
        fr.update_weights_from_disk(model, ckpts[kind, seed])
        now = fr.snapshot(model)
        fresh = fr.snapshot(fr.load_model(ckpts[kind, seed], device=device))
        assert fr.compare_states(fresh, now) == []
        assert now.ids == ids.ids and now.attrs == ids.attrs


@pytest.mark.parametrize("kind", KINDS)
def test_filtered_reload_from_other_checkpoint(device, ckpts, tiny_cfg, tmp_path, kind):
    """Experts in the filter take the new values, all else keeps its bytes, and the
    whole state equals a fresh load of the correspondingly mixed checkpoint."""
    spec = {1: [0, 5], 2: [2]}
    chosen = {(layer, e) for layer, es in spec.items() for e in es}
    model = fr.load_model(ckpts[kind, 0], device=device)
    before = fr.snapshot(model)
    report = fr.update_weights_from_disk(model, ckpts[kind, 1], fr.generate_weight_name_filter(spec))
    after = fr.snapshot(model)
    assert report.experts_reloaded == {1: [0, 5], 2: [2]}

    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed",
                            lambda n: expert_of(n) in chosen)
    assert fr.compare_states(fr.snapshot(fr.load_model(mixed, device=device)), after) == []

    # Slot by slot: chosen experts changed, every other expert bit-identical.
    for layer in tiny_cfg.moe_layers:
        for pname in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            name = f"model.layers.{layer}.mlp.experts.{pname}"
            for e in range(tiny_cfg.num_experts):
                same = fr.state.bitwise_equal(before.tensors[name][e], after.tensors[name][e])
                if (layer, e) in chosen and pname == "w13_weight":
                    assert not same, f"{name}[{e}] should have changed"
                if (layer, e) not in chosen:
                    assert same, f"{name}[{e}] was not reloaded but changed"
    # Non-expert parameters did not move at all.
    for name in before.tensors:
        if ".mlp.experts." not in name:
            assert fr.compare_states(fr.Snapshot({name: before.tensors[name]}, {}, {}),
                                     fr.Snapshot({name: after.tensors[name]}, {}, {})) == []


@pytest.mark.parametrize("kind", KINDS)
def test_filtered_reload_processes_only_reloaded_moe_layers(ckpts, kind, monkeypatch):
    model = fr.load_model(ckpts[kind, 0])
    linear = model.model.layers[0].self_attn.q_proj
    ptr, shape = linear.weight.data_ptr(), tuple(linear.weight.shape)
    calls = []
    orig = linear.quant_method.__class__.process_weights_after_loading
    monkeypatch.setattr(linear.quant_method.__class__, "process_weights_after_loading",
                        lambda self, layer: (calls.append(layer), orig(self, layer)))
    report = fr.update_weights_from_disk(model, ckpts[kind, 0], fr.generate_weight_name_filter({2: [1]}))
    assert report.modules_processed == ["model.layers.2.mlp.experts"]
    assert calls == []
    assert linear.weight.data_ptr() == ptr and tuple(linear.weight.shape) == shape


@pytest.mark.parametrize("kind", KINDS)
def test_reloading_a_linear_layer_in_kernel_layout(ckpts, kind):
    """A reloaded FP8 linear (weight already transposed) matches a fresh load."""
    model = fr.load_model(ckpts[kind, 0])
    flt = lambda n: n.startswith("model.layers.1.self_attn.q_proj.") or ".shared_experts." in n  # noqa: E731
    report = fr.update_weights_from_disk(model, ckpts[kind, 1], flt)
    assert "model.layers.1.self_attn.q_proj" in report.modules_processed
    mixed_expect = fr.snapshot(model)
    fresh1 = fr.snapshot(fr.load_model(ckpts[kind, 1]))
    for name, t in mixed_expect.tensors.items():
        if name.startswith("model.layers.1.self_attn.q_proj.") or ".shared_experts." in name:
            assert fr.state.bitwise_equal(t, fresh1.tensors[name]), name


def test_a_partial_match_reloads_the_whole_expert(ckpts):
    """The reload unit is an expert: its gate/up scales and weights are processed together."""
    path = ckpts["fp8", 0]
    model = fr.load_model(path)
    before = fr.snapshot(model)
    one = "model.layers.1.mlp.experts.3.up_proj.weight"
    report = fr.update_weights_from_disk(model, path, lambda n: n == one)
    assert report.tensors_loaded == 9  # gate/up/down x weight/weight_scale/input_scale
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


@pytest.mark.parametrize("kind", KINDS)
def test_filtered_reload_reads_only_that_experts_bytes(ckpts, kind):
    path = ckpts[kind, 0]
    ckpt = fr.Checkpoint(path)
    model = fr.load_model(path)
    expert = [n for n in ckpt.names if n.startswith("model.layers.2.mlp.experts.6.")]
    report = fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({2: [6]}))
    assert report.tensors_loaded == len(expert) == (9 if kind == "fp8" else 3)
    assert report.bytes_read == sum(ckpt.info(n).nbytes for n in expert)
    assert report.files_opened == len({ckpt.weight_map[n] for n in expert})
    assert report.bytes_read < ckpt.total_bytes() / 20  # tiny: 16 experts + dense layers

    scan = fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({2: [6]}), scan_all=True)
    assert scan.bytes_read == ckpt.total_bytes()
    assert scan.files_opened == len(set(ckpt.weight_map.values()))


def test_backup_is_bounded_by_the_reloaded_experts(ckpts, tiny_cfg):
    model = fr.load_model(ckpts["fp8", 0])
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [2]}))
    e, h, i = tiny_cfg.num_experts, tiny_cfg.hidden_size, tiny_cfg.moe_intermediate_size
    expert_bytes = 3 * h * i  # fp8 w13 + w2 of one expert
    small_state = 4 * (2 * e + e + 4 * e)  # scales and per-expert input-scale buffers, whole
    assert report.backup_bytes <= expert_bytes + small_state


# ---------------------------------------------------------------- upstream

@pytest.mark.parametrize("kind", KINDS)
def test_upstream_reload_dies_on_missing_weight_loader_and_leaves_model_as_it_was(device, ckpts, tiny_cfg,
                                                                                  kind):
    model = fr.load_model(ckpts[kind, 0], processing="upstream", device=device)
    before = fr.snapshot(model)
    x = tokens(tiny_cfg).to(device)
    y0 = model(x)
    with pytest.raises(fr.ReloadError, match="weight_loader") as info:
        fr.update_weights_from_disk(model, ckpts[kind, 1], fr.generate_weight_name_filter({1: [3]}))
    assert isinstance(info.value.__cause__, AttributeError)
    assert "'Parameter' object has no attribute 'weight_loader'" in str(info.value.__cause__)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    assert torch.equal(model(x), y0)


def test_upstream_post_processing_replaces_and_collapses_scales(ckpts, tiny_cfg):
    model = fr.load_model(ckpts["fp8", 0], processing="upstream")
    experts = model.model.layers[1].mlp.experts
    assert tuple(experts.w13_weight_scale.shape) == (tiny_cfg.num_experts,)
    assert experts.w13_input_scale.dim() == 0 and experts.w2_input_scale.dim() == 0
    for p in (experts.w13_weight_scale, experts.w13_input_scale, experts.w2_input_scale):
        assert not hasattr(p, "weight_loader")


def test_upstream_collapsed_scale_cannot_take_a_shard_index(ckpts):
    """Even with the loader attribute put back, [E] scales cannot be indexed [expert][shard]."""
    model = fr.load_model(ckpts["fp8", 0], processing="upstream")
    experts = model.model.layers[1].mlp.experts
    for p in experts.parameters():
        if not hasattr(p, "weight_loader"):
            p.weight_loader = experts.weight_loader
            p.quant_method = "tensor"
    before = fr.snapshot(model)
    with pytest.raises(fr.ReloadError) as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [3]}))
    assert isinstance(info.value.__cause__, (IndexError, RuntimeError))
    assert fr.compare_states(before, fr.snapshot(model)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_identity_only_fix_still_double_transposes_linear_layers(device, ckpts, tiny_cfg, kind):
    """The fp8.py half of the fix alone: the MoE Parameters survive, but every module is
    post-processed again, so q_proj is transposed back and the next forward fails."""
    model = fr.load_model(ckpts[kind, 0], processing="identity-only", device=device)
    q = model.model.layers[1].self_attn.q_proj
    moe_ids = {n: id(p) for n, p in model.named_parameters() if ".mlp.experts." in n}
    kernel_shape = tuple(q.weight.shape)
    assert kernel_shape == (q.input_size, q.output_size)
    fr.update_weights_from_disk(model, ckpts[kind, 0], fr.generate_weight_name_filter({1: [3]}))
    assert tuple(model.model.layers[1].self_attn.q_proj.weight.shape) == (q.output_size, q.input_size)
    assert {n: id(p) for n, p in model.named_parameters() if ".mlp.experts." in n} == moe_ids
    with pytest.raises(RuntimeError):
        model(tokens(tiny_cfg).to(device))


def test_fixed_keeps_the_sglang_scale_layout(ckpts, tiny_cfg):
    model = fr.load_model(ckpts["fp8", 0])
    experts = model.model.layers[1].mlp.experts
    s = experts.w13_weight_scale
    assert tuple(s.shape) == (tiny_cfg.num_experts, 2)
    assert torch.equal(s[:, 0], s[:, 1])
    assert torch.all(experts.w13_input_scale == experts.w13_input_scale.max())
    # the checkpoint's gate and up scales differ: both columns hold the larger one
    ckpt = fr.Checkpoint(ckpts["fp8", 0])
    vals = dict(ckpt.read([f"model.layers.1.mlp.experts.4.{p}_proj.weight_scale" for p in ("gate", "up")]))
    gate = vals["model.layers.1.mlp.experts.4.gate_proj.weight_scale"]
    up = vals["model.layers.1.mlp.experts.4.up_proj.weight_scale"]
    assert gate != up
    assert s[4, 0] == torch.maximum(gate, up)


# ---------------------------------------------------------------- errors

def test_errors_name_the_cause_and_leave_the_model_alone(ckpts, tmp_path, monkeypatch):
    from .conftest import copy_checkpoint, rewrite_tensor

    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)

    with pytest.raises(fr.CheckpointError, match="does not exist"):
        fr.update_weights_from_disk(model, tmp_path / "nope")
    with pytest.raises(fr.FilterMatchedNothingError):
        fr.update_weights_from_disk(model, ckpts["fp8", 0], lambda n: False)
    with pytest.raises(fr.CheckpointMismatchError, match="kind"):
        fr.update_weights_from_disk(model, ckpts["bf16", 0])

    bad = copy_checkpoint(ckpts["fp8", 1], tmp_path / "nan-scale")
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    rewrite_tensor(bad, name, lambda t: torch.full_like(t, float("nan")))
    with pytest.raises(fr.CheckpointError, match=re.escape(name)):
        fr.update_weights_from_disk(model, bad)

    # A fault in the middle of post-processing is rolled back.
    import fp8_reload.processing.moe as moe_processing

    orig = moe_processing.process_fp8_experts_

    def fail_midway(w13, scale, experts, shard, input_scales=None, cache=None):
        orig(w13, scale, experts[:1], shard, input_scales, cache)  # writes one expert, then dies
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(moe_processing, "process_fp8_experts_", fail_midway)
    with pytest.raises(fr.ReloadError, match="injected device fault"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter({1: [0, 1, 2]}))
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_generate_weight_name_filter():
    f = fr.generate_weight_name_filter({3: [0, 7]})
    assert f("model.layers.3.mlp.experts.7.up_proj.weight")
    assert f("model.layers.3.mlp.experts.0.down_proj.input_scale")
    assert not f("model.layers.3.mlp.experts.70.up_proj.weight")
    assert not f("model.layers.13.mlp.experts.7.up_proj.weight")
    assert not f("model.layers.3.mlp.shared_experts.up_proj.weight")
    assert not f("model.layers.3.self_attn.q_proj.weight")


def test_planning_reuses_the_parsed_checkpoint_until_a_file_changes(ckpts, tmp_path):
    from .conftest import copy_checkpoint, rewrite_tensor

    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "c")
    model = fr.load_model(path)
    flt = fr.generate_weight_name_filter({1: [2]})
    fr.update_weights_from_disk(model, path, flt)
    key = os.path.realpath(path)
    first = model._checkpoint_cache[key][1]
    fr.update_weights_from_disk(model, path, flt)
    assert model._checkpoint_cache[key][1] is first  # nothing changed: index and headers reused
    name = "model.layers.1.mlp.experts.2.gate_proj.weight_scale"
    rewrite_tensor(path, name, lambda t: t * 2)  # rewritten in place: the stamp changes
    before = fr.snapshot(model)
    fr.update_weights_from_disk(model, path, flt)
    assert model._checkpoint_cache[key][1] is not first
    assert fr.compare_states(before, fr.snapshot(model)) != []  # the new scale was read
    shard = path / fr.Checkpoint(path).weight_map[name]
    shard.unlink()
    with pytest.raises(fr.CheckpointError):
        fr.update_weights_from_disk(model, path, flt)
