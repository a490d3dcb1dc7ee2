"""The rebalance's row moves: the batched copy kernel (Triton's interpreter on CPU), the
`RowMover` on both paths against `pack_slots`, a rollback restored from the send buffers,
and whole rebalances on 2 gloo ranks with the kernel forced."""

from __future__ import annotations

import pytest
import torch

from fp8_reload.expert_parallel import (
    RebalancePlan,
    load_rank_model,
    moe_layer_map,
    pack_slots,
    slot_tensors,
)
from fp8_reload.expert_parallel.transfer import RowMover, Run, plan_moves, run_bytes
from fp8_reload.state import compare_states, snapshot
from fp8_reload.tools.rebalance import param_ids

from .test_rebalance import Scenario, Step, _assert_equals_fresh, _hand_placement, _run, _skewed

PATHS = ["index", "triton"]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernel compiled, or interpreted


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("FP8_RELOAD_REBALANCE_COPY", request.param)
    if request.param == "triton":
        pytest.importorskip("triton")
        from fp8_reload.kernels.triton import runtime

        if not runtime.INTERPRET and not torch.cuda.is_available():
            pytest.skip("triton was imported without its interpreter")
    return request.param


def test_copy_rows_copies_every_range_and_nothing_else():
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton.copy_rows import BLOCK_BYTES, copy_rows_

    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (3 * BLOCK_BYTES,), dtype=torch.uint8, generator=g).to(DEV)
    dst = torch.zeros(6 * BLOCK_BYTES, dtype=torch.uint8, device=DEV)
    # (source offset, destination offset, bytes): aligned whole blocks and a tail, aligned
    # words with a partial block, odd offsets, a 4-byte scale, an empty row
    cases = [(0, 0, 2 * BLOCK_BYTES + 48), (16, 2 * BLOCK_BYTES + 64, 1000), (3, 3 * BLOCK_BYTES + 1, 4097),
             (8, 4 * BLOCK_BYTES + 5, 4), (0, 5 * BLOCK_BYTES, 0)]
    col = lambda base, i: torch.tensor([base.data_ptr() + c[i] for c in cases])  # noqa: E731
    copy_rows_(col(src, 0), col(dst, 1), torch.tensor([c[2] for c in cases]), DEV)
    want = torch.zeros_like(dst)
    for s, d, n in cases:
        want[d:d + n] = src[s:s + n]
    assert torch.equal(dst, want), f"first difference at byte {int((dst != want).nonzero()[0])}"


def test_row_mover_packs_like_pack_slots_and_scatters_back(ckpts, path):
    start, _ = _hand_placement()
    model = load_rank_model(ckpts["fp8", 0], start, rank=0, device=DEV)
    layers = moe_layer_map(model)
    ids = param_ids(model)
    mover = RowMover(layers, DEV)
    assert mover.kernel == (path == "triton") and mover.path == path
    w1, w2 = mover.row_bytes(1), mover.row_bytes(2)
    off = run_bytes(2, w1)
    buf = torch.zeros(off + run_bytes(3, w2), dtype=torch.uint8, device=DEV)
    mover.gather([Run(1, [3, 1], buf, 0, 2), Run(2, [0, 4, 2], buf, off, 3)])
    assert torch.equal(buf[:2 * w1], pack_slots(layers[1], [3, 1]))
    assert torch.equal(buf[off:off + 3 * w2], pack_slots(layers[2], [0, 4, 2]))
    # row 0 (slot 3's) fills slots 0 and 2, row 1 (slot 1's) slot 4
    want = {s: [t[src:src + 1].clone() for t in slot_tensors(layers[1])]
            for s, src in ((0, 3), (2, 3), (4, 1))}
    mover.scatter([Run(1, [0, 2, 4], buf, 0, 2, [0, 0, 1])])
    for s, rows in want.items():
        for t, w in zip(slot_tensors(layers[1]), rows):
            assert torch.equal(t[s:s + 1].view(torch.uint8), w.view(torch.uint8)), f"slot {s}"
    assert param_ids(model) == ids


def test_rollback_restores_changed_slots_from_send_buffers_and_backup(ckpts, path):
    """Every changed slot gets its old row back: those it sent from the send buffer (no
    second copy was taken), the others from the backup."""
    start, hand = _hand_placement()
    skewed = _skewed(start)
    for new, mode in ((skewed, "p2p"), (hand, "hybrid")):
        model = load_rank_model(ckpts["fp8", 0], start, rank=0, device=DEV)
        layers = moe_layer_map(model)
        mine = RebalancePlan.build(start, new, mode).ranks[0]
        mover = RowMover(layers, DEV)
        moves = plan_moves(mover, mine, DEV)
        sent = {(r.lid, s) for r in moves.sends for s in r.slots}
        kept = {(r.lid, s) for r in moves.restore if r.buf.data_ptr() in
                {b.data_ptr() for b in moves.send_bufs.values()} for s in r.slots}
        assert kept and kept <= sent, (new, mode)
        before = snapshot(model)
        mover.gather(moves.sends)
        mover.gather(moves.local + moves.backup)
        for lid, changed in mine.changed.items():  # a half-done commit: garbage in every slot
            for t in slot_tensors(layers[lid]):
                t[sorted(changed)] = t[sorted(changed)].view(torch.uint8).add(1).view(t.dtype)
        assert compare_states(before, snapshot(model))
        mover.scatter(moves.restore)
        assert not compare_states(before, snapshot(model), identity=True)


def test_rebalance_with_the_copy_kernel_equals_fresh_load(ckpts, monkeypatch):
    """The ranks (spawned: they inherit the environment) move rows with the kernel."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("gloo ranks hold CPU tensors; on a GPU host the benchmark checks NCCL ranks")
    monkeypatch.setenv("FP8_RELOAD_REBALANCE_COPY", "triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ck = {"fp8": ckpts["fp8", 0], "bf16": ckpts["bf16", 0]}
    start, hand = _hand_placement()
    skewed = _skewed(start)
    scenarios = [
        Scenario("fp8-p2p", "fp8", start, [Step(skewed, "p2p"), Step(start, "p2p")]),
        Scenario("fp8-hybrid", "fp8", start, [Step(hand, "hybrid", (1,))]),
        Scenario("fp8-hand-p2p", "fp8", start, [Step(hand, "p2p")]),
        Scenario("bf16-p2p", "bf16", start, [Step(hand, "p2p")]),
    ]
    results = _run(2, scenarios, ck)
    for sc in scenarios:
        for i in range(len(sc.steps)):
            _assert_equals_fresh(results, sc.name, step=i)
