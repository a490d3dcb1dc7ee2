"""Review s19: a host backup's first pieces kept on the device (`backup.ON_DEVICE`), and a merged
FP8 linear requantized by the w13 kernel.

The backup runs on its GPU path on CPU with the side stream deferred (`test_review_s17.deferred`):
a copy queued there runs only when someone waits for an event recorded after it. A first
piece's copy goes to the device arena (`Backup.near`, 12f1c53; on CPU a `DeviceArena` of
the CPU), the rest to the pinned one: the split, both arenas' sizes and the ordering of
every write after the backup of its bytes are checked with any share of the pieces on the
device. The linear's kernel runs in Triton's interpreter on CPU (as `test_requant` does).
"""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
import fp8_reload.reload.backup as bk
import fp8_reload.reload.backup_plan as bplan
from fp8_reload.checkpoint import staging
from fp8_reload.reload.backup_plan import piece_bytes

from .conftest import mix_checkpoints, unchanged
from .test_review_s17 import SPECS, _fail_processing, _setup, deferred, rolled_back_changed  # noqa: F401

SHARES = ["first", "a third", "all but one", "all", "beyond"]


def _sizes(saved) -> list[int]:
    return [piece_bytes(tensor, run) for _, tensor, run, _ in saved.todo]


def _on_device(share: str, sizes: list[int]) -> int:
    return {"first": sizes[0], "a third": sum(sizes) // 3, "all but one": sum(sizes) - 1,
            "all": sum(sizes), "beyond": 1 << 40}[share]


def _prefix(sizes: list[int], limit: int) -> int:
    """The longest prefix of `sizes`, each aligned as the device arena hands it out, within
    `limit` (what `_begin` keeps on the device)."""
    n, total = 0, 0
    while n < len(sizes) and total + staging.aligned(sizes[n]) <= limit:
        total, n = total + staging.aligned(sizes[n]), n + 1
    return n


def _arena_resets(monkeypatch) -> list[int]:
    asked, reset = [], staging.PinnedArena.reset
    monkeypatch.setattr(staging.PinnedArena, "reset",
                        lambda self, n: asked.append((self, n)) or reset(self, n))
    return asked


def _check_split(saved, asked: list[int], limit: int) -> None:
    """The big copies before `on_device` outside the arena, the rest and the small batches in
    it; the arena asked for exactly what was carved out of it (nothing left over, no overflow)."""
    sizes = _sizes(saved)
    n = _prefix(sizes, limit)
    assert saved.on_device == n and saved.device_bytes == sum(sizes[:n])
    assert len(saved.big) == len(sizes)
    buf = saved.arena.buffer.untyped_storage().data_ptr()
    near = None if saved.near is None else saved.near.buffer.untyped_storage().data_ptr()
    assert (near is None) == (n == 0)
    for k, (_, _, copy) in enumerate(saved.big):
        assert copy.untyped_storage().data_ptr() == (buf if k >= n else near), k
    if n:  # (the device arena: exactly the aligned first pieces, within the share)
        assert saved.near.used == saved.near.capacity == sum(staging.aligned(m) for m in sizes[:n]) <= limit
    for _, flat in saved.small:
        assert flat.untyped_storage().data_ptr() == buf
    mine = [n for arena, n in asked if arena is saved.arena]
    assert mine[-1] == saved.arena.used <= saved.arena.capacity


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("small", [bplan.SMALL_BYTES, 0], ids=["small", "no-small"])
@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
@pytest.mark.parametrize("spec", ["full", "two-layers", "one-expert"])
def test_a_rollback_restores_every_byte_whatever_share_is_on_the_device(ckpts, deferred, monkeypatch,  # noqa: F811
                                                                        share, small, registered, spec):
    """s17's attack with the split: every write waits for its bytes' backup, device-arena copies
    included (whole tensors, slot runs through `index_copy_`, a transposed linear weight's
    `dense_view` when nothing is small); the arena holds exactly the rest."""
    _setup(monkeypatch, registered, small)
    asked = _arena_resets(monkeypatch)
    flt = SPECS[spec]
    flt = fr.generate_weight_name_filter(flt) if isinstance(flt, dict) else flt
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1], flt)  # (ON_DEVICE 0: learns the sizes)
    sizes = _sizes(deferred.made[-1])
    assert len(sizes) > 1
    limit = _on_device(share, sizes)
    monkeypatch.setattr(bk, "ON_DEVICE", limit)
    before = fr.snapshot(model)
    with monkeypatch.context() as m:
        _fail_processing(m)
        with pytest.raises(fr.CommitError, match="ZeroDivision") as info:
            fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)
    saved = deferred.made[-1]
    assert _sizes(saved) == sizes
    _check_split(saved, asked, limit)
    assert info.value.report.backup_device_bytes == saved.device_bytes
    assert deferred.done == len(deferred.todo)
    assert not unchanged(model, before)
    if spec == "full" and small == 0 and saved.on_device == len(sizes):  # (a transposed linear weight)
        linears = {id(p.data.untyped_storage()): p for n, p in model.named_parameters()
                   if n.endswith("proj.weight")}
        assert any(t.shape != linears[id(t.untyped_storage())].shape for t, run, _ in saved.big
                   if run is None and id(t.untyped_storage()) in linears)
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)
    assert report.backup_device_bytes == deferred.made[-1].device_bytes == sum(sizes[:saved.on_device])
    # (base 0, the filtered part from 1, then from 0 again: all of 0)
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 0])), fr.snapshot(model))


def test_the_first_piece_too_big_keeps_nothing_on_the_device(ckpts, deferred, monkeypatch):  # noqa: F811
    """The share is a prefix of the write order: a first piece above `ON_DEVICE` puts every
    copy in the arena, even where later pieces would fit (what the docstring says)."""
    _setup(monkeypatch, True, chunk=1 << 20)  # (a layer's experts one piece: the first is big)
    asked = _arena_resets(monkeypatch)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    sizes = _sizes(deferred.made[-1])
    assert min(sizes[1:]) < sizes[0]
    monkeypatch.setattr(bk, "ON_DEVICE", sizes[0] - 1)
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0])
    saved = deferred.made[-1]
    assert saved.on_device == 0 and saved.device_bytes == report.backup_device_bytes == 0
    _check_split(saved, asked, sizes[0] - 1)
    small = sum(staging.aligned(flat.numel() * flat.element_size()) for _, flat in saved.small)
    host = [n for arena, n in asked if arena is saved.arena][-1]
    assert saved.near is None and host == sum(staging.aligned(n) for n in sizes) + small


def test_a_kept_plan_reused_with_another_share_each_reload(ckpts, deferred, monkeypatch):  # noqa: F811
    """The kept plan (`kept_plan`) is reused across full reloads while `ON_DEVICE` changes:
    the split is worked out afresh each time, the grow-only arena never overflows, a failing
    reload restores the model and a clean one equals a fresh load."""
    _setup(monkeypatch, True)
    asked = _arena_resets(monkeypatch)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    sizes = _sizes(deferred.made[-1])
    for seed, share in enumerate(["all", "first", "a third", "beyond", "all but one"]):
        limit = _on_device(share, sizes)
        monkeypatch.setattr(bk, "ON_DEVICE", limit)
        before = fr.snapshot(model)
        with monkeypatch.context() as m:
            _fail_processing(m)
            with pytest.raises(fr.CommitError):
                fr.update_weights_from_disk(model, ckpts["fp8", seed % 2])
        assert not unchanged(model, before)
        _check_split(deferred.made[-1], asked, limit)
        fr.update_weights_from_disk(model, ckpts["fp8", seed % 2])
        saved = deferred.made[-1]
        # (the plan kept per checkpoint: the failed reload's, and the last one's of this checkpoint)
        assert saved.todo is deferred.made[-2].todo and (seed < 2 or saved.todo is deferred.made[-5].todo)
        _check_split(saved, asked, limit)
        assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", seed % 2])), fr.snapshot(model))


@pytest.mark.parametrize("then", ["none", "all"])
def test_on_device_changed_between_begin_and_start_keeps_the_begun_split(ckpts, deferred, monkeypatch, then):  # noqa: F811
    """`ON_DEVICE` is read once, by `begin` (before the read): a change before `start_on_demand`
    moves nothing, the arena sized at `begin` holds what goes there, the rollback is exact."""
    _setup(monkeypatch, True)
    asked = _arena_resets(monkeypatch)
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    sizes = _sizes(deferred.made[-1])
    limit = sum(sizes) // 3
    monkeypatch.setattr(bk, "ON_DEVICE", limit)
    real = bk.Backup.start_on_demand

    def later(self):
        monkeypatch.setattr(bk, "ON_DEVICE", {"none": 0, "all": 1 << 40}[then])
        real(self)

    monkeypatch.setattr(bk.Backup, "start_on_demand", later)
    before = fr.snapshot(model)
    _fail_processing(monkeypatch)
    with pytest.raises(fr.CommitError):
        fr.update_weights_from_disk(model, ckpts["fp8", 0])
    _check_split(deferred.made[-1], asked, limit)
    assert not unchanged(model, before)


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("at", [1, 2, 3, 6], ids=lambda k: f"clone{k}")
@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
def test_a_fault_while_device_clones_are_queued_restores_the_model(ckpts, deferred, monkeypatch, fault, at,  # noqa: F811
                                                                    registered):
    """The `at`-th device-arena copy raises (clone1, clone2: `begin`'s first piece, before the lock:
    nothing written; later ones mid-commit, after writes of earlier pieces): the model is as it was,
    a Ctrl-C propagates as itself, nothing queued is left running, the next reload is exact."""
    _setup(monkeypatch, registered)
    model = fr.load_model(ckpts["fp8", 0])
    monkeypatch.setattr(bk, "ON_DEVICE", 1 << 40)
    keep, clones = bk.Backup._keep, []

    def failing(self, src, arena, fresh):
        if arena is not None and arena is self.near:  # (a first piece: into the device arena)
            clones.append(src)
            if len(clones) == at:
                raise fault("injected: a device-arena copy failed")
        return keep(self, src, arena, fresh)

    monkeypatch.setattr(bk.Backup, "_keep", failing)
    before = fr.snapshot(model)
    expected = fr.ReloadError if fault is RuntimeError else KeyboardInterrupt
    with pytest.raises(expected, match="injected") as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    saved = deferred.made[-1]
    assert saved.on_device == len(saved.todo) and len(clones) == at
    if fault is RuntimeError:
        # (`begin` queues the first piece's copies, up to its event, before anything is written)
        assert isinstance(info.value, fr.CommitError) == (at > min(saved.marks) + 1)
    assert deferred.done == len(deferred.todo)
    assert not unchanged(model, before)
    assert not getattr(model, "weights_undefined", None)
    monkeypatch.setattr(bk.Backup, "_keep", keep)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert not fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model))


@pytest.mark.parametrize("backup", ["host", "device"])
def test_device_bytes_of_a_cpu_model_and_of_a_device_backup(ckpts, monkeypatch, backup):
    """A CPU model keeps nothing "on the device" with a host backup (no arena: `ON_DEVICE`
    does not apply), all of it with `backup="device"`; the report says so on success and on
    a rolled-back failure."""
    monkeypatch.setattr(bk, "ON_DEVICE", 1 << 40)
    model = fr.load_model(ckpts["fp8", 0])
    report = fr.update_weights_from_disk(model, ckpts["fp8", 1], backup=backup)
    assert report.backup_bytes > 0
    assert report.backup_device_bytes == (report.backup_bytes if backup == "device" else 0)
    _fail_processing(monkeypatch)
    with pytest.raises(fr.CommitError) as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 0], backup=backup)
    failed = info.value.report
    assert failed.backup_bytes == report.backup_bytes
    assert failed.backup_device_bytes == (failed.backup_bytes if backup == "device" else 0)


def test_a_device_backup_on_the_gpu_path_is_all_device_bytes_and_no_arena(ckpts, deferred, monkeypatch):  # noqa: F811
    """`backup="device"` on the GPU path: every byte beside the weights whatever `ON_DEVICE`,
    no arena reset; a rollback is exact."""
    _setup(monkeypatch, True)
    asked = _arena_resets(monkeypatch)
    monkeypatch.setattr(bk, "ON_DEVICE", 0)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    _fail_processing(monkeypatch)
    with pytest.raises(fr.CommitError) as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1], backup="device")
    saved = deferred.made[-1]
    assert saved.device_bytes == saved.nbytes == info.value.report.backup_device_bytes > 0
    assert saved.arena is None and saved.on_device == 0
    assert not [n for arena, n in asked if arena is staging.arena(model, "backup")]
    assert not unchanged(model, before)


def test_the_harness_catches_a_write_not_waiting_for_a_device_clone(ckpts, deferred, monkeypatch):  # noqa: F811
    """Teeth: with every big copy on the device, writes not told to wait for the pieces
    before `on_device` (their events dropped) are backed up after they ran: the rollback
    leaves the model changed. The split tests above would see such a bug."""
    _setup(monkeypatch, True)
    monkeypatch.setattr(bk, "ON_DEVICE", 1 << 40)
    real = bk.Backup.event_for

    def dropped(self, module, slot=None):
        event = real(self, module, slot)
        k = self.due.get((id(module), slot), self.due.get((id(module), None)))
        return None if k is not None and k < self.on_device else event

    monkeypatch.setattr(bk.Backup, "event_for", dropped)
    assert rolled_back_changed(ckpts, monkeypatch)


# ---- a merged FP8 linear through the w13 kernel (Triton's interpreter on CPU) ----


def _interpreted(monkeypatch) -> list:
    """Processing of linears and experts on "a Triton device" (CPU tensors through Triton's
    interpreter); returns the shapes of the w13 requantizations launched."""
    pytest.importorskip("triton")
    from fp8_reload.kernels.triton import requant
    from fp8_reload.kernels.triton.runtime import INTERPRET
    from fp8_reload.processing import linear, ops

    if not INTERPRET:
        pytest.skip("compiled Triton cannot run CPU tensors")
    launched, real = [], requant.requantize_w13_
    monkeypatch.setattr(requant, "requantize_w13_",
                        lambda w13, *a, **kw: launched.append(tuple(w13.shape)) or real(w13, *a, **kw))
    for module in (linear, ops):
        monkeypatch.setattr(module, "on_triton", lambda t: True)
    return launched


def test_a_model_whose_merged_linears_take_the_kernel_equals_the_torch_loop(ckpts, monkeypatch, tmp_path):
    """Load (kernel_layout False), full reloads (kernel_layout True: `checkpoint_view` is the
    transpose of `.data`, contiguous), and a filtered reload naming one gate shard (the module
    reloaded whole): bit for bit what the CPU torch loop gives, input scales
    included, each gate_up one launch."""
    want = {k: fr.snapshot(fr.load_model(ckpts["fp8", k])) for k in (0, 1)}
    gate = lambda n: n.startswith("model.layers.0.mlp.gate_proj.")  # noqa: E731
    # (the fixed mode reloads a merged module whole: the filter's gate pulls in its up)
    unit = lambda n: n.startswith(("model.layers.0.mlp.gate_proj.", "model.layers.0.mlp.up_proj."))  # noqa: E731
    mixed = mix_checkpoints(ckpts["fp8", 1], ckpts["fp8", 0], tmp_path / "m", unit)
    want["mixed"] = fr.snapshot(fr.load_model(mixed))
    assert fr.compare_states(want["mixed"], want[1])  # (the gate's bytes and scales differ)
    launched = _interpreted(monkeypatch)
    model = fr.load_model(ckpts["fp8", 0])
    merged = [n for n, m in model.named_modules() if n.endswith("gate_up_proj")]
    assert len(merged) == 3 and launched.count((1, 192, 64)) == 1 and launched.count((1, 64, 64)) == 2
    assert not fr.compare_states(want[0], fr.snapshot(model))
    weight = model.get_submodule(merged[0]).weight
    for k in (1, 1):
        del launched[:]
        fr.update_weights_from_disk(model, ckpts["fp8", k])
        assert launched.count((1, 192, 64)) == 1 and model.get_submodule(merged[0]).kernel_layout
        assert not fr.compare_states(want[k], fr.snapshot(model))
    del launched[:]
    report = fr.update_weights_from_disk(model, ckpts["fp8", 0], gate)
    assert launched == [(1, 192, 64)] and report.modules_processed == [merged[0]]
    assert report.tensors_loaded == 6
    assert model.get_submodule(merged[0]).weight is weight
    assert not fr.compare_states(want["mixed"], fr.snapshot(model))


@pytest.mark.parametrize("case", ["processed-twice", "scale-not-contiguous", "weight-not-contiguous"])
def test_a_merged_linear_processed_again_or_off_the_kernel_path_has_the_loops_bytes(monkeypatch, case):
    """A layer processed once (kernel_layout True), its gate shard loaded anew with another
    scale and processed again; or a scale / weight rebound to a strided view (the guard sends
    it to the torch loop): the same bytes, scales and input scales as the CPU loop."""
    from fp8_reload.layers import Fp8Linear
    from fp8_reload.processing import linear

    g = torch.Generator().manual_seed(3)
    values = torch.randn(96, 80, generator=g) * 2
    scales = torch.tensor([0.03, 0.05]), torch.tensor([0.07, 0.02])
    layers = []
    for interpreted in (False, True):
        launched = _interpreted(monkeypatch) if interpreted else None
        layer = Fp8Linear(80, [48, 48], linear.FixedFp8LinearMethod(True))
        for shard, s in enumerate(scales[0]):
            q = fr.quant.quantize_static(values[48 * shard:48 * shard + 48], s)
            layer.weight_loader(layer.weight, q, shard)
            layer.weight_loader(layer.weight_scale, s, shard)
            layer.weight_loader(layer.input_scale, torch.tensor(0.5 + shard), shard)
        if case == "scale-not-contiguous":
            layer.weight_scale.data = torch.zeros(2, 2)[:, 0].copy_(layer.weight_scale.data)
        layer.quant_method.process_weights_after_loading(layer)
        if case == "weight-not-contiguous":  # (a layer someone left with a strided weight)
            w = torch.empty(96, 160, dtype=layer.weight.dtype)[:, ::2]
            w.copy_(layer.weight.data.t())
            layer.weight.data, layer.kernel_layout = w.t(), True
        q = fr.quant.quantize_static(values[:48] * 1.5, scales[1][0])
        layer.weight_loader(layer.weight, q, 0)
        layer.weight_loader(layer.weight_scale, scales[1][0], 0)
        layer.weight_loader(layer.input_scale, torch.tensor(0.25), 0)
        layer.quant_method.process_weights_after_loading(layer)
        if interpreted:
            kernel = {"processed-twice": 2, "weight-not-contiguous": 1, "scale-not-contiguous": 0}[case]
            assert launched == [(1, 96, 80)] * kernel
        layers.append(layer)
        monkeypatch.undo()
    want, got = layers
    for name in ("weight", "weight_scale", "input_scale"):
        a, b = (getattr(t, name).data for t in (want, got))
        a, b = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, b))
        assert a.shape == b.shape and torch.equal(a, b), name
    assert torch.equal(got.input_scale.data, torch.tensor([1.5, 1.5]))
