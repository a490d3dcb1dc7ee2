"""apply / revert / version check / how a server turns the patch on."""

from __future__ import annotations

from importlib import metadata

import pytest

from fp8_reload import sglang_patch


def _current():
    return {(cls, attr): cls.__dict__[attr] for cls, attr, _ in sglang_patch.targets()}


def test_apply_then_revert_restores_the_originals_exactly(unpatched):
    before = _current()
    names = sglang_patch.apply()
    try:
        assert len(names) == len(before) == 9
        now = _current()
        assert all(now[k] is not before[k] for k in before)  # every target replaced
        assert sglang_patch.apply() == names  # idempotent
    finally:
        sglang_patch.revert()
    after = _current()
    assert all(after[k] is before[k] for k in before)
    assert not sglang_patch.is_applied()


def test_parts_patch_only_their_half(unpatched):
    before = _current()
    sglang_patch.apply(parts=("reload",))
    try:
        now = _current()
        changed = sorted(f"{c.__name__}.{a}" for (c, a) in before if now[(c, a)] is not before[(c, a)])
    finally:
        sglang_patch.revert()
    assert changed == ["DefaultModelLoader._get_weights_iterator",
                       "DefaultModelLoader.load_weights_and_postprocess",
                       "WeightUpdater.update_weights_from_disk"]
    with pytest.raises(ValueError, match="unknown parts"):
        sglang_patch.apply(parts=("everything",))
    assert _current() == before
    sglang_patch.apply(parts=("moe",))
    try:
        assert len(sglang_patch.apply()) == 9  # the rest added; the moe half not patched twice
    finally:
        sglang_patch.revert()
    assert _current() == before


def test_supported_version_is_the_installed_one():
    assert sglang_patch.installed_version() == "0.5.23"
    assert sglang_patch.check_version() == "0.5.23"


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "0.5.23.post1"])
def test_unknown_version_is_refused_and_nothing_is_patched(unpatched, monkeypatch, version):
    before = _current()
    monkeypatch.setattr(sglang_patch.patch, "installed_version", lambda: version)
    with pytest.raises(sglang_patch.UnsupportedSGLangVersion,
                       match=rf"supports sglang 0\.5\.23, found {version}"):
        sglang_patch.apply()
    assert not sglang_patch.is_applied() and _current() == before
    try:
        assert len(sglang_patch.apply(force=True)) == 9  # force skips only the version check
    finally:
        sglang_patch.revert()


def test_missing_sglang_is_refused(monkeypatch):
    monkeypatch.setattr(sglang_patch.patch, "installed_version", lambda: None)
    with pytest.raises(sglang_patch.UnsupportedSGLangVersion, match="not installed"):
        sglang_patch.check_version()


def test_plugin_is_registered_and_opt_in(unpatched, monkeypatch):
    eps = {ep.name: ep for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert eps["fp8_reload"].value == "fp8_reload.sglang_patch:sglang_plugin"
    monkeypatch.delenv(sglang_patch.ENV_ENABLE, raising=False)
    sglang_patch.sglang_plugin()
    assert not sglang_patch.is_applied()


def test_sglang_plugin_loader_applies_the_patch(unpatched, monkeypatch):
    """sglang's own plugin loader (run by every sglang process) applies it when opted in."""
    import sglang.srt.plugins as plugins

    monkeypatch.setenv(sglang_patch.ENV_ENABLE, "1")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    try:
        plugins.load_plugins()
        assert sglang_patch.is_applied()
    finally:
        sglang_patch.revert()


def test_launcher_check_reports_the_patch(unpatched, capsys):
    from fp8_reload.tools.cli import main

    assert main(["sglang-launch", "--check"]) == 0
    out = capsys.readouterr().out
    assert "sglang 0.5.23: patch applies" in out
    assert "Fp8MoEMethod.process_weights_after_loading" in out
    assert not sglang_patch.is_applied()


def test_launcher_refuses_an_unknown_version(monkeypatch, capsys):
    from fp8_reload.tools.cli import main

    monkeypatch.setattr(sglang_patch.patch, "installed_version", lambda: "0.6.0")
    assert main(["sglang-launch", "--", "--model-path", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8-reload sglang-launch: error: ")
    assert "supports sglang 0.5.23, found 0.6.0" in err
