"""Files with new stamps and the same layout (touched, or new values written in the same
places, as RL weight sync does at every step) keep the plan made from the old parse, and
still have their values read and checked anew; any other change of layout is planned again.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.plan as plan_module
import fp8_reload.reload.targets as targets_module
from fp8_reload.errors import InvalidTensorError
from fp8_reload.testing import io_paths

from .conftest import copy_checkpoint, rewrite_tensor

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _refuse_planning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr(targets_module, "_landing", refuse)
    monkeypatch.setattr(plan_module, "plan", refuse)


def _new_values_in_place(src, dst) -> None:
    """The shards of `src` over those of `dst` (same layout, other values); `dst`'s own
    config.json and index stay."""
    for f in src.glob("*.safetensors"):
        shutil.copyfile(f, dst / f.name)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_touched_files_keep_the_plan_and_are_checked_again(ckpts, tmp_path, monkeypatch, kind, device):
    path = copy_checkpoint(ckpts[kind, 0], tmp_path / "c")
    model = fr.load_model(path, device=device)
    fr.update_weights_from_disk(model, path)
    before = fr.snapshot(model)
    old = plan_module.open_checkpoint(model, path)
    io_paths.touch(io_paths.shard_files(path))
    _refuse_planning(monkeypatch)
    fr.update_weights_from_disk(model, path)
    new = plan_module.open_checkpoint(model, path)
    assert new is not old and new.plans is old.plans
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_new_values_in_the_same_places_are_what_the_reload_loads(ckpts, tmp_path, monkeypatch, kind, device):
    path = copy_checkpoint(ckpts[kind, 0], tmp_path / "c")
    model = fr.load_model(path, device=device)
    fr.update_weights_from_disk(model, path)
    expected = fr.snapshot(fr.load_model(ckpts[kind, 1], device=device))
    _new_values_in_place(ckpts[kind, 1], path)
    _refuse_planning(monkeypatch)
    fr.update_weights_from_disk(model, path)
    assert fr.compare_states(expected, fr.snapshot(model)) == []


def test_a_bad_value_in_the_same_layout_is_caught_and_rolled_back(ckpts, tmp_path, monkeypatch, device):
    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "c")
    model = fr.load_model(path, device=device)
    fr.update_weights_from_disk(model, path)
    before = fr.snapshot(model)
    nan = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)

    def poison(t):
        t = t.clone()
        t.view(-1)[5] = nan
        return t

    rewrite_tensor(path, EXPERT, poison)  # same shapes and dtypes: the same header bytes
    _refuse_planning(monkeypatch)
    with pytest.raises(InvalidTensorError):
        fr.update_weights_from_disk(model, path)
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


def test_another_layout_is_planned_again(ckpts, tmp_path, tiny_cfg):
    """Shards cut differently (another index, other offsets): nothing of the old plan is kept."""
    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "c")
    model = fr.load_model(path)
    fr.update_weights_from_disk(model, path)
    old = plan_module.open_checkpoint(model, path)
    other = fr.write_checkpoint(tmp_path / "o", tiny_cfg, seed=1, min_shards=7)
    shutil.rmtree(path)
    shutil.copytree(other, path)
    new = plan_module.open_checkpoint(model, path)
    assert not new.same_index(old) and new.plans is not old.plans
    fr.update_weights_from_disk(model, path)
    assert fr.compare_states(fr.snapshot(fr.load_model(other)), fr.snapshot(model)) == []


def test_one_header_changed_replans_the_full_reload(ckpts, tmp_path, monkeypatch):
    """The same index, one shard written anew with other metadata (another header, other
    offsets): the names are kept, where they land is worked out again."""
    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "c")
    model = fr.load_model(path)
    fr.update_weights_from_disk(model, path)
    old = plan_module.open_checkpoint(model, path)
    from safetensors.torch import load_file, save_file

    fname = old.weight_map[EXPERT]
    tensors = load_file(str(path / fname))
    save_file(tensors, str(path / fname), metadata={"format": "pt", "note": "rewritten"})
    new = plan_module.open_checkpoint(model, path)
    assert new.same_index(old) and not new.same_headers(old.parsed_headers())
    planned = []
    real = plan_module.plan
    monkeypatch.setattr(plan_module, "plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    fr.update_weights_from_disk(model, path)
    assert planned
    assert fr.compare_states(fr.snapshot(fr.load_model(path)), fr.snapshot(model)) == []


def test_a_filtered_reload_of_touched_files_reads_only_its_shards_headers(ckpts, tmp_path, tiny_cfg,
                                                                        monkeypatch):
    """An EPLB step after the files were touched opens the shards holding its experts only:
    the headers of the others are compared by the next full reload, if one comes."""
    import fp8_reload.checkpoint.reader as reader

    path = fr.write_checkpoint(tmp_path / "c", tiny_cfg, seed=0, min_shards=7)
    model = fr.load_model(path)
    fr.update_weights_from_disk(model, path)
    read = []
    real = reader.load_shard_header
    monkeypatch.setattr(reader, "load_shard_header", lambda f, name=None: read.append(name) or real(f, name))
    io_paths.touch(io_paths.shard_files(path))
    spec = {1: [3]}
    fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter(spec))
    ckpt = plan_module.open_checkpoint(model, path)
    wanted = {ckpt.weight_map[n] for n in ckpt.names if fr.generate_weight_name_filter(spec)(n)}
    assert set(read) == wanted and len(wanted) < len(ckpt.shard_files)


def test_wait_settled_returns_once_touched_files_count_as_at_rest(tmp_path):
    """The GPU scripts time "repeated" reloads after `touch`: only once the files are at rest
    (audit s26: without the wait they timed reloads that re-read scales and re-checked values)."""
    import os

    from fp8_reload.checkpoint import files

    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"x")
    io_paths.wait_settled([str(f)])
    assert files.settled(files.stamp(os.stat(f)))
    io_paths.touch([str(f)])
    assert not files.settled(files.stamp(os.stat(f)))
    io_paths.wait_settled([str(f)])
    assert files.settled(files.stamp(os.stat(f)))
