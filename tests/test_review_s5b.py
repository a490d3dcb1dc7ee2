"""Adversarial review (s5b) of the rebalance rewrite (transfer.py) and the requant kernels.

The in-process part runs every rank of a rebalance in one process: each rank's
`plan_moves`, gathers, an "exchange" by copying each send buffer into its peer's
receive buffer, the commit, and a rollback from any point; then compares each rank
with a fresh load (commit) or with its state before (rollback).
"""

from __future__ import annotations

import pytest
import torch

from fp8_reload.expert_parallel import (
    Placement,
    RebalancePlan,
    load_rank_model,
    moe_layer_map,
)
from fp8_reload.expert_parallel.slots import refresh_merged_input_scales
from fp8_reload.expert_parallel.transfer import RowMover, plan_moves
from fp8_reload.expert_parallel.undo import Undo, save_scales
from fp8_reload.kernels.scales import clear_kernel_caches
from fp8_reload.reload import generate_weight_name_filter, update_weights_from_disk
from fp8_reload.state import compare_states, snapshot
from fp8_reload.tools.rebalance import param_ids

LAYERS = (1, 2)
E = 8

PATHS = ["copy", "index", "triton"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("FP8_RELOAD_REBALANCE_COPY", request.param)
    if request.param == "triton":
        pytest.importorskip("triton")
        from fp8_reload.kernels.triton.runtime import INTERPRET

        if not INTERPRET:  # (a CUDA host: compiled Triton cannot run the gloo ranks' CPU tensors)
            pytest.skip("the ranks hold CPU tensors, which Triton runs only in its interpreter")
    return request.param


def _placement(rows_per_layer, ranks, slots):
    return Placement(LAYERS, E, ranks, slots, torch.tensor(rows_per_layer))


def _random_placement(g, ranks, slots):
    rows = []
    for _ in LAYERS:
        extra = torch.randint(0, E, (ranks * slots - E,), generator=g).tolist()
        perm = torch.randperm(ranks * slots, generator=g)
        rows.append(torch.tensor(list(range(E)) + extra)[perm].tolist())
    return _placement(rows, ranks, slots)


def _simulate(ckpt, old, new, mode, fail_at=None, fail_rank=None):
    """Every rank of one rebalance in this process. `fail_at` in ("disk", "local_in",
    "received", "refresh"): `fail_rank` (every rank when None) stops there and every rank
    (touched) rolls back. Returns per rank (model, before-snapshot, ids)."""
    ranks = old.ep_size
    plan = RebalancePlan.build(old, new, mode)
    st = []
    for r in range(ranks):
        model = load_rank_model(ckpt, old, r)
        layers = moe_layer_map(model)
        mover = RowMover(layers, torch.device("cpu"))
        moves = plan_moves(mover, plan.ranks[r], "cpu")
        st.append(dict(model=model, layers=layers, mover=mover, moves=moves,
                       mine=plan.ranks[r], before=snapshot(model), ids=param_ids(model)))
    for s in st:
        s["mover"].gather(s["moves"].sends)
    for s in st:
        s["mover"].gather(s["moves"].local + s["moves"].backup)
        s["scales"] = save_scales(s["layers"], s["mine"].changed)
    for r, s in enumerate(st):  # the exchange
        for p, buf in s["moves"].send_bufs.items():
            dst = st[p]["moves"].recv_bufs[r]
            assert dst.numel() == buf.numel(), (r, p)
            dst.copy_(buf)
    failed = False
    for r, s in enumerate(st):
        stop = fail_at if fail_rank in (None, r) else None
        model, layers, mine, mover, moves = (s[k] for k in ("model", "layers", "mine", "mover",
                                                              "moves"))
        for lid, layer in layers.items():
            layer.expert_slots = new.local_slots(lid, r)
        wanted = mine.disk_experts()
        if wanted:
            update_weights_from_disk(model, ckpt, generate_weight_name_filter(wanted))
        if stop == "disk":
            failed = True
            continue
        mover.scatter(moves.local_in)
        if stop == "local_in":
            failed = True
            continue
        mover.scatter(moves.received)
        if stop == "received":
            failed = True
            continue
        for lid in mine.changed:
            refresh_merged_input_scales([layers[lid]])
            layers[lid].weights_version += 1
        clear_kernel_caches(model)
        if stop == "refresh":
            failed = True
    out = []
    for r, s in enumerate(st):
        if failed:
            Undo(s["model"], s["layers"], s["mover"], s["moves"], s["mine"], old, r,
                 s["scales"]).restore()
        else:
            s["model"].placement = new
        out.append(s)
    return out, failed


def _check(ckpt, res, failed, new):
    for r, s in enumerate(res):
        model = s["model"]
        assert param_ids(model) == s["ids"], f"rank {r}: Parameters replaced"
        if failed:
            diffs = compare_states(s["before"], snapshot(model), identity=True)
            assert not diffs, f"rank {r} not rolled back: {diffs[:3]}"
        else:
            fresh = load_rank_model(ckpt, new, r)
            diffs = compare_states(snapshot(model), snapshot(fresh))
            assert not diffs, f"rank {r} differs from a fresh load: {diffs[:3]}"


# Hand-made cases: (old rows, new rows), 2 ranks x 5 slots, both layers alike unless given.
_OLD2 = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 2
HAND2 = {
    # slot 0 <-> slot 1 swap in place, slot 2 <-> slot 3 swap too; rank 1 unchanged
    "swap-in-rank": [[1, 0, 3, 2, 4, 5, 6, 7, 0, 1], _OLD2[1]],
    # a 3-cycle inside rank 0
    "cycle-in-rank": [[1, 2, 0, 3, 4, 5, 6, 7, 0, 1], _OLD2[1]],
    # ranks swap whole contents: every slot is sent and received
    "swap-ranks": [[5, 6, 7, 0, 1, 0, 1, 2, 3, 4]] * 2,
    # expert 5 (only on r1) into three slots of r0; r0's old rows 2,3 leave
    "replicas-in": [[5, 1, 5, 5, 4, 2, 3, 7, 0, 6]] * 2,
    # r0 slot 0 takes r1's expert and r1 takes r0's slot 0 expert into its slot 0
    "cross-swap": [[5, 1, 2, 3, 4, 0, 6, 7, 0, 1]] * 2,
    # a slot that is both sent and filled locally from another slot
    "sent-and-local": [[1, 1, 2, 3, 4, 0, 6, 7, 5, 1]] * 2,
}


@pytest.mark.parametrize("name", sorted(HAND2))
@pytest.mark.parametrize("fail_at", [None, "local_in", "received", "refresh"])
def test_hand_cases_two_ranks(ckpts, path, name, fail_at):
    old = _placement(_OLD2, 2, 5)
    new = _placement(HAND2[name], 2, 5)
    for mode in ("p2p", "hybrid"):
        res, failed = _simulate(ckpts["fp8", 0], old, new, mode, fail_at)
        assert failed == (fail_at is not None)
        _check(ckpts["fp8", 0], res, failed, new)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ranks,slots", [(2, 6), (3, 4), (4, 3)])
def test_random_placements_commit_and_rollback(ckpts, path, seed, ranks, slots):
    g = torch.Generator().manual_seed(seed * 31 + ranks)
    old, new = _random_placement(g, ranks, slots), _random_placement(g, ranks, slots)
    kind = "fp8" if seed % 2 == 0 else "bf16"
    mode = ("p2p", "hybrid", "disk")[seed % 3]
    res, failed = _simulate(ckpts[kind, 0], old, new, mode)
    _check(ckpts[kind, 0], res, failed, new)
    fail_at = ("disk", "local_in", "received", "refresh")[seed % 4]
    res, failed = _simulate(ckpts[kind, 0], old, new, mode, fail_at, fail_rank=seed % ranks)
    assert failed
    _check(ckpts[kind, 0], res, failed, new)


# --------------------------------------------------------------------------
# gloo: a failure on one rank before the exchange (plan_moves: buffer allocation)
# --------------------------------------------------------------------------

def _rebalance_with_a_fault(rank, device, ckpt, mode, fault) -> dict:
    """One rank of a rebalance of the hand-made placements with `fault(module, rank)`
    installed in the rebalance module first: its error and what changed on this rank."""
    import sys

    from fp8_reload.expert_parallel import rebalance

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]  # the package's name is the function
    old = _placement(_OLD2, 2, 5)
    new = _placement(HAND2["replicas-in"], 2, 5)
    model = load_rank_model(ckpt, old, rank, device)
    before = snapshot(model)
    slots_before = {lid: dict(layer.expert_slots) for lid, layer in moe_layer_map(model).items()}
    fault(rb, rank)
    try:
        rebalance(model, new if rank == 0 else None, mode=mode)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"[:300]
    return {"error": err, "diffs": compare_states(before, snapshot(model), identity=True),
            "slots_kept": {lid: dict(layer.expert_slots)
                           for lid, layer in moe_layer_map(model).items()} == slots_before}


def _no_buffers_on_rank_1(rb, rank):
    if rank == 1:
        def boom(*a, **k):
            raise RuntimeError("out of memory (injected into plan_moves)")
        rb.plan_moves = boom


def _outcome_vote_raises(rb, rank):
    """The first vote (buffers laid out) passes, the outcome vote raises (as when a peer
    has left the group), on every rank."""
    from tests.conftest import raising_on_call

    rb.failed_ranks = raising_on_call(rb.failed_ranks, 2, RuntimeError(
        "Connection reset by peer (injected into the outcome vote)"))


def _plan_moves_fails_on_rank_1(rank, world, device, ckpt, mode):
    return _rebalance_with_a_fault(rank, device, ckpt, mode, _no_buffers_on_rank_1)


def _outcome_vote_fails(rank, world, device, ckpt, mode):
    return _rebalance_with_a_fault(rank, device, ckpt, mode, _outcome_vote_raises)


@pytest.fixture(scope="module")
def plan_moves_fails(ckpts):
    from fp8_reload.expert_parallel import run_ranks

    return run_ranks(_plan_moves_fails_on_rank_1, 2, "gloo", str(ckpts["fp8", 0]), "disk")


def test_a_rank_whose_outcome_vote_fails_rolls_back(ckpts):
    """The outcome vote (all-gather) raising, as when a peer left the group: before, the
    rank returned that bare error with its weights and `expert_slots` half new and
    `placement` old. Fixed: a failed vote rolls back like a failed rank."""
    from fp8_reload.expert_parallel import run_ranks

    for r in run_ranks(_outcome_vote_fails, 2, "gloo", str(ckpts["fp8", 0]), "disk"):
        assert r["error"] and r["error"].startswith("RebalanceError"), r["error"]
        assert not r["diffs"], r["diffs"][:3]
        assert r["slots_kept"]


def test_a_rank_failing_to_lay_out_its_buffers_fails_together(plan_moves_fails):
    """`plan_moves` (every buffer's allocation) raising on rank 1 only: before, rank 1
    left with a bare error and rank 0 waited in the exchange. Fixed: a vote after the
    layout; both raise, nothing changed anywhere."""
    for r in plan_moves_fails:
        assert r["error"] and r["error"].startswith("RebalanceError"), r["error"]
        assert "nothing was changed" in r["error"], r["error"]
        assert not r["diffs"], r["diffs"][:3]
        assert r["slots_kept"]


# --------------------------------------------------------------------------
# Post-processing kernels (Triton's interpreter on CPU)
# --------------------------------------------------------------------------

def _requant_case(experts, merge=True):
    from fp8_reload.processing import ops

    from .test_requant import fp8_w13

    q, s = fp8_w13(7, 48, 80)
    g = torch.Generator().manual_seed(3)
    a13, a2 = torch.rand(7, generator=g) + 0.5, torch.rand(7, generator=g) + 0.5
    raw13, raw2 = torch.rand(7, generator=g), torch.rand(7, generator=g)
    orig = tuple(t.to(DEVICE) for t in (q, s, a13, raw13, a2, raw2))  # the kernels' device
    want = [t.cpu().clone() for t in orig]  # the torch path on CPU: the bytes to match
    idx = torch.tensor(experts, dtype=torch.long)
    if merge:
        ops.merge_input_scales_(want[2], want[3], idx)
        ops.merge_input_scales_(want[4], want[5], idx)
    ops.requantize_w13_to_expert_max_(want[0], want[1], idx, 48)
    return orig, want


def _same(a, b):
    a, b = a.cpu(), b.cpu()
    return torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a.view(torch.int32),
                       b.view(torch.uint8) if b.dtype.itemsize == 1 else b.view(torch.int32))


def test_requant_after_an_interrupted_launch_gives_the_torch_bytes(monkeypatch):
    """A launch cut short after some programs took their ticket (here: an exception from
    the interpreter's second atomic) left the layer's ticket counter at 1, and the cache
    kept that counter: in every later launch of the layer the second-to-last program
    wrote the scales before the last one read them, and the counter stayed at 1, so the
    layer never recovered. Fixed: a launch that raises drops the layer's cache entry."""
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    from fp8_reload.kernels.triton import requant

    if not requant.INTERPRET:
        pytest.skip("a launch is cut short half-way only in Triton's interpreter (the CPU run)")

    experts = [1, 3, 6]
    orig, want = _requant_case(experts)
    got = [t.clone() for t in orig]
    scales = ((got[2], got[3]), (got[4], got[5]))
    real, calls = interpreter.InterpreterBuilder.create_atomic_rmw, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("launch interrupted (injected)")
        return real(self, *a, **k)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", flaky)
    with pytest.raises(KeyboardInterrupt):
        requant.requantize_w13_(got[0], got[1], experts, scales)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", real)
    for t, o in zip(got, orig):  # the same tensors (same addresses), old values again
        t.copy_(o)
    for _ in range(2):
        requant.requantize_w13_(got[0], got[1], experts, scales)
        for name, a, b in zip(("w13", "w13_scale", "a13", "a13 raw", "a2", "a2 raw"), want, got):
            assert _same(a, b), name
        for t, o in zip(got, orig):
            t.copy_(o)


def test_requant_duplicated_slots_match_the_torch_path():
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton import requant

    experts = [3, 3]
    orig, want = _requant_case(experts, merge=False)
    got = [t.clone() for t in orig]
    requant.requantize_w13_(got[0], got[1], experts)
    assert _same(want[0], got[0]) and _same(want[1], got[1])


def test_requant_checks_a_tensor_at_a_cached_address():
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton import requant

    orig, _ = _requant_case([1], merge=False)
    q, s = orig[0].clone(), orig[1].clone()
    requant.requantize_w13_(q, s, [1])
    with pytest.raises(ValueError):  # same address and shape, not FP8
        requant.requantize_w13_(q.view(torch.uint8), s, [1])


# --------------------------------------------------------------------------
# gloo, 3 ranks: a rollback restores slots from send buffers (a row sent to two peers,
# replicas, in-rank cycles) after the other ranks committed
# --------------------------------------------------------------------------

_OLD3 = [[0, 1, 2, 7, 4, 5, 6, 0, 3, 1, 4, 5]] * 2
# r0: 0->3 (disk: held only by excluded r2), 1->4 (peer), 7->0 (local, from a changed slot)
# r1: 4->7, 5->7 (one row of r0's changed slot 3 into two slots), 0->1 (r0's slot 1)
# r2: a 3-cycle of its own slots, 5->7 (r0 slot 3 again: one old row sent to two peers)
_NEW3 = [[3, 4, 2, 0, 7, 7, 6, 1, 5, 4, 3, 7]] * 2


@pytest.fixture(scope="module", params=PATHS)
def three_ranks(request, ckpts, tmp_path_factory):
    import os

    from .conftest import copy_checkpoint, rewrite_tensor
    from .test_rebalance import Scenario, Step, _run

    if request.param == "triton":
        pytest.importorskip("triton")
        from fp8_reload.kernels.triton.runtime import INTERPRET

        if not INTERPRET:  # (a CUDA host: compiled Triton cannot run the gloo ranks' CPU tensors)
            pytest.skip("the ranks hold CPU tensors, which Triton runs only in its interpreter")
    old, new = _placement(_OLD3, 3, 4), _placement(_NEW3, 3, 4)
    plan = RebalancePlan.build(old, new, "hybrid", (2,))
    assert plan.ranks[0].disk_experts() == {1: [3], 2: [3]}
    sends0 = plan.ranks[0].sends
    assert sorted(p for p in sends0) == [1, 2]
    bad = copy_checkpoint(ckpts["fp8", 0], tmp_path_factory.mktemp("bad3") / "ckpt")
    rewrite_tensor(bad, "model.layers.1.mlp.experts.3.up_proj.input_scale",
                   lambda t: torch.full_like(t, float("nan")))
    scenarios = [
        Scenario("rollback", "fp8", old, [Step(new, "hybrid", (2,), str(bad)),
                                          Step(new, "hybrid", (2,)), Step(old, "p2p")]),
        Scenario("bf16", "bf16", old, [Step(new, "p2p"), Step(old, "hybrid", (0,))]),
    ]
    prev = os.environ.get("FP8_RELOAD_REBALANCE_COPY")
    os.environ["FP8_RELOAD_REBALANCE_COPY"] = request.param  # the spawned ranks inherit it
    try:
        return _run(3, scenarios, {"fp8": ckpts["fp8", 0], "bf16": ckpts["bf16", 0]})
    finally:
        if prev is None:
            os.environ.pop("FP8_RELOAD_REBALANCE_COPY")
        else:
            os.environ["FP8_RELOAD_REBALANCE_COPY"] = prev


def test_three_ranks_roll_back_from_send_buffers_then_move(three_ranks):
    from .test_rebalance import _assert_equals_fresh

    for rank, res in enumerate(three_ranks["rollback", 0]):
        assert res["error"] and "rank(s) [0]" in res["error"], (rank, res["error"])
        assert not res["unchanged"], (rank, res["unchanged"][:3])
        assert not res["at_new"] and not res["diffs"]
    _assert_equals_fresh(three_ranks, "rollback", step=1)
    _assert_equals_fresh(three_ranks, "rollback", step=2)
    _assert_equals_fresh(three_ranks, "bf16", step=0)
    _assert_equals_fresh(three_ranks, "bf16", step=1)
