"""Review s26 of the accuracy gate (an attack on `fp8-reload gate`). Each case failed before
its fix:

* a loader bug that a fresh load shares (gate and up of every expert swapped, so each MoE layer
  computed silu(up) * gate, calc_diff 0.2 off a correct load) passed every check: they all
  compare with a fresh load or with the model's own stored state. `ckpt.weights` compares
  the experts and the FP8 linears with the checkpoint's tensors read by safetensors;
* a kept --workdir whose "other seed" checkpoint held the same seed made every reload vacuous;
* a reload that moved the weights to new memory (captured CUDA graphs read the old) passed
  `identity`;
* a NaN layer passed `ref.moe` and `gate.json` held bare NaN;
* `--backend torch,all` refused a backend `all` skips; a backend skipped for one kind only was
  reported as not gated while its other kind's steps counted; `--kind ,` ran nothing and
  failed (exit 1); an unwritable --json exited 1 with a traceback after "gate PASSED".
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp8_reload as fr
from fp8_reload import kernels
from fp8_reload.layers import FusedMoE
from fp8_reload.tools import gate
from fp8_reload.tools.cli import main
from fp8_reload.tools.gate import run as gate_run

from .test_gate import bounds_with, failed, run

SCRIPT = gate.default_script(fr.MoEConfig.preset("tiny"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gate-s26")


def test_a_loader_bug_a_fresh_load_shares_fails_ckpt_experts(workdir, monkeypatch):
    real = FusedMoE.slot_destination

    def swapped(self, param, weight_name, shard_id, slot):  # gate and up trade places
        return real(self, param, weight_name, {"w1": "w3", "w3": "w1"}.get(shard_id, shard_id), slot)

    monkeypatch.setattr(FusedMoE, "slot_destination", swapped)
    r = run(workdir, kinds="fp8")
    f = failed(r)
    assert f.get("ckpt.weights") == list(range(len(SCRIPT) + 1)), f  # the load and every step
    assert "fresh.state" not in f and "identity" not in f  # the fresh load shares the bug
    bad = next(c for s in r.steps for c in s.checks if c.name == "ckpt.weights")
    assert bad.measured > 0.1 and ("gate_proj" in bad.detail or "up_proj" in bad.detail)


def test_a_workdir_holding_another_seed_is_refused(tmp_path):
    cfg = fr.MoEConfig.preset("tiny")
    for seed in (0, 1):  # both of seed 0: every reload from "s1" would load the same bytes
        fr.write_checkpoint(tmp_path / f"{cfg.name}-{cfg.num_layers}L-fp8-s{seed}", cfg, seed=0)
    with pytest.raises(gate.GateError, match=r"fp8-s1 holds another checkpoint .*'seed': 0"):
        run(tmp_path, kinds="fp8")


def test_a_reload_moving_weights_to_new_memory_fails_identity(workdir, monkeypatch):
    real = gate_run.update_weights_from_disk

    def moves(model, path, flt=None, **kw):
        report = real(model, path, flt, **kw)
        for _, layer in model.moe_layers():
            layer.w13_weight.data = layer.w13_weight.data.clone()
        return report

    monkeypatch.setattr(gate_run, "update_weights_from_disk", moves)
    r = run(workdir, kinds="fp8")
    assert failed(r) == {"identity": list(range(1, len(SCRIPT) + 1))}
    assert "w13_weight: moved to new memory" in next(
        c.detail for s in r.steps for c in s.checks if c.name == "identity" and c.status == "fail")


@pytest.mark.parametrize("nan_layer", [1, 2])  # (first or last: a NaN stays the worst)
def test_a_nan_layer_fails_ref_moe_and_the_json_says_null(workdir, monkeypatch, tmp_path, nan_layer):
    torch_moe = kernels.BACKENDS["torch"]

    def nan_in_one_layer(layer, x, topk_weights, topk_ids):
        y = torch_moe(layer, x, topk_weights, topk_ids)
        return torch.full_like(y, float("nan")) if layer.layer_id == nan_layer else y

    monkeypatch.setitem(kernels.BACKENDS, "nan2", nan_in_one_layer)
    r = run(workdir, kinds="fp8", backends="nan2", bounds=bounds_with("nan2"))
    assert failed(r)["ref.moe"] == list(range(len(SCRIPT) + 1))
    assert next(c.detail for s in r.steps for c in s.checks if c.name == "fresh.forward"
                ) == "output not finite (reloaded and fresh model)"  # (not "not bitwise")
    out = tmp_path / "g.json"
    gate.write_json(r, out)
    text = out.read_text()
    assert "NaN" not in text
    measured = [c["measured"] for s in json.loads(text)["steps"] for c in s["checks"]
                if c["name"] == "ref.moe"]
    assert measured and all(m is None for m in measured)


def test_backends_and_kinds_that_cannot_run(workdir, monkeypatch, capsys):
    def never(layer, x, topk_weights, topk_ids):
        raise fr.BackendUnavailable("needs an sm90 GPU")

    with monkeypatch.context() as m:
        m.setitem(kernels.BACKENDS, "never", never)
        # "all" is what this host can run: on a GPU host the real Triton and DeepGEMM too
        m.setattr(gate_run, "available_backends", lambda: ["torch", "never"])
        r = run(workdir, kinds="fp8", backends="torch,all", bounds=bounds_with("never"))
        assert r.passed and r.skipped_backends == {"never": "needs an sm90 GPU"}
    assert main(["gate", "--device", "cpu", "--kind", ","]) == 2
    assert "--kind names no checkpoint kind" in capsys.readouterr().err
    assert main(["gate", "--device", "cpu", "--kind", "fp8", "--workdir", str(workdir),
                 "--json", "/dev/full"]) == 2
    assert "--json /dev/full: cannot write it" in capsys.readouterr().err
    monkeypatch.setitem(kernels.BACKENDS, "never", never)
    monkeypatch.setattr(gate_run, "available_backends", lambda: ["never"])  # a machine without
    with pytest.raises(gate.GateError, match="no backend could run here: never: needs an sm90"):
        run(workdir, kinds="fp8", backends="all", bounds=bounds_with("never"))


def test_a_backend_skipped_for_one_kind_is_gated_for_the_other(workdir, monkeypatch):
    torch_moe = kernels.BACKENDS["torch"]

    def fp8_only(layer, x, topk_weights, topk_ids):
        if layer.w13_input_scale is None:  # a bf16 checkpoint's layer (dynamic input scales)
            raise fr.BackendUnavailable("fp8 only")
        return torch_moe(layer, x, topk_weights, topk_ids)

    monkeypatch.setitem(kernels.BACKENDS, "fp8only", fp8_only)
    monkeypatch.setattr(gate_run, "available_backends", lambda: ["torch", "fp8only"])
    r = run(workdir, kinds="fp8,bf16", backends="all", bounds=bounds_with("fp8only"))
    assert r.passed and "fp8only" in r.backends
    assert r.skipped_backends == {"fp8only (bf16)": "fp8 only"}
    assert {s.kind for s in r.steps if s.backend == "fp8only"} == {"fp8"}


def test_a_linear_loader_bug_a_fresh_load_shares_fails_ckpt_weights(workdir, monkeypatch):
    """The same for the FP8 linears: the dense MLP's gate and up trade places in gate_up_proj."""
    import fp8_reload.layers.model as layers  # (where the loader reads STACKED)

    monkeypatch.setattr(layers, "STACKED", (("gate_up_proj", "gate_proj", 1),
                                            ("gate_up_proj", "up_proj", 0)))
    r = run(workdir, kinds="fp8")
    f = failed(r)
    assert f.get("ckpt.weights") == list(range(len(SCRIPT) + 1)), f
    assert "fresh.state" not in f and "identity" not in f
    bad = next(c for s in r.steps for c in s.checks if c.name == "ckpt.weights")
    assert bad.measured > 0.1 and "gate_up_proj" in bad.detail


def test_a_nan_weight_anywhere_fails_ckpt_weights(ckpts):
    """A NaN scale in the first linear the oracle reads, with finite ones after it."""
    from fp8_reload.testing.reference import checkpoint_weight_diff

    model = fr.load_model(ckpts["fp8", 0])
    model.model.layers[0].self_attn.q_proj.weight_scale.data.fill_(float("nan"))
    worst, where = checkpoint_weight_diff(model, ckpts["fp8", 0])
    assert math.isnan(worst) and where == "model.layers.0.self_attn.q_proj", (worst, where)


def test_a_backend_that_cannot_run_the_first_kind_is_gated_for_the_next(workdir, monkeypatch):
    torch_moe = kernels.BACKENDS["torch"]

    def bf16_only(layer, x, topk_weights, topk_ids):
        if layer.w13_input_scale is not None:  # an fp8 checkpoint's layer (static input scales)
            raise fr.BackendUnavailable("bf16 only")
        return torch_moe(layer, x, topk_weights, topk_ids)

    monkeypatch.setitem(kernels.BACKENDS, "bf16only", bf16_only)
    monkeypatch.setattr(gate_run, "available_backends", lambda: ["bf16only"])
    r = run(workdir, kinds="fp8,bf16", backends="all", bounds=bounds_with("bf16only"))
    assert r.passed and r.backends == ["bf16only"]
    assert r.skipped_backends == {"bf16only (fp8)": "bf16 only"}
    assert {s.kind for s in r.steps} == {"bf16"}
