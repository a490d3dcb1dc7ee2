"""`fp8-reload report`'s expert-parallel tables on a synthetic asv results directory: each p2p
rebalance beside the contiguous bound of the same run, and the EP forward's balance."""

from __future__ import annotations

import math

import pandas as pd

from fp8_reload.tools.report import load_results, write_report
from fp8_reload.tools.report.rebalance import ep_forward_table, rebalance_table

from .asv_files import write_benchmarks_json, write_machine, write_result

REB = "rebalance.Rebalance.time_rebalance"
EXCH = "rebalance.ContiguousExchange.time_exchange"
WHOLE = "rebalance.WholeModelRebalance.time_rebalance"
WHOLE_EX = "rebalance.WholeModelExchange.time_exchange"
TOK = "ep_forward.EPForwardRank.track_tokens"
MOE = "ep_forward.EPForwardRank.track_moe_seconds"
TOK_IMB = "ep_forward.EPBalance.track_tokens_imbalance"
MOE_IMB = "ep_forward.EPBalance.track_moe_imbalance"
FWD = "ep_forward.EPForward.time_forward"
SOURCES = ["p2p", "disk", "hybrid", "disk-cold"]
PL = ["start", "balanced"]


def _results(tmp_path):
    root = tmp_path / "asv"
    moved = ["experts_moved_per_layer"]
    write_benchmarks_json(root, {
        REB: (moved + ["source", "layers"], [[8, 32], SOURCES, ["1", "all"]], "seconds"),
        EXCH: (moved + ["layers"], [[8, 32], ["1", "all"]], "seconds"),
        WHOLE: (moved, [[32]], "seconds"), WHOLE_EX: (moved, [[32]], "seconds"),
        TOK: (["placement", "rank"], [PL, [0, 1]], "tokens"),
        MOE: (["placement", "rank"], [PL, [0, 1]], "seconds"),
        TOK_IMB: (["placement"], [PL], "slowest/mean"), MOE_IMB: (["placement"], [PL], "slowest/mean"),
        FWD: (["placement"], [PL], "seconds"),
    })
    write_machine(root, "gpu2")
    # product order: moved, source, layers
    reb = [0.001 * (1 + i) for i in range(16)]
    write_result(root, "gpu2", "e" * 40, {
        REB: ([[8, 32], SOURCES, ["1", "all"]], reb),
        EXCH: ([[8, 32], ["1", "all"]], [0.0005, 0.0009, 0.0004, 0.0010]),
        WHOLE: ([[32]], [0.052]), WHOLE_EX: ([[32]], [0.026]),
        TOK: ([PL, [0, 1]], [3000, 1000, 2010, 1990]),
        MOE: ([PL, [0, 1]], [0.003, 0.001, 0.002, 0.0019]),
        TOK_IMB: ([PL], [1.5, 1.005]), MOE_IMB: ([PL], [1.45, 1.03]),
        FWD: ([PL], [0.010, 0.008]),
    })
    return root


def test_rebalance_rows_sit_beside_their_bound(tmp_path):
    table = rebalance_table(load_results(_results(tmp_path))).set_index(
        ["experts_moved_per_layer", "layers"])
    one = table.loc[(8, "1")]
    assert math.isclose(one["p2p ms"], 1.0) and math.isclose(one["disk ms"], 3.0)
    assert math.isclose(one["hybrid ms"], 5.0) and math.isclose(one["disk-cold ms"], 7.0)
    assert math.isclose(one["bound ms"], 0.5) and math.isclose(one["p2p share of bound"], 0.5)
    assert math.isclose(table.loc[(32, "all"), "p2p share of bound"], 1.0 / 10.0)
    whole = table.loc[(32, "whole")]
    assert math.isclose(whole["p2p ms"], 52.0) and math.isclose(whole["p2p share of bound"], 0.5)


def test_ep_forward_rows_per_placement(tmp_path):
    table = ep_forward_table(load_results(_results(tmp_path))).set_index("placement")
    assert table.index.tolist() == ["start", "balanced"]
    assert table.loc["start", "rank 0 tokens"] == 3000 and table.loc["balanced", "rank 1 tokens"] == 1990
    assert math.isclose(table.loc["start", "rank 0 MoE ms"], 3.0)
    assert table.loc["balanced", "MoE slowest/mean"] == 1.03
    assert math.isclose(table.loc["balanced", "forward ms"], 8.0)


def test_write_report_adds_the_expert_parallel_section(tmp_path):
    written = write_report(_results(tmp_path), tmp_path / "report")
    assert {"rebalance.csv", "ep_forward.csv"} <= set(written)
    md = (tmp_path / "report" / "headline.md").read_text()
    assert "## Expert parallel" in md and "contiguous transfer of the same bytes" in md
    csv = pd.read_csv(tmp_path / "report" / "rebalance.csv")
    assert {"p2p ms", "bound ms", "p2p share of bound"} <= set(csv.columns)
