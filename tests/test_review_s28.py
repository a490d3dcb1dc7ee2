"""Leftovers of attack s27 on the reload, and attack s28 (helper 61). Each case failed
before its fix:

* `update_weights_from_disk(model, "")` reloaded from the current directory (``Path("")`` is
  "."): a server started inside one checkpoint and handed a blank path reloaded that one;
  `load_model(None)` raised Path's TypeError from deep inside `Checkpoint`;
* an expert filter naming an expert the model does not have (``{1: [99]}`` beside real ones,
  or a dense layer) reloaded the others and reported success: the expert meant to be
  replaced kept serving; one the checkpoint lacks entirely was skipped the same way;
* (s28) filter keys naming one layer overwrote each other; ``tensor([3])`` was an expert id;
  a Parameter re-viewed as another dtype got the checkpoint's bytes; a forward waiting on a
  forward of the same model in another thread deadlocked with a waiting reload.
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


def test_keys_naming_one_layer_add_up_not_overwrite(ckpts, model_and_state):
    """Attack s28: ``{1: [0], "1": [3]}`` (a plan merged from JSON and code) became
    ``{1: [3]}``: expert 0 was silently not reloaded, and the report agreed."""
    import torch

    for spec in ({1: [0], "1": [3]}, {torch.tensor(1): [0], torch.tensor(1): [3]},
                 {1: [0], " 1": [3], "01": [0]}):
        flt = fr.generate_weight_name_filter(spec)
        assert repr(flt) == "generate_weight_name_filter({1: [0, 3]})", spec
    model, _ = model_and_state
    assert fr.update_weights_from_disk(model, ckpts["fp8", 1], flt).experts_reloaded == {1: [0, 3]}


def test_an_expert_id_is_one_number_not_an_array_of_one():
    """torch took ``tensor([3])`` as expert 3 where numpy's ``array([3])`` was refused."""
    import numpy as np
    import torch

    for experts in ([torch.tensor([3])], [np.array([3])], [torch.tensor([[3]])]):
        with pytest.raises(TypeError, match="is not a whole number"):
            fr.generate_weight_name_filter({1: experts})
    with pytest.raises(TypeError, match="layer tensor\\(\\[1\\]\\) is not a whole number"):
        fr.generate_weight_name_filter({torch.tensor([1]): [0]})


def test_a_parameter_given_another_dtype_over_its_memory_gets_values_not_bytes(ckpts, engine):
    """Attack s28: a bf16 norm re-viewed as float16 (same memory, shape and strides) was
    reloaded with the checkpoint's bf16 bytes, read as float16: other values, no error."""
    import torch

    model = fr.load_model(ckpts["bf16", 0])
    fr.update_weights_from_disk(model, ckpts["bf16", 0])  # the norm's target planned and kept
    norm = model.model.layers[1].post_attention_layernorm.weight
    norm.data = norm.data.view(torch.float16)
    fr.update_weights_from_disk(model, ckpts["bf16", 1])
    want = fr.load_model(ckpts["bf16", 1]).model.layers[1].post_attention_layernorm.weight
    assert norm.dtype == torch.float16 and torch.equal(norm, want.to(torch.float16))


def test_a_forward_waiting_on_a_forward_in_another_thread_fails_the_reload_not_hangs(
        ckpts, monkeypatch):
    """Attack s28: a batch holding the model's read access hands a micro-batch to a pool
    thread while a reload waits: the pool's forward queues behind the waiting write, the
    batch waits for it, the write for the batch, all forever. The write now gives up after
    `FP8_RELOAD_WRITE_WAIT_S`, nothing written, and the forwards go on."""
    import concurrent.futures
    import threading
    import time

    import fp8_reload.locks as locks

    from .conftest import tokens

    monkeypatch.setattr(locks, "WRITE_WAIT_S", 1)
    model = fr.load_model(ckpts["fp8", 0])
    before, x = fr.snapshot(model), tokens(model.config, 4)
    out, pool, waiting = {}, concurrent.futures.ThreadPoolExecutor(1), threading.Event()

    def batch():
        with model.weights_lock.read():  # one set of weights for the whole batch
            waiting.wait(5)
            time.sleep(0.2)  # (the reload now waits for this forward)
            out["y"] = pool.submit(model, x).result(timeout=30)

    def reload():
        waiting.set()
        try:
            fr.update_weights_from_disk(model, ckpts["fp8", 1])
        except fr.ReloadError as e:
            out["error"] = e

    threads = [threading.Thread(target=batch, daemon=True), threading.Thread(target=reload, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert "FP8_RELOAD_WRITE_WAIT_S" in str(out["error"]) and "nothing was written" in str(out["error"])
    assert "y" in out and fr.compare_states(before, fr.snapshot(model), identity=True) == []
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # and the next one goes through
    pool.shutdown()
