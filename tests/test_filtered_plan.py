"""EPLB's structured filter (`generate_weight_name_filter`) is planned from a per-checkpoint
index, not by calling it on every name: it must select exactly what the same filter does
as a plain callable (the slow path), fail the same way, and keep every guarantee of a
reload (fresh-load bytes, rollback bit for bit).
"""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.chunks as chunks_mod
from fp8_reload.errors import ReloadError
from fp8_reload.reload.filters import ExpertFilter
from fp8_reload.reload.plan import open_checkpoint, plan, plan_reload

from .conftest import copy_checkpoint, mix_checkpoints

# tiny: layers 0 (dense), 1, 2 (MoE), 8 experts each
SPECS = {
    "two-layers": {1: [0, 3], 2: [5, 7]},
    "one-each": {1: [0], 2: [0]},
    "all-experts": {1: list(range(8))},
    "duplicates": {2: [4, 4, 1]},
    "with-dense-layer": {0: [0], 1: [2]},
    "with-out-of-range": {1: [6, 99], 7: [0]},
    "dense-only": {0: [0, 1]},
    "out-of-range-only": {2: [8, 1000], 5: [1]},
    "empty": {},
    "empty-lists": {1: [], 2: []},
}
NAMES_UNKNOWN = {"with-dense-layer", "with-out-of-range", "dense-only", "out-of-range-only"}


def _slow(flt):
    """The same filter as an arbitrary callable: planned by calling it on every name."""
    return lambda name: flt(name)


def _outcome(fn):
    try:
        return "ok", fn()
    except ReloadError as e:
        return type(e).__name__, str(e)


def _target_key(targets):
    return [(t.info.name, t.kind, t.module_name, t.slots, t.shard,
             [(v.data_ptr(), tuple(v.shape), tuple(v.stride())) for v in t.views]) for t in targets]


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "no-expand"])
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_structured_and_callable_filters_plan_the_same(ckpts, kind, spec, expand):
    """...except that an expert filter knows which experts it names: one the model lacks
    is refused (a callable cannot tell a typo from a name it does not want)."""
    model = fr.load_model(ckpts[kind, 0])
    ckpt = open_checkpoint(model, ckpts[kind, 1])
    flt = fr.generate_weight_name_filter(SPECS[spec])
    assert type(flt) is ExpertFilter
    fast = _outcome(lambda: plan(model, ckpt, flt, expand))
    slow = _outcome(lambda: plan(model, ckpt, _slow(flt), expand))
    if spec in NAMES_UNKNOWN:
        assert fast[0] == "UnknownExpertError" and slow[0] != fast[0], (fast, slow)
    else:
        assert fast == slow
    assert fast == _outcome(lambda: plan(model, ckpt, flt, expand))  # from the cached index
    if fast[0] == "ok" and expand:
        for on_device in (False, True):
            a = plan_reload(model, ckpt, flt, on_device)
            b = plan_reload(model, ckpt, _slow(flt), on_device)
            assert a[0] == b[0] and _target_key(a[1]) == _target_key(b[1])


def test_a_structured_filter_is_not_called_per_name(ckpts, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [0, 3]})

    def refuse(self, name):
        raise AssertionError("called per name")

    monkeypatch.setattr(ExpertFilter, "__call__", refuse)
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)


def test_a_structured_filter_still_answers_per_name():
    flt = fr.generate_weight_name_filter({1: [0, 3], "2": ["5"]})
    assert flt("model.layers.1.mlp.experts.3.up_proj.weight")
    assert flt("model.layers.2.mlp.experts.5.down_proj.weight_scale")
    assert not flt("model.layers.1.mlp.experts.4.up_proj.weight")
    assert not flt("model.layers.1.mlp.shared_experts.up_proj.weight")
    assert not flt("model.layers.1.self_attn.q_proj.weight")
    assert flt.layer_experts == {1: [0, 3], 2: [5]}  # (digits, as a plan read from JSON has, as ints)


def _expected(ckpts, kind, spec, tmp_path):
    chosen = {(layer, e) for layer, es in spec.items() for e in es}
    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed",
                            lambda n: ExpertFilter.key(n) in chosen)
    return fr.snapshot(fr.load_model(mixed))


@pytest.mark.parametrize("spec", [SPECS["two-layers"], SPECS["duplicates"]],
                         ids=["two-layers", "duplicates"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_structured_and_callable_filters_reload_the_same(ckpts, tmp_path, engine, kind, spec):
    flt = fr.generate_weight_name_filter(spec)
    expected = _expected(ckpts, kind, spec, tmp_path)
    got = {}
    for how, f in (("fast", flt), ("slow", _slow(flt))):
        model = fr.load_model(ckpts[kind, 0])
        before = fr.snapshot(model)
        for _ in range(3):  # the later ones from the cached index and targets
            report = fr.update_weights_from_disk(model, ckpts[kind, 1], f)
            after = fr.snapshot(model)
            assert fr.compare_states(expected, after) == []
            assert after.ids == before.ids
        got[how] = (report.tensors_loaded, report.bytes_read, report.experts_reloaded,
                    report.modules_processed, report.backup_bytes)
    assert got["fast"] == got["slow"]


def test_a_failure_mid_commit_of_a_filtered_reload_rolls_back(ckpts, monkeypatch, engine):
    import fp8_reload.reload.transaction as transaction_mod

    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [0, 3], 2: [7]})
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)  # plans and index cached
    fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)
    before = fr.snapshot(model)
    orig = transaction_mod.process_modules
    calls = []

    def fail_on_second(items):  # one module processed, then a device error
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return orig(items)

    monkeypatch.setattr(transaction_mod, "process_modules", fail_on_second)
    with pytest.raises(fr.CommitError, match="injected"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    monkeypatch.undo()
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    assert fr.compare_states(before, fr.snapshot(model)) != []


def test_a_file_changed_under_a_filtered_reload_rolls_it_back(ckpts, tmp_path, rewrite_mid_stream):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [0, 3], 2: [7]})
    fr.update_weights_from_disk(model, path, flt)  # index, targets, checked values cached
    fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)
    before = fr.snapshot(model)
    rewrite_mid_stream(path)
    with pytest.raises(fr.CorruptCheckpointError, match="changed while they were read"):
        fr.update_weights_from_disk(model, path, flt)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_a_shard_replaced_between_filtered_reloads_is_replanned(ckpts, tmp_path):
    """The index and targets hang on the parsed checkpoint: new files, a new plan."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({2: [5]})
    fr.update_weights_from_disk(model, path, flt)
    for f in path.glob("*.safetensors"):
        f.unlink()
    for f in ckpts["fp8", 0].glob("*.safetensors"):
        (path / f.name).write_bytes(f.read_bytes())
    fr.update_weights_from_disk(model, path, flt)
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 0])), fr.snapshot(model)) == []


@pytest.mark.parametrize("spec", [None, {1: [0, 3], 2: [5]}], ids=["full", "filtered"])
def test_targets_follow_experts_moved_between_reloads(ckpts, spec):
    """A rebalance moves experts to other slots (`expert_slots`) and reloads them: what
    was planned for the old slots must not be reused."""
    moved = {e: [(e + 3) % 8] for e in range(8)}
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)  # targets planned for slot = expert
    for _, layer in model.moe_layers():
        layer.expert_slots = moved
    fr.update_weights_from_disk(model, ckpts["fp8", 0])  # every expert into its new slot
    expected = fr.snapshot(fr.load_model(ckpts["fp8", 0], expert_slots=lambda layer_id: moved))
    assert fr.compare_states(expected, fr.snapshot(model)) == []
    if flt is not None:
        fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
        mixed = fr.load_model(ckpts["fp8", 0], expert_slots=lambda layer_id: moved)
        fr.update_weights_from_disk(mixed, ckpts["fp8", 1], fr.generate_weight_name_filter(spec))
        assert fr.compare_states(fr.snapshot(mixed), fr.snapshot(model)) == []


def test_targets_follow_a_replaced_parameter(ckpts, tmp_path):
    flt = fr.generate_weight_name_filter({1: [0, 3]})
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)  # targets planned
    moe = dict(model.moe_layers())["model.layers.1.mlp.experts"]
    for name in ("w13_weight", "w2_weight_scale"):
        old = getattr(moe, name)
        new = torch.nn.Parameter(old.data.clone(), requires_grad=False)
        for attr in ("weight_loader", "quant_method"):
            if hasattr(old, attr):
                setattr(new, attr, getattr(old, attr))
        setattr(moe, name, new)
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)
    assert fr.compare_states(_expected(ckpts, "fp8", {1: [0, 3]}, tmp_path), fr.snapshot(model)) == []


def test_a_modules_state_reads_attributes_as_getattr_would():
    """The kept plans' module check reads `quant_method` and `expert_slots` without
    `Module.__getattr__`'s raised miss, and finds them wherever getattr would: the
    instance, a property, a submodule, a class's own `__getattr__`; None where it would not."""
    from fp8_reload.reload.targets import _attr

    class Prop(torch.nn.Module):
        quant_method = property(lambda self: "from a property")

    class Forwarding(torch.nn.Module):
        def __getattr__(self, name):
            if name == "quant_method":
                return "forwarded"
            return super().__getattr__(name)

    plain, sub = torch.nn.Linear(2, 2), torch.nn.Module()
    plain.expert_slots = {0: [1]}
    sub.quant_method = torch.nn.Identity()
    for module in (plain, Prop(), sub, Forwarding(), torch.nn.LayerNorm(2)):
        for name in ("quant_method", "expert_slots"):
            assert _attr(module, name) is getattr(module, name, None), (type(module).__name__, name)
    assert _attr(Forwarding(), "quant_method") == "forwarded"


def test_targets_are_planned_once_per_model_across_checkpoints(ckpts, tiny_cfg, tmp_path):
    """Where a tensor lands depends on the model, not on the files: a reload from new
    files (RL weight sync writes new ones every step) reuses the views planned before,
    with the new files' offsets, and still equals a fresh load of the new files."""
    other = fr.write_checkpoint(tmp_path / "other", tiny_cfg, seed=1, min_shards=7)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 0])
    planned = plan_reload(model, open_checkpoint(model, ckpts["fp8", 0]), None, False)[1]
    first = {t.info.name: t for t in planned}
    ckpt = open_checkpoint(model, other)
    where = lambda info: (info.file, info.offset)  # noqa: E731
    assert sum(where(ckpt.info(n)) != where(t.info) for n, t in first.items()) > len(first) // 2
    again = plan_reload(model, ckpt, None, False)[1]
    assert {t.info.name for t in again} == set(first)
    for t in again:
        assert t.info is ckpt.info(t.info.name)  # this parse's offsets and files
        assert [v.data_ptr() for v in t.views] == [v.data_ptr() for v in first[t.info.name].views]
        assert all(a is b for a, b in zip(t.views, first[t.info.name].views))  # views reused
    fr.update_weights_from_disk(model, other)
    assert fr.compare_states(fr.snapshot(fr.load_model(other)), fr.snapshot(model)) == []


def test_a_fresh_load_leaves_its_parse_and_plan_to_the_first_reload(ckpts, monkeypatch):
    """The first reload after `load_model` from unchanged files neither parses the files
    again nor works out where tensors land: the load did both."""
    import fp8_reload.reload.plan as plan_module
    import fp8_reload.reload.targets as targets_module

    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)

    def refuse(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(targets_module, "_landing", refuse)
    monkeypatch.setattr(plan_module, "Checkpoint", refuse)
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0])
    assert report.tensors_loaded == len(fr.Checkpoint(ckpts["fp8", 0]).names)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_what_a_kept_full_plan_derives_is_kept_with_it(ckpts):
    """A repeated full reload reuses its kept plan, and with it what the reload derives
    from the plan's names (the slots its backup covers, the modules' order, the backup's
    copies, the experts it reports); experts moved to other slots replan, and derive anew."""
    from fp8_reload.reload.plan import target_cache

    model = fr.load_model(ckpts["fp8", 0])
    first = fr.update_weights_from_disk(model, ckpts["fp8", 1])
    first.experts_reloaded[1].clear()  # the report's own copy: the kept one is untouched
    again = fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert again.experts_reloaded == {layer: list(range(8)) for layer in again.experts_reloaded}
    cache = target_cache(model)
    (kept_names, derived), = cache.derived.values()
    chunks_key = ("chunks", chunks_mod.CHUNK_BYTES, chunks_mod.READ_IO)
    kept = {"backup_slots", "order", "backup_order", "backup_plan", "experts", "kinds", chunks_key}
    assert kept <= set(derived) <= kept | {"all_checked"}  # (the last once every value is checked)
    assert any(kept[0] is kept_names for kept in cache.full.values())
    # (the files and bytes the GPU path asks the registrations for, each reload: kept too)
    targets = next(kept[1] for kept in cache.full.values() if kept[0] is kept_names)
    kinds = derived["kinds"]
    assert kinds.files == {t.info.file for t in targets}
    streamed = [t for t in targets if t.kind in ("copy", "quant")]
    assert kinds.streamed_by_file == {f: sum(t.info.nbytes for t in streamed if t.info.file == f)
                                      for f in {t.info.file for t in streamed}}
    for _, layer in model.moe_layers():
        layer.expert_slots = {e: [(e + 3) % 8] for e in range(8)}
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # replanned: another names list
    assert len(cache.derived) == 1
    assert all(names is not kept_names for names, _ in cache.derived.values())
    moved = {e: [(e + 3) % 8] for e in range(8)}
    expected = fr.load_model(ckpts["fp8", 1], expert_slots=lambda layer_id: moved)
    assert fr.compare_states(fr.snapshot(expected), fr.snapshot(model)) == []
