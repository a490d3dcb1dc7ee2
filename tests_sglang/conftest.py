"""Real sglang 0.5.23 on the CPU: import bootstrap, runtime context, checkpoints.

Runs in ``.venv-sglang`` (``bash .ci/setup-sglang``), never in the core
environment. Two things sglang needs on a CPU machine are provided (by
`cpu_bootstrap`, which spawned ranks import too), and nothing else is faked:

* PyPI's torchvision is built against CUDA torch; beside the CPU torch its C
  ops are missing, and its import registers fake kernels for
  ``torchvision::nms``/``qnms``, which needs their schemas. They are defined
  (schema only) before sglang imports torchvision.
* ``scaled_fp8_quant`` has no CPU kernel in sglang. sglang's *own* processing
  (the unpatched MoE path and its FP8 linear layers, which the patch leaves
  alone) calls it, so the tests that run those paths take the explicit
  `cpu_scaled_fp8_quant` fixture. The patched MoE code never needs it: the
  tests of the patched MoE alone run without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from .cpu_bootstrap import cpu_scaled_fp8_quant_, publish_cpu_scheduler  # noqa: E402  (before sglang)

# isort: split
import sglang  # noqa: E402,F401  (fails the run loudly if sglang is missing)

import fp8_reload as fr  # noqa: E402
from fp8_reload import sglang_patch  # noqa: E402

CFG = fr.MoEConfig.preset("tiny", num_layers=2)  # layer 0 dense, layer 1 MoE (8 experts)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """{(kind, seed): path}: tiny two-layer checkpoints written by fp8_reload."""
    root = tmp_path_factory.mktemp("sgl-ckpt")
    return {(kind, seed): fr.write_checkpoint(root / f"{kind}-{seed}", CFG, seed=seed, kind=kind)
            for kind in ("fp8", "bf16") for seed in (0, 1)}


@pytest.fixture(scope="session", autouse=True)
def server_args(ckpts):
    """sglang's process-wide config for a one-rank CPU 'scheduler', as a server publishes it."""
    return publish_cpu_scheduler(ckpts[("fp8", 0)])


@pytest.fixture
def patched():
    """sglang with the fix applied for the test, reverted afterwards."""
    sglang_patch.apply()
    yield
    sglang_patch.revert()


@pytest.fixture
def unpatched():
    assert not sglang_patch.is_applied()
    yield


@pytest.fixture
def cpu_scaled_fp8_quant(monkeypatch):
    """Give sglang's own processing a CPU ``scaled_fp8_quant`` (it has none) for this test."""
    from sglang.srt.layers.quantization import fp8, utils

    monkeypatch.setattr(fp8, "scaled_fp8_quant", cpu_scaled_fp8_quant_)
    monkeypatch.setattr(utils, "scaled_fp8_quant", cpu_scaled_fp8_quant_)
