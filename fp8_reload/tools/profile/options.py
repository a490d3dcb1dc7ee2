"""The names `fp8-reload profile` shares with its command line (light: no torch, so the
command line can list scenarios and tools in its help)."""

from __future__ import annotations

SCENARIOS = ("reload-full", "reload-filtered", "forward")
SCENARIO_PREFIX = "fp8_reload/scenario/"
PROFILE_RANGE = "fp8_reload/profile"
TOOLS = ("auto", "nsys", "torch")
