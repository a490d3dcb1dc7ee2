"""Expert-parallel rebalance on real gloo process groups (2 and 4 CPU ranks).

The invariant, checked on every rank after every rebalance: the rank's full
state equals a fresh load of that rank under the new placement, bit for bit,
with the same Parameter objects. A failure on one rank rolls every rank back.

Each world size runs all its scenarios in one set of spawned processes (process
start-up dominates the cost on CPU).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_reload.expert_parallel import (
    MODES,
    Placement,
    RebalanceError,
    RebalancePlan,
    balance_placement,
    load_rank_model,
    moe_layer_map,
    move_experts,
    pack_slots,
    rebalance,
    row_bytes,
    run_ranks,
    slot_tensors,
    synthetic_load,
    write_slots,
)
from fp8_reload.state import compare_states, snapshot
from fp8_reload.tools.cli import main
from fp8_reload.tools.rebalance import param_ids

from .conftest import copy_checkpoint, rewrite_tensor

LAYERS = (1, 2)  # the tiny preset's MoE layers
E = 8


# --------------------------------------------------------------------------
# The plan (pure)
# --------------------------------------------------------------------------

def _hand_placement():
    """2 ranks x 5 slots; layer 1 exercises every kind of move, layer 2 does not change."""
    start = Placement.round_robin(LAYERS, E, ep_size=2, slots_per_rank=5)
    # start, both layers: r0 [0, 1, 2, 3, 4], r1 [5, 6, 7, 0, 1]
    new = Placement.from_rank_slots(E, {
        1: [[1, 0, 5, 5, 4],     # swap 0/1 in place (local), expert 5 from r1 into two slots
            [5, 6, 7, 2, 3]],    # 2 and 3 leave r0 for r1
        2: [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]],
    })
    return start, new


def test_plan_sources_and_pairing():
    start, new = _hand_placement()
    plan = RebalancePlan.build(start, new, "p2p")
    r0, r1 = plan.ranks
    assert r0.changed == {1: {0: 1, 1: 0, 2: 5, 3: 5}} and r1.changed == {1: {3: 2, 4: 3}}
    assert {e: (f.source, f.src_rank, f.src_slot) for e, f in r0.fetch[1].items()} == {
        0: ("local", 0, 0), 1: ("local", 0, 1), 5: ("peer", 1, 0)}  # 5 fetched once for 2 slots
    assert {e: (f.source, f.src_rank, f.src_slot) for e, f in r1.fetch[1].items()} == {
        2: ("peer", 0, 2), 3: ("peer", 0, 3)}
    assert r0.sends == {1: [(1, 2), (1, 3)]} and r1.recvs == {0: [(1, 2), (1, 3)]}
    assert r1.sends == {0: [(1, 0)]} and r0.recvs == {1: [(1, 5)]}

    disk = RebalancePlan.build(start, new, "disk")
    assert disk.ranks[0].disk_experts() == {1: [5]} and disk.ranks[1].disk_experts() == {1: [2, 3]}
    assert disk.ranks[0].count("local") == 2 and not disk.ranks[0].sends

    hybrid = RebalancePlan.build(start, new, "hybrid", exclude_sources=[1])
    assert hybrid.ranks[0].disk_experts() == {1: [5]}  # only rank 1 holds 5, and it may not serve
    assert hybrid.ranks[1].count("peer") == 2
    with pytest.raises(ValueError, match="held only by excluded ranks"):
        RebalancePlan.build(start, new, "p2p", exclude_sources=[1])
    with pytest.raises(ValueError, match="unknown rebalance mode"):
        RebalancePlan.build(start, new, "rdma")


def test_plan_spreads_sending_over_replica_holders():
    start = Placement.from_rank_slots(4, {1: [[0, 1], [0, 2], [0, 3], [1, 2]]})
    new = Placement.from_rank_slots(4, {1: [[0, 1], [0, 2], [0, 3], [0, 3]]})  # r3 needs 0 and 3
    plan = RebalancePlan.build(start, new, "p2p")
    sources = {e: f.src_rank for e, f in plan.ranks[3].fetch[1].items()}
    assert sources == {0: 0, 3: 2}
    new2 = Placement.from_rank_slots(4, {1: [[0, 1], [0, 2], [0, 3], [0, 0]]})
    plan2 = RebalancePlan.build(start, new2, "p2p")
    assert [f.src_rank for f in plan2.ranks[3].fetch[1].values()] == [0]


def _reference_plan(old, new, mode, excluded):
    """The plan by its definition, one layer, rank and expert at a time: the oracle the
    vectorized `RebalancePlan.build` must reproduce exactly."""
    s = old.slots_per_rank
    out = {r: ({}, {}, {}, {}) for r in range(old.ep_size)}  # changed, fetch, sends, recvs
    served = [0] * old.ep_size
    for layer in old.layers:
        holders = old.logical_to_physical(layer)
        for dst in range(old.ep_size):
            before, after = old.rank_experts(layer, dst), new.rank_experts(layer, dst)
            changed = {k: e for k, (a, e) in enumerate(zip(before, after)) if a != e}
            if not changed:
                continue
            out[dst][0][layer] = changed
            for e in sorted(set(changed.values())):
                peers = sorted({p // s for p in holders[e]} - {dst} - set(excluded))
                if e in before:
                    f = ("local", dst, before.index(e))
                elif mode == "disk" or (mode == "hybrid" and not peers):
                    f = ("disk", -1, -1)
                elif not peers:
                    raise ValueError("held only by excluded ranks")
                else:
                    src = min(peers, key=lambda r: (served[r], r))
                    f = ("peer", src, next(p % s for p in holders[e] if p // s == src))
                    served[src] += 1
                    out[src][2].setdefault(dst, []).append((layer, f[2]))
                    out[dst][3].setdefault(src, []).append((layer, e))
                out[dst][1].setdefault(layer, {})[e] = f
    return out


def _random_placement(draw, layers, experts, ranks, slots):
    rows = []
    for _ in layers:
        extra = draw(st.lists(st.integers(0, experts - 1), min_size=ranks * slots - experts,
                              max_size=ranks * slots - experts))
        rows.append(draw(st.permutations(list(range(experts)) + extra)))
    return Placement(layers, experts, ranks, slots, torch.tensor(rows))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), experts=st.integers(2, 9), ranks=st.integers(1, 4),
       spare=st.integers(0, 2), n_layers=st.integers(1, 3), mode=st.sampled_from(MODES))
def test_vectorized_plan_equals_the_definition(data, experts, ranks, spare, n_layers, mode):
    slots = -(-experts // ranks) + spare
    layers = tuple(range(1, n_layers + 1))
    old = _random_placement(data.draw, layers, experts, ranks, slots)
    new = _random_placement(data.draw, layers, experts, ranks, slots)
    excluded = data.draw(st.sets(st.integers(0, ranks - 1), max_size=ranks - 1))
    try:
        want = _reference_plan(old, new, mode, excluded)
    except ValueError:
        with pytest.raises(ValueError, match="held only by excluded ranks"):
            RebalancePlan.build(old, new, mode, excluded)
        return
    plan = RebalancePlan.build(old, new, mode, excluded)
    for r, p in enumerate(plan.ranks):
        fetch = {lid: {e: (f.source, f.src_rank, f.src_slot) for e, f in per.items()}
                 for lid, per in p.fetch.items()}
        assert (p.changed, fetch, p.sends, p.recvs) == want[r]
        mine = RebalancePlan.for_rank(old, new, mode, excluded, r)  # what a rebalance makes
        assert (mine.changed, mine.fetch, mine.sends, mine.recvs) == (p.changed, p.fetch, p.sends,
                                                                      p.recvs)


def test_pack_write_round_trip_keeps_parameters(ckpts):
    start, _ = _hand_placement()
    model = load_rank_model(ckpts["fp8", 0], start, rank=0)
    layer = moe_layer_map(model)[1]
    ids = param_ids(model)
    packed = pack_slots(layer, [4, 0])
    write_slots(layer, [1, 2], packed)
    for t in slot_tensors(layer):
        b = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        assert torch.equal(b[1], b[4]) and torch.equal(b[2], b[0])
    write_slots(layer, [3, 2, 1], packed, rows=[1, 0, 0])  # one packed expert, several slots
    for t in slot_tensors(layer):
        b = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        assert torch.equal(b[3], b[0]) and torch.equal(b[2], b[4]) and torch.equal(b[1], b[4])
    assert param_ids(model) == ids


@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8])
def test_pack_writes_into_the_given_buffer_at_any_offset(ckpts, offset):
    """Staging packs straight into the send buffer (no intermediate copy, whatever the
    buffer's alignment), tensor-major, and unpacking from there restores the slots."""
    start, _ = _hand_placement()
    layer = moe_layer_map(load_rank_model(ckpts["fp8", 0], start, rank=0))[1]
    width = row_bytes(layer)
    buf = torch.zeros(offset + 2 * width, dtype=torch.uint8)
    view = buf[offset:]
    assert pack_slots(layer, [3, 1], out=view).data_ptr() == view.data_ptr()
    assert not buf[:offset].any()
    w13 = layer.w13_weight.data.view(torch.uint8).reshape(layer.w13_weight.shape[0], -1)
    assert torch.equal(view[:2 * w13.shape[1]].view(2, -1), w13[[3, 1]])
    assert torch.equal(view, pack_slots(layer, [3, 1]))
    expect = [t[[3, 1]].clone() for t in slot_tensors(layer)]
    write_slots(layer, [0, 4], view)
    for t, want in zip(slot_tensors(layer), expect):
        assert torch.equal(t[[0, 4]].view(torch.uint8), want.view(torch.uint8))


# --------------------------------------------------------------------------
# Distributed scenarios
# --------------------------------------------------------------------------

@dataclass
class Step:
    new: Placement
    mode: str
    exclude: tuple = ()
    checkpoint: str | None = None  # default: the one the model was loaded from


@dataclass
class Scenario:
    name: str
    kind: str
    start: Placement
    steps: list = field(default_factory=list)
    share_of: dict | None = None  # {rank: rank whose share it loads} to provoke disagreement


def _scenario_rank(rank, world, device, scenarios, ckpts):
    out = {}
    for sc in scenarios:
        share = (sc.share_of or {}).get(rank, rank)
        model = load_rank_model(ckpts[sc.kind], sc.start, share, device)
        for i, step in enumerate(sc.steps):
            before, ids = snapshot(model), param_ids(model)
            res = {"error": None}
            try:
                rep = rebalance(model, step.new if rank == 0 else None, mode=step.mode,
                                exclude_sources=step.exclude, checkpoint=step.checkpoint)
                res.update(local=rep.experts_local, p2p=rep.experts_p2p, disk=rep.experts_disk,
                           sent=rep.bytes_sent, received=rep.bytes_received)
            except RebalanceError as e:
                res["error"] = str(e)
                res["unchanged"] = compare_states(before, snapshot(model), identity=True)
            fresh = load_rank_model(ckpts[sc.kind], model.placement, share, device)
            res["diffs"] = compare_states(snapshot(model), snapshot(fresh))
            res["identity_kept"] = param_ids(model) == ids
            res["at_new"] = model.placement == step.new
            out[sc.name, i] = res
    return out


def _run(world, scenarios, ckpts):
    per_rank = run_ranks(_scenario_rank, world, "gloo", scenarios,
                         {k: str(v) for k, v in ckpts.items()})
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def _assert_equals_fresh(results, name, step=0):
    for rank, res in enumerate(results[name, step]):
        assert res["error"] is None, f"{name} rank {rank}: {res['error']}"
        assert res["at_new"], f"{name} rank {rank}: placement not updated"
        assert not res["diffs"], f"{name} rank {rank} differs from a fresh load: {res['diffs'][:3]}"
        assert res["identity_kept"], f"{name} rank {rank}: Parameters replaced"


def _skewed(start, seed=0):
    return balance_placement(synthetic_load(start.layers, E, seed=seed, alpha=1.5), start)


@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory):
    ck = {"fp8": ckpts["fp8", 0], "bf16": ckpts["bf16", 0]}
    start, hand = _hand_placement()
    skewed = _skewed(start)
    assert start.moved_slots(skewed) > 0
    # A checkpoint whose copy of an expert rank 1 must read from disk is corrupt
    # (NaN input scale): rank 1 fails after rank 0 already committed its part.
    plan = RebalancePlan.build(start, hand, "disk")
    victim = plan.ranks[1].disk_experts()[1][0]
    assert victim not in plan.ranks[0].disk_experts()[1]
    bad = copy_checkpoint(ck["fp8"], tmp_path_factory.mktemp("bad") / "ckpt")
    rewrite_tensor(bad, f"model.layers.1.mlp.experts.{victim}.up_proj.input_scale",
                   lambda t: torch.full_like(t, float("nan")))
    scenarios = [
        Scenario("fp8-p2p", "fp8", start, [Step(skewed, "p2p"), Step(start, "p2p")]),
        Scenario("fp8-disk", "fp8", start, [Step(skewed, "disk")]),
        Scenario("fp8-hybrid", "fp8", start, [Step(hand, "hybrid", (1,))]),
        Scenario("fp8-hand-p2p", "fp8", start, [Step(hand, "p2p")]),
        Scenario("bf16-p2p", "bf16", start, [Step(hand, "p2p")]),
        Scenario("bf16-hybrid", "bf16", start, [Step(skewed, "hybrid", (0,))]),
        Scenario("rollback", "fp8", start, [Step(hand, "disk", (), str(bad)), Step(hand, "p2p")]),
        Scenario("disagree", "fp8", start, [Step(hand, "p2p")], share_of={1: 0}),
        Scenario("bad-mode", "fp8", start, [Step(hand, "rdma")]),
        Scenario("bad-layout", "fp8", start,
                 [Step(Placement.round_robin(LAYERS, E, ep_size=2, slots_per_rank=6), "p2p")]),
    ]
    return _run(2, scenarios, ck)


@pytest.mark.parametrize("name", ["fp8-p2p", "fp8-disk", "fp8-hybrid", "fp8-hand-p2p",
                                  "bf16-p2p", "bf16-hybrid"])
def test_two_ranks_equal_fresh_load(two_ranks, name):
    _assert_equals_fresh(two_ranks, name)


def test_two_ranks_move_back_and_forth(two_ranks):
    _assert_equals_fresh(two_ranks, "fp8-p2p", step=1)


def test_two_ranks_sources(two_ranks):
    r0, r1 = two_ranks["fp8-hand-p2p", 0]
    assert (r0["local"], r0["p2p"], r0["disk"]) == (2, 1, 0)
    assert (r1["local"], r1["p2p"], r1["disk"]) == (0, 2, 0)
    assert r0["sent"] == r1["received"] == 2 * r0["received"] > 0
    r0, r1 = two_ranks["fp8-hybrid", 0]
    assert (r0["p2p"], r0["disk"], r1["p2p"], r1["disk"]) == (0, 1, 2, 0)
    assert all(r["p2p"] == 0 and r["disk"] > 0 for r in two_ranks["fp8-disk", 0])


def test_failure_on_one_rank_rolls_back_every_rank(two_ranks):
    for rank, res in enumerate(two_ranks["rollback", 0]):
        assert res["error"] and "rolled back" in res["error"], res
        assert "rank(s) [1]" in res["error"]
        assert not res["unchanged"], f"rank {rank} changed: {res['unchanged'][:3]}"
        assert not res["at_new"] and not res["diffs"]  # still a fresh load of the old placement
    assert "scale must be finite and positive" in two_ranks["rollback", 0][1]["error"]
    _assert_equals_fresh(two_ranks, "rollback", step=1)  # and the next rebalance works


def test_ranks_that_disagree_change_nothing(two_ranks):
    for res in two_ranks["disagree", 0]:
        assert res["error"] and "disagree" in res["error"] and not res["unchanged"]


@pytest.mark.parametrize("name, why", [("bad-mode", "unknown rebalance mode"),
                                       ("bad-layout", "another layout")])
def test_a_request_rank_0_cannot_make_changes_nothing(two_ranks, name, why):
    for res in two_ranks[name, 0]:
        assert res["error"] and why in res["error"] and "nothing was changed" in res["error"]
        assert not res["unchanged"] and not res["at_new"] and not res["diffs"]


@pytest.fixture(scope="module")
def four_ranks(ckpts):
    ck = {"fp8": ckpts["fp8", 0], "bf16": ckpts["bf16", 0]}
    start = Placement.round_robin(LAYERS, E, ep_size=4, slots_per_rank=3)
    skewed = _skewed(start, seed=1)
    moved = move_experts(start, per_layer=3, seed=2)
    scenarios = [
        Scenario("fp8-p2p", "fp8", start, [Step(skewed, "p2p")]),
        Scenario("fp8-hybrid", "fp8", start, [Step(moved, "hybrid", (1, 2))]),
        Scenario("bf16-disk", "bf16", start, [Step(moved, "disk")]),
    ]
    return _run(4, scenarios, ck)


@pytest.mark.parametrize("name", ["fp8-p2p", "fp8-hybrid", "bf16-disk"])
def test_four_ranks_equal_fresh_load(four_ranks, name):
    _assert_equals_fresh(four_ranks, name)
    assert sum(r["local"] + r["p2p"] + r["disk"] for r in four_ranks[name, 0]) > 0


def test_four_ranks_hybrid_uses_both_paths(four_ranks):
    res = four_ranks["fp8-hybrid", 0]
    assert sum(r["p2p"] for r in res) > 0 and sum(r["disk"] for r in res) > 0
    assert res[1]["sent"] == res[2]["sent"] == 0  # excluded sources serve nothing


def test_rebalance_needs_a_placed_fixed_model(ckpts):
    import fp8_reload as fr

    with pytest.raises(RebalanceError, match="no placement"):
        rebalance(fr.load_model(ckpts["fp8", 0]), None)


def test_cli_rebalance(capfd, tmp_path):
    report = tmp_path / "rebalance.json"
    assert main(["rebalance", "--world-size", "2", "--backend", "gloo", "--mode", "all",
                 "--preset", "tiny", "--tokens", "64", "--json", str(report)]) == 0
    captured = capfd.readouterr()
    out = captured.out
    assert "OK: every rank equals a fresh load" in out
    for mode in ("p2p", "disk", "hybrid"):
        assert out.count(f" {mode} ") >= 2
    # the EP forward before -> after, per rank, and a progress line per step
    assert "slowest rank / mean per MoE layer: tokens" in out and out.count("matches: ") == 6
    assert [f"step {i}/3" in captured.err for i in (1, 2, 3)] == [True] * 3
    rows = json.loads(report.read_text())
    assert len(rows) == 6 and all(r["forward_matches"] and r["equals_fresh_load"] for r in rows)
    for mode in ("p2p", "disk", "hybrid"):
        ranks = [r for r in rows if r["mode"] == mode]
        pairs = 2 * 64 * 2 * 2  # ranks x tokens x top-k x MoE layers
        assert sum(r["tokens_before"] for r in ranks) == sum(r["tokens_after"] for r in ranks) == pairs
        assert all(r["forward_calc_diff"] <= r["forward_bound"] for r in ranks)


def test_cli_rebalance_fails_when_a_forward_does_not_match(capsys):
    """--forward-bound 0 demands bitwise equality, which ranks quantizing activations with
    their own scales do not give: the command must say so and exit 1."""
    assert main(["rebalance", "--world-size", "2", "--backend", "gloo", "--preset", "tiny",
                 "--tokens", "32", "--forward-bound", "0"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT MATCH" in out and out.rstrip().endswith("single-device forward")


@pytest.mark.parametrize("args, why", [
    (["--mode", "bogus"], "unknown --mode"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--kind", "int4"], "--kind"),
    (["--preset", "huge"], "argument --preset: invalid choice"),
    (["--num-layers", "1"], "argument --num-layers: must be at least 2"),
    (["--slots-per-rank", "3"], "cannot hold 8 experts"),
    (["--alpha", "-1"], "--alpha"),
    (["--tokens", "0"], "--tokens"),
    (["--exclude-sources", "5"], "ranks lie in [0, 2)"),
    (["--moe-backend", "nope"], "--moe-backend nope"),
    (["--checkpoint", "/nonexistent"], "no config.json"),
])
def test_cli_rebalance_refuses_bad_requests_in_one_line(capsys, args, why):
    try:  # argparse's own checks exit; the command's return 2
        code = main(["rebalance", "--backend", "gloo", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's refusals print the usage above the line
    assert last.startswith("fp8-reload rebalance: error: ") and why in last
    assert err.count("\n") == 1 or err.startswith("usage: fp8-reload rebalance")


def _changed_rank(rank, world, device, path, other):
    """Both ranks load `path`; rank 0 then copies `other`'s files over it; a disk rebalance."""
    import shutil

    import torch.distributed as dist

    start, hand = _hand_placement()
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    dist.barrier()
    if rank == 0:
        for f in sorted(os.listdir(other)):
            shutil.copy(os.path.join(other, f), os.path.join(path, f + ".new"))
            os.replace(os.path.join(path, f + ".new"), os.path.join(path, f))
    dist.barrier()
    try:
        rebalance(model, hand if rank == 0 else None, mode="disk")
        error = None
    except RebalanceError as e:
        error = str(e)
    return error, compare_states(before, snapshot(model), identity=True), model.placement == start


def test_a_disk_rebalance_from_a_checkpoint_changed_since_loaded_is_refused(ckpts, tmp_path):
    """Attack s28 (helper 64): ranks loaded P, P's files were then replaced by another
    checkpoint's, and a disk-mode rebalance read the moved experts from the new files beside
    the old ones (equal to neither version, no error). Now every rank refuses and rolls back."""
    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "moving")
    for error, diffs, at_start in run_ranks(_changed_rank, 2, "gloo", str(path), str(ckpts["fp8", 1])):
        assert error and "changed since this rank read it" in error and "rolled back" in error, error
        assert diffs == [] and at_start
