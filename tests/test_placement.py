"""Expert-parallel placement and the greedy balancer: pure functions, plus loading
each rank's share of a real checkpoint under a placement."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8_reload as fr
from fp8_reload.expert_parallel import load_rank_model, moe_layer_map, slot_tensors
from fp8_reload.expert_parallel.placement import (
    Placement,
    balance_placement,
    default_slots_per_rank,
    keep_slots,
    pack,
    replicate,
)
from fp8_reload.expert_parallel.workload import move_experts, synthetic_load


def test_round_robin_layout():
    p = Placement.round_robin([1, 2], num_experts=8, ep_size=2, slots_per_rank=5)
    assert p.num_physical == 10
    assert p.rank_experts(1, 0) == [0, 1, 2, 3, 4]
    assert p.rank_experts(1, 1) == [5, 6, 7, 0, 1]  # spare slots replicate the first experts
    assert p.local_slots(2, 1) == {5: [0], 6: [1], 7: [2], 0: [3], 1: [4]}
    assert p.logical_to_physical(1)[0] == [0, 8]
    assert p.replicas()[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert p.expert_slots_for(0)(2) == {0: [0], 1: [1], 2: [2], 3: [3], 4: [4]}
    assert p.model_kwargs(1)["num_local_experts"] == 5
    with pytest.raises(KeyError, match="layer 0 is not an MoE layer"):
        p.row(0)


@pytest.mark.parametrize("table, match", [
    ([[0, 1, 2, 0]], "experts \\[3\\] have no replica"),
    ([[0, 1, 2, 9]], "expert ids must lie in"),
    ([[0, 1, 2]], "table has shape"),
])
def test_validate_rejects_bad_tables(table, match):
    with pytest.raises(ValueError, match=match):
        Placement([1], num_experts=4, ep_size=2, slots_per_rank=2, table=torch.tensor(table))


def test_too_few_slots_rejected():
    with pytest.raises(ValueError, match="cannot hold 8 experts"):
        Placement.round_robin([1], 8, ep_size=2, slots_per_rank=3)


def test_replicate_gives_spares_to_the_hottest_per_replica():
    assert replicate([10, 1, 1, 1], num_physical=6, max_replicas=4) == [3, 1, 1, 1]
    assert replicate([10, 9, 1, 1], num_physical=6, max_replicas=4) == [2, 2, 1, 1]
    assert replicate([10, 1, 1, 1], num_physical=8, max_replicas=2) == [2, 2, 2, 2]
    with pytest.raises(ValueError):
        replicate([1, 1], num_physical=1, max_replicas=2)


def test_keep_slots_leaves_staying_experts_in_place():
    assert keep_slots([4, 5, 6, 7], [7, 1, 4, 1]) == [4, 1, 1, 7]
    assert keep_slots([3, 3, 2], [3, 9, 2]) == [3, 9, 2]


def test_pack_fills_every_slot_and_balances():
    load = [8.0, 4.0, 4.0, 2.0, 1.0, 1.0]
    ranks = pack(load, [1] * 6, ep_size=2, slots_per_rank=3)
    assert sorted(e for r in ranks for e in r) == list(range(6))
    totals = [sum(load[e] for e in r) for r in ranks]
    assert max(totals) <= sum(load) / 2 + max(load)  # the greedy (LPT) bound; 10/10 is optimal
    assert pack([1.0] * 6, [1] * 6, ep_size=3, slots_per_rank=2) == [[0, 3], [1, 4], [2, 5]]


def test_balancer_on_skewed_load():
    start = Placement.round_robin([1, 2, 3], 16, ep_size=4, slots_per_rank=5)
    load = synthetic_load(start.layers, 16, seed=3, alpha=1.4)
    new = balance_placement(load, start)
    assert new.imbalance(load).max() < 1.15 < start.imbalance(load).min()
    # the hottest expert of each layer gets the most replicas, never two on one rank
    for i, layer in enumerate(new.layers):
        hot = int(load[i].argmax())
        assert new.replicas()[i, hot] == new.replicas()[i].max() >= 2
        for r in range(4):
            experts = new.rank_experts(layer, r)
            assert len(set(experts)) == len(experts)
    # deterministic, and rebalancing for the same load moves nothing
    assert balance_placement(load, start) == new
    assert balance_placement(load, new) == new


@settings(max_examples=60, deadline=None)
@given(num_experts=st.integers(2, 12), ep_size=st.integers(1, 4), redundant=st.integers(0, 2),
       seed=st.integers(0, 10_000), alpha=st.floats(0.0, 2.5))
def test_balancer_properties(num_experts, ep_size, redundant, seed, alpha):
    slots = default_slots_per_rank(num_experts, ep_size, redundant)
    start = Placement.round_robin([1, 2], num_experts, ep_size, slots)
    load = synthetic_load(start.layers, num_experts, seed=seed, alpha=alpha, tokens=500)
    new = balance_placement(load, start)  # validates: every slot filled, every expert held
    assert new.table.shape == start.table.shape
    # load is conserved, and the busiest rank carries no more than the old one did
    assert torch.allclose(new.rank_load(load).sum(1), load.sum(1))
    assert (new.rank_load(load).amax(1) <= start.rank_load(load).amax(1) + 1e-9).all()
    # experts that stay on a rank stay in their slot: only necessary slots change
    for layer in start.layers:
        for r in range(ep_size):
            old, now = start.rank_experts(layer, r), new.rank_experts(layer, r)
            kept = sum(min(old.count(e), now.count(e)) for e in set(now))
            assert sum(a != b for a, b in zip(old, now)) == slots - kept


def test_synthetic_load_is_skewed_and_deterministic():
    a = synthetic_load([1, 2], 64, seed=0, alpha=1.2, tokens=10_000)
    assert torch.equal(a, synthetic_load([1, 2], 64, seed=0, alpha=1.2, tokens=10_000))
    assert a.sum(1).tolist() == [10_000.0, 10_000.0]
    assert (a.amax(1) / a.mean(1) > 5).all()
    assert not torch.equal(a[0], a[1])  # each layer has its own hot experts


def test_move_experts_moves_exactly_that_many_across_ranks():
    start = Placement.round_robin([1, 2, 3], 16, ep_size=2, slots_per_rank=9)
    new = move_experts(start, per_layer=3, seed=1)
    assert start.moved_slots(new) == 3 * 2 * 3
    for layer in start.layers:
        for r in range(2):
            gained = set(new.rank_experts(layer, r)) - set(start.rank_experts(layer, r))
            assert len(gained) == 3  # none of them could be copied locally
    with pytest.raises(ValueError, match="cannot move"):
        move_experts(start, per_layer=9)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_rank_models_hold_exactly_their_placed_experts(ckpts, tiny_cfg, kind):
    """Each slot of a rank's FusedMoE equals the full model's copy of its logical
    expert; the merged input scale is the max over the rank's own experts."""
    path = ckpts[kind, 0]
    full = moe_layer_map(fr.load_model(path))  # identity placement: slot == expert
    start = Placement.round_robin(tiny_cfg.moe_layers, 8, ep_size=2, slots_per_rank=5)
    placement = move_experts(start, per_layer=2, seed=0)
    assert not torch.equal(placement.table[0], placement.table[1])  # layers differ
    for rank in range(2):
        model = load_rank_model(path, placement, rank)
        for lid, layer in moe_layer_map(model).items():
            experts = placement.rank_experts(lid, rank)
            assert layer.expert_slots == placement.local_slots(lid, rank)
            idx = torch.tensor(experts)
            for mine, ref in zip(slot_tensors(layer), slot_tensors(full[lid])):
                assert torch.equal(mine.view(torch.uint8) if mine.dtype == torch.float8_e4m3fn else mine,
                                   (ref.view(torch.uint8) if ref.dtype == torch.float8_e4m3fn else ref)[idx])
            if kind == "fp8":
                raw = full[lid].w13_input_scale_per_expert[idx]
                assert torch.equal(layer.w13_input_scale.data, raw.max().expand(5))
