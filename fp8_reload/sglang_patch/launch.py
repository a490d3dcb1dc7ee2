"""`fp8-reload sglang-launch`: an sglang server with the patch on in every process."""

from __future__ import annotations

import os
import sys
from importlib import metadata

from .patch import ENV_ENABLE, UnsupportedSGLangVersion, apply, check_version, revert

PLUGIN = "fp8_reload.sglang_patch:sglang_plugin"


class LaunchRefused(RuntimeError):
    """Why no server was launched (the command line prints it, exit status 2)."""


def plugin_registered() -> bool:
    return any(ep.value == PLUGIN for ep in metadata.entry_points(group="sglang.srt.plugins"))


def launch(server_args: list[str], check: bool = False) -> int:
    """Run ``python -m sglang.launch_server SERVER_ARGS`` with the patch on in every process.

    The environment variable reaches every process sglang spawns, and each of
    them runs its plugin loader, which applies the patch. ``check=True`` applies
    the patch here once, reports it, reverts, and launches nothing. Raises
    `LaunchRefused` when it cannot (sglang missing or of another version, plugin
    entry point not installed).
    """
    try:
        version = check_version()
    except UnsupportedSGLangVersion as e:
        raise LaunchRefused(str(e)) from None
    if not plugin_registered():
        raise LaunchRefused("the sglang plugin entry point is not registered: install this "
                            "package into sglang's environment (pip install --no-deps -e .)")
    if check:
        names = apply()
        revert()
        print(f"sglang {version}: patch applies; with {ENV_ENABLE}=1 every sglang process patches:")
        for name in names:
            print(f"  {name}")
        return 0
    env = dict(os.environ, **{ENV_ENABLE: "1"})
    allowed = env.get("SGLANG_PLUGINS")
    if allowed and "fp8_reload" not in {x.strip() for x in allowed.split(",")}:
        env["SGLANG_PLUGINS"] = f"{allowed},fp8_reload"
    cmd = [sys.executable, "-m", "sglang.launch_server", *server_args]
    print(f"fp8-reload: {ENV_ENABLE}=1 {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached
