"""The accuracy gate: passes on the fix, fails on sglang as shipped, and cannot pass
vacuously: each planted fault is caught, by the check that names it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import fp8_reload as fr
from fp8_reload import kernels
from fp8_reload.kernels.bounds import BoundsError
from fp8_reload.processing import FixedFp8LinearMethod
from fp8_reload.reload import transaction
from fp8_reload.tools import gate
from fp8_reload.tools.cli import main
from fp8_reload.tools.gate import run as gate_run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Checkpoints (and mixes) shared by every gate run here: deterministic, written once."""
    return tmp_path_factory.mktemp("gate")


def run(workdir, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("log", lambda s: None)
    return gate.run_gate(workdir=workdir, **kw)


def failed(result) -> dict[str, list[int]]:
    """{check name: [step indices where it failed]} (skipped checks left out)."""
    out: dict[str, list[int]] = {}
    for s, c in result.failures():
        if c.status == "fail":
            out.setdefault(c.name, []).append(s.index)
    return out


def detail(result, check: str, step: int) -> str:
    return next(c.detail for s in result.steps if s.index == step
                for c in s.checks if c.name == check)


def bounds_with(*backends):
    """The versioned bounds plus the torch entries under the names of test backends."""
    b = gate.load_bounds()
    for name in backends:
        for kind in gate.KINDS:
            b.entries[name, kind] = b.get("torch", kind)
    return b


SCRIPT = gate.default_script(fr.MoEConfig.preset("tiny"))
FULL = [i for i, s in enumerate(SCRIPT, 1) if s.experts is None]
FILTERED = [i for i, s in enumerate(SCRIPT, 1) if s.experts is not None]


# ---------------------------------------------------------------- CI wiring

def test_cli_gate_passes_the_fix(workdir, tmp_path, capsys):
    out = tmp_path / "gate.json"
    assert main(["gate", "--device", "cpu", "--workdir", str(workdir), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gate PASSED" in text and "torch/fp8" in text and "torch/bf16" in text
    data = json.loads(out.read_text())
    assert data["passed"] and data["backends"] == ["torch"] and data["kinds"] == ["fp8", "bf16"]
    assert len(data["steps"]) == 2 * (1 + len(SCRIPT))
    checks = [c for s in data["steps"] for c in s["checks"]]
    assert {c["name"] for c in checks if c["status"] == "pass"} == set(gate.CHECKS)
    assert all(c["status"] in ("pass", "n/a") for c in checks)
    assert {c["name"] for c in checks if c["status"] == "n/a"} == {"untouched"}  # load + full only
    # The reference checks measure real FP8 activation error, never a trivial 0.
    for c in checks:
        if c["name"] in ("ref.model", "ref.moe"):
            assert 1e-5 < c["measured"] <= c["bound"]


@pytest.mark.parametrize("processing", ["upstream", "identity-only"])
def test_cli_gate_fails_sglang_as_shipped(workdir, capsys, processing):
    assert main(["gate", "--device", "cpu", "--workdir", str(workdir),
                 "--processing", processing]) == 1
    out = capsys.readouterr().out
    assert "gate FAILED" in out
    # Loading already replaced the stacked linear weights: no weight_loader left on them.
    assert "FAIL torch/fp8 check identity at step" in out
    assert "; step 0 (load s0): measured" in out
    if processing == "upstream":
        assert "check reload" in out
        assert "AttributeError: 'Parameter' object has no attribute 'weight_loader'" in out
    else:  # MoE reloads work, but every FP8 linear is transposed again
        assert "check untouched" in out and "check fresh.state" in out
        assert "changed (no expert of its module was reloaded)" in out


def test_cli_gate_unavailable_backend_is_a_clear_error(capsys):
    if "deep_gemm" in fr.available_backends():
        pytest.skip("deep_gemm is available here")
    assert main(["gate", "--device", "cpu", "--backend", "deep_gemm"]) == 2
    err = capsys.readouterr().err
    assert "MoE backend 'deep_gemm' is not available here (available: torch" in err


def test_gate_is_deterministic(workdir):
    a, b = run(workdir, kinds="fp8"), run(workdir, kinds="fp8")
    key = lambda r: [(s.label, c.name, c.status, c.measured, c.detail)  # noqa: E731
                     for s in r.steps for c in s.checks]
    assert a.passed and key(a) == key(b)


# ---------------------------------------------------------------- planted faults

def test_wrong_scale_written_by_a_reload_fails_fresh_state(workdir, monkeypatch):
    real = gate_run.update_weights_from_disk

    def buggy(model, path, flt=None, **kw):
        report = real(model, path, flt, **kw)
        if flt is not None:  # one reloaded expert gets twice its w13 scale
            layer, experts = next(iter(flt.layer_experts.items()))
            model.model.layers[layer].mlp.experts.w13_weight_scale.data[experts[0]] *= 2
        return report

    monkeypatch.setattr(gate_run, "update_weights_from_disk", buggy)
    r = run(workdir, kinds="fp8")
    f = failed(r)
    assert not r.passed
    assert f["fresh.state"] == FILTERED
    assert "experts.w13_weight_scale" in detail(r, "fresh.state", FILTERED[0])
    # A wrong value inside the reloaded expert: nothing else moved, nothing was replaced.
    assert "untouched" not in f and "identity" not in f


def test_kernel_reading_the_wrong_scale_fails_ref_moe(workdir, monkeypatch):
    """A kernel that indexes `scale + expert` on the [E, 2] layout (not the contiguous
    [E] view) gives expert e the scale of expert e // 2. State and reload are fine;
    only the comparison with the float32 reference can see it."""

    def flat_scale_moe(layer, x, topk_weights, topk_ids):
        e = layer.num_local_experts
        view = SimpleNamespace(w13_weight=layer.w13_weight, w2_weight=layer.w2_weight,
                               w13_weight_scale=layer.w13_weight_scale.reshape(-1)[:e],
                               w2_weight_scale=layer.w2_weight_scale,
                               w13_input_scale=layer.w13_input_scale,
                               w2_input_scale=layer.w2_input_scale,
                               intermediate_size=layer.intermediate_size)
        return kernels.moe_forward_torch(view, x, topk_weights, topk_ids)

    monkeypatch.setitem(kernels.BACKENDS, "flat-scale", flat_scale_moe)
    r = run(workdir, kinds="fp8", backends="flat-scale", bounds=bounds_with("flat-scale"))
    f = failed(r)
    assert f["ref.moe"] == list(range(len(SCRIPT) + 1))  # every step, the load included
    assert not {"fresh.state", "fresh.forward", "identity", "untouched"} & set(f)
    worst = max(c.measured for s in r.steps for c in s.checks if c.name == "ref.moe")
    assert worst > 10 * gate.load_bounds().get("torch", "fp8").ref_moe


def _caching_moe(layer, x, topk_weights, topk_ids):
    """A backend that keeps derived tensors in `layer.kernel_cache` (as a GPU backend
    keeps repacked weights / expanded scales) and relies on reload invalidating it."""
    cache = layer.__dict__.setdefault("kernel_cache", {})
    if "view" not in cache:
        cache["view"] = SimpleNamespace(
            intermediate_size=layer.intermediate_size,
            **{n: None if getattr(layer, n) is None else getattr(layer, n).detach().clone()
               for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                         "w13_input_scale", "w2_input_scale")})
    return kernels.moe_forward_torch(cache["view"], x, topk_weights, topk_ids)


@pytest.mark.parametrize("invalidated", [True, False], ids=["invalidated", "stale"])
def test_stale_kernel_cache_fails_fresh_forward(workdir, monkeypatch, invalidated):
    monkeypatch.setitem(kernels.BACKENDS, "cached", _caching_moe)
    if not invalidated:
        monkeypatch.setattr(transaction, "clear_kernel_caches", lambda model: None)
    r = run(workdir, kinds="fp8", backends="cached", bounds=bounds_with("cached"))
    if invalidated:  # the control: the same backend passes when reload clears its cache
        assert r.passed, gate.format_report(r)
        return
    f = failed(r)
    assert 1 in f["fresh.forward"]  # the first reload from the other checkpoint
    assert "not bitwise" in detail(r, "fresh.forward", 1)
    assert "fresh.state" not in f and "identity" not in f  # the weights themselves are right


def test_transposed_square_weight_fails_fresh_state(workdir, monkeypatch):
    """A re-processed FP8 linear transposed once more. For a square layer (o_proj of the
    tiny preset) nothing crashes: only the comparison with a fresh load sees it."""
    orig = FixedFp8LinearMethod.process_weights_after_loading

    def transposes_again(self, layer):
        again = layer.kernel_layout and layer.needs_processing and layer.input_size == layer.output_size
        orig(self, layer)
        if again:
            layer.weight.data = layer.weight.data.t()

    monkeypatch.setattr(FixedFp8LinearMethod, "process_weights_after_loading", transposes_again)
    r = run(workdir, kinds="fp8")
    f = failed(r)
    assert f["fresh.state"][0] == FULL[0]  # the first full reload re-processes linears
    assert 0 not in f["fresh.state"]
    assert "o_proj.weight" in detail(r, "fresh.state", FULL[0])
    assert FULL[0] in f["fresh.forward"]
    assert "identity" not in f


def test_loader_writing_the_wrong_slot_fails_untouched(workdir, monkeypatch):
    real = gate_run.update_weights_from_disk

    def off_by_one(model, path, flt=None, **kw):
        if flt is None:
            return real(model, path, flt, **kw)
        moes = [m for _, m in model.moe_layers()]
        for m in moes:
            m.expert_slots = {e: [(e + 1) % m.num_local_experts] for e in range(m.num_local_experts)}
        try:
            return real(model, path, flt, **kw)
        finally:
            for m in moes:
                m.expert_slots = None

    monkeypatch.setattr(gate_run, "update_weights_from_disk", off_by_one)
    r = run(workdir, kinds="fp8")
    f = failed(r)
    first = FILTERED[0]  # one expert L1:3 <- s0 on a model holding s1: slot 4 takes it
    assert first in f["untouched"]
    assert "experts [4] changed but were not reloaded" in detail(r, "untouched", first)
    assert first in f["fresh.state"]


def test_replaced_parameter_fails_identity_only(workdir, monkeypatch):
    real = gate_run.update_weights_from_disk

    def replaces(model, path, flt=None, **kw):
        report = real(model, path, flt, **kw)
        moe = model.model.layers[model.config.moe_layers[0]].mlp.experts
        old = moe.w2_weight_scale
        new = torch.nn.Parameter(old.data.clone(), requires_grad=False)
        new.weight_loader, new.quant_method = old.weight_loader, old.quant_method  # loader kept
        moe.w2_weight_scale = new
        return report

    monkeypatch.setattr(gate_run, "update_weights_from_disk", replaces)
    r = run(workdir, kinds="fp8")
    f = failed(r)
    assert f == {"identity": list(range(1, len(SCRIPT) + 1))}  # same bytes: only identity
    assert "w2_weight_scale: Parameter object replaced" in detail(r, "identity", 1)


# ---------------------------------------------------------------- backends, bounds

def test_backend_that_cannot_run_here(workdir, monkeypatch):
    def unavailable(layer, x, topk_weights, topk_ids):
        raise fr.BackendUnavailable("needs an sm90 GPU")

    monkeypatch.setitem(kernels.BACKENDS, "gpu-only", unavailable)
    b = bounds_with("gpu-only")
    with pytest.raises(gate.GateError, match="'gpu-only' cannot run here: needs an sm90 GPU"):
        run(workdir, kinds="fp8", backends="gpu-only", bounds=b)
    monkeypatch.setattr(gate_run, "available_backends", lambda: ["torch", "gpu-only"])
    r = run(workdir, kinds="fp8", backends="all", bounds=b)
    assert r.passed and r.backends == ["torch"] and r.skipped_backends == {"gpu-only": "needs an sm90 GPU"}


def test_versioned_bounds_cover_every_backend_and_kind():
    b = gate.load_bounds()
    assert b.version >= 1
    for backend in ("torch", "triton", "deep_gemm"):
        for kind in gate.KINDS:
            entry = b.get(backend, kind)
            assert entry.reason and 0 < entry.ref_moe <= gate.MAX_BOUND
    assert b.get("torch", "fp8").fresh_forward == 0  # the reference backend is bitwise


@pytest.mark.parametrize("text, match", [
    ("version = 1\n[torch.fp8]\nref_model = 1e-3\n", "needs exactly"),
    ("version = 1\n[torch.fp8]\nfresh_forward = 0\nref_model = 0.5\nref_moe = 1e-3\nreason = 'x'\n",
     r"ref_model = 0.5 must be a number in \[0, 0.01\]"),
    ("version = 1\n[torch.fp4]\nfresh_forward = 0\nref_model = 1e-3\nref_moe = 1e-3\nreason = 'x'\n",
     "unknown checkpoint kind"),
    ("[torch.fp8]\n", "integer top-level `version`"),
    ("version = [", "not valid TOML"),
])
def test_bad_bounds_files_are_refused(tmp_path, text, match):
    p = tmp_path / "bounds.toml"
    p.write_text(text)
    with pytest.raises(BoundsError, match=match):
        gate.load_bounds(p)
    with pytest.raises(gate.GateError, match=match):  # what the gate (and its exit 2) reports
        gate.run_gate(bounds=p, workdir=tmp_path)


def test_missing_bounds_entry_is_refused_before_any_work(tmp_path, capsys):
    p = tmp_path / "bounds.toml"
    p.write_text("version = 1\n[torch.fp8]\nfresh_forward = 0\nref_model = 1e-3\n"
                 "ref_moe = 1e-3\nreason = 'only fp8'\n")
    assert main(["gate", "--device", "cpu", "--bounds", str(p), "--workdir", str(tmp_path / "w")]) == 2
    assert "no bounds for backend 'torch' and checkpoint kind 'bf16'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- the reference

def test_reference_moe_agrees_with_the_torch_kernel_without_activation_quant(ckpts, tiny_cfg):
    from .conftest import tokens

    model = fr.load_model(ckpts["fp8", 0])
    block = model.model.layers[1].mlp
    x = tokens(tiny_cfg)
    w, ids = block.gate(x)
    ref = gate.reference_moe(block.experts, x, w, ids)
    other = kernels.moe_forward_torch(block.experts, x, w, ids, quantize_activations=False)
    assert fr.calc_diff(ref, other) < 1e-5  # two implementations, bf16 output rounding apart
    assert fr.calc_diff(ref, kernels.moe_forward_torch(block.experts, x, w, ids)) > 1e-5


def test_dequantized_linear_weight_reads_both_layouts(ckpts):
    """Upstream keeps the transposed weight with per-channel scales, fixed a per-shard
    scale and a checkpoint view: a single-shard layer dequantizes identically."""
    fixed = fr.load_model(ckpts["fp8", 0])
    upstream = fr.load_model(ckpts["fp8", 0], processing="upstream")
    for name in ("self_attn.q_proj", "self_attn.o_proj"):
        a = gate.dequantized_linear_weight(fixed.get_submodule(f"model.layers.1.{name}"))
        b = gate.dequantized_linear_weight(upstream.get_submodule(f"model.layers.1.{name}"))
        assert torch.equal(a, b)
