"""The main job: the demo tells the story and its verdict is honest."""

from fp8_reload.tools.cli import main
from fp8_reload.tools.demo import DemoRow, format_rows, run_demo, verdict


def test_demo_shows_upstream_broken_and_fixed_clean(capsys):
    rows = run_demo(preset="tiny", device="cpu", log=lambda s: None)
    by = {(r.kind, r.mode, r.step): r for r in rows}
    for kind in ("fp8", "bf16"):
        fixed = by[kind, "fixed", "EPLB filtered"]
        assert (fixed.outcome, fixed.identity, fixed.loaders, fixed.equals_fresh, fixed.forward) == \
            ("ok", "kept", "all", "yes", "same")
        assert by[kind, "upstream", "EPLB filtered"].outcome.startswith("FAIL AttributeError")
        assert by[kind, "identity-only", "EPLB filtered"].forward.startswith("FAIL")
    ok, text = verdict(rows)
    assert ok, text


def test_cli_demo_exit_code(capsys):
    assert main(["demo", "--preset", "tiny", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "fixed" in out and "upstream" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    # the whole error, once, below the tables; progress went to stderr, one line per step
    assert out.count("[1] AttributeError: 'Parameter' object has no attribute 'weight_loader'") == 1
    steps = [line for line in captured.err.splitlines() if line.startswith("[demo] ")]
    assert len(steps) == 1 + 2 * (1 + 3)  # model, then per kind: checkpoint + 3 modes


def test_long_errors_wrap_within_100_columns_and_repeat_by_number():
    long = "FAIL RuntimeError: " + "a very long explanation " * 12
    rows = [DemoRow("fp8", mode, step, long if mode == "upstream" else "ok", "kept", "123 missing",
                    "no (1234)", long, 12345.6, float("nan"))
            for mode in ("upstream", "identity-only", "fixed") for step in ("EPLB filtered", "full")]
    text = format_rows(rows)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.count("FAIL [1]") == 8 and "[2]" not in text  # one message, one note
    assert " ".join(text.split("\n[1] ")[1].split()) == long[5:].strip()
