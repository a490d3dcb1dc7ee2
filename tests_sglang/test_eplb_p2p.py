"""sglang's own EPLB move between ranks (`update_expert_weights_single_layer`: P2P over two
gloo ranks, and copies within a rank) on the patched per-tensor layer.

After the move, and after a filtered reload that follows it, each rank must equal a fresh
load of that rank under the new placement, bit for bit, kernel inputs included. A static
input scale is one value per layer for the kernels (the max over the rank's experts), so it
must follow the experts that move: sglang moves every ``[E]`` Parameter, never a buffer.
Upstream makes that scale a 0-dim Parameter, which no move touches: the rank keeps the max of
the experts it no longer holds (reproduced below).

Each rank's layer is its share of the checkpoint's MoE layer built as sglang's `FusedMoE` of
`LOCAL` experts (the expert-parallel groups sglang would build around it are not built here);
slot s of rank r holds logical expert ``placement[r * LOCAL + s]``, loaded through the real
`weight_loader`. All cases run in one pair of spawned ranks (each imports sglang once).
"""

from __future__ import annotations

import dataclasses

import pytest

from fp8_reload import sglang_patch
from fp8_reload.expert_parallel.launch import run_ranks

from .conftest import CFG
from .sgl_model import (
    EXPERTS_PREFIX,
    byte_diffs,
    changed_since,
    eplb_move,
    load_experts,
    make_experts,
    read_tensors,
    snapshot,
)

WORLD = 2
LOCAL = CFG.num_experts // WORLD
RELOADED_SLOT = 1


def _load_slots(moe, slots: dict[int, tuple]) -> None:
    """Slot s <- logical expert e of checkpoint p, for ``slots[s] = (p, e)`` (a rank's
    experts are distinct)."""
    load_experts(moe, {e: path for path, e in slots.values()},
                 slot_of={e: s for s, (_, e) in slots.items()})


def _rank_layer(kind, placement, rank, path, override=None):
    """A fresh load of `rank`'s share under `placement` (slots in `override` from elsewhere)."""
    moe = make_experts(dataclasses.replace(CFG, num_experts=LOCAL), kind)
    slots = {s: (path, placement[rank * LOCAL + s]) for s in range(LOCAL)}
    _load_slots(moe, {**slots, **(override or {})})
    moe.quant_method.process_weights_after_loading(moe)
    return moe


def _kernel_scales(moe) -> list:
    """The activation scales the Triton MoE kernel gets (None for dynamic ones)."""
    info = moe.quant_method.get_triton_quant_info(moe)
    return [None if s is None else float(s) for s in (info.a13_scale, info.a2_scale)]


def _case(rank, kind, patched, paths, old, new) -> dict:
    from sglang.srt.layers.quantization import fp8, utils

    from .cpu_bootstrap import cpu_scaled_fp8_quant_

    if not patched:  # sglang's own processing needs a CPU scaled_fp8_quant
        fp8.scaled_fp8_quant = utils.scaled_fp8_quant = cpu_scaled_fp8_quant_
    (sglang_patch.apply if patched else sglang_patch.revert)()
    base, donor = paths
    moe = _rank_layer(kind, old, rank, base)
    before = snapshot(moe)

    def against(fresh) -> dict:
        return {"diffs": byte_diffs(moe, fresh), "kernel": _kernel_scales(moe),
                "fresh_kernel": _kernel_scales(fresh), "replaced": changed_since(moe, before)[0]}

    eplb_move(moe, old, new, rank, WORLD)
    out = {"moved": against(_rank_layer(kind, new, rank, base))}
    if patched:  # then EPLB's filtered reload of one slot, from another checkpoint
        donor_slot = {RELOADED_SLOT: (donor, new[rank * LOCAL + RELOADED_SLOT])}
        _load_slots(moe, donor_slot)
        moe.quant_method.process_weights_after_loading(moe)
        out["reloaded"] = against(_rank_layer(kind, new, rank, base, donor_slot))
    return out


def _rank(rank, world, device, model_path, cases):
    from .cpu_bootstrap import publish_cpu_scheduler

    publish_cpu_scheduler(model_path)  # sglang's config of one rank: the layers here are local
    try:
        return [_case(rank, *case) for case in cases]
    finally:
        sglang_patch.revert()


def _placements(path) -> tuple[list[int], list[int]]:
    """Rank-contiguous placement, then one where the expert with the largest down-projection
    input scale changes rank (so both ranks' layer max moves) and rank 1 permutes two slots."""
    names = [f"{EXPERTS_PREFIX}.{e}.down_proj.input_scale" for e in range(CFG.num_experts)]
    scales = dict(read_tensors(path, names))
    w2 = [float(scales[n]) for n in names]
    old = list(range(CFG.num_experts))
    top = max(old, key=w2.__getitem__)
    other = LOCAL if top < LOCAL else 0
    new = list(old)
    new[top], new[other] = new[other], new[top]
    a, b = LOCAL + 2, LOCAL + 3
    new[a], new[b] = new[b], new[a]
    for r in range(WORLD):  # the case is only a test if each rank's max changes
        share = slice(r * LOCAL, (r + 1) * LOCAL)
        assert max(w2[e] for e in old[share]) != max(w2[e] for e in new[share])
    return old, new


@pytest.fixture(scope="module")
def moved(ckpts):
    """{(kind, patched): [per-rank result]} from one pair of spawned ranks."""
    old, new = _placements(ckpts[("fp8", 0)])
    keys = [("fp8", True), ("bf16", True), ("fp8", False)]
    cases = [(kind, patched, (ckpts[(kind, 0)], ckpts[(kind, 1)]), old, new)
             for kind, patched in keys]
    results = run_ranks(_rank, WORLD, "gloo", ckpts[("fp8", 0)], cases)
    return {key: [results[r][i] for r in range(WORLD)] for i, key in enumerate(keys)}


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("stage", ["moved", "reloaded"], ids=["after-move", "then-filtered-reload"])
def test_patched_layer_after_sglang_eplb_move_is_a_fresh_load(moved, kind, stage):
    for rank, got in enumerate(moved[(kind, True)]):
        got = got[stage]
        assert got["diffs"] == [], (rank, got)
        assert got["kernel"] == got["fresh_kernel"], (rank, got)
        assert got["replaced"] == [], (rank, got)


def test_upstream_keeps_the_input_scale_of_experts_moved_away(moved):
    """sglang's own layer: weights and weight scales move, the 0-dim input scales do not."""
    for rank, got in enumerate(moved[("fp8", False)]):
        got = got["moved"]
        assert "w2_input_scale" in got["diffs"], (rank, got)
        assert set(got["diffs"]) <= {"w13_input_scale", "w2_input_scale"}, (rank, got)
        assert got["kernel"][1] != got["fresh_kernel"][1], (rank, got)


def test_cases_use_real_scales(moved):
    """Static input scales on the fp8 checkpoint, dynamic on bf16 (no scale to move)."""
    assert all(s is not None for got in moved[("fp8", True)] for s in got["moved"]["fresh_kernel"])
    assert all(got["moved"]["fresh_kernel"] == [None, None] for got in moved[("bf16", True)])
