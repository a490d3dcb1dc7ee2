"""The Triton post-processing kernels give the torch path's bytes.

On CPU the kernels run in Triton's interpreter (with its FP8 rounding emulated
exactly); on a GPU they run compiled and are compared with the torch path run on
CPU copies of the same tensors: the CPU torch path, the GPU torch path and the
kernels share one arithmetic (`quant.INV_FP8_MAX`, IEEE division where torch
divides two tensors), so all three agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from fp8_reload.processing import ops
from fp8_reload.quant import FP8_DTYPE, quantize_static
from fp8_reload.testing import assert_bitwise_equal

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
from fp8_reload.kernels.triton import requant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_w13(e: int, inter: int, hidden: int, seed: int = 0):
    """[E, 2I, H] FP8 gate|up halves quantized with their own scales, and the [E, 2] scales:
    some experts with equal halves (nothing to move), tiny values that underflow."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, 2 * inter, hidden, generator=g) * torch.rand(e, 1, 1, generator=g) * 3
    w[:, :, :4] *= 1e-4  # values that round to (signed) zero after requantization
    s = torch.rand(e, 2, generator=g) * 2 + 0.05
    s[1, 1] = s[1, 0]
    q = torch.cat([quantize_static(w[:, :inter], s[:, 0, None, None]),
                   quantize_static(w[:, inter:], s[:, 1, None, None])], dim=1)
    return q, s


@pytest.mark.parametrize("experts", [[0, 1, 2, 3, 4, 5, 6], [5], [1, 3, 6], [2, 3, 4]],
                         ids=["all", "one", "some", "a-run"])
def test_requantize_matches_the_torch_path(experts):
    q, s = fp8_w13(7, 48, 80)
    idx = torch.tensor(experts)
    a13, a2 = torch.rand(7) + 0.5, torch.rand(7) + 0.5
    raw13, raw2 = torch.rand(7), torch.rand(7)
    want = [t.clone() for t in (q, s, a13, raw13, a2, raw2)]
    ops.merge_input_scales_(want[2], want[3], idx)
    ops.merge_input_scales_(want[4], want[5], idx)
    ops.requantize_w13_to_expert_max_(want[0], want[1], idx, 48)

    got = [t.to(DEVICE) for t in (q, s, a13, raw13, a2, raw2)]
    requant.requantize_w13_(got[0], got[1], experts, ((got[2], got[3]), (got[4], got[5])))
    for name, a, b in zip(("w13", "w13_scale", "a13", "a13 raw", "a2", "a2 raw"), want, got):
        assert_bitwise_equal(a, b.cpu(), name)
    untouched = [e for e in range(7) if e not in experts]
    assert torch.equal(got[0].cpu()[untouched].view(torch.uint8), q[untouched].view(torch.uint8))


def test_requantize_twice_changes_nothing():
    q, s = fp8_w13(4, 32, 64, seed=1)
    q, s = q.to(DEVICE), s.to(DEVICE)
    requant.requantize_w13_(q, s, [0, 1, 2, 3])
    once = q.clone()
    requant.requantize_w13_(q, s, [0, 1, 2, 3])
    assert_bitwise_equal(q, once, "w13 processed again")


def test_quantize_pieces_matches_the_torch_path():
    g = torch.Generator().manual_seed(2)
    e, inter, hidden = 5, 32, 64
    slots = [0, 2, 4]
    staged = {s: {"w1": (torch.randn(inter, hidden, generator=g) * (s + 1)).to(torch.bfloat16),
                  "w3": torch.randn(inter, hidden, generator=g).to(torch.bfloat16),
                  "w2": (torch.randn(hidden, inter, generator=g) * 1e3).to(torch.bfloat16)}
              for s in slots}
    staged[2]["w2"].zero_()  # an all-zero expert: the smallest scale, zeros out
    staged[4]["w1"][0, 0] = float("1e30")  # a huge value: saturates nothing else away
    w13 = torch.zeros(e, 2 * inter, hidden, dtype=FP8_DTYPE)
    w2 = torch.zeros(e, hidden, inter, dtype=FP8_DTYPE)
    s13, s2 = torch.ones(e, 2), torch.ones(e)
    want = [t.clone() for t in (w13, s13, w2, s2)]
    idx = torch.tensor(slots)
    ops.quantize_experts_(want[0], want[1], idx,
                          torch.stack([torch.cat([staged[s]["w1"], staged[s]["w3"]]) for s in slots]))
    ops.quantize_experts_(want[2], want[3], idx, torch.stack([staged[s]["w2"] for s in slots]))

    got = [t.to(DEVICE) for t in (w13, s13, w2, s2)]
    pieces = []
    for k, s in enumerate(slots):
        src = {n: t.to(DEVICE) for n, t in staged[s].items()}
        pieces += [(src["w1"], got[0][s, :inter], 2 * k, got[1][s]),
                   (src["w3"], got[0][s, inter:], 2 * k, None),
                   (src["w2"], got[2][s], 2 * k + 1, got[3][s:s + 1])]
    requant.quantize_pieces_(pieces)
    for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
        assert_bitwise_equal(a, b.cpu(), name)


def test_quantize_pieces_refuses_mismatched_pieces():
    a = torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.zeros(3, 4, dtype=FP8_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="one size"):
        requant.quantize_pieces_([(a, dst, 0, None)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the dispatch runs Triton there)")
def test_ops_dispatch_to_triton_on_cuda_with_the_same_bytes():
    assert ops.on_triton(torch.empty(1, device="cuda"))
    q, s = fp8_w13(8, 64, 128, seed=3)
    want_q, want_s = q.clone(), s.clone()
    ops.requantize_w13_to_expert_max_(want_q, want_s, torch.tensor([1, 2, 7]), 64)  # CPU: torch
    got_q, got_s = q.cuda(), s.cuda()
    ops.requantize_w13_to_expert_max_(got_q, got_s, torch.tensor([1, 2, 7]), 64)  # CUDA: Triton
    assert_bitwise_equal(want_q, got_q.cpu(), "w13")
    assert_bitwise_equal(want_s, got_s.cpu(), "w13_scale")


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("where", ["device", "host"], ids=["pieces-on-device", "pieces-on-host"])
def test_quantize_staged_by_address_matches_the_torch_path(seed, where):
    """The layout's addresses instead of a view per piece (the Triton path of
    `quantize_staged_experts_`): the torch path's bytes, every slot elsewhere untouched."""
    g = torch.Generator().manual_seed(seed)
    e, inter, hidden = 6, 32, 64
    slots = [1, 2, 5]
    staged = {s: {n: (torch.randn(*shape, generator=g) * (s + 1)).to(torch.bfloat16)
                  for n, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter)))}
              for s in slots}
    w13 = quantize_static(torch.randn(e, 2 * inter, hidden, generator=g), 0.01)
    w2 = quantize_static(torch.randn(e, hidden, inter, generator=g), 0.01)
    s13, s2 = torch.rand(e, 2, generator=g), torch.rand(e, generator=g)
    want = [t.clone() for t in (w13, s13, w2, s2)]
    ops.quantize_staged_experts_(*want, staged)  # CPU tensors: the torch path

    got = [t.to(DEVICE) for t in (w13, s13, w2, s2)]
    put = DEVICE if where == "device" else "cpu"
    moved = {s: {n: t.to(put) for n, t in p.items()} for s, p in staged.items()}
    ops.quantize_staged_by_address_(*got, moved, slots)
    for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
        assert_bitwise_equal(a, b.cpu(), name)
