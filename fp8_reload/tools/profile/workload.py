"""What `fp8-reload profile` runs: a model, a checkpoint and the scenarios' inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import trace
from ...checkpoint import write_checkpoint
from ...config import MoEConfig
from ...device import resolve_device, synchronize
from ...errors import BackendUnavailable
from ...kernels import BACKENDS, available_backends
from ...reload import eplb_filter, load_model, update_weights_from_disk
from ..usage import progress
from .options import PROFILE_RANGE, SCENARIO_PREFIX, SCENARIOS


@dataclass
class Workload:
    """A model, a checkpoint and the inputs the scenarios use."""

    preset: str = "small"
    num_layers: int | None = None
    kind: str = "fp8"
    device: str | None = None
    backend: str | None = None
    processing: str = "fixed"
    tokens: int = 64
    experts: int = 2  # experts per MoE layer in the filtered (EPLB) reload
    repeat: int = 3
    checkpoint: str | None = None
    model: object = field(default=None, repr=False)
    x: object = field(default=None, repr=False)
    filter: object = field(default=None, repr=False)

    def resolve(self, workdir: Path) -> Workload:
        """Check the device (None: the default) and write the checkpoint (once) if none was given."""
        self.device = resolve_device(self.device)
        if self.checkpoint is None:
            cfg = MoEConfig.preset(self.preset, num_layers=self.num_layers)
            path = Path(workdir) / f"ckpt-{cfg.name}-{cfg.num_layers}l-{self.kind}"
            if not (path / "config.json").exists():
                progress(f"[profile] writing a {self.kind} checkpoint of preset {self.preset!r} to {path}")
                write_checkpoint(path, cfg, seed=0, kind=self.kind)
            self.checkpoint = str(path)
        return self

    def prepare(self) -> Workload:
        """Load the model (not profiled) and build the forward input and the EPLB filter."""
        model = load_model(self.checkpoint, device=self.device, processing=self.processing)
        if self.backend and self.backend not in BACKENDS and self.backend not in available_backends():
            raise BackendUnavailable(f"MoE backend {self.backend!r} is not available here "
                                     f"(available: {', '.join(available_backends())})")
        model.set_backend(self.backend)
        cfg = model.config
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(self.tokens, cfg.hidden_size, generator=g).to(torch.bfloat16).to(self.device)
        self.filter, _ = eplb_filter(cfg, self.experts)
        self.model = model
        return self

    def step(self, scenario: str) -> None:
        if scenario == "reload-full":
            update_weights_from_disk(self.model, self.checkpoint)
        elif scenario == "reload-filtered":
            update_weights_from_disk(self.model, self.checkpoint, self.filter)
        elif scenario == "forward":
            with torch.no_grad():
                self.model(self.x)
        else:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        synchronize(self.model)

    def run(self, scenarios: Sequence[str]) -> None:
        """The profiled window: every scenario `repeat` times, each in its scenario range."""
        with trace.range(PROFILE_RANGE):
            for scenario in scenarios:
                for _ in range(self.repeat):
                    with trace.range(SCENARIO_PREFIX + scenario,
                                     payload=self.tokens if scenario == "forward" else None):
                        self.step(scenario)

    def warmup(self, scenarios: Sequence[str]) -> None:
        for scenario in scenarios:
            self.step(scenario)

    def argv(self) -> list[str]:
        """Command-line flags that rebuild this workload in a child process."""
        out = ["--preset", self.preset, "--kind", self.kind, "--device", str(self.device),
               "--tokens", str(self.tokens), "--experts", str(self.experts),
               "--repeat", str(self.repeat), "--processing", self.processing,
               "--checkpoint", str(self.checkpoint)]
        if self.num_layers:
            out += ["--num-layers", str(self.num_layers)]
        if self.backend:
            out += ["--backend", self.backend]
        return out

