"""Tests written to kill mutants that the rest of the suite let through.

Each one pins a promise of the central invariant's oracle (`fr.snapshot` and
`fr.compare_states`, which every invariant test and the accuracy gate judge by) or
of the gate itself, on a real model loaded from a real checkpoint.
"""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
from fp8_reload.processing import FixedFp8LinearMethod
from fp8_reload.processing import linear as linear_mod
from fp8_reload.tools import gate

from . import bad_checkpoints as bad


def _first_moe(model):
    return model.model.layers[model.config.moe_layers[0]].mlp.experts


def test_compare_states_sees_a_dtype_change_that_keeps_the_bytes(ckpts):
    """Same shape, same bytes, another dtype (an FP8 weight rebound to its uint8 view):
    not the state a fresh load gives."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    moe = _first_moe(model)
    moe.w13_weight.data = moe.w13_weight.data.view(torch.uint8)
    diffs = fr.compare_states(before, fr.snapshot(model))
    assert len(diffs) == 1 and "w13_weight:" in diffs[0] and "torch.uint8" in diffs[0], diffs


def test_compare_states_sees_a_lost_loader_attribute(ckpts):
    """The same Parameter object without its `weight_loader` is what makes the next
    reload die upstream: identity=True must report it."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    scale = _first_moe(model).w13_weight_scale
    del scale.weight_loader
    diffs = fr.compare_states(before, fr.snapshot(model), identity=True)
    assert len(diffs) == 1 and "w13_weight_scale: loader attributes" in diffs[0], diffs
    assert fr.compare_states(before, fr.snapshot(model)) == []  # the bytes are the same


def test_snapshot_covers_buffers(ckpts):
    """Buffers are model state too (the per-expert input scales a later merge is computed
    from): a change in one is a difference."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    with torch.no_grad():
        _first_moe(model).w13_input_scale_per_expert[0] *= 2
    diffs = fr.compare_states(before, fr.snapshot(model))
    assert len(diffs) == 1 and "w13_input_scale_per_expert:" in diffs[0], diffs


def test_linear_reading_the_wrong_scale_fails_ref_model(tmp_path, monkeypatch):
    """A dense FP8 GEMM that computes with twice its weight scale. State, identity and the
    untouched experts are right, a fresh model computes with the same bug (fresh.forward
    passes) and the MoE blocks alone are right (ref.moe passes): only ref.model, the
    whole forward against the float32 reference, can see it."""
    def wrong_scale(self, layer, x):
        a = None if layer.input_scale is None else layer.input_scale[0]
        return linear_mod._linear_forward(x, layer.weight, 2 * layer.weight_scale[0], a)

    monkeypatch.setattr(FixedFp8LinearMethod, "apply", wrong_scale)
    r = gate.run_gate(workdir=tmp_path, device="cpu", kinds="fp8", log=lambda s: None)
    failed = {c.name for _, c in r.failures() if c.status == "fail"}
    assert not r.passed and failed == {"ref.model"}, gate.format_report(r)


def test_overlapping_data_offsets_are_refused_as_an_overlap(ckpts, tiny_cfg, tmp_path):
    """Two tensors on one byte range: the message names that cause (the tiling check
    behind it would only say that minus some bytes belong to no tensor)."""
    model = fr.load_model(ckpts["fp8", 0])
    path, _ = bad.overlapping_offsets(ckpts["fp8", 0], tmp_path, "fp8", tiny_cfg)
    with pytest.raises(fr.CorruptCheckpointError, match=r"corrupt header: tensor '.+' overlaps "
                       r"the data of tensor '.+'"):
        fr.update_weights_from_disk(model, path)
