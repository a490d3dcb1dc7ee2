"""The main job: the demo tells the story and its verdict is honest."""

from fp8_reload.tools.cli import main
from fp8_reload.tools.demo import run_demo, verdict


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
    out = capsys.readouterr().out
    assert "fixed" in out and "upstream" in out
