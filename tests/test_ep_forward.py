"""The expert-parallel forward on real gloo process groups (2 and 4 CPU ranks).

Checked on every rank, before and after a rebalance: the EP forward of each MoE
layer equals the single-device forward of the same checkpoint within the
bounds `expert_parallel.forward` states (CROSS_SCHEME_BOUND with the torch
backend, whose ranks quantize activations with their own scales;
SAME_SCHEME_BOUND with the float32 reference, where only the bf16 rounding of
per-expert outputs and the summation order differ), and each rank computes
exactly the (token, expert) pairs the replica policy sends it under the
placement the model holds now. Ranks that hold different placements or cannot
route refuse together, and a forward never runs on a half-moved layer.

Pure tests of the replica policy (no ranks) cover where tokens go and that they
follow the balancer's prediction.
"""

from __future__ import annotations

import functools
import importlib
import threading

import pytest
import torch
import torch.distributed as dist

import fp8_reload as fr
from fp8_reload import kernels
from fp8_reload.expert_parallel import (
    DispatchError,
    EPForwardStats,
    Placement,
    balance_placement,
    choose_replicas,
    default_slots_per_rank,
    ep_moe_forward,
    load_rank_model,
    local_expert_forward,
    move_experts,
    owned_tokens,
    rebalance,
    routing_load,
    run_ranks,
    skewed_routing,
)
from fp8_reload.kernels import CROSS_SCHEME_BOUND, MOE_LAYER_BOUND, SAME_SCHEME_BOUND
from fp8_reload.kernels.reference import moe_forward_torch

# the module, not the function of the same name the package exports
rebalance_module = importlib.import_module("fp8_reload.expert_parallel.rebalance")
F32 = "float32-reference"  # the torch reference without activation quantization
WAIT = 20.0  # seconds a rank waits for a thread or event before failing (never hang)


# --------------------------------------------------------------------------
# The replica policy (pure)
# --------------------------------------------------------------------------

def test_owned_tokens_split_the_batch_into_contiguous_blocks():
    for n, world in ((10, 3), (3, 4), (0, 2), (64, 4)):
        blocks = [owned_tokens(n, world, r) for r in range(world)]
        assert blocks[0].start == 0 and blocks[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
        sizes = [b.stop - b.start for b in blocks]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        owned_tokens(8, 2, 2)


def test_pairs_stay_home_when_the_rank_holds_the_expert():
    p = Placement.from_rank_slots(8, {1: [[1, 0, 5, 5, 4], [5, 6, 7, 2, 3]]})
    ids = torch.tensor([[5, 6], [5, 0], [2, 5], [3, 1]])
    # rank 0 holds 5 twice (physical 2 and 3): the token index alternates them;
    # 6, 2 and 3 live only on rank 1 (physical 6, 8, 9)
    assert choose_replicas(p, 1, 0, ids).tolist() == [[2, 6], [3, 1], [8, 2], [9, 0]]
    # rank 1 holds 5 (physical 5), 2 and 3 itself; 0 and 1 only rank 0 has
    assert choose_replicas(p, 1, 1, ids).tolist() == [[5, 6], [5, 1], [8, 5], [9, 0]]


def test_pairs_of_ranks_without_a_replica_spread_evenly_over_the_replicas():
    p = Placement.round_robin([1], 8, ep_size=4, slots_per_rank=3)  # expert 0: physical 0 and 8
    ids = torch.zeros(1000, 1, dtype=torch.long)
    for rank in (1, 3):  # neither holds expert 0
        chosen = choose_replicas(p, 1, rank, ids).flatten()
        assert set(chosen.tolist()) == {0, 8}
        assert abs(int((chosen == 0).sum()) - 500) <= 1
    assert set(choose_replicas(p, 1, 2, ids).flatten().tolist()) == {8}  # rank 2 holds it


def test_skewed_routing_is_deterministic_distinct_and_shares_hot_experts_across_ranks():
    w, ids = skewed_routing(4000, 16, 4, layer=1, seed=3, alpha=1.4, rank=0)
    w2, ids2 = skewed_routing(4000, 16, 4, layer=1, seed=3, alpha=1.4, rank=0)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert torch.allclose(w.sum(1), torch.ones(4000)) and bool((w > 0).all())
    load0 = routing_load(ids, 16)
    load1 = routing_load(skewed_routing(4000, 16, 4, layer=1, seed=3, alpha=1.4, rank=1)[1], 16)
    assert int(load0.argmax()) == int(load1.argmax())  # the same hot expert on every rank
    assert not torch.equal(load0, load1)  # but other tokens
    assert load0.max() / load0.mean() > 2
    other = routing_load(skewed_routing(4000, 16, 4, layer=2, seed=3, alpha=1.4)[1], 16)
    assert int(other.argmax()) != int(load0.argmax())  # another hot expert in another layer


def _pairs_per_rank(placement, routings, layer):
    """Pairs each rank computes when rank r's tokens route as `routings[r]`."""
    out = torch.zeros(placement.ep_size, dtype=torch.long)
    for r, ids in enumerate(routings):
        dest = choose_replicas(placement, layer, r, ids) // placement.slots_per_rank
        out += torch.bincount(dest.flatten(), minlength=placement.ep_size)
    return out


@pytest.mark.parametrize("ranks, experts, top_k", [(2, 16, 4), (4, 16, 4), (4, 64, 6)])
def test_dispatch_follows_the_balancers_prediction(ranks, experts, top_k):
    """Measured tokens per rank under the policy match `Placement.rank_load` (the even
    split over replicas the balancer optimizes), and balancing evens them out."""
    layers = [1, 2, 3]
    routings = {layer: [skewed_routing(2048, experts, top_k, layer, seed=5, alpha=1.2, rank=r)[1]
                        for r in range(ranks)] for layer in layers}
    load = torch.stack([sum(routing_load(ids, experts) for ids in routings[layer])
                        for layer in layers])
    start = Placement.round_robin(layers, experts, ranks, default_slots_per_rank(experts, ranks))
    new = balance_placement(load, start)
    for placement in (start, new):
        predicted = placement.rank_load(load)
        for i, layer in enumerate(layers):
            measured = _pairs_per_rank(placement, routings[layer], layer).double()
            assert measured.sum() == load[i].sum()
            assert torch.allclose(measured, predicted[i], rtol=0.03), (layer, measured, predicted[i])
    for layer in layers:
        before = _pairs_per_rank(start, routings[layer], layer).double()
        after = _pairs_per_rank(new, routings[layer], layer).double()
        assert after.max() / after.mean() <= min(1.1, before.max() / before.mean())


# --------------------------------------------------------------------------
# Distributed: accuracy and where tokens go, before and after a rebalance
# --------------------------------------------------------------------------

def _global_batch(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16)


def _block(sizes, rank) -> slice:
    """Rank `rank`'s tokens when the ranks hold `sizes` tokens, in rank order."""
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def _routing(full, rank, x, layer, how):
    """The routing of `rank`'s tokens `x` in `layer`: the gate's, or a skewed one."""
    if how == "gate":
        return full.model.layers[layer].mlp.gate(x)
    cfg = full.config
    return skewed_routing(x.shape[0], cfg.num_experts, cfg.top_k, layer, seed=1, alpha=1.5,
                          rank=rank)


def _expected_rows(full, placement, layer, how, batch, sizes, rank):
    """Pairs `rank` must compute: every rank's tokens through the policy, here on the host."""
    rows = 0
    for r in range(len(sizes)):
        ids = _routing(full, r, batch[_block(sizes, r)], layer, how)[1]
        rows += int((choose_replicas(placement, layer, r, ids) // placement.slots_per_rank
                     == rank).sum())
    return rows


def _forward_rank(rank, world, device, ckpts, sizes):
    kernels.BACKENDS[F32] = functools.partial(moe_forward_torch, quantize_activations=False)
    out = {}
    for kind, path in ckpts.items():
        full = fr.load_model(path)
        cfg = full.config
        e = cfg.num_experts
        start = Placement.round_robin(cfg.moe_layers, e, world, default_slots_per_rank(e, world))
        model = load_rank_model(path, start, rank)
        batch = _global_batch(cfg, sum(sizes))
        x = batch[_block(sizes, rank)]
        load = torch.stack([routing_load(_routing(full, rank, x, layer, "skewed")[1], e)
                            for layer in start.layers])
        dist.all_reduce(load)
        for tag in ("start", "balanced"):
            if tag == "balanced":
                rebalance(model, balance_placement(load, start) if rank == 0 else None, mode="p2p")
                assert model.placement != start
            for layer in start.layers:
                for how in ("gate", "skewed"):
                    r = _routing(full, rank, x, layer, how)
                    want = _expected_rows(full, model.placement, layer, how, batch, sizes, rank)
                    ys = {}
                    for backend in ("torch", F32):
                        stats = EPForwardStats()
                        ys[backend] = y = ep_moe_forward(model, layer, x, r, backend=backend,
                                                         stats=stats)
                        if x.shape[0]:
                            ref = full.model.layers[layer].mlp(x, backend=backend, routing=r)
                        else:  # a rank without tokens (the single device cannot run none)
                            ref = torch.empty_like(x)
                        out[kind, tag, layer, how, backend] = {
                            "diff": fr.calc_diff(y, ref), "shape_ok": y.shape == x.shape,
                            "rows": stats.rows_computed, "want_rows": want}
                    # the premise of the torch bound: the EP forward is as close to the float32
                    # forward of the same weights as any per-tensor FP8 MoE layer
                    out[kind, tag, layer, how, "torch"]["to_float32"] = fr.calc_diff(ys["torch"], ref)
    return out


def _by_rank(per_rank):
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.fixture(scope="module")
def ckpt_paths(ckpts):
    return {"fp8": str(ckpts["fp8", 0]), "bf16": str(ckpts["bf16", 0])}


@pytest.fixture(scope="module")
def forward_results(ckpt_paths):
    # data-parallel blocks of 129 tokens on 2 ranks (64 / 65); uneven ones on 4, rank 0 without any
    sizes = {2: [len(range(129)[owned_tokens(129, 2, r)]) for r in range(2)], 4: [0, 64, 24, 40]}
    return {world: _by_rank(run_ranks(_forward_rank, world, "gloo", ckpt_paths, sizes[world]))
            for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_forward_equals_the_single_device_forward_on_every_rank(forward_results, world):
    results = forward_results[world]
    assert len(results) == 2 * 2 * 2 * 2 * 2  # kinds x tags x layers x routings x backends
    for key, per_rank in results.items():
        bound = CROSS_SCHEME_BOUND if key[-1] == "torch" else SAME_SCHEME_BOUND
        for rank, res in enumerate(per_rank):
            assert res["shape_ok"], (key, rank)
            assert res["diff"] <= bound, (key, rank, res["diff"], bound)
            assert res.get("to_float32", 0.0) <= MOE_LAYER_BOUND, (key, rank, res["to_float32"])


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_computes_the_pairs_the_placement_sends_it(forward_results, world):
    results = forward_results[world]
    for key, per_rank in results.items():
        assert [r["rows"] for r in per_rank] == [r["want_rows"] for r in per_rank], key


def test_a_rebalance_changes_where_tokens_go(forward_results):
    results = forward_results[2]
    moved = [key for key in results if key[1] == "start" and
             [r["rows"] for r in results[key]] !=
             [r["rows"] for r in results[(key[0], "balanced", *key[2:])]]]
    assert moved, "the rebalance moved experts, yet every rank computed the same pairs"


# --------------------------------------------------------------------------
# Distributed: refusals and the half-moved layer
# --------------------------------------------------------------------------

class _PauseAfterFirstWrite:
    """Pauses the rebalance's commit after its first `write_slots` (some slots of the layer
    hold new experts, others old ones) until `open` is set."""

    def __init__(self):
        self.reached, self.open = threading.Event(), threading.Event()
        self.orig = rebalance_module.write_slots

    def __call__(self, *args, **kwargs):
        self.orig(*args, **kwargs)
        if not self.reached.is_set():
            self.reached.set()
            assert self.open.wait(WAIT), "never opened"


def _refusal_rank(rank, world, device, path):
    full = fr.load_model(path)
    cfg = full.config
    layer = cfg.moe_layers[0]
    start = Placement.round_robin(cfg.moe_layers, 8, world, 5)
    # layer 1: each rank copies one expert locally (written first) and gets one from its peer
    hand = Placement.from_rank_slots(8, {1: [[1, 0, 2, 5, 4], [5, 6, 7, 7, 3]],
                                         2: [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]})
    model = load_rank_model(path, start, rank)
    x = _global_batch(cfg, 16)[owned_tokens(16, world, rank)]
    out = {}

    def attempt(name, *args, **kwargs):
        try:
            ep_moe_forward(model, *args, **kwargs)
            out[name] = None
        except DispatchError as e:
            out[name] = str(e)

    if rank == 1:  # as if a rebalance had run here only
        model.placement = move_experts(start, 1, seed=0)
    attempt("mismatch", layer, x)
    model.placement = start
    bad = (torch.ones(x.shape[0], 2) / 2, torch.full((x.shape[0], 2), 99 if rank == 0 else 0))
    attempt("bad-routing", layer, x, bad)
    attempt("dense-layer", 0, x)
    attempt("bad-backend", layer, x, backend="torch" if rank == 0 else "no-such-backend")
    attempt("recovered", layer, x)

    # A forward arriving while the commit is half done waits for it.
    rows = _global_batch(cfg, 10, seed=3)
    slots = torch.arange(10) % start.slots_per_rank
    pause = _PauseAfterFirstWrite()
    rebalance_module.write_slots = pause
    result = {}
    mover = threading.Thread(target=lambda: result.update(
        report=rebalance(model, hand if rank == 0 else None, mode="p2p")), daemon=True)
    mover.start()
    assert pause.reached.wait(WAIT), "the commit never started"
    layer_now = model.model.layers[layer].mlp.experts
    ones = torch.ones(10, 1)
    torn = kernels.run_moe(layer_now, rows, ones, slots.view(-1, 1))  # bypasses the lock
    waited = {}
    forward = threading.Thread(target=lambda: waited.update(
        y=local_expert_forward(model, layer, rows, slots)), daemon=True)
    forward.start()
    forward.join(0.3)
    out["forward_waited"] = forward.is_alive()
    pause.open.set()
    mover.join(WAIT)
    forward.join(WAIT)
    rebalance_module.write_slots = pause.orig
    out["rebalanced"] = "report" in result and model.placement == hand
    old_y = local_expert_forward(load_rank_model(path, start, rank), layer, rows, slots)
    new_y = local_expert_forward(load_rank_model(path, hand, rank), layer, rows, slots)
    out["torn_is_neither"] = not torch.equal(torn, old_y) and not torch.equal(torn, new_y)
    out["forward_saw_new"] = "y" in waited and torch.equal(waited["y"], new_y)
    out["new_differs"] = not torch.equal(old_y, new_y)
    return out


@pytest.fixture(scope="module")
def refusals(ckpt_paths):
    return _by_rank(run_ranks(_refusal_rank, 2, "gloo", ckpt_paths["fp8"]))


def test_ranks_holding_different_placements_refuse_together(refusals):
    for msg in refusals["mismatch"]:
        assert msg and "different placements" in msg


def test_one_rank_that_cannot_route_makes_every_rank_refuse(refusals):
    r0, r1 = refusals["bad-routing"]
    assert r0 and "rank(s) [0] cannot dispatch" in r0 and "must lie in [0, 8)" in r0
    assert r1 and "rank(s) [0] cannot dispatch" in r1
    assert all(m and "not an MoE layer" in m for m in refusals["dense-layer"])
    assert refusals["recovered"] == [None, None]  # and the next forward runs


def test_a_rank_whose_experts_fail_fails_every_rank_without_a_hang(refusals):
    r0, r1 = refusals["bad-backend"]
    assert r0 and "failed in the local experts of rank(s) [1]" in r0
    assert r1 and "rank(s) [1]" in r1 and "no-such-backend" in r1


def test_a_forward_never_runs_on_a_half_moved_layer(refusals):
    for rank in range(2):
        assert refusals["new_differs"][rank]
        # the control: mid-commit the layer *is* half moved
        assert refusals["torn_is_neither"][rank]
        # a forward arriving then waited, and saw the whole new placement
        assert refusals["forward_waited"][rank]
        assert refusals["forward_saw_new"][rank] and refusals["rebalanced"][rank]

