"""`fp8-reload report` on a synthetic asv results directory: numbers, targets, files."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

import fp8_reload as fr
from fp8_reload.tools.cli import main
from fp8_reload.tools.report import fraction_value, headline, load_results, write_report

from .asv_files import write_benchmarks_json, write_machine, write_result

FR = ["1/layer", "10%", "50%", "100%"]
ST = ["fixed", "scan-all", "upstream-style"]
KINDS = ["fp8", "bf16"]
READERS = ["safetensors", "preadv"]
FILTERED = "reload.FilteredReload.time_reload"
FULL = "reload.FullReload.time_reload"
RAW = "reload.RawReadCopy.time_read_copy"
PROC = "processing.ProcessMoELayer.time_process"
MEM = "reload.ReloadDeviceMemory.track_peak_bytes"
BOUND = "reload.DeviceMemoryBound.track_bound_bytes"
FWD = "forward.MoEForward.time_forward"
ACC = "accuracy.ForwardAccuracy.track_calc_diff"
SM = "forward.DeepGemmScaleMode.time_forward"
EX = "forward.BlockScaleExpansion.time_block_scales"
NAN = float("nan")


def filtered_times(kind):
    base = 0.010 if kind == "fp8" else 0.020
    # fixed grows with the share; scan-all / upstream-style stay near a full read
    out = []
    for i, _ in enumerate(FR):
        out += [base * (1 + 3 * i), 0.200, 0.250]
    return out


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "asv"
    write_benchmarks_json(root, {
        FILTERED: (["preset", "kind", "experts", "strategy"], [["small"], KINDS, FR, ST], "seconds"),
        FULL: (["preset", "kind"], [["small"], KINDS], "seconds"),
        RAW: (["preset", "kind", "experts", "reader"], [["small"], KINDS, FR + ["full"], READERS],
              "seconds"),
        PROC: (["preset", "kind", "impl"], [["small"], KINDS, ["upstream", "fixed", "fixed-1-expert"]],
               "seconds"),
        MEM: (["preset", "kind", "experts"], [["small"], KINDS, FR + ["full"]], "bytes"),
        BOUND: ([], [], "bytes"),
        FWD: (["preset", "backend", "tokens"], [["small"], ["torch", "triton"], [16, 128]], "seconds"),
        ACC: (["preset", "backend", "tokens"], [["small"], ["torch", "triton"], [64]], "calc_diff"),
        SM: (["preset", "scale_mode", "tokens"], [["small"], ["precomputed", "cached", "per-forward"],
                                                  [128]], "seconds"),
        EX: (["preset", "expansion"], [["small"], ["per-forward", "cached"]], "seconds"),
    })
    write_machine(root, "box", gpu="Test GPU")
    res = {
        FILTERED: ([["small"], KINDS, FR, ST], filtered_times("fp8") + filtered_times("bf16")),
        FULL: ([["small"], KINDS], [0.100, 0.400]),
        # safetensors then preadv per share; the preadv reader is the faster one for "full"
        RAW: ([["small"], KINDS, FR + ["full"], READERS],
              [0.001, 0.001, 0.002, 0.002, 0.005, 0.005, 0.01, 0.01, 0.090, 0.080] * 2),
        PROC: ([["small"], KINDS, ["upstream", "fixed", "fixed-1-expert"]],
               [0.050, 0.004, 0.001, 0.050, 0.100, 0.002]),
        MEM: ([["small"], KINDS, FR + ["full"]], [NAN] * 5 + [50 * 2**20, NAN, NAN, NAN, 3 * 2**30]),
        BOUND: ([], [256 * 2**20]),
        FWD: ([["small"], ["torch", "triton"], [16, 128]], [0.002, 0.004, NAN, None]),
        ACC: ([["small"], ["torch", "triton"], [64]], [1.5e-3, NAN]),
        SM: ([["small"], ["precomputed", "cached", "per-forward"], [128]], [0.00100, 0.00102, 0.00125]),
        EX: ([["small"], ["per-forward", "cached"]], [2e-5, 1e-6]),
    }
    write_result(root, "box", "c" * 40, res, started_at=2000)
    # an older run of another commit on the same machine: must not leak into the report
    write_result(root, "box", "d" * 40, {FULL: ([["small"], KINDS], [9.0, 9.0])}, started_at=1000)
    return root


def test_load_results_is_tidy_and_keeps_the_newest_run(results):
    df = load_results(results)
    assert set(df["commit"]) == {"c" * 40}
    full = df[df.benchmark == FULL].set_index("kind")["value"]
    assert full["fp8"] == 0.100 and full["bf16"] == 0.400
    f = df[(df.benchmark == FILTERED) & (df.kind == "bf16") & (df.experts == "50%")
           & (df.strategy == "fixed")]
    assert len(f) == 1 and math.isclose(f["value"].iloc[0], 0.020 * 7)
    fw = df[df.benchmark == FWD]
    assert fw["failed"].tolist() == [False, False, False, True]
    assert load_results(results, commit="dddd")["value"].tolist() == [9.0, 9.0]


def test_headline_ratios_and_targets(results):
    hl = headline(load_results(results)).set_index(["kind", "figure"])
    fp8 = hl.loc["fp8"]
    filt = fp8.loc["filtered reload, 1 expert/layer: upstream-style / fixed"]
    assert filt["value"] == 25.0 and bool(filt["met"])
    raw = fp8.loc["full reload vs plain read+copy (issue 4's baseline)"]
    assert raw["value"] == 80.0 and bool(raw["met"])  # the best reader is the baseline
    assert "baseline 80.0 ms (preadv; preadv 80.0 ms, safetensors 90.0 ms)" in raw["detail"]
    assert "not a bound" not in raw["detail"]
    h2d = fp8.loc["full reload vs pinned host-to-device copy"]
    assert h2d["met"] is None and "no pinned-copy limit measured" in h2d["detail"]
    proc = fp8.loc["post-processing, one MoE layer: upstream loop / fixed"]
    assert proc["value"] == 12.5 and bool(proc["met"])
    bf16 = hl.loc["bf16"]
    assert bf16.loc["filtered reload, 1 expert/layer: upstream-style / fixed"]["value"] == 12.5
    assert not bool(bf16.loc["filtered reload, 1 expert/layer: upstream-style / fixed"]["met"])
    assert bf16.loc["full reload vs plain read+copy (issue 4's baseline)"]["value"] == 20.0
    assert bf16.loc["post-processing, one MoE layer: upstream loop / fixed"]["value"] == 0.5
    mem = fp8.loc["reload device-memory peak above the model"]
    assert mem["met"] is None and "needs CUDA" in mem["detail"]
    mem = bf16.loc["reload device-memory peak above the model"]
    assert mem["value"] == 3072.0 and not bool(mem["met"]) and mem["target"] == "<= 256 MiB"
    assert "1 expert/layer 50.0 MiB, full 3072.0 MiB" in mem["detail"]


def test_memory_is_judged_by_the_bound_recorded_with_the_results(results):
    df = load_results(results)
    loose = df.copy()
    loose.loc[loose.benchmark == BOUND, "value"] = 4 * 2**30  # the measured code allowed 4 GiB
    mem = headline(loose).set_index(["kind", "figure"]).loc[
        ("bf16", "reload device-memory peak above the model")]
    assert bool(mem["met"]) and mem["target"] == "<= 4096 MiB"
    older = df[df.benchmark != BOUND]  # results from before the bound was recorded: not judged
    mem = headline(older).set_index(["kind", "figure"]).loc[
        ("bf16", "reload device-memory peak above the model")]
    assert mem["met"] is None and mem["value"] == 3072.0
    assert mem["target"] == f"<= {fr.reload.device_memory_bound() >> 20} MiB (this code's)"
    assert "not judged" in mem["detail"]


def test_write_report_files(results, tmp_path):
    out = tmp_path / "report"
    written = write_report(results, out)
    assert set(written) == {"results.csv", "headline.csv", "headline.md", "forward.csv", "scales.csv",
                            "reload_vs_fraction.png", "forward_tflops.png"}
    for png in ("reload_vs_fraction.png", "forward_tflops.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "headline.md").read_text()
    assert "## box (commit cccccccc)" in md and "gpu: Test GPU" in md and "cpu: Test CPU" in md
    assert "| small | fp8 | filtered reload, 1 expert/layer: upstream-style / fixed | 25 |" in md
    assert "1 benchmark runs failed" in md
    csv = pd.read_csv(out / "headline.csv")
    assert {"machine", "commit", "preset", "kind", "figure", "value", "target", "met"} <= set(csv.columns)
    fw = pd.read_csv(out / "forward.csv").set_index(["backend", "tokens"])
    cfg = fr.MoEConfig.preset("small")
    flops = 2 * 128 * cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert math.isclose(fw.loc[("torch", 128), "tflops"], flops / 0.004 / 1e12)
    assert fw.loc[("torch", 16), "calc_diff"] == 1.5e-3
    assert ("triton", 128) not in fw.index  # failed run: no throughput
    sc = pd.read_csv(out / "scales.csv").set_index("what")
    row = sc.loc["DeepGEMM forward, 128 tokens"]
    assert row["cached vs precomputed"] == "98.0%" and row["per-forward vs precomputed"] == "80.0%"
    assert sc.loc["block scales alone (w13 + w2)"]["note"] == \
        "cached lookup 20x faster than re-expanding"
    assert "Block scales for DeepGEMM" in md


def test_fraction_values_match_the_benchmarks():
    from benchmarks.common import fraction_experts, preset_config

    for preset in ("tiny", "small", "v2-lite:2"):
        cfg = preset_config(preset)
        for label in FR:
            chosen = fraction_experts(cfg, label)
            assert set(chosen) == set(cfg.moe_layers)
            assert all(len(v) == len(set(v)) for v in chosen.values())
            n = len(next(iter(chosen.values())))
            assert math.isclose(fraction_value(label, cfg.num_experts), n / cfg.num_experts)


def test_cli_report(results, tmp_path, capsys):
    assert main(["report", "--results", str(results), "--out", str(tmp_path / "r")]) == 0
    assert "full reload vs plain read+copy (issue 4's baseline)" in capsys.readouterr().out
    assert main(["report", "--results", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 2


def test_times_are_best_samples_unless_median_is_asked_for(tmp_path):
    root = tmp_path / "asv"
    write_benchmarks_json(root, {FULL: (["preset", "kind"], [["small"], ["fp8"]], "seconds"),
                                 RAW: (["preset", "kind", "experts", "reader"],
                                       [["small"], ["fp8"], ["full"], ["safetensors"]], "seconds")})
    write_machine(root, "box")
    inf = float("inf")
    # one disturbed process: the median is 10x off, the best sample is not
    write_result(root, "box", "e" * 40, {
        FULL: ([["small"], ["fp8"]], [1.0], [-inf], [inf], [[0.1, 1.0, 1.1, 0.12]]),
        RAW: ([["small"], ["fp8"], ["full"], ["safetensors"]], [0.08], [-inf], [inf], [[0.08, 0.09]])})
    best = pd.read_csv(Path(write_report(root, tmp_path / "b")["headline.csv"]))
    median = pd.read_csv(Path(write_report(root, tmp_path / "m", stat="median")["headline.csv"]))
    assert best["value"].iloc[0] == 80.0 and median["value"].iloc[0] == 8.0
    assert "asv's median is `asv_value`" in (tmp_path / "b" / "headline.md").read_text()


def test_the_committed_report_is_what_the_code_makes_of_the_committed_results(tmp_path):
    """results/report/ must be regenerated whenever the report code or results/asv change."""
    repo = Path(__file__).resolve().parents[1]
    written = write_report(repo / "results" / "asv", tmp_path)
    committed = repo / "results" / "report"
    assert {p.name for p in committed.iterdir()} == set(written)
    for name in written:
        if name.endswith((".md", ".csv")):
            assert (tmp_path / name).read_text() == (committed / name).read_text(), \
                f"results/report/{name} is stale: run `fp8-reload report`"


def test_your_machine_beside_the_curated_ones(results, tmp_path, capsys):
    mine = tmp_path / "local"
    write_benchmarks_json(mine, {FULL: (["preset", "kind"], [["small"], KINDS], "seconds")})
    write_machine(mine, "laptop")
    write_result(mine, "laptop", "f" * 40, {FULL: ([["small"], KINDS], [0.3, 0.6])})
    assert main(["report", "--results", str(results), "--results", str(mine),
                 "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "headline.md").read_text()
    assert "## box (commit cccccccc)" in md and "## laptop (commit ffffffff)" in md
    write_machine(mine, "box")  # the same name in both: refused in one line
    capsys.readouterr()
    assert main(["report", "--results", str(results), "--results", str(mine),
                 "--out", str(tmp_path / "r")]) == 2
    assert "machine 'box' is in both" in capsys.readouterr().err


def test_reload_plot_panels_show_curves_only():
    from fp8_reload.tools.report.plots import percent, reload_series

    assert [percent(x) for x in (1 / 64, 6 / 64, 0.5, 1.0)] == ["1.56%", "9.38%", "50%", "100%"]
    rows = pd.DataFrame([
        {"benchmark": FILTERED, "strategy": "fixed", "experts": "1/layer", "value": 0.01},
        {"benchmark": FILTERED, "strategy": "fixed", "experts": "100%", "value": 0.1},
        {"benchmark": FILTERED, "strategy": "scan-all", "experts": "1/layer", "value": 0.2},
        {"benchmark": RAW, "experts": "full", "reader": "preadv", "value": 0.05}])
    assert reload_series(rows, 16) == {"fixed": [(1 / 16, 0.01), (1.0, 0.1)]}  # no lone points


def test_grouped_track_times_read_as_the_time_benchmarks(tmp_path):
    """`benchmarks.grouped` (the GPU run) records times as ``track_time_*`` of the same
    classes: the report reads them as the ``time_*`` figures; beside the per-process
    benchmark of the same figure (a CPU run of everything), the per-process one counts."""
    root = tmp_path / "asv"
    gfull, graw = "grouped.FullReload.track_time_reload", "grouped.RawReadCopy.track_time_read_copy"
    raw_params = [["small"], ["fp8"], ["full"], ["preadv"]]
    write_benchmarks_json(root, {
        gfull: (["preset", "kind"], [["small"], ["fp8", "bf16"]], "seconds"),
        graw: (["preset", "kind", "experts", "reader"], raw_params, "seconds"),
        FULL: (["preset", "kind"], [["small"], ["fp8", "bf16"]], "seconds")})
    write_machine(root, "box")
    write_result(root, "box", "f" * 40, {gfull: ([["small"], ["fp8", "bf16"]], [0.1, 0.3]),
                                         graw: (raw_params, [0.08]),
                                         FULL: ([["small"], ["fp8", "bf16"]], [NAN, 0.4])})
    df = load_results(root)
    times = df[df["benchmark"].str.endswith("FullReload.time_reload")].dropna(subset=["value"])
    assert sorted(zip(times["kind"], times["value"], times["benchmark"])) == [
        ("bf16", 0.4, FULL), ("fp8", 0.1, "grouped.FullReload.time_reload")]
    assert set(times["bench_type"]) == {"time"} and set(times["unit"]) == {"seconds"}
    hl = headline(df)
    row = hl[(hl.kind == "fp8") & hl.figure.str.startswith("full reload")].iloc[0]
    assert row["value"] == 80.0


def test_io_paths_sit_beside_the_limits_of_the_same_run(tmp_path):
    """The I/O table (`benchmarks/io.py`, grouped as ``track_time_move``): GB/s of the tensor
    bytes each case moves, and shares of the run's own limits (full scope only)."""
    from fp8_reload.tools.report.io_paths import moved_bytes

    root = tmp_path / "asv"
    name = "grouped.IOPaths.track_time_move"
    ios = ["limit-h2d", "limit-read", "limit-read-direct", "fp8-reload", "fp8-reload-direct"]
    params = [["small"], ["fp8"], ios, ["full", "1/layer"], ["warm", "cold"]]
    write_benchmarks_json(root, {name: (["preset", "kind", "io", "scope", "cache"], params, "seconds")})
    write_machine(root, "box")
    # per io: (full, warm), (full, cold), (1/layer, warm), (1/layer, cold); limits: full only
    times = [0.01, NAN, NAN, NAN, 0.015, 0.6, NAN, NAN, 0.5, 0.5, NAN, NAN,
             0.025, 0.7, 0.001, 0.3, 0.5, 0.5, 0.02, 0.02]
    write_result(root, "box", "e" * 40, {name: (params, times)})
    written = write_report(root, tmp_path / "r")
    table = pd.read_csv(written["io.csv"])
    full = moved_bytes("small", "fp8", "full")
    def case(io, scope, cache):
        return table[(table.io == io) & (table.scope == scope) & (table.cache == cache)].iloc[0]

    row = case("fp8-reload", "full", "warm")
    assert row["ms"] == 25.0 and math.isclose(row["GB/s"], round(full / 0.025 / 1e9, 2), abs_tol=0.01)
    assert row["of H2D limit"] == "40%" and row["of read limit"] == "60%"  # 0.010 / 0.025, 0.015 / 0.025
    cold = case("fp8-reload-direct", "full", "cold")
    assert cold["of read limit"] == "100%" and cold["of H2D limit"] == "2%"  # the O_DIRECT read: 0.5 s
    one = case("fp8-reload", "1/layer", "warm")
    assert one["ms"] == 1.0 and pd.isna(one["of H2D limit"])
    assert moved_bytes("small", "fp8", "1/layer") < full / 10
    assert "## I/O paths" in written["headline.md"].read_text()


GFULL, GFILT = "grouped.FullReload.track_time_reload", "grouped.FilteredReload.track_time_reload"
GIO = "grouped.IOPaths.track_time_move"
IO_PARAMS = [["small"], ["fp8"], ["limit-h2d"], ["full"], ["warm"]]
FILT_PARAMS = [["small"], ["fp8"], ["1/layer"], ["fixed"]]


def _grouped_suite(root):
    """benchmarks.json of two reload-group classes, the io group and a per-process class."""
    write_benchmarks_json(root, {
        GFULL: (["preset", "kind"], [["small"], ["fp8"]], "seconds", "grouped:104"),
        GFILT: (["preset", "kind", "experts", "strategy"], FILT_PARAMS, "seconds", "grouped:104"),
        GIO: (["preset", "kind", "io", "scope", "cache"], IO_PARAMS, "seconds", "grouped:126"),
        EX: (["preset", "scale_mode"], [["small"], ["cached"]], "seconds")})
    write_machine(root, "box")


def _figures(df):
    return sorted(zip(df["benchmark"].str.split(".").str[1], df["commit"].str[0], df["value"]))


def test_a_run_of_one_group_adds_to_the_run_before(tmp_path):
    """`BENCH_GROUPS=io` runs the I/O group alone: the report keeps the reload figures of the
    run before it and labels each commit with its classes; a class an older run measured
    per process (outside the grouped suite) does not come back."""
    root = tmp_path / "asv"
    _grouped_suite(root)
    small = [["small"], ["fp8"]]
    write_result(root, "box", "a" * 40, {EX: ([["small"], ["cached"]], [1e-6])}, started_at=1000)
    write_result(root, "box", "b" * 40, {GFULL: (small, [0.5])}, started_at=2000)
    write_result(root, "box", "c" * 40, {GFULL: (small, [0.1]), GFILT: (FILT_PARAMS, [0.01])},
                 started_at=3000)
    write_result(root, "box", "d" * 40, {GIO: (IO_PARAMS, [0.01])}, started_at=4000)
    df = load_results(root)
    assert _figures(df) == [("FilteredReload", "c", 0.01), ("FullReload", "c", 0.1), ("IOPaths", "d", 0.01)]
    write_report(root, tmp_path / "r")
    md = (tmp_path / "r" / "headline.md").read_text()
    assert "## box (commit cccccccc: FilteredReload, FullReload; commit dddddddd: IOPaths)" in md
    assert set(headline(df)["commit"]) == {"cccccccc"}


def test_a_group_that_ran_replaces_its_older_figures_whole(tmp_path):
    """Review (helper 31): classes were filled in one by one, so a newer run of the reload
    group lacking one class showed that class from an older commit beside the others (and
    the headline named either commit by file order)."""
    root = tmp_path / "asv"
    _grouped_suite(root)
    small = [["small"], ["fp8"]]
    write_result(root, "box", "c" * 40, {GFULL: (small, [0.1]), GFILT: (FILT_PARAMS, [0.01])},
                 started_at=3000)
    write_result(root, "box", "0" * 40, {GFULL: (small, [0.2])}, started_at=4000)
    df = load_results(root)
    assert _figures(df) == [("FullReload", "0", 0.2)]
    assert set(headline(df)["commit"]) == {"00000000"}


def test_grouped_figures_do_not_come_back_under_a_per_process_run(tmp_path):
    """Review (helper 31): a newer run of the per-process suite brought the grouped figures
    of an older run back beside its own."""
    root = tmp_path / "asv"
    _grouped_suite(root)
    small = [["small"], ["fp8"]]
    write_result(root, "box", "c" * 40, {GFULL: (small, [0.1]), GIO: (IO_PARAMS, [0.01])}, started_at=3000)
    write_result(root, "box", "e" * 40, {EX: ([["small"], ["cached"]], [1e-6])}, started_at=4000)
    assert [c for _, c, _ in _figures(load_results(root))] == ["e"]


def test_of_runs_started_together_one_fills_a_group(tmp_path):
    """Review (helper 32): two older runs of a group with the same start (results without
    `started_at`) were both kept: each figure twice, from two commits."""
    root = tmp_path / "asv"
    _grouped_suite(root)
    small = [["small"], ["fp8"]]
    for c, v in (("a", 0.1), ("b", 0.2)):
        write_result(root, "box", c * 40, {GFULL: (small, [v]), GFILT: (FILT_PARAMS, [v / 10])},
                     started_at=3000)
    write_result(root, "box", "d" * 40, {GIO: (IO_PARAMS, [0.01])}, started_at=4000)
    assert _figures(load_results(root)) == [("FilteredReload", "b", 0.02), ("FullReload", "b", 0.2),
                                            ("IOPaths", "d", 0.01)]


def test_the_pinned_copy_limit_judges_only_the_full_reload_of_its_own_run(tmp_path):
    """Review s26 (an audit of the results): the headline judged the full reload against a
    plain read+copy it beat by 3.5x, as a bound; the bound is one pinned copy of the same
    checkpoint, and only a limit measured in the same run may judge."""
    root = tmp_path / "asv"
    _grouped_suite(root)
    small = [["small"], ["fp8"]]
    figure = "full reload vs pinned host-to-device copy"
    write_result(root, "box", "c" * 40, {GFULL: (small, [0.1]), GIO: (IO_PARAMS, [0.09])},
                 started_at=3000)
    row = headline(load_results(root)).set_index("figure").loc[figure]
    assert row["value"] == 90.0 and bool(row["met"]) and row["target"] == ">= 85%"
    write_result(root, "box", "d" * 40, {GFULL: (small, [0.2])}, started_at=4000)  # reload group alone
    row = headline(load_results(root)).set_index("figure").loc[figure]
    assert row["value"] is None and row["met"] is None
    assert "not judged" in row["detail"] and "(cccccccc)" in row["detail"]
