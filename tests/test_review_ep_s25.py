"""Review s25 of the expert-parallel paths (an attack on real gloo ranks; reproductions in
`.scratch/attack25b/`). Each case failed before its fix:

* a Ctrl-C (KeyboardInterrupt) in one rank's commit left that rank half moved and its peer
  waiting in the outcome vote; now every rank rolls back and that rank raises it;
* a rolled-back disk rebalance from ``checkpoint=C`` left ``model.checkpoint_path`` at C, so
  the next default disk rebalance read C's experts;
* a rank with undefined weights (a failed restore) served them to its peers by P2P;
* `Placement` took a layer twice, `from_rank_slots` read a layer by another's rank sizes;
* the EP forward read fp16 tokens as bf16 bytes (and misread the slot column of fp32);
* `RankPool` kept a timed-out rank's late reply and returned it for the next command.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fp8_reload.expert_parallel import Placement, RankPool, RebalanceError

from .test_review_ep import _bounded

E, SLOTS = 8, 5


def _swap(start: Placement) -> Placement:
    """Rank 0's slot 0 and rank 1's slot 0 trade experts in every layer."""
    t = start.table.clone()
    s = start.slots_per_rank
    t[:, 0], t[:, s] = start.table[:, s], start.table[:, 0]
    return Placement(start.layers, E, start.ep_size, s, t)


def _interrupted_commit(rank, world, device, path):
    from fp8_reload.expert_parallel import load_rank_model, moe_layer_map, rebalance
    from fp8_reload.state import compare_states, snapshot

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]  # (the package's `rebalance` is the function)
    start = Placement.round_robin((1, 2), E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    before = snapshot(model)
    if rank == 0:
        write, calls = rb.write_slots, []

        def interrupted(mover, runs):
            write(mover, runs)  # the first batch lands, the Ctrl-C comes during the second
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        rb.write_slots = interrupted
    try:
        rebalance(model, _swap(start) if rank == 0 else None, mode="p2p")
        raised = None
    except BaseException as e:  # noqa: BLE001  (the KeyboardInterrupt is the point)
        raised = type(e).__name__
    layers = moe_layer_map(model)
    return {"raised": raised, "diffs": compare_states(before, snapshot(model)),
            "old placement": model.placement == start,
            "slots match": all(layers[lid].expert_slots == start.local_slots(lid, rank) for lid in (1, 2))}


def test_a_ctrl_c_in_one_ranks_commit_rolls_every_rank_back(ckpts):
    results = _bounded(_interrupted_commit, 2, str(ckpts["fp8", 0]))
    assert [r.get("raised") for r in results] == ["KeyboardInterrupt", "RebalanceError"], results
    for r in results:
        assert r["diffs"] == [] and r["old placement"] and r["slots match"], r


def _disk_from_another_checkpoint(rank, world, device, a, c):
    from fp8_reload.expert_parallel import load_rank_model, rebalance
    from fp8_reload.state import compare_states, snapshot

    rb = sys.modules["fp8_reload.expert_parallel.rebalance"]
    start = Placement.round_robin((1, 2), E, world, SLOTS)
    model = load_rank_model(a, start, rank, device)
    write = rb.write_slots
    if rank == 1:
        def fail(*args):
            raise RuntimeError("planted failure in rank 1's commit")
        rb.write_slots = fail
    try:
        rebalance(model, _swap(start) if rank == 0 else None, mode="disk", checkpoint=c)
        first = "ok"
    except RebalanceError:
        first = "rolled back"
    rb.write_slots = write
    path_after = str(model.checkpoint_path)
    rebalance(model, _swap(start) if rank == 0 else None, mode="disk")  # from what it was loaded from
    fresh = load_rank_model(a, model.placement, rank, device)
    return {"first": first, "path after": path_after, "path": str(model.checkpoint_path),
            "diffs": compare_states(snapshot(fresh), snapshot(model))}


def test_a_rolled_back_disk_rebalance_keeps_the_checkpoint_the_model_came_from(ckpts):
    a, c = str(ckpts["fp8", 0]), str(ckpts["fp8", 1])
    for r in _bounded(_disk_from_another_checkpoint, 2, a, c):
        assert r.get("first") == "rolled back", r
        assert r["path after"] == r["path"] == a and r["diffs"] == [], r


def _undefined_on_rank1(rank, world, device, path):
    from fp8_reload.expert_parallel import load_rank_model, moe_layer_map, rebalance
    from fp8_reload.state import compare_states, snapshot

    start = Placement.round_robin((1, 2), E, world, SLOTS)
    model = load_rank_model(path, start, rank, device)
    if rank == 1:  # what a RollbackError leaves: bytes undefined, the model marked
        for layer in moe_layer_map(model).values():
            layer.w13_weight.data[0].view(torch.uint8).fill_(0x7E)
        model.weights_undefined = "reload from X failed, and restoring the backup failed too"
    before = snapshot(model)
    try:
        rebalance(model, _swap(start) if rank == 0 else None, mode="p2p")
        outcome = "ok"
    except RebalanceError as e:
        outcome = str(e)
    return {"outcome": outcome, "diffs": compare_states(before, snapshot(model))}


def test_a_rank_with_undefined_weights_makes_every_rank_refuse(ckpts):
    results = _bounded(_undefined_on_rank1, 2, str(ckpts["fp8", 0]))
    for r in results:
        assert "nothing was changed" in r.get("outcome", "") and r["diffs"] == [], r
    assert "undefined" in results[1]["outcome"]


def test_a_placement_names_each_layer_once_and_every_layer_by_its_own_sizes():
    table = Placement.round_robin((1,), E, 2, SLOTS).table
    with pytest.raises(ValueError, match="name a layer twice"):
        Placement((1, 1), E, 2, SLOTS, table.repeat(2, 1))
    with pytest.raises(ValueError, match="layer 2 \\[3, 1\\]"):
        Placement.from_rank_slots(4, {1: [[0, 1], [2, 3]], 2: [[0, 1, 2], [3]]})
    with pytest.raises(ValueError, match="at least one layer"):
        Placement.from_rank_slots(4, {})
    with pytest.raises(ValueError, match="slots_per_rank must be >= 1"):
        Placement.round_robin((1,), E, 2, 0)


def _forward_in(rank, world, device, path, dtype):
    from fp8_reload.expert_parallel import ep_moe_forward, load_rank_model

    model = load_rank_model(path, Placement.round_robin((1, 2), E, world, SLOTS), rank, device)
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(rank))
    try:
        ep_moe_forward(model, 1, x.to(getattr(torch, dtype)))
        return {"outcome": "ran"}
    except Exception as e:  # noqa: BLE001
        return {"outcome": f"{type(e).__name__}: {e}"}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_ep_forward_refuses_tokens_that_are_not_bf16_on_every_rank(ckpts, dtype):
    for r in _bounded(_forward_in, 2, str(ckpts["fp8", 0]), dtype):
        assert "takes bf16 tokens" in r["outcome"] and f"torch.{dtype}" in r["outcome"], r


def _slow_on_rank1(model, tag, seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return f"{tag} from rank {dist.get_rank()}"


def test_a_rank_pool_that_timed_out_is_closed_not_reused_out_of_step(ckpts):
    pool = RankPool(2, "gloo", ckpts["fp8", 0], Placement.round_robin((1, 2), E, 2, SLOTS), timeout_s=5)
    try:
        assert pool.call(_slow_on_rank1, "warm", 0) == ["warm from rank 0", "warm from rank 1"]
        with pytest.raises(TimeoutError, match="rank 1 did not answer within 5 s; the rank pool is closed"):
            pool.call(_slow_on_rank1, "first", 30)
        with pytest.raises(RuntimeError, match="the rank pool is closed \\(rank 1 did not answer"):
            pool.call(_slow_on_rank1, "second", 0)
    finally:
        pool.close()


def test_the_rebalance_command_on_one_rank_and_with_a_checkpoint_of_either_kind(ckpts, capsys, tmp_path):
    """`--exclude-sources` defaulted to rank 1 even with one rank (refused, about an option not
    given); `--checkpoint` of bf16 was reported as fp8 (the `--kind` default)."""
    from fp8_reload.tools import cli

    assert cli.main(["rebalance", "--world-size", "1", "--mode", "p2p"]) == 0
    bf16 = str(ckpts["bf16", 0])
    assert cli.main(["rebalance", "--checkpoint", bf16, "--kind", "fp8"]) == 2
    assert f"--kind fp8: --checkpoint {bf16} is bf16" in capsys.readouterr().err
    out = tmp_path / "rows.json"
    assert cli.main(["rebalance", "--checkpoint", bf16, "--mode", "p2p", "--json", str(out)]) == 0
    assert {row["kind"] for row in json.loads(out.read_text())} == {"bf16"}
