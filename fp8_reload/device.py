"""Where a model lives, and waiting for its device: the one place that synchronizes a GPU.

A GPU call returns once its kernels are queued; code that times work, reuses
staging memory or hands weights to other threads waits here first.
"""

from __future__ import annotations

import torch
from torch import nn


def default_device() -> str:
    """``cuda`` where a GPU is usable, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None for a model without any)."""
    p = next(model.parameters(), None)
    return None if p is None else p.device


def on_cuda(model: nn.Module) -> bool:
    device = model_device(model)
    return device is not None and device.type == "cuda"


def synchronize(target: nn.Module | torch.Tensor | torch.device | str | None = None) -> None:
    """Wait for the queued work of `target`'s CUDA device; nothing on CPU.

    `target` is a module (its parameters' device), a tensor, a device, or None
    (the current CUDA device, when CUDA is available).
    """
    if isinstance(target, nn.Module):
        target = model_device(target)
    elif isinstance(target, torch.Tensor):
        target = target.device
    elif target is None:
        target = torch.device("cuda") if torch.cuda.is_available() else None
    if target is not None and torch.device(target).type == "cuda":
        torch.cuda.synchronize(target)
