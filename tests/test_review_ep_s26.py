"""Review s26 of the expert-parallel paths (an attack on real gloo ranks). Each case failed
before its fix:

* a `Placement` kept the caller's table tensor: editing it afterwards (to build the next
  request) changed the placement a model held, under a stale fingerprint: wrong experts in the
  EP forward (calc_diff 0.25) and a next rebalance that hung;
* a rollback whose own restore failed left that rank half moved and unmarked, every rank
  reported "every rank rolled back", and the next rebalance shipped the wrong rows by P2P
  (now it is marked: rebalances and its EP forwards are refused until a full reload);
* (review of the fix) when the outcome vote failed on one rank only, its rollback vote met
  the peer's outcome vote: the peer committed while it rolled back; a device fault revealed
  by a `phase_times` wait left that rank half moved and its peer waiting;
* tokens of another width with the caller's routing killed the peer process in gloo; ranks
  running different layers computed garbage without an error;
* a MemoryError in one rank's planning, or an error while recording the exchange's bytes,
  left the peers waiting in a collective until the group's timeout;
* `load_rank_model` loaded a placement of 10 experts on an 8-expert checkpoint (two slots of
  uninitialised memory) and placements of other layers;
* `fp8-reload rebalance --no-check` printed "OK: every rank equals a fresh load" and wrote
  ``equals_fresh_load: false``; a truncated ``--checkpoint`` exited 1 from inside the ranks and
  one without an MoE layer with a torch error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

import fp8_reload as fr
from fp8_reload.expert_parallel import Placement, load_rank_model
from fp8_reload.tools import cli

from .test_review_ep import _bounded
from .test_review_ep_s25 import SLOTS, E, _swap

LAYERS = (1, 2)


def test_a_placement_keeps_its_own_table():
    start = Placement.round_robin(LAYERS, E, 2, SLOTS)
    t = start.table.clone()
    new = Placement(LAYERS, E, 2, SLOTS, t)
    kept, fingerprint = new.table.clone(), new.fingerprint()
    t[:, [0, 1]] = t[:, [1, 0]]  # the caller builds its next request from the same tensor
    assert torch.equal(new.table, kept)
    assert new.fingerprint() == fingerprint == Placement(LAYERS, E, 2, SLOTS, kept).fingerprint()


def _restore_fails_on_rank1(rank, world, device, path):
    import fp8_reload.expert_parallel.rows as rows
    from fp8_reload.expert_parallel import DispatchError, ep_moe_forward, rebalance
    from fp8_reload.state import compare_states, snapshot

    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    scatter = rows.RowMover.scatter
    if rank == 1:
        calls = []

        def failing(self, runs):  # the local copies land; the commit fails, then the restore
            calls.append(1)
            if len(calls) == 1:
                return scatter(self, runs)
            raise RuntimeError(f"planted scatter failure #{len(calls)}")
        rows.RowMover.scatter = failing
    outcome = []
    for _ in range(2):
        try:
            rebalance(model, _swap(start) if rank == 0 else None, mode="p2p")
            outcome.append("ok")
        except fr.ReloadError as e:
            outcome.append(str(e))
        rows.RowMover.scatter = scatter
    undefined = getattr(model, "weights_undefined", None)
    x = torch.randn(8, model.config.hidden_size).bfloat16()
    try:
        ep_moe_forward(model, 1, x)
        forward = "computed"
    except DispatchError as e:
        forward = str(e)
    unchanged = compare_states(before, snapshot(model)) == []
    if rank == 1:  # what the error says repairs it
        fr.update_weights_from_disk(model, path, None)
    rebalance(model, _swap(start) if rank == 0 else None, mode="p2p")
    fresh = load_rank_model(path, _swap(start), rank, device)
    return {"outcome": outcome, "undefined": undefined, "forward": forward,
            "unchanged": unchanged, "then": compare_states(snapshot(fresh), snapshot(model))}


def test_a_rank_that_cannot_roll_back_is_marked_and_named_until_a_full_reload(ckpts):
    results = _bounded(_restore_fails_on_rank1, 2, str(ckpts["fp8", 0]))
    for rank, r in enumerate(results):
        first, second = r["outcome"]
        assert "rank(s) [1] could not roll back: their weights are undefined" in first, r
        assert "ranks disagree" in second and "undefined weights" in second, r
        assert "rank(s) [1] cannot dispatch" in r["forward"], r
        assert (r["undefined"] is not None) == (rank == 1) and r["unchanged"] == (rank == 0), r
        assert r["then"] == [], r  # after rank 1's full reload the next rebalance is right
    assert "planted scatter failure #3" in results[1]["undefined"]


def _group_fails_at_the_outcome(rank, world, device, path):
    from datetime import timedelta

    import torch.distributed as dist

    from fp8_reload.expert_parallel import rebalance
    from fp8_reload.state import compare_states, snapshot

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=8))
    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    if rank == 1:  # its outcome vote fails before it reaches the peer (a broken communicator)
        vote, calls = rb.failed_ranks, []

        def failing(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("planted: the group failed")
            return vote(*args)
        rb.failed_ranks = failing
    try:
        rebalance(model, _swap(start) if rank == 0 else None, mode="p2p", group=group)
        outcome = "ok"
    except fr.ReloadError as e:
        outcome = str(e)
    return {"outcome": outcome, "old placement": model.placement == start,
            "diffs": compare_states(before, snapshot(model))}


def test_a_group_failing_at_the_outcome_vote_rolls_every_rank_back_on_its_own(ckpts):
    for r in _bounded(_group_fails_at_the_outcome, 2, str(ckpts["fp8", 0]), deadline=120):
        assert "(the ranks could not vote on its outcome); this rank rolled back" in r["outcome"], r
        assert "the others' outcome is unknown" in r["outcome"], r
        assert r["old placement"] and r["diffs"] == [], r


def _device_fault_in_a_timed_phase(rank, world, device, path):
    from fp8_reload.expert_parallel import rebalance
    from fp8_reload.state import compare_states, snapshot

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]
    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    if rank == 1:  # the device wait after the exchange reveals a fault, on this rank only
        mark, wait = rb._Timer.mark, rb.synchronize

        def fault(*args):
            raise RuntimeError("planted device fault")

        def marked(self, name, t0, sync=True):
            rb.synchronize = fault if name == "exchange" and sync else wait
            try:
                return mark(self, name, t0, sync)
            finally:
                rb.synchronize = wait
        rb._Timer.mark = marked
    try:
        rebalance(model, _swap(start) if rank == 0 else None, mode="p2p", phase_times=True)
        outcome = "ok"
    except fr.ReloadError as e:
        outcome = str(e)
    return {"outcome": outcome, "diffs": compare_states(before, snapshot(model))}


def test_a_device_fault_in_a_timed_phase_fails_every_rank_together(ckpts):
    for r in _bounded(_device_fault_in_a_timed_phase, 2, str(ckpts["fp8", 0])):
        assert "failed on rank(s) [1]; every rank rolled back" in r["outcome"], r
        assert r["diffs"] == [], r


def _hostile_forwards(rank, world, device, path):
    from fp8_reload.expert_parallel import DispatchError, ep_moe_forward

    model = load_rank_model(path, Placement.round_robin(LAYERS, E, world, SLOTS), rank, device)
    hidden = model.config.hidden_size
    routing = (torch.full((16, 2), 0.5), torch.zeros(16, 2, dtype=torch.long))
    cases = {"width": (1, torch.randn(16, hidden + 8 * rank).bfloat16(), routing),
             "layer": (1 + rank, torch.randn(16, hidden).bfloat16(), None),
             "model": (1, torch.randn(16, hidden + 8 * rank).bfloat16(), routing)}
    out = {}
    for name, (layer, x, how) in cases.items():
        if name == "model" and rank == 1:  # a rank holding another model of the same placement
            model.config = dataclasses.replace(model.config, hidden_size=hidden + 8)
        try:
            ep_moe_forward(model, layer, x, how)
            out[name] = "computed"
        except DispatchError as e:
            out[name] = str(e)
    return out


def test_the_ep_forward_refuses_another_width_or_layer_on_every_rank(ckpts):
    for r in _bounded(_hostile_forwards, 2, str(ckpts["fp8", 0])):
        assert "rank(s) [1] cannot dispatch" in r["width"], r
        assert "the ranks run different layers ([1, 2] by rank)" in r["layer"], r
        assert "the ranks run different hidden sizes" in r["model"], r


def _fails_before_the_commit(rank, world, device, path):
    from fp8_reload.expert_parallel import rebalance
    from fp8_reload.state import compare_states, snapshot

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]
    start = Placement.round_robin(LAYERS, E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    plan, payload = rb.RebalancePlan.for_rank, rb.Moves.payload

    def out_of_memory(*args):
        raise MemoryError("planted in planning")

    def broken(*args):
        raise RuntimeError("planted in the exchange's byte count")
    out = {}
    for name, target, attr, planted in (("plan", rb.RebalancePlan, "for_rank", out_of_memory),
                                        ("payload", rb.Moves, "payload", broken)):
        if rank == 1:
            setattr(target, attr, planted)
        try:
            rebalance(model, _swap(start) if rank == 0 else None, mode="p2p")
            out[name] = "ok"
        except fr.ReloadError as e:
            out[name] = str(e)
        rb.RebalancePlan.for_rank, rb.Moves.payload = plan, payload
        out[name + " diffs"] = compare_states(before, snapshot(model))
    return out


def test_a_failure_before_the_commit_on_one_rank_fails_every_rank_without_waiting(ckpts):
    results = _bounded(_fails_before_the_commit, 2, str(ckpts["fp8", 0]), deadline=120)
    for r in results:
        assert "failed on rank(s) [1] while laying out its buffers; nothing was changed" in r["plan"], r
        assert "failed on rank(s) [1]; every rank rolled back" in r["payload"], r
        assert r["plan diffs"] == r["payload diffs"] == [], r


@pytest.mark.parametrize("change", [dict(num_experts=10), dict(num_experts=6), dict(layers=(1,)),
                                    dict(layers=(1, 2, 5))])
def test_load_rank_model_refuses_a_placement_of_other_experts_or_layers(ckpts, change):
    layers, experts = change.get("layers", LAYERS), change.get("num_experts", E)
    placement = Placement.round_robin(layers, experts, 2, max(SLOTS, experts))
    with pytest.raises(ValueError, match=r"the checkpoint has 8 experts in MoE layers \[1, 2\]"):
        load_rank_model(ckpts["fp8", 0], placement, 0)


def test_load_rank_model_opens_the_checkpoint_once(ckpts, monkeypatch):
    """(s27) the placement check and the load share one parse of the index and config."""
    from fp8_reload.checkpoint import Checkpoint

    opened = []
    real_init = Checkpoint.__init__
    monkeypatch.setattr(Checkpoint, "__init__", lambda self, *a, **k: opened.append(a)
                        or real_init(self, *a, **k))
    placement = Placement.round_robin(LAYERS, E, 2, SLOTS)
    model = load_rank_model(ckpts["fp8", 0], placement, 1)
    assert len(opened) == 1, opened
    fresh = fr.load_model(ckpts["fp8", 0], **placement.model_kwargs(1))
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []


def test_rebalance_without_checks_says_so(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["rebalance", "--world-size", "1", "--no-check", "--json", str(out)]) == 0
    assert "NOT CHECKED (--no-check)" in capsys.readouterr().out
    assert [r["equals_fresh_load"] for r in json.loads(out.read_text())] == [None]


def _truncated(src, dst):
    shutil.copytree(src, dst)
    shard = max(dst.glob("*.safetensors"), key=os.path.getsize)
    os.truncate(shard, os.path.getsize(shard) - 100)
    return dst


def test_rebalance_refuses_a_broken_or_dense_checkpoint_in_one_line(ckpts, tmp_path, capsys):
    dense = fr.write_checkpoint(tmp_path / "dense", fr.MoEConfig.preset("tiny", num_layers=1))
    for path, why in ((_truncated(ckpts["fp8", 0], tmp_path / "cut"), "truncated"),
                      (dense, "the model has no MoE layer")):
        assert cli.main(["rebalance", "--checkpoint", str(path)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]
        assert len(err) == 1 and why in err[0], err
