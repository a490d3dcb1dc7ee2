"""The MoE forward backends on a GPU: accuracy bounds, agreement, reload equality.

Skips cleanly without CUDA; DeepGEMM tests skip with the reason when DeepGEMM
cannot run (see `kernels.UNAVAILABLE`). The shape is the `small` preset
(hidden 512, intermediate 256, 16 experts, top-4): every dimension a multiple
of 128, as DeepGEMM needs. Token count is fixed (64) so the DeepGEMM JIT
compiles few kernels.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fp8_reload as fr  # noqa: E402
from fp8_reload import kernels  # noqa: E402
from fp8_reload.kernels import (  # noqa: E402
    CROSS_SCHEME_BOUND,
    GEMM_BOUND,
    MOE_LAYER_BOUND,
    SAME_SCHEME_BOUND,
    moe_forward_torch,
)
from fp8_reload.testing import calc_diff  # noqa: E402

from .conftest import copy_checkpoint, mix_checkpoints, rewrite_tensor  # noqa: E402

pytestmark = pytest.mark.gpu
TOKENS = 64
KINDS = ["fp8", "bf16"]
AVAILABLE = kernels.available_backends()
BACKENDS = ["torch", "triton", "deep_gemm", "deep_gemm_masked"]


def need(*names):
    missing = [n for n in names if n not in AVAILABLE]
    if missing:
        pytest.skip("; ".join(f"{n}: {kernels.UNAVAILABLE.get(n, 'not registered')}"
                              for n in missing))


@pytest.fixture(scope="module")
def cfg():
    return fr.MoEConfig.preset("small", num_layers=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, cfg):
    root = tmp_path_factory.mktemp("gpu")
    return {(kind, seed): fr.write_checkpoint(root / f"{kind}-{seed}", cfg, seed=seed, kind=kind)
            for kind in KINDS for seed in (0, 1)}


def load(path):
    return fr.load_model(path, device="cuda")


def moe_layer(model):
    return next(layer for _, layer in model.moe_layers())


def routed(model, seed=0):
    cfg = model.config
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = model.model.layers[cfg.first_dense_layers].mlp.gate(x)
    return x, w, ids


def run_all(layer, x, w, ids, names):
    return {n: kernels.run_moe(layer, x, w, ids, backend=n) for n in names}


# --------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------

def test_deep_gemm_single_grouped_gemm_within_fp8_bound():
    need("deep_gemm")
    from fp8_reload.kernels.deep_gemm import EmulatedGroupedGemm, deep_gemm_lib
    from fp8_reload.kernels.routing import contiguous_rows
    from fp8_reload.kernels.scales import expand_block_scales
    from fp8_reload.kernels.triton import group_quant
    from fp8_reload.quant import FP8_DTYPE, FP8_MAX
    from fp8_reload.testing.workloads import gemm_reference_diff

    lib = deep_gemm_lib()
    groups, per, n, k = 16, 128, 512, 512
    # the row count of the gate/up GEMM of the small model at TOKENS tokens: the same
    # kernel as the MoE forward below, so the JIT compiles nothing extra
    m = contiguous_rows(torch.zeros(TOKENS, 4, dtype=torch.long), groups, lib.m_alignment).num_rows
    used = groups * per
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[:used] = torch.randn(used, k, generator=g, device="cuda").to(torch.bfloat16)
    wt = (torch.randn(groups, n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    scale = (wt.float().abs().amax(dim=(1, 2)) / FP8_MAX).clamp(min=1e-12)
    b = ((wt.float() / scale[:, None, None]).to(FP8_DTYPE), expand_block_scales(scale, n, k))
    a = group_quant(x)
    m_indices = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    m_indices[:used] = torch.arange(groups, dtype=torch.int32, device="cuda").repeat_interleave(per)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    lib.contiguous(a, b, d, m_indices)
    assert gemm_reference_diff(x[:used], wt, d[:used], per) < GEMM_BOUND
    emulated = torch.empty_like(d)
    EmulatedGroupedGemm().contiguous(a, b, emulated, m_indices)
    # the CPU emulation computes what DeepGEMM computes, up to accumulation order: even one
    # bf16 ulp (2^-8) off on every element would give 7.6e-6
    assert calc_diff(d[:used], emulated[:used]) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_each_backend_within_bound_and_backends_agree(ckpts, kind):
    need("triton")
    model = load(ckpts[kind, 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
    names = [n for n in BACKENDS if n in AVAILABLE]
    ys = run_all(layer, x, w, ids, names)
    for name, y in ys.items():
        assert torch.isfinite(y.float()).all(), name
        assert calc_diff(y, ref) < MOE_LAYER_BOUND, (name, calc_diff(y, ref))
    assert calc_diff(ys["triton"], ys["torch"]) < SAME_SCHEME_BOUND
    if "deep_gemm" in ys:
        assert calc_diff(ys["deep_gemm"], ys["triton"]) < CROSS_SCHEME_BOUND
        assert calc_diff(ys["deep_gemm"], ys["deep_gemm_masked"]) < SAME_SCHEME_BOUND
        from fp8_reload.kernels.deep_gemm import EmulatedGroupedGemm, moe_forward_deepgemm

        emulated = moe_forward_deepgemm(layer, x, w, ids, gemm=EmulatedGroupedGemm())
        assert calc_diff(ys["deep_gemm"], emulated) < SAME_SCHEME_BOUND


# --------------------------------------------------------------------------
# Reloads
# --------------------------------------------------------------------------

def _target(ckpts, tmp_path, kind, which):
    if which == "full":
        return ckpts[kind, 1], None
    flt = fr.generate_weight_name_filter({1: [0, 5, 9, 14]})
    return mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed", flt), flt


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["full", "filtered"])
def test_after_reload_each_backend_equals_a_fresh_load_bitwise(ckpts, tmp_path, kind, which):
    need("triton")
    names = [n for n in BACKENDS if n in AVAILABLE]
    model = load(ckpts[kind, 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    before = run_all(layer, x, w, ids, names)  # fills every kernel cache
    for n in names:  # deterministic: same inputs, same bits
        assert torch.equal(kernels.run_moe(layer, x, w, ids, backend=n), before[n]), n
    path, flt = _target(ckpts, tmp_path, kind, which)
    fr.update_weights_from_disk(model, path, flt)
    fresh = load(path)
    after = run_all(layer, x, w, ids, names)
    want = run_all(moe_layer(fresh), x, w, ids, names)
    for n in names:
        assert torch.equal(after[n], want[n]), n
        assert not torch.equal(after[n], before[n]), n
        assert torch.equal(model(x, backend=n), fresh(x, backend=n)), n


def test_stale_block_scales_would_be_a_wrong_answer(ckpts, tmp_path):
    need("deep_gemm")
    model = load(ckpts["fp8", 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    kernels.run_moe(layer, x, w, ids, backend="deep_gemm")
    stale_cache, stale_version = dict(layer.kernel_cache), layer.weights_version
    path, flt = _target(ckpts, tmp_path, "fp8", "filtered")
    fr.update_weights_from_disk(model, path, flt)
    want = kernels.run_moe(moe_layer(load(path)), x, w, ids, backend="deep_gemm")
    assert torch.equal(kernels.run_moe(layer, x, w, ids, backend="deep_gemm"), want)
    layer.kernel_cache, layer.weights_version = stale_cache, stale_version
    assert not torch.equal(kernels.run_moe(layer, x, w, ids, backend="deep_gemm"), want)


def test_forward_replays_in_a_cuda_graph(ckpts):
    """No host synchronization on the GPU paths: decode-sized MoE layers run in CUDA graphs."""
    need("triton")
    from fp8_reload.testing import capture_graph

    model = load(ckpts["fp8", 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    for n in [n for n in BACKENDS[1:] if n in AVAILABLE]:
        eager = kernels.run_moe(layer, x, w, ids, backend=n)
        graph, out = capture_graph(lambda n=n: kernels.run_moe(layer, x, w, ids, backend=n))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), n


def test_model_level_backend_selection(ckpts):
    need("triton")
    model = load(ckpts["fp8", 0])
    x, _, _ = routed(model)
    names = [n for n in BACKENDS if n in AVAILABLE]
    for n in names:
        model.set_backend(n)
        assert torch.equal(model(x), model(x, backend=n)), n
    model.set_backend(None)


# --------------------------------------------------------------------------
# [E, 2] scales with wildly different gate/up halves
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def skewed(tmp_path_factory, ckpts, cfg):
    path = copy_checkpoint(ckpts["fp8", 0], tmp_path_factory.mktemp("skew") / "fp8")
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            f = 4.0 ** ((e % 4) - 1.5)
            base = f"model.layers.{layer}.mlp.experts.{e}"
            rewrite_tensor(path, f"{base}.gate_proj.weight_scale", lambda t, f=f: t * f)
            rewrite_tensor(path, f"{base}.up_proj.weight_scale", lambda t, f=f: t / f)
    return path


def test_skewed_gate_up_scales_come_out_right_on_every_backend(skewed):
    need("triton")
    model = load(skewed)
    layer = moe_layer(model)
    x, w, ids = routed(model)
    ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
    names = [n for n in BACKENDS if n in AVAILABLE]
    for n, y in run_all(layer, x, w, ids, names).items():
        assert calc_diff(y, ref) < MOE_LAYER_BOUND, n

    from fp8_reload.kernels.triton import fused_moe

    s13 = layer.w13_weight_scale.data
    misread = s13.reshape(-1)[: s13.shape[0]].contiguous()  # [E, 2] read as [E]
    _, w2_s, a13, a2 = kernels.moe_kernel_scales(layer)
    bad = fused_moe(x, layer.w13_weight, layer.w2_weight, misread, w2_s, a13, a2, w, ids)
    assert calc_diff(bad, ref) > 10 * MOE_LAYER_BOUND
    if "deep_gemm" in names:
        from fp8_reload.kernels import deep_gemm as kd
        from fp8_reload.kernels import scales

        e, n13, k13 = layer.w13_weight.shape
        bad_bs = (scales.expand_block_scales(misread, n13, k13), scales.block_scales(layer)[1])
        bad = kd.moe_forward_deepgemm(layer, x, w, ids, scale_mode="precomputed",
                                      precomputed_scales=bad_bs)
        assert calc_diff(bad, ref) > 10 * MOE_LAYER_BOUND
