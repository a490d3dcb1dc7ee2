"""What sglang needs to run on a CPU machine, for the test session and for spawned ranks.

Import this before sglang: PyPI's torchvision is built against CUDA torch, and beside the
CPU torch its import registers fake kernels for ``torchvision::nms``/``qnms`` whose
schemas are missing; they are defined here (schema only).
"""

from __future__ import annotations

from pathlib import Path

import torch

_TV = torch.library.Library("torchvision", "DEF")  # kept alive for the process
_TV.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_TV.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def publish_cpu_scheduler(model_path: Path):
    """sglang's process-wide config for a one-rank CPU 'scheduler', as a server publishes it."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model_path), device="cpu", load_format="safetensors")
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    return args


def cpu_scaled_fp8_quant_(input, scale=None, num_token_padding=None, use_per_token_if_dynamic=False):
    """Per-tensor ``scaled_fp8_quant`` in torch (sglang has no CPU kernel for it): x / scale
    saturated to e4m3, scale = amax / 448."""
    assert num_token_padding is None and not use_per_token_if_dynamic
    if scale is None:
        scale = (input.abs().amax().float() / 448.0).clamp(min=1e-12).reshape(1)
    q = (input.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale
