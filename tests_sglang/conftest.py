"""Real sglang 0.5.23 on the CPU: import bootstrap, runtime context, checkpoints.

Runs in ``.venv-sglang`` (``bash .ci/setup-sglang``), never in the core
environment. Two things sglang needs on a CPU machine are provided here, and
nothing else is faked:

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
import torch  # noqa: E402

_TV = torch.library.Library("torchvision", "DEF")  # kept alive for the session
_TV.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TV.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

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
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(ckpts[("fp8", 0)]), device="cpu", load_format="safetensors")
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return args


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


def _cpu_scaled_fp8_quant(input, scale=None, num_token_padding=None,
                          use_per_token_if_dynamic=False):
    """Per-tensor ``scaled_fp8_quant`` in torch: x / scale saturated to e4m3, scale = amax / 448."""
    assert num_token_padding is None and not use_per_token_if_dynamic
    if scale is None:
        scale = (input.abs().amax().float() / 448.0).clamp(min=1e-12).reshape(1)
    q = (input.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture
def cpu_scaled_fp8_quant(monkeypatch):
    """Give sglang's own processing a CPU ``scaled_fp8_quant`` (it has none) for this test."""
    from sglang.srt.layers.quantization import fp8, utils

    monkeypatch.setattr(fp8, "scaled_fp8_quant", _cpu_scaled_fp8_quant)
    monkeypatch.setattr(utils, "scaled_fp8_quant", _cpu_scaled_fp8_quant)
