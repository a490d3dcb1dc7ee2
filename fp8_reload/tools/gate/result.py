"""The gate's results: checks, steps, the whole run, and what "passed" means."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..usage import UsageError

CHECKS = ("reload", "fresh.state", "ckpt.weights", "fresh.forward", "ref.model", "ref.moe",
          "identity", "untouched")
# ckpt.weights: FP8 rounding of a requantized gate/up half (fp8 checkpoints) or of the
# quantization on load (bf16); measured at most 7.4e-4 on the tiny and small presets, both
# kinds and every processing mode. A misplaced or mis-scaled projection measures ~1.
CHECKPOINT_BOUND = 2e-3


class GateError(UsageError):
    """The gate cannot run as asked (unknown backend, bad bounds file, no CUDA): exit 2."""


@dataclass
class Check:
    name: str
    status: str  # pass | fail | n/a | skip
    measured: float | None = None
    bound: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "n/a")


@dataclass
class StepResult:
    backend: str
    kind: str
    index: int
    label: str
    checks: list[Check]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)


@dataclass
class GateResult:
    preset: str
    device: str
    processing: str
    backends: list[str]
    kinds: list[str]
    bounds_file: str
    bounds_version: int
    bounds: dict[str, dict]
    steps: list[StepResult] = field(default_factory=list)
    skipped_backends: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Every check of every step passed, and every check passed at least once."""
        exercised = {c.name for s in self.steps for c in s.checks if c.status == "pass"}
        return bool(self.steps) and all(s.passed for s in self.steps) and exercised == set(CHECKS)

    def failures(self) -> list[tuple[StepResult, Check]]:
        return [(s, c) for s in self.steps for c in s.checks if not c.ok]

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["torch"] = torch.__version__
        return d

