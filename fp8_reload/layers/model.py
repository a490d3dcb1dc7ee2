"""The whole model: checkpoint names mapped to parameters, and sglang's DeepSeek loader."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .. import trace
from ..config import MoEConfig
from ..locks import WeightsLock
from .blocks import DecoderStack, FusedMoE, default_weight_loader

# Checkpoint name -> parameter mapping, as in sglang's DeepSeek loader.
EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(.+)$")
EXPERT_SHARD = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"), "down_proj": ("w2_", "w2")}
STACKED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a checkpoint tensor of a routed expert; None for any other."""
    m = EXPERT_RE.match(name)
    return None if m is None else (int(name.split(".")[2]), int(m.group(2)))


class FP8MoEModel(nn.Module):
    """DeepSeek-V2-style decoder: x [tokens, hidden] bf16 -> [tokens, hidden] bf16."""

    def __init__(self, cfg: MoEConfig, mode, checkpoint_kind: str, device=None,
                 **moe_kwargs):
        super().__init__()
        self.config = cfg
        self.mode = mode
        self.checkpoint_kind = checkpoint_kind
        fp8_ckpt = checkpoint_kind == "fp8"
        make_linear = lambda: mode.linear_method(fp8_ckpt)  # noqa: E731
        make_moe = lambda: mode.moe_method(fp8_ckpt)  # noqa: E731
        self.model = DecoderStack(cfg, make_linear, make_moe, device, **moe_kwargs)
        # One reload at a time; forwards share `weights_lock`, a reload's commit takes it
        # exclusively, so no forward sees a half-written layer (rule: locks.py).
        self.reload_lock = threading.RLock()
        self.weights_lock = WeightsLock()

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """`backend` picks the MoE forward for this call; default: `set_backend`'s choice."""
        with self.weights_lock.read(), trace.range("fp8_reload/forward", payload=x.shape[0]):
            return self.model(x, backend=backend)

    def set_backend(self, backend: str | None) -> None:
        """Select the MoE forward backend for every layer (None: the torch reference)."""
        for _, layer in self.moe_layers():
            layer.backend = backend

    def moe_layers(self) -> Iterable[tuple[str, FusedMoE]]:
        """(name, layer) of every FusedMoE: one per MoE decoder layer, where the stack puts
        it (a walk of every module costs each reload's cache invalidation O(model))."""
        for i, layer in enumerate(self.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if isinstance(experts, FusedMoE):
                yield f"model.layers.{i}.mlp.experts", experts

    def quantized_modules(self) -> Iterable[tuple[str, nn.Module]]:
        for name, module in self.named_modules():
            if getattr(module, "quant_method", None) is not None:
                yield name, module

    # ----- name mapping -----
    def resolve(self, name: str) -> tuple[str, str, dict]:
        """Checkpoint tensor name -> (parameter name, module name, loader kwargs).

        Raises KeyError for a name the model has no parameter for. Pure in `name`:
        kept per model (a reload resolves every name it plans, again for each checkpoint).
        """
        known = self.__dict__.setdefault("_resolved", {})
        hit = known.get(name)
        if hit is None:
            hit = known[name] = self._resolve(name)
        return hit[0], hit[1], dict(hit[2])

    def _resolve(self, name: str) -> tuple[str, str, dict]:
        m = EXPERT_RE.match(name)
        if m:
            prefix, expert, proj, suffix = m.groups()
            pfx, shard = EXPERT_SHARD[proj]
            return (f"{prefix}.{pfx}{suffix}", prefix,
                    {"shard_id": shard, "expert_id": int(expert), "weight_name": None})
        for param_part, ckpt_part, shard in STACKED:
            if f".{ckpt_part}." in name:
                pname = name.replace(f".{ckpt_part}.", f".{param_part}.")
                return pname, pname.rsplit(".", 1)[0], {"loaded_shard_id": shard}
        return name, name.rsplit(".", 1)[0], {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors the way sglang's DeepSeek loader does.

        Expert and stacked parameters look up `param.weight_loader` directly (and
        so raise AttributeError when post-processing replaced the Parameter);
        others fall back to `default_weight_loader`. Returns the names of the
        modules that received weights.
        """
        params = dict(self.named_parameters())
        touched: set[str] = set()
        for name, tensor in weights:
            pname, module_name, kw = self.resolve(name)
            if pname not in params:
                raise KeyError(f"no parameter {pname!r} for checkpoint tensor {name!r}")
            param = params[pname]
            with trace.range("fp8_reload/weight_loader", payload=tensor.nbytes):
                if "expert_id" in kw:
                    loader: Callable = param.weight_loader
                    loader(param, tensor, pname, shard_id=kw["shard_id"], expert_id=kw["expert_id"])
                elif "loaded_shard_id" in kw:
                    param.weight_loader(param, tensor, kw["loaded_shard_id"])
                else:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            touched.add(module_name)
        return touched
