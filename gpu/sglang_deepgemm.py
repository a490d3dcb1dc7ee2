"""GPU check of the sglang patch: the DeepGEMM block scales the patched sglang hands its runner.

`sglang_patch.deepgemm_quant_info` feeds DeepGEMM ``per_tensor_block_scales``
of the fixed ``[E, 2]`` w13 scale. This runs DeepGEMM's own grouped FP8 GEMM
on exactly such tensors, after processing and after an in-place reload of some
experts, against a float32 reference. Prints PASS/FAIL lines.
"""

import sys
import traceback

import torch

from fp8_reload.kernels.reference import per_token_group_quant
from fp8_reload.kernels.scales import collapse_w13_scale
from fp8_reload.processing import requantize_w13_to_expert_max_
from fp8_reload.quant import FP8_MAX
from fp8_reload.sglang_patch import per_tensor_block_scales
from fp8_reload.testing import calc_diff

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to smoke-test the script

E, ROWS, INTER, HIDDEN = 8, 256, 512, 1024  # w13 [E, 2*INTER, HIDDEN]


def checkpoint_w13(seed):
    """Gate/up halves quantized with their own scales, as a checkpoint stores them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(E, 2 * INTER, HIDDEN, device=DEVICE, generator=g) / HIDDEN ** 0.5
    w[:, INTER:] *= 4.0  # up rows larger: the two halves get different scales
    halves = w.view(E, 2, INTER, HIDDEN)
    scale = (halves.abs().amax(dim=(2, 3)) / FP8_MAX).float()  # [E, 2]
    q = (halves / scale[:, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(E, 2 * INTER, HIDDEN), scale


def run_gemm(deep_gemm, w13, scale, x):
    bs = per_tensor_block_scales(scale, w13.shape)
    assert bs.shape == (E, 2 * INTER // 128, HIDDEN // 128) and bs.is_contiguous()
    a, sfa = per_token_group_quant(x, 128)
    m_indices = torch.arange(E, device=DEVICE, dtype=torch.int32).repeat_interleave(ROWS)
    d = torch.empty(E * ROWS, 2 * INTER, device=DEVICE, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (w13, bs), d, m_indices)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    s = collapse_w13_scale(scale)
    ref = torch.cat([(a[e * ROWS:(e + 1) * ROWS].float()
                      * sfa[e * ROWS:(e + 1) * ROWS].repeat_interleave(128, dim=1))
                     @ (w13[e].float() * s[e]).t() for e in range(E)])
    return d, calc_diff(d, ref)


def main() -> int:
    try:
        import deep_gemm
    except Exception as e:
        print(f"FAIL deepgemm import: {type(e).__name__}: {e}")
        return 1
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, {where}")
    ok = True
    try:
        x = torch.randn(E * ROWS, HIDDEN, device=DEVICE).to(torch.bfloat16)
        w13, scale = checkpoint_w13(0)
        everyone = torch.arange(E)
        requantize_w13_to_expert_max_(w13, scale, everyone, INTER)  # fresh load
        d0, diff0 = run_gemm(deep_gemm, w13, scale, x)
        print(f"{'PASS' if diff0 < 1e-3 else 'FAIL'} fresh load: calc_diff {diff0:.2e} (bound 1e-3)")
        ok &= diff0 < 1e-3

        # in-place reload of experts 1 and 5 from another checkpoint, then a fresh load of the mix
        new_w, new_s = checkpoint_w13(1)
        reloaded = torch.tensor([1, 5])
        for e in reloaded.tolist():
            w13[e].copy_(new_w[e])
            scale[e].copy_(new_s[e])
        w13_ptr, scale_ptr = w13.data_ptr(), scale.data_ptr()
        requantize_w13_to_expert_max_(w13, scale, reloaded, INTER)
        d1, diff1 = run_gemm(deep_gemm, w13, scale, x)
        mix_w, mix_s = checkpoint_w13(0)
        for e in reloaded.tolist():
            mix_w[e].copy_(new_w[e])
            mix_s[e].copy_(new_s[e])
        requantize_w13_to_expert_max_(mix_w, mix_s, everyone, INTER)
        d2, _ = run_gemm(deep_gemm, mix_w, mix_s, x)
        same = torch.equal(d1.view(torch.int16), d2.view(torch.int16))
        in_place = (w13.data_ptr(), scale.data_ptr()) == (w13_ptr, scale_ptr)
        print(f"{'PASS' if diff1 < 1e-3 else 'FAIL'} after reload of experts 1,5: calc_diff {diff1:.2e}")
        print(f"{'PASS' if same else 'FAIL'} reload output == fresh-load output, bit for bit")
        print(f"{'PASS' if in_place else 'FAIL'} weights and [E, 2] scale updated in place")
        ok &= diff1 < 1e-3 and same and in_place
    except Exception:
        traceback.print_exc()
        print("FAIL deepgemm check raised")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
