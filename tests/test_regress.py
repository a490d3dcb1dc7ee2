"""The regression comparison on synthetic asv result files (`fp8-reload regress --files`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fp8_reload.tools.cli import main
from fp8_reload.tools.regress import combine_rounds, compare

from .asv_files import write_benchmarks_json, write_result

NAN = float("nan")
T = "reload.FilteredReload.time_reload"
B = "reload.FilteredReload.track_bytes_read"
PARAMS = [["small"], ["fixed", "scan-all"]]


@pytest.fixture
def root(tmp_path):
    write_benchmarks_json(tmp_path, {T: (["preset", "strategy"], PARAMS, "seconds"),
                                     B: (["preset", "strategy"], PARAMS, "bytes")})
    return tmp_path


def pair(root, base_values, head_values, bench=T, ci=None):
    b = {bench: (PARAMS, base_values) + (ci[0] if ci else ())}
    h = {bench: (PARAMS, head_values) + (ci[1] if ci else ())}
    return (write_result(root, "m", "a" * 40, b), write_result(root, "m", "b" * 40, h))


def by_strategy(changes):
    return {c.params[1]: c for c in changes}


def test_ten_percent_slowdown_is_a_regression_and_five_is_not(root):
    base, head = pair(root, [1.0, 2.0], [1.10, 2.10])
    c = by_strategy(compare(base, head, 0.10))
    assert c["fixed"].status == "slower" and c["fixed"].regression
    assert math.isclose(c["fixed"].ratio, 1.10)
    assert c["scan-all"].status == "same" and not c["scan-all"].regression


def test_speedup_is_reported_not_failed(root):
    base, head = pair(root, [1.0, 2.0], [0.5, 2.0])
    c = by_strategy(compare(base, head))
    assert c["fixed"].status == "faster" and not c["fixed"].regression


def test_overlapping_confidence_intervals_are_noise(root):
    # 20% slower median, but the 99% intervals overlap: not significant
    ci = (([0.8, 1.9], [1.3, 2.1]), ([1.0, 1.95], [1.5, 2.05]))
    base, head = pair(root, [1.0, 2.0], [1.2, 2.0], ci=ci)
    c = by_strategy(compare(base, head))
    assert c["fixed"].significant is False and c["fixed"].status == "same"


def test_separated_confidence_intervals_are_significant(root):
    ci = (([0.95, 1.9], [1.05, 2.1]), ([1.15, 1.9], [1.25, 2.1]))
    base, head = pair(root, [1.0, 2.0], [1.2, 2.0], ci=ci)
    c = by_strategy(compare(base, head))
    assert c["fixed"].significant is True and c["fixed"].regression


def test_quick_runs_without_intervals_compare_by_ratio(root):
    inf = math.inf
    ci = (([-inf, -inf], [inf, inf]), ([-inf, -inf], [inf, inf]))
    base, head = pair(root, [1.0, 2.0], [1.5, 2.0], ci=ci)
    c = by_strategy(compare(base, head))
    assert c["fixed"].significant is None and c["fixed"].regression


def test_failure_in_head_is_a_regression_skips_are_ignored(root):
    base, head = pair(root, [1.0, NAN], [None, 5.0])
    c = by_strategy(compare(base, head))
    assert c["fixed"].status == "failed" and c["fixed"].regression
    assert c["scan-all"].status == "n/a" and not c["scan-all"].regression


def test_best_sample_decides_when_samples_were_recorded(root):
    # medians 20% apart from noise, best samples equal: not a regression (and vice versa)
    inf = math.inf
    ci = (([-inf, -inf], [inf, inf], [[1.0, 1.0, 1.1], [2.0, 2.1, 2.2]]),
          ([-inf, -inf], [inf, inf], [[1.0, 1.2, 1.3], [2.3, 2.4, 2.5]]))
    base, head = pair(root, [1.0, 2.1], [1.2, 2.4], ci=ci)
    c = by_strategy(compare(base, head))
    assert c["fixed"].statistic == "min" and c["fixed"].status == "same"
    assert c["scan-all"].status == "slower" and math.isclose(c["scan-all"].ratio, 1.15)


def test_benchmarks_run_on_neither_side_are_left_out(root):
    base, head = pair(root, [1.0, NAN], [1.0, NAN])
    assert [c.params[1] for c in compare(base, head)] == ["fixed"]


def test_track_values_and_zero_base(root):
    base, head = pair(root, [0, 100], [10, 100], bench=B)
    c = by_strategy(compare(base, head))
    assert c["fixed"].ratio == math.inf and c["fixed"].regression
    assert c["scan-all"].status == "same"
    assert c["fixed"].unit == "bytes"


def test_only_common_benchmarks_are_compared(root):
    b = write_result(root, "m", "a" * 40, {T: (PARAMS, [1.0, 2.0])})
    h = write_result(root, "m", "b" * 40, {B: (PARAMS, [1.0, 2.0])})
    assert compare(b, h) == []


def test_nothing_in_common_is_refused_not_passed(root, capsys):
    b = write_result(root, "m", "a" * 40, {T: (PARAMS, [1.0, 2.0])})
    h = write_result(root, "m", "b" * 40, {B: (PARAMS, [1.0, 2.0])})
    assert main(["regress", "--files", str(b), str(h)]) == 2
    assert "nothing was compared" in capsys.readouterr().err


def test_cli_exit_status(root, capsys):
    base, head = pair(root, [1.0, 2.0], [1.25, 2.0])
    assert main(["regress", "--files", str(base), str(head)]) == 1
    out = capsys.readouterr().out
    assert "slower" in out and "FilteredReload.time_reload(small, fixed)" in out
    assert main(["regress", "--files", "--threshold", "0.3", str(base), str(head)]) == 0


def test_a_slowdown_must_show_in_every_round(root):
    rounds = []
    for k, head in enumerate(([1.5, 2.0], [1.3, 2.5], [1.2, 1.9])):
        b = write_result(root / f"r{k}", "m", "a" * 40, {T: (PARAMS, [1.0, 2.0])})
        h = write_result(root / f"r{k}", "m", "b" * 40, {T: (PARAMS, head)})
        rounds.append(compare(b, h))
    c = by_strategy(combine_rounds(rounds))
    assert c["fixed"].status == "slower" and c["fixed"].round_ratios == pytest.approx((1.5, 1.3, 1.2))
    assert math.isclose(c["fixed"].ratio, 1.2)  # best of the rounds on each side
    # scan-all: +25% in one round only (noise), not a regression
    assert c["scan-all"].status == "same" and not c["scan-all"].regression


def test_a_failure_in_any_round_fails(root):
    rounds = []
    for k, head in enumerate(([1.0, 2.0], [None, 2.0])):
        b = write_result(root / f"r{k}", "m", "a" * 40, {T: (PARAMS, [1.0, 2.0])})
        h = write_result(root / f"r{k}", "m", "b" * 40, {T: (PARAMS, head)})
        rounds.append(compare(b, h))
    assert by_strategy(combine_rounds(rounds))["fixed"].status == "failed"


def test_regress_reports_progress_per_side_and_round(root, tmp_path, monkeypatch, capsys):
    """Each side of each round takes ~half a minute on a CPU box: a line before and after it
    on stderr, the comparison on stdout. asv and the worktrees are stood in for here."""
    from fp8_reload.tools import regress as rg

    shas = {"HEAD": "a" * 40, "HEAD~0": "b" * 40}  # names git resolves in any checkout
    runs = []

    def fake_checkout(repo, commit, work):
        return shas[commit], tmp_path / commit

    def fake_asv_run(repo, sha, src, work, *args, log=print, **kw):
        runs.append(sha[0])
        return write_result(work, "m", sha, {T: (PARAMS, [1.0, 2.0] if sha[0] == "a" else [1.5, 2.0])})

    monkeypatch.setattr(rg, "checkout", fake_checkout)
    monkeypatch.setattr(rg, "asv_run", fake_asv_run)
    monkeypatch.setattr(rg, "ensure_machine", lambda name, **kw: {})
    assert rg.regress("HEAD", "HEAD~0", repo=Path(__file__).parent, rounds=2,
                      keep=tmp_path / "keep") == 1
    captured = capsys.readouterr()
    assert runs == ["a", "b", "b", "a"]  # ABBA
    lines = [line for line in captured.err.splitlines() if line.startswith("[regress] round")]
    assert len(lines) == 8 and lines[0].startswith("[regress] round 1/2: base (aaaaaaaaaaaa) running")
    assert lines[1].startswith("[regress] round 1/2: base done in ")
    assert "slower" in captured.out and "[regress]" not in captured.out
