"""Review (sglang path): cases found by breaking the patched sglang 0.5.23 on the CPU.

Every model here is loaded by sglang's own `DefaultModelLoader` and reloaded through its
`WeightUpdater.update_weights_from_disk`; "a fresh load" is a model sglang loaded from the
checkpoint at startup (its reader's order), not one of this project's readers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8_reload as fr

from .conftest import CFG
from .sgl_model import MOE_LAYER, byte_diffs, changed_since, fresh_experts, snapshot
from .test_weight_updater import _experts, served, updater

E = CFG.num_experts


def _up_before_gate(src, dst):
    """`src` with an index that lists each expert's up_proj before its gate_proj (JSON
    order is free; sglang's reader goes by the shards' sorted names, not the index)."""
    d = shutil.copytree(src, dst)
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(index["weight_map"], key=lambda n: n.replace("up_proj", "a_proj"))
    index["weight_map"] = {n: index["weight_map"][n] for n in names}
    path.write_text(json.dumps(index))
    return d


def test_filtered_reload_reads_in_sglang_order(patched, cpu_scaled_fp8_quant, server_args, ckpts,
                                               tmp_path):
    """gate_proj and up_proj input scales both land in w13_input_scale[e] (the last one read
    wins, in sglang too): a filtered reload must read a shard's tensors in the order sglang's
    startup load does, or the input scale differs from a fresh load."""
    base = _up_before_gate(ckpts[("fp8", 0)], tmp_path / "base")
    donor = _up_before_gate(ckpts[("fp8", 1)], tmp_path / "donor")
    model = served(server_args, "fp8", base)
    ok, msg = updater(server_args, model, donor).update_weights_from_disk(
        str(donor), "safetensors",
        weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: range(E)}))
    assert ok, msg
    assert byte_diffs(_experts(model), _experts(served(server_args, "fp8", donor))) == []


def _faulty(orig, n: int):
    """sglang's `FusedMoE._weight_loader_impl`, whose `n`-th call raises (once)."""
    calls = []

    def impl(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected fault")
        return orig(*args, **kwargs)

    return impl


def _corrupt(src, dst, name: str):
    """`src` with tensor `name` one column too wide: sglang's loader fails to copy it."""
    d = shutil.copytree(src, dst)
    fname = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(d / fname)
    t = tensors[name]
    tensors[name] = torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype)
    save_file(tensors, d / fname, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("n", [1, 4])
def test_failed_filtered_update_leaves_the_experts_as_they_were(
        patched, cpu_scaled_fp8_quant, server_args, ckpts, monkeypatch, kind, n):
    """A loader fault mid-reload: sglang reports "Rolling back to original weights", but its
    rollback re-reads the *new* path (it set model_config.model_path first). The experts must
    be as before the call, not the new checkpoint's, nor half of it."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from fp8_reload import sglang_patch

    base, donor = ckpts[(kind, 0)], ckpts[(kind, 1)]
    model = served(server_args, kind, base)
    before = snapshot(model)
    key = (FusedMoE, "_weight_loader_impl")
    monkeypatch.setitem(sglang_patch.originals.ORIGINALS, key,
                        _faulty(sglang_patch.originals.ORIGINALS[key], n))
    ok, msg = updater(server_args, model, base).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [0, 3]}))
    assert not ok and "injected fault" in msg
    assert changed_since(model, before) == ([], [])
    experts = _experts(model)
    assert experts._fp8r_loaded == set() and not getattr(experts, "_fp8r_staged", {})


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_update_whose_rollback_fails_too_leaves_the_experts_as_they_were(
        patched, cpu_scaled_fp8_quant, server_args, ckpts, tmp_path, kind):
    """A tensor sglang cannot load: its rollback reads it again and raises. The experts
    are as before, and the next reload (of another expert) is a fresh load of the mix."""
    base, donor = ckpts[(kind, 0)], ckpts[(kind, 1)]
    bad = _corrupt(donor, tmp_path / "bad", f"model.layers.{MOE_LAYER}.mlp.experts.3.up_proj.weight")
    model = served(server_args, kind, base)
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        updater(server_args, model, base).update_weights_from_disk(
            str(bad), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [0, 3]}))
    assert changed_since(model, before) == ([], [])

    ok, msg = updater(server_args, model, base).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [5]}))
    assert ok, msg
    expected = fresh_experts(CFG, kind, {e: (donor if e == 5 else base) for e in range(E)})
    assert byte_diffs(_experts(model), expected) == []


def test_bf16_experts_loaded_by_parallel_loaders_are_a_fresh_load(patched, ckpts):
    """sglang's DeepSeek loader hands every host tensor to a thread pool
    (`maybe_executor_submit`): gate and up of one expert are written at once. Their staging
    buffer must be one, not one per thread (the loser's half was left uninitialized)."""
    import concurrent.futures

    from sglang.srt.model_loader.utils import maybe_executor_submit

    from .sgl_model import EXPERTS_PREFIX, expert_mapping, expert_tensor_names, make_experts, read_tensors

    path = ckpts[("bf16", 0)]
    tensors = read_tensors(path, expert_tensor_names(path, range(E)))
    expected = fresh_experts(CFG, "bf16", {e: path for e in range(E)})
    mapping = expert_mapping(E)
    for trial in range(20):
        moe = make_experts(CFG, "bf16")
        params = dict(moe.named_parameters())
        with concurrent.futures.ThreadPoolExecutor() as executor:
            futures = []
            for name, tensor in tensors:
                param_name, weight_name, expert_id, shard_id = next(m for m in mapping if m[1] in name)
                local = name.replace(weight_name, param_name).rsplit("experts.", 1)[1]
                maybe_executor_submit(executor=executor, futures=futures, use_async=True,
                                      func=params[local].weight_loader,
                                      func_args=(params[local], tensor, f"{EXPERTS_PREFIX}.{local}"),
                                      func_kwargs={"shard_id": shard_id, "expert_id": expert_id})
            for future in concurrent.futures.as_completed(futures):
                future.result()
        moe.quant_method.process_weights_after_loading(moe)
        assert byte_diffs(moe, expected) == [], f"trial {trial}"


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_many_updates_alternating_checkpoints_keep_objects_and_loaders(
        patched, cpu_scaled_fp8_quant, server_args, ckpts, kind):
    """Twelve filtered updates through sglang's updater, experts in odd orders and
    repeated, alternating two checkpoints: always a fresh load of the mix, the same
    Parameter objects, the same loader objects."""
    a, b = ckpts[(kind, 0)], ckpts[(kind, 1)]
    model = served(server_args, kind, a)
    before = snapshot(model)
    loaders = {n: p.__dict__.get("weight_loader") for n, p in model.named_parameters()}
    current = {e: a for e in range(E)}
    steps = [[7, 0, 7], [3], [6, 5, 4, 3, 2, 1, 0], [1, 1, 1], [], [2, 4, 6]] * 2
    for step, experts in enumerate(steps):
        src = b if step % 2 == 0 else a
        ok, msg = updater(server_args, model, a).update_weights_from_disk(
            str(src), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: experts}))
        assert ok, msg
        current.update({e: src for e in experts})
        assert byte_diffs(_experts(model), fresh_experts(CFG, kind, current)) == [], f"step {step}"
    assert changed_since(model, before)[0] == []
    assert {n: p.__dict__.get("weight_loader") for n, p in model.named_parameters()} == loaders


def test_fault_in_processing_leaves_the_experts_as_they_were(
        patched, cpu_scaled_fp8_quant, server_args, ckpts, monkeypatch):
    from fp8_reload.sglang_patch import moe

    base, donor = ckpts[("fp8", 0)], ckpts[("fp8", 1)]
    model = served(server_args, "fp8", base)
    before = snapshot(model)
    calls = []
    real = moe.requantize_w13_to_expert_max_

    def faulty(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected processing fault")
        return real(*args)

    monkeypatch.setattr(moe, "requantize_w13_to_expert_max_", faulty)
    ok, msg = updater(server_args, model, base).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [2, 6]}))
    assert not ok and "injected processing fault" in msg
    assert changed_since(model, before) == ([], [])


def test_fp8_update_of_part_of_an_expert_is_refused(patched, cpu_scaled_fp8_quant, server_args, ckpts):
    """A filter selecting an FP8 expert's weights without their scales: the new FP8 bytes
    were requantized under the old scales, a model equal to neither checkpoint, reported as
    a success. Refused (as bf16 checkpoints' partial experts are), the experts untouched."""
    base, donor = ckpts[("fp8", 0)], ckpts[("fp8", 1)]
    model = served(server_args, "fp8", base)
    before = snapshot(model)
    # sglang's rollback runs the same partial load again, so the refusal escapes it
    with pytest.raises(RuntimeError, match=r"experts \(local slots\) \[3\] were loaded only in part"):
        updater(server_args, model, base).update_weights_from_disk(
            str(donor), "safetensors",
            weight_name_filter=lambda n: ".experts.3." in n and n.endswith(".weight"))
    assert changed_since(model, before) == ([], [])
    assert _experts(model)._fp8r_parts == {}
