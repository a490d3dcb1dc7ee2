"""The expert-parallel benchmarks (`benchmarks/rebalance.py`, `benchmarks/ep_forward.py`) run in
this process on tiny models, every parameter set, on one pool per model (asv would build one
per parameter set): the numbers they report must add up, and the standalone tables that
`gpu/rebalance_2gpu.sh` prints must carry the figures the issue asks for.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math

import pytest

ENV = {"FP8_RELOAD_BENCH_DEVICE": "cpu", "FP8_RELOAD_BENCH_REBALANCE": "tiny:3",
       "FP8_RELOAD_BENCH_WHOLE": "tiny", "FP8_RELOAD_BENCH_MOVED": "0,2",
       "FP8_RELOAD_BENCH_EP_TOKENS": "48"}


@pytest.fixture(scope="module")
def mods(tmp_path_factory):
    """The benchmark modules imported with tiny parameters (fixed at import), their pools
    closed afterwards."""
    env = {**ENV, "FP8_RELOAD_BENCH_DIR": str(tmp_path_factory.mktemp("bench"))}
    with pytest.MonkeyPatch.context() as mp:  # parameters are read at import only
        for k, v in env.items():
            mp.setenv(k, v)
        out = {name: importlib.reload(importlib.import_module(f"benchmarks.{name}"))
               for name in ("ep_common", "rebalance", "ep_forward", "rebalance_table",
                            "ep_forward_report")}
    yield out
    out["ep_common"].close_pools()


def _run(cls, method):
    """{params: (bench, value) | 'skip: why'} for every parameter set of `cls.method`."""
    params = cls.params if isinstance(cls.params[0], list) else [cls.params]
    out = {}
    for combo in itertools.product(*params):
        bench = cls()
        try:
            bench.setup(*combo)
        except NotImplementedError as e:
            out[combo] = f"skip: {e}"
            continue
        out[combo] = (bench, getattr(bench, method)(*combo))
    return out


def test_rebalance_rows_and_their_bound_move_the_same_bytes(mods):
    reb = mods["rebalance"]
    rows = _run(reb.Rebalance, "time_rebalance")
    assert rows[0, "hybrid", "1"] == "skip: nothing moves: the same as p2p"
    ran = {k: v for k, v in rows.items() if not isinstance(v, str)}
    assert len(ran) == 2 * 4 * 2 - 2 and all(value is None for _, value in ran.values())
    for (moved, source, layers), (bench, _) in ran.items():
        reports = [r["report"] for r in bench.last]
        got = sum(r.experts_p2p + r.experts_disk for r in reports)
        n_layers = 1 if layers == "1" else 2
        assert got == moved * n_layers, (moved, source, layers)  # every moved expert arrived
        if source == "hybrid":  # rank 1 may not serve: rank 0 reads, rank 1 receives
            assert reports[0].experts_disk == reports[1].experts_p2p == moved // 2 * n_layers
    bounds = _run(reb.ContiguousExchange, "time_exchange")
    for (moved, layers), (bench, _) in bounds.items():
        p2p = rows[moved, "p2p", layers][0]
        assert bench.nbytes == max(r["report"].bytes_received for r in p2p.last) > 0
        assert all(len(t) == 1 and t[0] > 0 for t in bench.last)


def test_whole_model_moves_every_layer_and_checks_every_slot(mods):
    reb = mods["rebalance"]
    rows = _run(reb.WholeModelRebalance, "time_rebalance")
    (bench, _), = rows.values()
    reports = [r["report"] for r in bench.last]
    assert sum(r.experts_p2p for r in reports) == 2 * 2  # 2 moved in each of 2 MoE layers
    check = importlib.import_module("fp8_reload.testing.ep_bench").check_filled
    assert bench.pool.call(check) == [[], []]  # at the moved placement, every slot right
    (ex, _), = _run(reb.WholeModelExchange, "time_exchange").values()
    assert ex.nbytes == max(r.bytes_received for r in reports)


def test_ep_forward_tracks_add_up_and_balancing_evens_them(mods):
    ep = mods["ep_forward"]
    tokens = _run(ep.EPForwardRank, "track_tokens")
    moe = _run(ep.EPForwardRank, "track_moe_seconds")
    pairs = 2 * 48 * 2 * 2  # ranks x tokens x top-k x MoE layers
    for placement in ep.PLACEMENTS:
        assert sum(tokens[placement, r][1] for r in range(2)) == pairs
        assert all(moe[placement, r][1] > 0 for r in range(2))
    imbalance = _run(ep.EPBalance, "track_tokens_imbalance")
    assert imbalance["balanced",][1] <= imbalance["start",][1]
    assert all(v[1] >= 1.0 for v in imbalance.values())
    for v in _run(ep.EPBalance, "track_moe_imbalance").values():
        assert math.isfinite(v[1]) and v[1] >= 1.0
    assert all(v[1] is None for v in _run(ep.EPForward, "time_forward").values())


def test_standalone_tables_carry_the_issue_figures(mods, tmp_path, capsys):
    assert mods["rebalance_table"].main(["--repeat", "1", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    p2p = [r for r in data["rows"] if r["source"] == "p2p" and r["experts_moved_per_layer"]]
    assert {r["layers"] for r in p2p} == {"1", "all", "whole"}
    assert all(r["bound_rank_median_s"] > 0 and r["bytes_per_rank"] > 0 for r in p2p)
    assert len(data["meta"]["headline"]) == 3
    assert all("ms per layer" in h and "of one contiguous transfer" in h for h in data["meta"]["headline"])
    assert mods["ep_forward_report"].main(["--json", str(tmp_path / "e.json"),
                                           "--plot", str(tmp_path / "e.png")]) == 0
    ep = json.loads((tmp_path / "e.json").read_text())
    assert set(ep["results"]) == {"start", "balanced"}
    assert (tmp_path / "e.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "slowest rank / mean per layer" in out and "goal: slowest rank's MoE time" in out
