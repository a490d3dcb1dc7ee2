"""Leftovers of attack s27 on the reload. Each case failed before its fix:

* `update_weights_from_disk(model, "")` reloaded from the current directory (``Path("")`` is
  "."): a server started inside one checkpoint and handed a blank path reloaded that one;
  `load_model(None)` raised Path's TypeError from deep inside `Checkpoint`;
* an expert filter naming an expert the model does not have (``{1: [99]}`` beside real ones,
  or a dense layer) reloaded the others and reported success: the expert meant to be
  replaced kept serving; one the checkpoint lacks entirely was skipped the same way.
"""

from __future__ import annotations

import pytest

import fp8_reload as fr

from .bad_checkpoints import edit_tensors, weight_map, write_index
from .conftest import copy_checkpoint


@pytest.fixture
def model_and_state(ckpts):
    model = fr.load_model(ckpts["fp8", 0])
    return model, fr.snapshot(model)


def test_an_empty_path_is_refused_not_read_as_the_current_directory(ckpts, model_and_state, monkeypatch):
    model, before = model_and_state
    monkeypatch.chdir(ckpts["fp8", 1])  # a checkpoint that would load: the trap
    with pytest.raises(fr.CheckpointNotFoundError, match="empty path names no checkpoint"):
        fr.update_weights_from_disk(model, "")
    with pytest.raises(fr.CheckpointNotFoundError, match="empty path"):
        fr.update_weights_from_disk(model, "", fr.generate_weight_name_filter({1: [0]}))
    with pytest.raises(fr.CheckpointNotFoundError, match="empty path"):
        fr.load_model("")
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    assert fr.update_weights_from_disk(model, ".").full  # said explicitly, the directory is read
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []


@pytest.mark.parametrize("path", [None, 3, b"/tmp", ["dir"]])
def test_what_is_not_a_path_is_a_type_error_naming_the_argument(path, model_and_state):
    model, before = model_and_state
    with pytest.raises(TypeError, match="checkpoint path is a str or os.PathLike"):
        fr.update_weights_from_disk(model, path)
    with pytest.raises(TypeError, match="checkpoint path is a str or os.PathLike"):
        fr.load_model(path)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


@pytest.mark.parametrize("experts, says", [
    ({1: [0, 99]}, "layer 1 expert 99"),       # reloaded expert 0 alone
    ({1: [-1]}, "layer 1 expert -1"),
    ({0: [0], 1: [0]}, "layer 0 expert 0"),     # layer 0 is dense: no experts
    ({3: [0]}, "layer 3 expert 0"),            # the tiny preset has 3 layers
    ({2: range(8, 14)}, "layer 2 expert 8, layer 2 expert 9, .* \\(6 in all\\)"),
])
def test_an_expert_the_model_does_not_have_is_refused(experts, says, engine, ckpts, model_and_state):
    model, before = model_and_state
    with pytest.raises(fr.UnknownExpertError, match=f"{says}.*experts are 0..7 of layers 1..2"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(experts))
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    assert issubclass(fr.UnknownExpertError, fr.FilterMatchedNothingError)  # what callers caught


def test_an_expert_the_checkpoint_lacks_entirely_is_refused(engine, ckpts, model_and_state, tmp_path):
    model, before = model_and_state
    bad = copy_checkpoint(ckpts["fp8", 1], tmp_path / "no-expert-3")
    prefix = "model.layers.2.mlp.experts.3."
    wm = weight_map(bad)
    gone = [n for n in wm if n.startswith(prefix)]
    for name in gone:
        edit_tensors(bad, lambda t, name=name: t.pop(name), name)
        del wm[name]
    write_index(bad, wm)
    flt = fr.generate_weight_name_filter({2: [2, 3]})
    with pytest.raises(fr.MissingTensorError, match="expert 3 of layer 2 has no tensor in the checkpoint"):
        fr.update_weights_from_disk(model, bad, flt)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    report = fr.update_weights_from_disk(model, bad, fr.generate_weight_name_filter({2: [2]}))
    assert report.experts_reloaded == {2: [2]}  # the rest of that checkpoint still reloads
