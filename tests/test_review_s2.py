"""Adversarial review of session 2's changes (scalar cache, read-ahead, batched backup,
target cache, ExpertFilter index): each test a way the change could make a reload differ
from a fresh load or leave the model changed after a failure."""

from __future__ import annotations

import time

import pytest
import torch

import fp8_reload as fr
import fp8_reload.checkpoint.files as files_mod

from .conftest import copy_checkpoint, mix_checkpoints


def same_as_fresh(model, path) -> list[str]:
    return fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model))


def test_scales_of_a_fresh_shard_rewritten_within_its_tick_are_read_again(ckpts, tmp_path, monkeypatch):
    """A shard rewritten in place within one timestamp tick at the same size keeps its
    stamp (simulated: every stamp frozen at one fresh tick, as tests/test_hostile_files.py
    does). Its weights stream from disk anew; before the scalar cache its scales did
    too, so the reload equalled a fresh load of the new bytes. Cached scales gave the
    new weights with the old version's scales: a model no fresh load gives."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "live")
    tick = time.time_ns()
    monkeypatch.setattr(files_mod, "stamp", lambda st: (st.st_dev, st.st_ino, st.st_size, tick, tick))
    monkeypatch.setattr(files_mod, "SETTLED_NS", 10**15)  # the files stay fresh throughout
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, path)
    assert same_as_fresh(model, path) == []
    for shard in sorted(path.glob("*.safetensors")):  # seed 0's bytes, same inode and size
        data = (ckpts["fp8", 0] / shard.name).read_bytes()
        assert len(data) == shard.stat().st_size
        with open(shard, "r+b") as f:
            f.write(data)
    fr.update_weights_from_disk(model, path)
    assert same_as_fresh(model, ckpts["fp8", 0]) == []


def test_a_nan_scale_in_a_new_version_is_refused_after_cached_scales(ckpts, tmp_path, monkeypatch):
    """The cache lives with one parse: a new version (new stamps) with a NaN scale is
    parsed anew and its scales checked, the model unchanged."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "live")
    monkeypatch.setattr(files_mod, "SETTLED_NS", 0)  # settled at once: the scales are cached
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [2]})
    for _ in range(2):
        fr.update_weights_from_disk(model, path, flt)
    ckpt = model.__dict__["_checkpoint_cache"][str(path.resolve())][1]
    assert ckpt.scalars  # cached
    before = fr.snapshot(model)
    from .conftest import rewrite_tensor
    rewrite_tensor(path, "model.layers.1.mlp.experts.2.up_proj.weight_scale",
                   lambda t: torch.full_like(t, float("nan")))
    with pytest.raises(fr.InvalidTensorError, match="experts.2.up_proj.weight_scale"):
        fr.update_weights_from_disk(model, path, flt)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def _rebind_w13(model):
    """`.data` of one MoE weight rebound to new memory (same shape and values)."""
    moe = dict(model.moe_layers())["model.layers.1.mlp.experts"]
    old = moe.w13_weight.data
    moe.w13_weight.data = old.clone()
    return moe, old


def _move_experts(model):
    """Layer 1's experts moved to other slots, their bytes with them (a rebalance)."""
    moved = {e: [(e + 3) % 8] for e in range(8)}
    for lname, layer in model.moe_layers():
        if lname != "model.layers.1.mlp.experts":
            continue
        for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            p = getattr(layer, name).data
            p.copy_(p[[(k - 3) % 8 for k in range(8)]])
        layer.expert_slots = moved
    return moved


@pytest.mark.parametrize("change", ["rebind", "rebalance"])
def test_a_full_plan_is_not_reused_after_a_filtered_reload_replanned_a_module(ckpts, change):
    """full reload (plan kept) -> a module changes (`.data` rebound / experts moved by a
    rebalance) -> a filtered reload replans that module, so the target cache holds its
    new state -> a full reload of the same checkpoint. `TargetCache.unchanged` then
    compared the modules with the *new* state and reused the full plan made for the old
    one: the reload wrote the old memory / the old slots, reported success, and the model
    was not what a fresh load gives."""
    path = ckpts["fp8", 1]
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, path)  # the full plan is kept
    if change == "rebind":
        moe, old = _rebind_w13(model)
        expected = fr.snapshot(fr.load_model(path))
    else:
        moved = _move_experts(model)
        slots = lambda layer_id: moved if layer_id == 1 else None  # noqa: E731
        expected = fr.snapshot(fr.load_model(path, expert_slots=slots))
    fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({1: [0]}))
    for _, layer in model.moe_layers():  # what the full reload must overwrite
        layer.w13_weight.data.zero_()
    if change == "rebind":
        old.zero_()
    fr.update_weights_from_disk(model, path)
    assert fr.compare_states(expected, fr.snapshot(model)) == []
    if change == "rebind":
        assert not old.view(torch.uint8).any()  # the detached memory was not written


def test_scales_of_a_settled_checkpoint_are_still_read_once(ckpts, tmp_path, monkeypatch):
    """The other side of the fix above: from shards settled when parsed (any rewrite then
    moves their stamp) a repeated reload reads no scale from disk."""
    import fp8_reload.reload.chunks as chunks_mod

    monkeypatch.setattr(files_mod, "SETTLED_NS", 0)
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [0, 3], 2: [5]})
    reads = []
    real = chunks_mod.read_span
    monkeypatch.setattr(chunks_mod, "read_span",
                        lambda *a, **k: reads.append(k.get("what")) or real(*a, **k))
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    first = [w for w in reads if w and w.startswith("scales")]
    reads.clear()
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    assert first and [w for w in reads if w and w.startswith("scales")] == []
    mixed = mix_checkpoints(ckpts["fp8", 0], ckpts["fp8", 1], tmp_path / "mixed", flt)
    assert same_as_fresh(model, mixed) == []
