"""Adversarial review (ep) of the expert-parallel rebalance on real gloo ranks.

Every multi-process case runs under `_bounded`: its own spawned ranks, a deadline after
which they are killed, so a hang fails the test (naming the ranks still running) instead
of blocking. Each rank returns its error and its differences from its state before
(refusals) or from a fresh load under the placement it ends at.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fp8_reload.expert_parallel import Placement, RebalanceError, load_rank_model, rebalance
from fp8_reload.expert_parallel.group import free_port, init_rank, share_cpu
from fp8_reload.state import compare_states, snapshot

LAYERS = (1, 2)
E = 8
DEADLINE_S = 90


def _entry(rank, world, port, fn, args, out_dir):
    share_cpu("gloo", world)
    device = init_rank("gloo", rank, world, f"tcp://127.0.0.1:{port}", timeout_s=600)
    try:
        result = fn(rank, world, device, *args)
    except BaseException:  # noqa: BLE001
        result = {"crashed": traceback.format_exc()[-2000:]}
    tmp = Path(out_dir) / f"rank{rank}.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(Path(out_dir) / f"rank{rank}.json")
    # Stay alive, as an engine's rank would, until every rank has answered: a rank that
    # left early would let a peer stuck in a collective fail on the closed connection.
    # No destroy_process_group: a peer may be stuck; the parent reaps us.
    while not all((Path(out_dir) / f"rank{r}.json").exists() for r in range(world)):
        time.sleep(0.2)


def _bounded(fn, world, *args, deadline=DEADLINE_S):
    """``fn(rank, world, device, *args)`` on `world` spawned gloo ranks; results by rank.
    Fails (after killing the ranks) if any rank has not finished within `deadline`."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        def running():
            return [r for r, p in enumerate(procs)
                    if p.is_alive() and not (Path(out) / f"rank{r}.json").exists()]
        while running() and time.monotonic() < end:
            time.sleep(0.2)
        hung = running()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        assert not hung, f"rank(s) {hung} hung (no result within {deadline} s)"
        results = []
        for r in range(world):
            f = Path(out) / f"rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else
                           {"crashed": f"rank {r} exited {procs[r].exitcode} without a result"})
        return results


def _start(world=2, slots=5):
    return Placement.round_robin(LAYERS, E, world, slots)


def _moved(start):
    """A new placement of `start`'s layout: every rank's experts rotated by one rank."""
    s, w = start.slots_per_rank, start.ep_size
    table = start.table.view(len(LAYERS), w, s).roll(1, dims=1).reshape(len(LAYERS), -1)
    return Placement(LAYERS, E, w, s, table)


def _outcome(model, before, ckpt, rank, err):
    fresh = load_rank_model(ckpt, model.placement, rank)
    return {"error": err,
            "unchanged": compare_states(before, snapshot(model), identity=True),
            "fresh_diffs": compare_states(snapshot(model), snapshot(fresh)),
            "placement": model.placement.table.tolist()}


def _try_rebalance(rank, world, device, ckpt, start, new_by_rank, kw_by_rank, prep=None):
    model = load_rank_model(ckpt, start, rank, device)
    before = snapshot(model)
    if prep is not None:
        prep(model, rank)
    try:
        rebalance(model, new_by_rank.get(rank), **kw_by_rank.get(rank, {}))
        err = None
    except RebalanceError as e:
        err = f"RebalanceError: {e}"
    except Exception as e:  # noqa: BLE001  (not the promised error type)
        err = f"OTHER {type(e).__name__}: {e}"
    if model.__dict__.get("placement") is None:
        model.placement = start
    return _outcome(model, before, ckpt, rank, err)


def _assert_refused_everywhere(results, why):
    for rank, res in enumerate(results):
        assert "crashed" not in res, res["crashed"]
        assert res["error"] and res["error"].startswith("RebalanceError"), \
            f"rank {rank}: {res['error']}"
        assert why in res["error"], f"rank {rank}: {res['error']}"
        assert "nothing was changed" in res["error"], f"rank {rank}: {res['error']}"
        assert not res["unchanged"], f"rank {rank} changed: {res['unchanged'][:3]}"


# --------------------------------------------------------------------------
# Requests rank 0 cannot make: refused on every rank, none waits for a peer
# --------------------------------------------------------------------------

@pytest.mark.parametrize("exclude", [(2,), (-1,), (5, 0)])
def test_exclusions_out_of_range_are_refused_on_every_rank(ckpts, exclude):
    """Before: rank 0 silently dropped exclusions outside [0, world) and went on moving."""
    start = _start()
    res = _bounded(_try_rebalance, 2, str(ckpts["fp8", 0]), start, {0: _moved(start)},
                   {0: {"mode": "hybrid", "exclude_sources": exclude}})
    _assert_refused_everywhere(res, "exclude")


@pytest.mark.parametrize("case", ["table", "exclude-str", "mode-unhashable"])
def test_malformed_request_on_rank_0_fails_every_rank_without_hanging(ckpts, case):
    """Before: rank 0 raised between the placement vote and the broadcast (a plain list
    as `new`, a non-integer exclusion...) and rank 1 waited in the broadcast forever."""
    start = _start()
    new, kw = _moved(start), {"mode": "p2p"}
    if case == "table":
        new = new.table.tolist()
    elif case == "exclude-str":
        kw = {"mode": "hybrid", "exclude_sources": ("1",)}
    else:
        kw = {"mode": ["p2p"]}
    res = _bounded(_try_rebalance, 2, str(ckpts["fp8", 0]), start, {0: new}, {0: kw})
    _assert_refused_everywhere(res, "rank 0")


def _drop_placement(model, rank):
    if rank == 1:
        model.placement = None


def test_a_rank_without_placement_fails_every_rank_without_hanging(ckpts):
    """Before: the rank with no placement raised before the first collective, its peers
    waited in the placement vote forever."""
    start = _start()
    res = _bounded(_try_rebalance, 2, str(ckpts["fp8", 0]), start, {0: _moved(start)}, {},
                   _drop_placement)
    _assert_refused_everywhere(res, "placement")


def test_a_rank_passing_another_new_placement_is_refused(ckpts):
    """Rank 1 asks for a different placement than rank 0: before, it silently ended at
    rank 0's placement, not the one it asked for."""
    start = _start()
    other = Placement(LAYERS, E, 2, 5, start.table.flip(1))
    res = _bounded(_try_rebalance, 2, str(ckpts["fp8", 0]), start,
                   {0: _moved(start), 1: other}, {})
    _assert_refused_everywhere(res, "new placement")


def test_ranks_passing_the_same_new_placement_move(ckpts):
    start = _start()
    new = _moved(start)
    res = _bounded(_try_rebalance, 2, str(ckpts["fp8", 0]), start, {0: new, 1: new}, {})
    for r in res:
        assert "crashed" not in r, r["crashed"]
        assert r["error"] is None and not r["fresh_diffs"] and r["placement"] == new.table.tolist()


# --------------------------------------------------------------------------
# A rank dying mid-rebalance: the survivor rolls back and returns
# --------------------------------------------------------------------------

def _die_in_commit(model, rank):
    if rank == 1:
        rb = sys.modules["fp8_reload.expert_parallel.rebalance"]

        def die(*a, **k):
            os._exit(17)
        rb.write_slots = die


def test_a_rank_killed_in_the_commit_leaves_the_survivor_rolled_back(ckpts):
    start = _start()
    ckpt = str(ckpts["fp8", 0])
    res = _bounded(_try_rebalance, 2, ckpt, start, {0: _moved(start)}, {}, _die_in_commit)
    r0 = res[0]
    assert "crashed" not in r0, r0["crashed"]
    assert r0["error"] and r0["error"].startswith("RebalanceError") and "rolled back" in r0["error"]
    assert not r0["unchanged"], r0["unchanged"][:3]


# --------------------------------------------------------------------------
# World 4: minimum slots, replicas, chains of moves
# --------------------------------------------------------------------------

def _chain(rank, world, device, ckpt, placements, modes):
    model = load_rank_model(ckpt, placements[0], rank, device)
    out = []
    for new, mode in zip(placements[1:], modes):
        try:
            rebalance(model, new if rank == 0 else None, mode=mode,
                      exclude_sources=(3,) if mode == "hybrid" else ())
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        fresh = load_rank_model(ckpt, model.placement, rank, device)
        out.append({"error": err, "at_new": model.placement == new,
                    "fresh_diffs": compare_states(snapshot(model), snapshot(fresh))})
    return out


def test_four_ranks_minimum_slots_and_replicas_equal_fresh_load(ckpts):
    g = torch.Generator().manual_seed(7)
    tight = [Placement(LAYERS, E, 4, 2, torch.stack([torch.randperm(E, generator=g)
                                                      for _ in LAYERS])) for _ in range(2)]
    rows = []
    for _ in LAYERS:  # 4 x 3 slots: every expert once, 4 replicas, some twice on one rank
        extra = torch.tensor([0, 0, 5, 5])
        rows.append(torch.cat([torch.arange(E), extra])[torch.randperm(12, generator=g)])
    wide = [Placement(LAYERS, E, 4, 3, torch.stack(rows))]
    wide.append(Placement(LAYERS, E, 4, 3, wide[0].table.flip(1)))
    for kind, chain, modes in (("fp8", tight, ["p2p"]), ("bf16", tight, ["hybrid"]),
                               ("fp8", [Placement.round_robin(LAYERS, E, 4, 3)] + wide,
                                ["p2p", "hybrid"])):
        res = _bounded(_chain, 4, str(ckpts[kind, 0]), chain, modes, deadline=150)
        for rank, steps in enumerate(res):
            assert not isinstance(steps, dict), steps.get("crashed")
            for i, s in enumerate(steps):
                assert s["error"] is None and s["at_new"], (kind, rank, i, s["error"])
                assert not s["fresh_diffs"], (kind, rank, i, s["fresh_diffs"][:3])


# --------------------------------------------------------------------------
# Forward: every token to one expert, a rank without tokens, world 4 at minimum slots
# --------------------------------------------------------------------------

def _hot_forward(rank, world, device, ckpt, placement):
    import fp8_reload as fr
    from fp8_reload.expert_parallel import ep_moe_forward
    from fp8_reload.kernels import CROSS_SCHEME_BOUND

    full = fr.load_model(ckpt)
    model = load_rank_model(ckpt, placement, rank, device)
    k = full.config.top_k
    n = 0 if rank == 1 else 16 + rank
    x = torch.randn(n, full.config.hidden_size, generator=torch.Generator().manual_seed(rank)
                    ).to(torch.bfloat16)
    out = []
    for layer in LAYERS:
        ids = torch.stack([torch.full((n,), 3)] + [torch.full((n,), 3 + j) for j in range(1, k)], 1)
        w = torch.full((n, k), 1.0 / k)
        y = ep_moe_forward(model, layer, x, (w, ids))
        if n:
            ref = full.model.layers[layer].mlp(x, routing=(w, ids))
            out.append(fr.calc_diff(y, ref) <= CROSS_SCHEME_BOUND and y.shape == x.shape)
        else:
            out.append(y.shape == x.shape)
    return out


def test_four_ranks_all_tokens_to_one_expert_and_a_rank_without_tokens(ckpts):
    placement = Placement(LAYERS, E, 4, 2, torch.arange(E).flip(0).repeat(len(LAYERS), 1))
    res = _bounded(_hot_forward, 4, str(ckpts["fp8", 0]), placement, deadline=150)
    for rank, r in enumerate(res):
        assert not isinstance(r, dict), r.get("crashed")
        assert all(r), (rank, r)
