"""Review s26 of the sglang patch (an attack through sglang's EPLB move and its LoRA layers).

sglang's `FusedMoEWithLoRA` takes the Triton quant info once, when it wraps the layer, and
hands that object to the kernels on every forward. For a patched layer the info holds copies
(the contiguous ``[E]`` w13 scale, the max of the per-expert input scales), so after a
reload or an EPLB move the LoRA forward ran the new FP8 weights under the old scales (about
6x too coarse on one expert of this test). The patch now takes it for every forward.

The kernels need a GPU: the forward here runs up to the LoRA runner, where the quant info the
kernels would get is recorded and the forward stopped.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import CFG
from .sgl_model import eplb_move, fresh_experts, load_experts

E = CFG.num_experts


class _Stopped(Exception):
    """Raised where the kernels would run."""


def _kernel_quant_info(lora):
    """The quant info `lora`'s forward hands the Triton MoE kernels."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    seen = []

    def run(dispatch_output, quant_info, lora_info=None):
        seen.append(quant_info)
        raise _Stopped

    lora._lora_runner.run = run
    x = torch.zeros(4, CFG.hidden_size, dtype=torch.bfloat16)
    topk = StandardTopKOutput(torch.full((4, 2), 0.5), torch.zeros(4, 2, dtype=torch.int32),
                              torch.zeros(4, E))
    with pytest.raises(_Stopped):
        lora._forward_with_lora(x, topk, lora_info=None)
    return seen[0]


def _reloaded(moe, ckpts):
    load_experts(moe, {e: ckpts[("fp8", 1)] for e in (1, 4)})
    moe.quant_method.process_weights_after_loading(moe)
    return fresh_experts(CFG, "fp8", {e: ckpts[("fp8", 1 if e in (1, 4) else 0)] for e in range(E)})


def _moved(moe, ckpts):
    new = list(reversed(range(E)))  # every slot takes another expert (same-rank copies)
    eplb_move(moe, list(range(E)), new)
    return fresh_experts(CFG, "fp8", {slot: ckpts[("fp8", 0)] for slot in range(E)}), new


@pytest.mark.parametrize("change", ["filtered reload", "EPLB move"])
def test_the_lora_forward_gets_the_scales_the_layer_holds_now(patched, ckpts, change):
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend
    from sglang.srt.lora.layers import FusedMoEWithLoRA

    moe = fresh_experts(CFG, "fp8", {e: ckpts[("fp8", 0)] for e in range(E)})
    lora = FusedMoEWithLoRA(moe, TritonLoRABackend(1, torch.device("cpu")))
    before = _kernel_quant_info(lora)
    if change == "filtered reload":
        fresh, order = _reloaded(moe, ckpts), list(range(E))
    else:
        fresh, order = _moved(moe, ckpts)
    want = fresh.quant_method.get_triton_quant_info(fresh)
    got = _kernel_quant_info(lora)
    assert not torch.equal(got.w13_scale, before.w13_scale)  # the change reached the scales
    assert torch.equal(got.w13_scale, want.w13_scale[order])
    assert torch.equal(got.w2_scale, want.w2_scale[order])
    assert torch.equal(got.a13_scale, want.a13_scale) and torch.equal(got.a2_scale, want.a2_scale)
    assert got.w13_weight is moe.w13_weight and got.w2_weight is moe.w2_weight
