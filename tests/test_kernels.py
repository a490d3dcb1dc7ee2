"""MoE forward kernels on real checkpoints: Triton (interpreter on CPU, compiled on a GPU)
and the DeepGEMM host path with its grouped GEMMs emulated in torch.

The emulation checks the operand layouts DeepGEMM checks and computes what
DeepGEMM computes, so routing, padding, scale-factor layout, block-scale caching
and the combine run here exactly as on the H200 (tests/test_kernels_gpu.py runs
the real kernels and compares them with the emulation).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8_reload as fr
from fp8_reload import kernels
from fp8_reload.kernels import CROSS_SCHEME_BOUND, MOE_LAYER_BOUND, SAME_SCHEME_BOUND, moe_forward_torch
from fp8_reload.kernels.reference import per_token_group_quant
from fp8_reload.kernels.routing import contiguous_rows, masked_rows
from fp8_reload.quant import quantize_static
from fp8_reload.testing import calc_diff

from .conftest import copy_checkpoint, mix_checkpoints, rewrite_tensor

triton = pytest.importorskip("triton", reason="triton not installed (pip install triton)")
kt = pytest.importorskip("fp8_reload.kernels.triton")
from fp8_reload.kernels import deep_gemm as kd  # noqa: E402
from fp8_reload.kernels import scales  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["fp8", "bf16"]
EMU = kd.EmulatedGroupedGemm()


# --------------------------------------------------------------------------
# Fixtures: a DeepGEMM-compatible tiny model (hidden and intermediate 128) and an
# odd-shaped one that exercises every mask of the Triton tiles.
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cfg128():
    return fr.MoEConfig.preset("tiny", hidden_size=128, moe_intermediate_size=128,
                               intermediate_size=128, num_layers=2)


@pytest.fixture(scope="module")
def ckpts128(tmp_path_factory, cfg128):
    root = tmp_path_factory.mktemp("k128")
    return {(kind, seed): fr.write_checkpoint(root / f"{kind}-{seed}", cfg128, seed=seed, kind=kind)
            for kind in KINDS for seed in (0, 1)}


def moe_layer(model):
    return next(layer for _, layer in model.moe_layers())


def routed(model, n=48, seed=0):
    """Tokens and the routing the MoE block's own router gives them."""
    cfg = model.config
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    x = x.to(torch.bfloat16).to(DEVICE)
    block = model.model.layers[cfg.first_dense_layers].mlp
    w, ids = block.gate(x)
    return x, w, ids


def load(path):
    return fr.load_model(path, device=DEVICE)


def forwards(layer, x, w, ids):
    """Every kernel path under test on one layer."""
    return {
        "triton": kt.moe_forward_triton(layer, x, w, ids),
        "dg-contiguous": kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU),
        "dg-masked": kd.moe_forward_deepgemm(layer, x, w, ids, layout="masked", gemm=EMU),
    }


# --------------------------------------------------------------------------
# Quantization kernels
# --------------------------------------------------------------------------

def _awkward(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-7, 3, cols)
    # ties to even (35/0.7 = 50 sits between 48 and 52), mantissa carry (124.7 -> 128),
    # saturation, signed zero and subnormals
    x[0, :6] = torch.tensor([35.0, 87.28311920166016, 1e4, -0.0, -3e-6, 2e-9])
    return x.to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("scale", [0.7, 1e-3, None])
def test_per_tensor_quant_matches_reference(scale):
    x = _awkward(67, 300, 0)
    s = None if scale is None else torch.tensor(scale, device=DEVICE)
    q, used = kt.quantize_per_tensor(x, s)
    ref = quantize_static(x, used.reshape(()))
    assert torch.equal(q.float(), ref.float())


def test_group_quant_matches_reference_and_deep_gemm_layout():
    x = _awkward(61, 384, 1)
    q, sf = kt.group_quant(x)
    rq, rs = per_token_group_quant(x)
    assert torch.equal(q.float(), rq.float())
    assert torch.equal(sf, rs)
    assert sf.stride() == (1, 64)  # MN-major, rows padded to a multiple of 4


# --------------------------------------------------------------------------
# Routing layouts
# --------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.data())
def test_routing_layouts(tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    align = data.draw(st.sampled_from([1, 4, 16, 128]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)

    c = contiguous_rows(ids, experts, align)
    assert c.num_rows % align == 0
    assert torch.equal(c.counts.long(), counts)
    assert torch.equal(c.row_expert[c.pos.long()].long(), flat)
    assert torch.equal(c.row_pair[c.pos.long()].long(), torch.arange(flat.numel()))
    assert int((c.row_expert >= 0).sum()) == flat.numel()
    for e in range(experts):  # one aligned run per expert, pairs in token order
        rows = (c.row_expert == e).nonzero().flatten()
        if rows.numel():
            assert int(rows[0]) % align == 0
            assert torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel()))
            assert bool((c.row_pair[rows].diff() > 0).all())
    if align > 1:
        assert torch.equal(c.block_expert(align), c.row_expert.view(-1, align)[:, 0])

    m = masked_rows(ids, experts, tokens)
    assert torch.equal(m.row_expert[m.pos.long()].long(), flat)
    assert torch.equal(m.pos.long() // tokens, flat)  # expert e owns rows [e*M, (e+1)*M)
    assert bool(((m.pos.long() % tokens) < counts[flat]).all())


# --------------------------------------------------------------------------
# Accuracy against the float32 reference, agreement between paths
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_paths_match_reference_and_each_other(ckpts128, kind):
    model = load(ckpts128[kind, 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
    same_scheme = moe_forward_torch(layer, x, w, ids)
    ys = forwards(layer, x, w, ids)
    for name, y in {"torch": same_scheme, **ys}.items():
        assert calc_diff(y, ref) < MOE_LAYER_BOUND, name
    assert calc_diff(ys["triton"], same_scheme) < SAME_SCHEME_BOUND
    assert calc_diff(ys["triton"], ys["dg-contiguous"]) < CROSS_SCHEME_BOUND
    assert torch.equal(ys["dg-contiguous"], ys["dg-masked"])


def test_paths_read_upstreams_collapsed_scales_too(ckpts128):
    """sglang 0.5.23's processing leaves w13_weight_scale as [E] and input scales 0-dim."""
    model = fr.load_model(ckpts128["fp8", 0], device=DEVICE, processing="upstream")
    layer = moe_layer(model)
    assert layer.w13_weight_scale.dim() == 1 and layer.w13_input_scale.dim() == 0
    x, w, ids = routed(model)
    ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
    ys = forwards(layer, x, w, ids)
    ys["dg-per-forward"] = kd.moe_forward_deepgemm(layer, x, w, ids, scale_mode="per-forward",
                                                   gemm=EMU)
    for name, y in ys.items():
        assert calc_diff(y, ref) < MOE_LAYER_BOUND, name
    assert torch.equal(ys["dg-per-forward"], ys["dg-contiguous"])


def test_triton_tiles_mask_ragged_shapes(tmp_path):
    """hidden 96 and intermediate 48: no tile size divides them."""
    cfg = fr.MoEConfig.preset("tiny", hidden_size=96, moe_intermediate_size=48, num_layers=2)
    model = load(fr.write_checkpoint(tmp_path / "odd", cfg, seed=3, kind="fp8"))
    layer = moe_layer(model)
    x, w, ids = routed(model, n=37)
    y = kt.moe_forward_triton(layer, x, w, ids)
    assert calc_diff(y, moe_forward_torch(layer, x, w, ids)) < SAME_SCHEME_BOUND
    with pytest.raises(fr.BackendUnavailable, match="multiples of 128"):
        kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU)


def test_scale_modes_give_identical_outputs(ckpts128):
    model = load(ckpts128["fp8", 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    cached = kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU)
    per_fwd = kd.moe_forward_deepgemm(layer, x, w, ids, scale_mode="per-forward", gemm=EMU)
    pre = kd.moe_forward_deepgemm(layer, x, w, ids, scale_mode="precomputed", gemm=EMU,
                                  precomputed_scales=scales.block_scales(layer))
    assert torch.equal(cached, per_fwd) and torch.equal(cached, pre)
    w13_bs, w2_bs = scales.block_scales(layer)
    e, i2, h = layer.w13_weight.shape
    assert w13_bs.shape == (e, i2 // 128, h // 128) and w13_bs.is_contiguous()
    assert torch.equal(w13_bs, scales.block_scales_per_forward(layer)[0])
    assert torch.equal(w13_bs[:, 0, 0], layer.w13_weight_scale[:, 0])


# --------------------------------------------------------------------------
# [E, 2] scales: experts whose gate and up scales differ wildly
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory, ckpts128, cfg128):
    """Expert e's gate scale x f_e and up scale / f_e, f_e in 1/8 .. 8 (gate/up ratio up to 64)."""
    path = copy_checkpoint(ckpts128["fp8", 0], tmp_path_factory.mktemp("skew") / "fp8")
    for layer in cfg128.moe_layers:
        for e in range(cfg128.num_experts):
            f = 4.0 ** ((e % 4) - 1.5)
            base = f"model.layers.{layer}.mlp.experts.{e}"
            rewrite_tensor(path, f"{base}.gate_proj.weight_scale", lambda t, f=f: t * f)
            rewrite_tensor(path, f"{base}.up_proj.weight_scale", lambda t, f=f: t / f)
    return path


def test_skewed_gate_up_scales_come_out_right_and_a_misread_is_caught(skewed_ckpt):
    model = load(skewed_ckpt)
    layer = moe_layer(model)
    x, w, ids = routed(model)
    s13 = layer.w13_weight_scale.data
    assert s13.shape[1] == 2 and float(s13[:, 0].max() / s13[:, 0].min()) > 8
    ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
    for name, y in forwards(layer, x, w, ids).items():
        assert calc_diff(y, ref) < MOE_LAYER_BOUND, name

    # A kernel reading the [E, 2] storage as if it were [E] sees scale[e // 2, e % 2].
    misread = s13.reshape(-1)[: s13.shape[0]].contiguous()
    w13_s, w2_s, a13, a2 = kernels.moe_kernel_scales(layer)
    bad_triton = kt.fused_moe(x, layer.w13_weight, layer.w2_weight, misread, w2_s, a13, a2, w, ids)
    e, n13, k13 = layer.w13_weight.shape
    bad_bs = (scales.expand_block_scales(misread, n13, k13), scales.block_scales(layer)[1])
    bad_dg = kd.moe_forward_deepgemm(layer, x, w, ids, scale_mode="precomputed",
                                     precomputed_scales=bad_bs, gemm=EMU)
    for y in (bad_triton, bad_dg):
        assert calc_diff(y, ref) > 10 * MOE_LAYER_BOUND
    with pytest.raises(ValueError, match=r"\[E\]"):
        kt.fused_moe(x, layer.w13_weight, layer.w2_weight, s13, w2_s, a13, a2, w, ids)


# --------------------------------------------------------------------------
# Reloads: outputs equal a fresh load's; the block-scale cache never goes stale
# --------------------------------------------------------------------------

RELOADS = ["full", "filtered"]


def _target(ckpts, tmp_path, kind, which):
    """(checkpoint to reload from, its weight_name_filter)."""
    if which == "full":
        return ckpts[kind, 1], None
    moved = {1: [0, 3, 5]}
    flt = fr.generate_weight_name_filter(moved)
    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed", flt)
    return mixed, flt


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", RELOADS)
def test_after_reload_each_path_equals_a_fresh_load(ckpts128, tmp_path, kind, which):
    model = load(ckpts128[kind, 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    before = forwards(layer, x, w, ids)  # fills the kernel caches
    path, flt = _target(ckpts128, tmp_path, kind, which)
    fr.update_weights_from_disk(model, path, flt)
    fresh = moe_layer(load(path))
    after, want = forwards(layer, x, w, ids), forwards(fresh, x, w, ids)
    for name in want:
        assert torch.equal(after[name], want[name]), name
        assert not torch.equal(after[name], before[name]), name  # the reload mattered


def test_stale_block_scales_would_be_a_wrong_answer(ckpts128, tmp_path):
    """Negative control for the test above: serve the pre-reload cache and the answer is wrong."""
    model = load(ckpts128["fp8", 0])
    layer = moe_layer(model)
    x, w, ids = routed(model)
    kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU)
    stale_cache, stale_version = dict(layer.kernel_cache), layer.weights_version
    assert any(k[0] == "deep_gemm_block_scales" for k in stale_cache)
    path, flt = _target(ckpts128, tmp_path, "fp8", "filtered")
    fr.update_weights_from_disk(model, path, flt)
    assert layer.weights_version != stale_version and not layer.kernel_cache
    want = kd.moe_forward_deepgemm(moe_layer(load(path)), x, w, ids, gemm=EMU)
    assert torch.equal(kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU), want)
    # what a forward would compute if the reload had not invalidated the cache
    layer.kernel_cache, layer.weights_version = stale_cache, stale_version
    assert not torch.equal(kd.moe_forward_deepgemm(layer, x, w, ids, gemm=EMU), want)


def test_layer_cache_keys_on_weights_version_and_reload_clears_it(ckpts128):
    model = load(ckpts128["fp8", 0])
    layer = moe_layer(model)
    calls = []
    build = lambda lyr: calls.append(lyr.weights_version) or len(calls)  # noqa: E731
    assert kernels.layer_cache(layer, "x", build) == kernels.layer_cache(layer, "x", build) == 1
    layer.weights_version += 1
    assert kernels.layer_cache(layer, "x", build) == 2
    assert [k[:2] for k in layer.kernel_cache if k[0] == "x"] == [("x", layer.weights_version)]
    kernels.clear_kernel_caches(model)
    assert layer.kernel_cache == {}
    assert kernels.cached_kernel_scales(layer)[0].is_contiguous()


# --------------------------------------------------------------------------
# The emulation checks what DeepGEMM checks; backends say why they are missing
# --------------------------------------------------------------------------

def test_emulated_gemm_rejects_layouts_deep_gemm_would_reject():
    m, n, k, g = 8, 128, 256, 2
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(g, n, k, dtype=torch.float8_e4m3fn)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    idx = torch.zeros(m, dtype=torch.int32)
    sfb = torch.ones(g, 1, 2)
    row_major_sfa = torch.ones(m, 2)
    with pytest.raises(ValueError, match="MN-major"):
        EMU.contiguous((a, row_major_sfa), (b, sfb), d, idx)
    good_sfa = torch.ones(2, m).t()
    with pytest.raises(ValueError, match="SFB"):
        EMU.contiguous((a, good_sfa), (b, torch.ones(g, 2, 1)), d, idx)
    EMU.contiguous((a, good_sfa), (b, sfb), d, idx)


def test_gpu_backends_are_registered_or_say_why():
    names = kernels.available_backends()
    for name in kernels.GPU_BACKENDS:
        if name in names:
            continue
        reason = kernels.UNAVAILABLE[name]
        assert reason
        with pytest.raises(fr.BackendUnavailable, match=name) as info:
            kernels.run_moe(None, None, None, None, backend=name)
        assert reason in str(info.value)
    if not torch.cuda.is_available():
        assert "no CUDA" in kernels.UNAVAILABLE["deep_gemm"]


# --------------------------------------------------------------------------
# The benchmark pipeline end to end (Triton interpreter + emulated DeepGEMM on CPU)
# --------------------------------------------------------------------------

def test_bench_pipeline_writes_tables(cfg128, tmp_path):
    from fp8_reload.tools import bench_kernels as bk

    bench = bk.Bench(cfg=cfg128, device=DEVICE, gemm=EMU, iters=1)
    cases = bk.all_cases(tokens=(24,), backends=("torch", "deep_gemm", "deep_gemm_masked"),
                         gemm_shapes=((2, 32, 128, 256),))
    result = bk.run(cases, bench, log=lambda *_: None)
    for table in ("scales", "gemm", "forward"):
        assert result[table] and not any("error" in r for r in result[table]), result[table]
    assert all(r["within_bound"] == "yes" for r in result["forward"] + result["scales"])
    assert float(result["gemm"][0]["calc_diff"]) < kernels.GEMM_BOUND
    assert {r["scales"] for r in result["scales"]} == {"precomputed", "cached", "per-forward"}
    assert all("vs_precomputed" in r for r in result["scales"])
    paths = bk.write_results(result, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["kernels.md", "kernels_forward.csv", "kernels_gemm.csv", "kernels_scales.csv"]
    md = (tmp_path / "kernels.md").read_text()
    assert "| tokens | backend |" in md and "deep_gemm_masked" in md
    assert f"Roofline limits: {bench.device_limits().describe()}." in md
    # the roofline divides by the bench's limits (given here: measured once, then kept)
    from fp8_reload.testing import DeviceLimits, roofline_ms

    slow = DeviceLimits(1e9, 1e12, "test")
    bench2 = bk.Bench(cfg=cfg128, device=DEVICE, gemm=EMU, iters=1, limits=slow)
    fwd = [c for c in cases if c.table == "forward"][:1]
    row = bench2.measure(fwd[0], log=lambda *_: None)
    _, facts = bench2.build(fwd[0].spec)
    assert row["roofline_ms"] == round(roofline_ms(facts["bytes"], facts["flop"], slow), 4)
    assert row["roofline_ms"] > 10 * roofline_ms(facts["bytes"], facts["flop"])
    assert bench2.device_limits() is slow
    ok, lines = bk.verdict(result)
    assert ok or all(line.startswith("MISS") for line in lines)  # CPU timings miss GPU targets


def test_roofline_divides_by_the_limits_it_is_given():
    from fp8_reload.testing import H200_DATASHEET, DeviceLimits, roofline_ms

    assert roofline_ms(4.8e9, 0.0) == pytest.approx(1.0)  # the datasheet's HBM by default
    slow = DeviceLimits(hbm_bytes_per_s=1e12, fp8_flop_per_s=1e15, source="test")
    assert roofline_ms(1e9, 1e12, slow) == pytest.approx(1.0)  # bytes bound
    assert roofline_ms(1e6, 5e12, slow) == pytest.approx(5.0)  # FLOP bound
    assert "datasheet" in H200_DATASHEET.describe()


@pytest.mark.skipif(not torch.cuda.is_available() or "H200" not in torch.cuda.get_device_name(),
                    reason="measures an H200 against its datasheet")
def test_device_limits_measured_on_cuda_stay_below_the_datasheet():
    from fp8_reload.testing import H200_DATASHEET, measure_device_limits

    lim = measure_device_limits("cuda", copy_bytes=256 << 20, gemm_size=4096, iters=5)
    print("device limits:", lim.describe())
    assert "measured" in lim.source
    assert 0.2e12 < lim.hbm_bytes_per_s <= 1.02 * H200_DATASHEET.hbm_bytes_per_s
    assert 0 < lim.fp8_flop_per_s <= 1.02 * H200_DATASHEET.fp8_flop_per_s


def test_synthetic_layer_matches_the_checkpoint_layout(cfg128):
    from fp8_reload.testing import routed_tokens, synthetic_moe_layer

    for kind in KINDS:
        layer = synthetic_moe_layer(cfg128, DEVICE, seed=0, kind=kind)
        s = layer.w13_weight_scale
        assert s.shape == (cfg128.num_experts, 2) and torch.equal(s[:, 0], s[:, 1])
        assert (layer.w13_input_scale is None) == (kind == "bf16")
        x, w, ids = routed_tokens(cfg128, 16, DEVICE)
        ref = moe_forward_torch(layer, x, w, ids, quantize_activations=False)
        assert calc_diff(moe_forward_torch(layer, x, w, ids), ref) < MOE_LAYER_BOUND


# --------------------------------------------------------------------------
# Routing on the device (Triton) against the torch layout
# --------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 70), top_k=st.integers(1, 4), experts=st.integers(4, 40),
       block_m=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**16))
def test_triton_align_groups_pairs_like_contiguous_rows(tokens, top_k, experts, block_m, seed):
    from fp8_reload.kernels.triton.align import align_pairs

    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    want = contiguous_rows(ids, experts, block_m)
    got = align_pairs(ids, experts, block_m)
    assert got.num_rows == want.num_rows and got.top_k == top_k
    assert torch.equal(got.block_expert(block_m).cpu(), want.block_expert(block_m).cpu())
    pos, row_pair = got.pos.cpu().long(), got.row_pair.cpu().long()
    flat = ids.reshape(-1).cpu()
    assert torch.equal(row_pair[pos], torch.arange(flat.numel()))  # pair -> row -> the same pair
    assert int((row_pair >= 0).sum()) == flat.numel()  # every other row is padding
    row_expert = want.row_expert.cpu().long()
    assert torch.equal(row_expert[pos], flat)  # each pair sits in a row of its expert's run


@pytest.mark.parametrize("kind", KINDS)
def test_input_quantization_fused_or_separate_gives_the_same_bytes(ckpts128, kind):
    """Decode sizes quantize x inside the up GEMM, large batches in a pass of their own:
    with the same static (or dynamic) scale both must give the same output, bit for bit."""
    model = load(ckpts128[kind, 0])
    layer = moe_layer(model)
    x, w, ids = routed(model, n=40)
    w13_s, w2_s, a13, a2 = kernels.cached_kernel_scales(layer)
    base = kt.default_config(ids.numel(), layer.num_local_experts, layer.hidden_size,
                             layer.intermediate_size)
    outs = [kt.fused_moe(x, layer.w13_weight, layer.w2_weight, w13_s, w2_s, a13, a2, w, ids,
                         {**base, "fuse_input_quant": fuse}) for fuse in (True, False)]
    assert torch.equal(outs[0], outs[1])
