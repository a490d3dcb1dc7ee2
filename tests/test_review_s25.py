"""Review s25 (an attack on the CPU paths; `.scratch/attack25/` held the reproductions).

Found and fixed: two models reloaded at once from two threads made each other's reloads fail
(one thread's reader-pool check closed the reader processes under the other's ring);
`release_staging` from inside a forward waited forever for a reload that waited for that
forward; EPLB filters took a string a digit at a time and a float as the expert below it; a
preset could be "cut" to more layers than it has. The CLI and settings findings are pinned in
`test_cli.py` and `test_knobs.py`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import fp8_reload as fr
from fp8_reload.checkpoint import read_procs

from .conftest import WAIT, tokens, unchanged
from .threads import start


def test_two_models_reloading_at_once_each_keep_their_readers(ckpts):
    """A draft and a target model reloaded from two threads: both stream at once, one through
    the reader processes, the other through reader threads; none fails, each equals a fresh
    load after every reload."""
    if not read_procs.supported():
        pytest.skip("reader processes are not supported here: one reader kind only")
    paths = [ckpts["fp8", 0], ckpts["fp8", 1]]
    fresh = [fr.snapshot(fr.load_model(p)) for p in paths]
    errors: list = []
    barrier = threading.Barrier(2)

    def reload_many(seed: int) -> int:
        model = fr.load_model(paths[0])
        barrier.wait(WAIT)
        for i in range(10):
            s = (i + seed) % 2
            try:
                fr.update_weights_from_disk(model, paths[s])
            except fr.ReloadError as e:
                errors.append(f"thread {seed}, reload {i}: {e}")
                continue
            if fr.compare_states(fresh[s], fr.snapshot(model)):
                errors.append(f"thread {seed}, reload {i}: differs from a fresh load")
        return seed

    runs = [start(reload_many, seed) for seed in (0, 1)]
    for t, _ in runs:
        t.join(20 * WAIT)
    assert not any(t.is_alive() for t, _ in runs), "a reload hung"
    assert [r.get("error") for _, r in runs] == [None, None]
    assert errors == []


def test_release_staging_inside_a_forward_is_refused_while_a_reload_waits(ckpts, tiny_cfg):
    """A forward hook (a memory-pressure handler) releasing the model's staging while another
    thread's reload waits for that forward: before, both waited forever (the release for the
    reload's lock, the reload for the forward). Now the release raises at once, the forward
    and the reload finish, and the model is the reloaded one."""
    x = tokens(tiny_cfg)
    y1 = fr.load_model(ckpts["fp8", 1])(x)
    model = fr.load_model(ckpts["fp8", 0])
    in_forward, go, errors = threading.Event(), threading.Event(), []

    def hook(module, args, out):
        if threading.current_thread().name != "F":
            return
        in_forward.set()
        assert go.wait(WAIT)
        try:
            fr.release_staging(model)
        except fr.ReloadError as e:
            errors.append(e)

    model.model.layers[0].register_forward_hook(hook)
    fwd = threading.Thread(target=model, args=(x,), name="F", daemon=True)
    fwd.start()
    assert in_forward.wait(WAIT)
    reload, result = start(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    t0 = time.monotonic()
    while model.weights_lock._writers_waiting == 0:  # the reload waits for the forward
        assert time.monotonic() - t0 < WAIT and reload.is_alive(), result
        time.sleep(0.005)
    go.set()
    fwd.join(WAIT)
    reload.join(WAIT)
    assert not fwd.is_alive() and not reload.is_alive(), "deadlocked"
    assert "error" not in result, result
    assert len(errors) == 1 and "inside a forward of the same model" in str(errors[0])
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []
    assert torch.equal(model(x), y1)
    fr.release_staging(model)  # outside a forward: as before


def test_release_staging_inside_a_forward_with_no_reload_is_refused_too(ckpts, tiny_cfg):
    """The same call with no reload waiting: refused the same way (whether it would wait
    depends on another thread's timing, so it never runs there), the forward unchanged."""
    x = tokens(tiny_cfg)
    model = fr.load_model(ckpts["fp8", 0])
    y0 = model(x)
    before, errors = fr.snapshot(model), []

    def hook(module, args, out):
        try:
            fr.release_staging(model)
        except fr.ReloadError as e:
            errors.append(e)

    handle = model.model.layers[0].register_forward_hook(hook)
    assert torch.equal(model(x), y0)
    handle.remove()
    assert len(errors) == 1 and unchanged(model, before) == []


@pytest.mark.parametrize("experts,says", [
    ("12", "must be a collection of whole numbers"),  # was experts 1 and 2
    (b"\x01", "must be a collection of whole numbers"),
    (5, "must be a collection of whole numbers"),
    (None, "must be a collection of whole numbers"),
    ([2.7], "expert 2.7 is not a whole number"),  # was expert 2
    ([1.0], "expert 1.0 is not a whole number"),
    ([np.float32(1)], "is not a whole number"),
    ([False, True], "expert False is a bool"),  # (s27) was experts 0 and 1
    ([np.bool_(True)], "is a bool"),
    ([torch.tensor(True)], "is a bool"),
])
def test_an_expert_filter_refuses_what_is_not_a_list_of_experts(experts, says):
    with pytest.raises(TypeError, match=f"layer 1.*{says}"):
        fr.generate_weight_name_filter({1: experts})


def test_an_expert_filter_takes_every_kind_of_whole_number(ckpts):
    """Ints, numpy integers, integer tensors (1-d, or their 0-d elements), sets, ranges,
    duplicates: the same filter, holding plain ints."""
    ways = [{1: [2, 0]}, {1: {0, 2}}, {1: (2, 0, 2)}, {np.int64(1): np.array([0, 2])},
            {1: torch.tensor([2, 0])}, {1: list(torch.tensor([0, 2]))}, {1: range(0, 3, 2)}]
    filters = [fr.generate_weight_name_filter(w) for w in ways]
    assert {repr(f) for f in filters} == {"generate_weight_name_filter({1: [0, 2]})"}
    assert all(type(e) is int for f in filters for es in f.layer_experts.values() for e in es)
    with pytest.raises(TypeError, match="takes {layer: experts}"):
        fr.generate_weight_name_filter([(1, [0])])
    with pytest.raises(TypeError, match="layer True is a bool"):  # (s27) was layer 1
        fr.generate_weight_name_filter({True: [0]})
    model = fr.load_model(ckpts["fp8", 0])
    report = fr.update_weights_from_disk(model, ckpts["fp8", 1], filters[3])
    assert report.experts_reloaded == {1: [0, 2]}


def test_a_preset_is_cut_never_extended():
    assert fr.MoEConfig.preset("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="preset 'tiny' has 3 layers"):
        fr.MoEConfig.preset("tiny", num_layers=4)
    with pytest.raises(ValueError, match="preset 'v2-lite' has 27 layers"):
        fr.MoEConfig.from_spec("v2-lite:99999")
