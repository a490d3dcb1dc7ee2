"""The rebalance's fast path: `Transfer` layouts (what staging packs, where commit writes,
what a rollback restores from) and a failure inside the commit, on 2 and 4 gloo ranks."""

from __future__ import annotations

import importlib

import pytest
import torch

from fp8_reload.expert_parallel import (
    Placement,
    RebalanceError,
    RebalancePlan,
    load_rank_model,
    moe_layer_map,
    move_experts,
    pack_slots,
    rebalance,
    row_bytes,
    run_ranks,
)
from fp8_reload.expert_parallel.transfer import Transfer
from fp8_reload.state import compare_states, snapshot
from fp8_reload.tools.rebalance import param_ids

from .test_rebalance import LAYERS, E, _hand_placement

rb = importlib.import_module("fp8_reload.expert_parallel.rebalance")  # the package exports the function


def _models(ckpt, placement):
    return [load_rank_model(ckpt, placement, r) for r in range(placement.ep_size)]


def _layouts(models, plan):
    out = []
    for r, model in enumerate(models):
        by_index = [moe_layer_map(model)[lid] for lid in plan.old.layers]
        out.append((by_index, Transfer(plan.ranks[r], [row_bytes(x) for x in by_index],
                                       plan.old.num_experts, "cpu")))
    return out


def _pack(by_index, moves, spec):
    buf = torch.empty(spec[0], dtype=torch.uint8)
    return rb._pack(by_index, moves, spec[1], buf)


@pytest.mark.parametrize("moves", ["hand", "swaps"])
def test_transfer_stages_exactly_the_planned_rows(ckpts, moves):
    """Each send buffer holds, in plan order, the packed rows of the slots the plan sends;
    a commit from those buffers (handed over in process) equals a fresh load under the new
    placement, and a restore from the sent rows plus the backup gives back the old bytes."""
    start, new = _hand_placement()
    if moves == "swaps":
        start = Placement.round_robin(LAYERS, E, ep_size=2, slots_per_rank=5)
        new = move_experts(start, per_layer=3, seed=1)
    plan = RebalancePlan.build(start, new, "p2p")
    models = _models(ckpts["fp8", 0], start)
    before = [snapshot(m) for m in models]
    ids = [param_ids(m) for m in models]
    lay = _layouts(models, plan)
    sent, saved = [], []
    for r, (by_index, mv) in enumerate(lay):
        bufs = {p: _pack(by_index, mv, spec) for p, spec in mv.sends.items()}
        for peer, items in plan.ranks[r].sends.items():  # the plan's (layer, slot) order
            runs = mv.sends[peer][1]
            assert [by_index[run.li].layer_id for run in runs] == sorted({lid for lid, _ in items})
            for run in runs:
                lid = by_index[run.li].layer_id
                want = pack_slots(by_index[run.li], [slot for x, slot in items if x == lid])
                got = bufs[peer][run.offset:run.offset + run.nbytes]
                assert torch.equal(got, want), f"rank {r} -> {peer}, layer {lid}"
            assert bufs[peer].numel() == sum(run.nbytes for run in runs)
        sent.append(bufs)
        saved.append((_pack(by_index, mv, mv.backup), _pack(by_index, mv, mv.local)))
    for r, (by_index, mv) in enumerate(lay):
        recv = {p: sent[p][r] for p in mv.recvs}
        for li in mv.changed_layers:
            by_index[li].expert_slots = new.local_slots(by_index[li].layer_id, r)
        rb._scatter(by_index, mv, mv.scatters, {**recv, r: saved[r][1]})
        rb._refresh(models[r], by_index, mv)
        models[r].placement = new
    for r, m in enumerate(models):
        fresh = load_rank_model(ckpts["fp8", 0], new, r)
        assert not compare_states(snapshot(m), snapshot(fresh)), f"rank {r}"
    for r, (by_index, mv) in enumerate(lay):
        rb._restore(models[r], by_index, mv, sent[r], saved[r][0], start, r)
        assert not compare_states(before[r], snapshot(models[r]), identity=True), f"rank {r}"
        assert param_ids(models[r]) == ids[r]
    if moves == "swaps":  # every changed slot sent its old expert away: nothing else is copied
        assert all(mv.backup[0] == 0 and mv.restores for _, mv in lay)


def _fail_in_commit_rank(rank, world, device, ckpt, start, new, victim):
    model = load_rank_model(ckpt, start, rank, device)
    before, ids = snapshot(model), param_ids(model)
    real = rb._refresh

    calls = []

    def refresh(*args):  # after every row was written, the commit (not the restore) fails
        real(*args)
        calls.append(1)
        if rank == victim and len(calls) == 1:
            raise RuntimeError("injected commit failure")

    rb._refresh = refresh
    try:
        rebalance(model, new if rank == 0 else None, mode="p2p")
        error = None
    except RebalanceError as e:
        error = str(e)
    finally:
        rb._refresh = real
    out = {"error": error, "unchanged": compare_states(before, snapshot(model), identity=True),
           "ids": param_ids(model) == ids, "at_old": model.placement == start}
    rebalance(model, new if rank == 0 else None, mode="p2p")  # the next one succeeds
    fresh = load_rank_model(ckpt, new, rank, device)
    out["then"] = compare_states(snapshot(model), snapshot(fresh))
    return out


@pytest.mark.parametrize("world, victim", [(2, 1), (2, 0), (4, 2)])
def test_a_failure_in_commit_rolls_every_rank_back_bit_identical(ckpts, world, victim):
    start = Placement.round_robin(LAYERS, E, ep_size=world, slots_per_rank=-(-E // world) + 1)
    new = move_experts(start, per_layer=2, seed=3)
    results = run_ranks(_fail_in_commit_rank, world, "gloo", str(ckpts["fp8", 0]), start, new,
                        victim)
    for rank, res in enumerate(results):
        assert res["error"] and f"rank(s) [{victim}]" in res["error"], res
        assert not res["unchanged"], f"rank {rank}: {res['unchanged'][:3]}"
        assert res["ids"] and res["at_old"]
        assert not res["then"], f"rank {rank} after the retry: {res['then'][:3]}"
