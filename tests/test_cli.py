"""The command line's manners: help without torch, --version, exit codes (2 for a request that
cannot be honoured, 130 for Ctrl-C), one line and no traceback, every option documented."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
from fp8_reload import kernels
from fp8_reload.config import MoEConfig
from fp8_reload.tools import cli

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "pandas", "asv", "matplotlib", "safetensors")


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, **kw)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_of_every_command_imports_no_heavy_module():
    """--help speed as an import check: what --help imports, not how long it took."""
    res = _python("import argparse, sys, contextlib, io\n"
                  "import fp8_reload\n"
                  "from fp8_reload.tools import cli\n"
                  "sub = [a for a in cli.build_parser()._actions\n"
                  "       if isinstance(a, argparse._SubParsersAction)][0]\n"
                  "names = [None] + sorted(sub.choices)\n"
                  "for name in names:\n"
                  "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
                  "        try:\n"
                  "            cli.main([name, '--help'] if name else ['--help'])\n"
                  "        except SystemExit as e:\n"
                  "            assert e.code == 0, (name, e.code)\n"
                  "    assert 'usage: fp8-reload' in out.getvalue(), name\n"
                  f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"--help imported {res.stdout.strip()}"


def test_public_names_import_on_first_use():
    res = _python("import sys, fp8_reload as fr\n"
                  "assert 'torch' not in sys.modules\n"
                  "assert set(fr.__all__) <= set(dir(fr))\n"
                  "fr.load_model\n"
                  "print('torch' in sys.modules)\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"


def test_every_public_name_resolves():
    for name in fr.__all__:
        assert getattr(fr, name) is not None, name
    assert fr.kernels.run_moe is kernels.run_moe and fr.state.snapshot is fr.snapshot
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fr.nope  # noqa: B018


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" in meta.get("dynamic", [])  # read from fp8_reload/version.py: one place
    assert capsys.readouterr().out.strip() == f"fp8-reload {fr.__version__}"


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fp8-reload") and "commands:" in err and "demo" in err


def test_every_option_has_help_and_shows_its_default():
    for name, parser in _commands().items():
        assert parser.description and parser.description.rstrip().endswith("."), name
        fmt = cli.HelpFormatter(name)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert action.help, f"{name} {action.dest}: no help"
            flag = isinstance(action, argparse._StoreTrueAction)
            if action.option_strings and not flag and not action.required:
                assert "default" in fmt._get_help_string(action), f"{name} {action.dest}"


def test_same_flag_same_name_and_presets_validated():
    for name, parser in _commands().items():
        options = {o: a for a in parser._actions for o in a.option_strings}
        assert "--backends" not in options, name
        if "--preset" in options:
            assert tuple(options["--preset"].choices) == MoEConfig.PRESETS, name
    assert cli.MOE_BACKENDS == kernels.BACKEND_NAMES


@pytest.mark.parametrize("command", ["demo", "gate", "profile", "rebalance", "write-checkpoint"])
def test_unknown_preset_is_a_usage_error(command, capsys, tmp_path):
    argv = [command, "--preset", "huge"] + {"profile": ["--out", str(tmp_path)],
                                            "write-checkpoint": [str(tmp_path)]}.get(command, [])
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'huge'" in err and "Traceback" not in err


def _one_line_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"fp8-reload {argv[0]}: error: ")
    return lines[0]


def test_missing_cuda_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["demo", "--device", "cuda", "--preset", "tiny"],
                 ["gate", "--device", "cuda"],
                 ["profile", "--device", "cuda", "--out", str(tmp_path / "p"), "--tool", "torch"]):
        assert "CUDA is not available" in _one_line_error(capsys, argv)
    assert not (tmp_path / "p").exists()  # checked before anything was written


def test_demo_on_a_missing_gpu_index_from_the_real_entry_point(tmp_path):
    res = subprocess.run([sys.executable, "-m", "fp8_reload", "demo", "--device", "cuda:99",
                          "--preset", "tiny"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "'cuda:99'" in res.stderr and "Traceback" not in res.stderr


def test_load_model_on_missing_cuda_says_so(ckpts, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(fr.DeviceUnavailableError, match="CUDA is not available") as e:
        fr.load_model(ckpts[("fp8", 0)], device="cuda")
    assert isinstance(e.value, fr.ReloadError)
    with pytest.raises(fr.DeviceUnavailableError, match="unknown device 'gpu'"):
        fr.load_model(ckpts[("fp8", 0)], device="gpu")


def test_profile_requests_that_cannot_run(capsys, tmp_path, monkeypatch, ckpts):
    out = tmp_path / "out"
    line = _one_line_error(capsys, ["profile", "--out", str(out), "--summarize",
                                    str(tmp_path / "missing.json")])
    assert "missing.json: no such trace file" in line
    (tmp_path / "t.txt").write_text("x")
    assert "expected a torch.profiler Chrome trace" in _one_line_error(
        capsys, ["profile", "--out", str(out), "--summarize", str(tmp_path / "t.txt")])
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no nsys anywhere
    line = _one_line_error(capsys, ["profile", "--out", str(out), "--tool", "nsys", "--preset", "tiny",
                                    "--device", "cpu"])
    assert "nsys (Nsight Systems) is not on PATH" in line
    assert not out.exists() or not any(out.iterdir())  # no checkpoint written first
    assert "unknown scenario 'nope'" in _one_line_error(
        capsys, ["profile", "--out", str(out), "--scenario", "nope", "--device", "cpu"])
    # an unknown or unavailable backend: refused before a checkpoint is written (docs/profiling.md)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("nope", "triton"):
        line = _one_line_error(capsys, ["profile", "--out", str(out), "--tool", "torch", "--preset", "tiny",
                                        "--device", "cpu", "--backend", backend])
        assert f"MoE backend {backend!r} is not available here" in line
        assert not out.exists() or not any(out.iterdir())


def test_other_commands_refuse_in_one_line(capsys, tmp_path):
    assert "no asv results directory" in _one_line_error(
        capsys, ["report", "--results", str(tmp_path / "none"), "--out", str(tmp_path / "r")])
    assert "no such asv result file" in _one_line_error(
        capsys, ["regress", "--files", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert "'no-such-commit' is not a commit" in _one_line_error(
        capsys, ["regress", "no-such-commit", "HEAD"])
    assert "experts per MoE layer" in _one_line_error(
        capsys, ["demo", "--preset", "tiny", "--device", "cpu", "--experts", "99"])
    assert "unknown MoE backend 'cuda'" in _one_line_error(capsys, ["bench-kernels", "--backend", "cuda"])
    (tmp_path / "file").write_text("")
    assert "cannot write" in _one_line_error(capsys, ["write-checkpoint", str(tmp_path / "file" / "x")])


def test_hostile_inputs_are_refused_in_one_line_naming_the_file(capsys, tmp_path):
    """JSON that parses but is no asv result, a corrupt checkpoint given by path, a file that
    cannot be written at the end of a run, a slice deeper than its preset: one line, exit 2,
    before any work (review s25: tracebacks, or a passed gate that lost its results)."""
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "rlist.json").write_text('{"results": []}')
    for f in ("list.json", "rlist.json"):
        line = _one_line_error(capsys, ["regress", "--files", str(tmp_path / f), str(tmp_path / f)])
        assert f"{tmp_path / f}: no table of benchmark results" in line
    for name, text, says in (("bad", "{bad", "not JSON"), ("list", '{"results": [], "commit_hash": "abc"}',
                                                          "not an asv result file")):
        (tmp_path / name / "machine").mkdir(parents=True)
        (tmp_path / name / "machine" / "x.json").write_text(text)
        argv = ["report", "--results", str(tmp_path / name), "--out", str(tmp_path / "o")]
        line = _one_line_error(capsys, argv)
        assert f"{tmp_path / name / 'machine' / 'x.json'}: {says}" in line
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{")
    line = _one_line_error(capsys, ["rebalance", "--checkpoint", str(tmp_path / "ck")])
    assert "config.json: corrupt JSON" in line
    assert cli.main(["profile", "--out", str(tmp_path / "p"), "--tool", "torch", "--device", "cpu",
                     "--checkpoint", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err  # (after its progress line: "loading the model")
    assert "Traceback" not in err and "config.json: corrupt JSON" in err.strip().splitlines()[-1]
    assert "preset 'tiny' has 3 layers" in _one_line_error(capsys, ["gate", "--num-layers", "99999"])
    (tmp_path / "afile").write_text("")
    for argv, says in ((["gate", "--json", str(tmp_path / "no" / "g.json")], "no such directory"),
                       (["rebalance", "--json", str(tmp_path / "no" / "r.json")], "no such directory"),
                       (["gate", "--workdir", str(tmp_path / "afile")], "exists and is not a directory")):
        with pytest.raises(SystemExit) as e:  # (argparse's own usage error)
            cli.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("sig,code,says", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_or_sigterm_exits_in_one_line_and_removes_temp_files(tmp_path, sig, code, says):
    """SIGTERM (a CI timeout, `kill`) ends a command as Ctrl-C does, its temporary checkpoints
    removed: under the default action they stayed behind (review s25: 11 GB)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "fp8_reload", "demo", "--preset", "small",
                             "--device", "cpu"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # the model line: the demo is working
        assert first.startswith("[demo] model:"), first
        assert proc.stderr.readline().startswith("[demo] fp8 checkpoint written")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"fp8-reload demo: {says}"
    assert not list(tmp_path.glob("fp8-reload-demo-*"))


def test_sglang_launch_refuses_in_one_line_like_every_command(monkeypatch, capsys):
    """Without the supported sglang the launcher exits 2 with the CLI's one error line."""
    import importlib

    launch = importlib.import_module("fp8_reload.sglang_patch.launch")  # the module, not the function
    patch = importlib.import_module("fp8_reload.sglang_patch.patch")

    def missing():
        raise patch.UnsupportedSGLangVersion("sglang is not installed")

    monkeypatch.setattr(launch, "check_version", missing)
    assert cli.main(["sglang-launch", "--", "--model-path", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "fp8-reload sglang-launch: error: sglang is not installed\n"
