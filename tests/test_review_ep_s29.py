"""Review s29 of the expert-parallel paths (helper 64's attack of session 28, on real gloo
ranks). Each case failed before its fix:

* `model.placement.table` edited in place on rank 0 (a frozen dataclass, a writable tensor):
  the vote passed on the cached fingerprint, the ranks planned different moves and waited
  for the group's timeout (20 s in the attack, 300 s by default), the group was dead after;
* a new placement edited after it was built (``new.table[0, 0] = 99``): rank 1 raised a bare
  ValueError outside any vote while rank 0 waited for it;
* a rank that never took part in the vote (gone, or stuck elsewhere) gave its peer a raw
  RuntimeError from torch.distributed instead of a RebalanceError;
* `model(x)` on an EP rank's share raised IndexError (a rebalanced single rank computed with
  other experts).

Review of those fixes (helper 65): `load_rank_model` loaded a share from an edited placement
whose dispatch tables were cached (tokens of expert 0 got expert 1's output, no error); edits
that keep the bytes (``unsqueeze_``, ``.data = t.view(torch.int32)``) passed the seal, and a
dtype change raised TypeError before the vote (the peer waited for the group's timeout); the
plain-forward guard let ``num_local_experts=4`` through, went stale when the slot map was
edited in place and reloaded, and took two experts in one slot for a valid map.
"""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
from fp8_reload.expert_parallel import Placement, load_rank_model

from .test_review_ep import _bounded
from .test_review_ep_s25 import SLOTS, E, _swap

LAYERS = (1, 2)


def test_an_edited_table_is_refused_before_anything_is_derived_from_it():
    p = Placement.round_robin(LAYERS, E, 2, SLOTS)
    fingerprint = p.fingerprint()
    p.table[:, [0, SLOTS]] = p.table[:, [SLOTS, 0]]
    with pytest.raises(ValueError, match="changed in place after it was built"):
        p.check_unedited()
    with pytest.raises(ValueError, match="changed in place"):
        p.derived("anything", lambda: 1)
    assert p.fingerprint() == fingerprint  # cached: what the ranks agreed on stays the same
    p.table[:, [0, SLOTS]] = p.table[:, [SLOTS, 0]]  # edited back: usable again
    p.check_unedited()
    assert p.derived("anything", lambda: 1) == 1


@pytest.mark.parametrize("edit", [
    lambda t: t.unsqueeze_(0), lambda t: t.resize_(t.numel()), lambda t: t.t_(),
    lambda t: setattr(t, "data", t.data.view(torch.int32)),
    lambda t: setattr(t, "data", t.data.to(torch.bfloat16))],
    ids=["unsqueeze_", "resize_", "t_", "view-int32", "bfloat16"])
def test_edits_that_keep_the_bytes_or_change_the_dtype_are_edits_too(edit):
    p = Placement.round_robin(LAYERS, E, 2, SLOTS)
    edit(p.table)
    with pytest.raises(ValueError, match="changed in place"):
        p.check_unedited()
    with pytest.raises(ValueError, match="changed in place"):
        p.local_slots(1, 0)  # every per-layer query reads `row`


def test_a_share_is_not_loaded_from_an_edited_placement(ckpts):
    p = Placement.round_robin(LAYERS, E, 2, SLOTS)
    p.derived("dispatch", lambda: "built from the table as it was")  # as an EP forward leaves it
    p.table[:, [0, 1]] = p.table[:, [1, 0]]
    with pytest.raises(ValueError, match="changed in place"):
        load_rank_model(ckpts["fp8", 0], p, 0)


def _edited_rank(rank, world, device, path, which):
    from datetime import timedelta

    import torch.distributed as dist

    from fp8_reload.expert_parallel import rebalance
    from fp8_reload.state import compare_states, snapshot

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    new = _swap(start) if rank == 0 else None
    if rank == 0 and which == "current":  # swap two ranks' slot 0 in the model's own placement
        model.placement.fingerprint()  # cached, as an EP forward or an earlier rebalance leaves it
        t = model.placement.table
        t[:, [0, SLOTS]] = t[:, [SLOTS, 0]]
    if rank == 0 and which == "new":
        new.table[0, 0] = 99
    try:
        rebalance(model, new, mode="p2p", group=group)
        outcome = "ok"
    except fr.ReloadError as e:
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "diffs": compare_states(before, snapshot(model), identity=True)}


@pytest.mark.parametrize("which, why", [
    ("current", "ranks disagree on the current placement"),
    ("new", "rank 0's new placement's table was changed in place")])
def test_a_placement_edited_in_place_is_refused_on_every_rank(ckpts, which, why):
    results = _bounded(_edited_rank, 2, str(ckpts["fp8", 0]), which, deadline=90)
    for rank, r in enumerate(results):
        assert "crashed" not in r, r["crashed"]
        assert r["outcome"].startswith("RebalanceError") and why in r["outcome"], (rank, r)
        assert "nothing was changed" in r["outcome"] and r["diffs"] == [], (rank, r)
    if which == "current":  # rank 0 says which placement was edited
        assert "model.placement" in results[0]["outcome"], results[0]


def _absent_rank(rank, world, device, path):
    from datetime import timedelta

    import torch.distributed as dist

    from fp8_reload.expert_parallel import rebalance
    from fp8_reload.state import compare_states, snapshot

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=4))
    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    outcome = "did not take part"
    if rank == 0:
        try:
            rebalance(model, _swap(start), mode="p2p", group=group)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 (the type is what is checked)
            outcome = f"{type(e).__name__}: {e}"
    dist.barrier()  # rank 1 stays in the group, away from the vote, until rank 0 gave up
    return {"outcome": outcome, "diffs": compare_states(before, snapshot(model), identity=True)}


def test_a_rank_absent_from_the_vote_gives_a_rebalance_error(ckpts):
    r = _bounded(_absent_rank, 2, str(ckpts["fp8", 0]), deadline=90)[0]
    assert r["outcome"].startswith("RebalanceError: the ranks could not agree"), r
    assert "nothing was changed" in r["outcome"] and r["diffs"] == [], r


def test_the_plain_forward_of_a_rank_model_is_refused_unless_slot_e_holds_expert_e(ckpts):
    """Helper 64: ``model(x)`` on an EP rank's share raised IndexError (slot ids past the
    share); a single rank whose slots were rebalanced would compute with other experts."""
    start = Placement.round_robin(LAYERS, E, 2, SLOTS)
    model = load_rank_model(ckpts["fp8", 0], start, 0, torch.device("cpu"))
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    with pytest.raises(ValueError, match="expert-parallel rank's slots.*ep_moe_forward"):
        model(x)
    alone = Placement.round_robin(LAYERS, E, 1, E + 1)  # one rank: slot e holds e, one spare
    torch.testing.assert_close(load_rank_model(ckpts["fp8", 0], alone, 0, torch.device("cpu"))(x),
                               fr.load_model(ckpts["fp8", 0], device="cpu")(x), rtol=0, atol=0)
    moved = Placement(LAYERS, E, 1, E + 1, alone.table[:, [1, 0, *range(2, E + 1)]])
    with pytest.raises(ValueError, match="slot e does not hold expert e"):
        load_rank_model(ckpts["fp8", 0], moved, 0, torch.device("cpu"))(x)


def test_the_plain_forward_guard_sees_partial_shares_shared_slots_and_edited_maps(ckpts):
    ck = ckpts["fp8", 0]
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="slot e does not hold expert e"):
        fr.load_model(ck, num_local_experts=4)(x)  # experts 4.. have no slot
    shared = {0: [0], 1: [1, 0], **{e: [e] for e in range(2, E)}}  # slot 0: expert 1, loaded last
    with pytest.raises(ValueError, match="slot e does not hold expert e"):
        fr.load_model(ck, expert_slots=shared)(x)
    model = fr.load_model(ck, expert_slots={e: [e] for e in range(E)})
    want = model(x)
    for _, layer in model.moe_layers():
        layer.expert_slots[0], layer.expert_slots[1] = [1], [0]  # the map edited in place...
    fr.update_weights_from_disk(model, ck)  # ...and the experts loaded by it
    with pytest.raises(ValueError, match="slot e does not hold expert e"):
        model(x)
    for _, layer in model.moe_layers():
        layer.expert_slots = {e: [e] for e in range(E)}
    fr.update_weights_from_disk(model, ck)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
