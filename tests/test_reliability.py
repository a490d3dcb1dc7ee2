"""Reliability: whatever goes wrong, the model stays exactly as it was.

* the bad-checkpoint corpus (`bad_checkpoints.CASES`): right error class, a
  message naming the file/tensor, model bit-identical (bytes, Parameter objects,
  loader attributes) and forward output unchanged; no code from the checkpoint
  ever runs (armed pickle traps never fire, no unpickler global, no eval);
* fault injection in the middle of commit and of post-processing, both
  checkpoint kinds, fixed and upstream modes, device errors and Ctrl-C;
* concurrency: reloads serialize, forwards never see a half-written layer,
  forwards keep running while a reload reads the checkpoint;
* memory: staged and backup bytes are bounded by the reload.
"""

from __future__ import annotations

import ast
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
import fp8_reload.layers as layers
import fp8_reload.processing as proc
import fp8_reload.processing.moe as moe_processing
import fp8_reload.reload.backup as backup_mod
from fp8_reload.checkpoint import Checkpoint
from fp8_reload.layers import EXPERT_RE, FusedMoE

from . import bad_checkpoints as bad
from .conftest import copy_checkpoint, mix_checkpoints, tokens

KINDS = ["fp8", "bf16"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
WAIT = 10.0  # seconds any test waits for a thread/event before failing (never hang)


def unchanged(model, before) -> list[str]:
    return fr.compare_states(before, fr.snapshot(model), identity=True)


def expert_key(name: str):
    m = EXPERT_RE.match(name)
    return None if m is None else (int(name.split(".")[2]), int(m.group(2)))


# ==========================================================================
# The bad-checkpoint corpus
# ==========================================================================

@pytest.fixture(scope="module")
def built(ckpts, tiny_cfg, tmp_path_factory):
    """Builds each (case, kind) once, from the seed-1 checkpoint: the models under
    test are loaded from seed 0, so any byte written before the error shows."""
    cache = {}

    def get(case, kind):
        if (case.name, kind) not in cache:
            work = tmp_path_factory.mktemp(f"bad-{case.name}-{kind}")
            path, mentions = case.build(ckpts[kind, 1], work, kind, tiny_cfg)
            cache[case.name, kind] = (path, mentions, work)
        return cache[case.name, kind]
    return get


CORPUS = [pytest.param(c, k, m, id=f"{c.name}-{k}-{m}")
          for c in bad.CASES for k in c.kinds for m in c.modes]


def test_corpus_is_large_and_distinct():
    names = [c.name for c in bad.CASES]
    assert len(set(names)) == len(names) >= 12
    assert len({c.build for c in bad.CASES}) >= 12


@pytest.mark.parametrize("case,kind,mode", CORPUS)
def test_bad_checkpoint_is_refused_and_model_unchanged(built, ckpts, tiny_cfg, case, kind, mode):
    path, mentions, work = built(case, kind)
    model = fr.load_model(ckpts[kind, 0], processing=mode)
    x = tokens(tiny_cfg)
    y0 = model(x)
    before = fr.snapshot(model)
    with bad.watch() as code_run, pytest.raises(fr.ReloadError) as info:
        fr.update_weights_from_disk(model, path, bad.weight_name_filter(case))
    err = info.value
    assert type(err) is case.error, f"{type(err).__name__}: {err}"
    for m in mentions:
        assert m in str(err), f"message lacks {m!r}: {err}"
    assert unchanged(model, before) == []
    assert torch.equal(model(x), y0)
    assert code_run == []
    assert not (work / "MARKER").exists()


@pytest.mark.parametrize("case,kind", [pytest.param(c, k, id=f"{c.name}-{k}")
                                       for c in bad.CASES if c.bad_alone for k in c.kinds])
def test_bad_checkpoint_fails_a_fresh_load_with_the_same_error(built, case, kind):
    path, mentions, work = built(case, kind)
    with bad.watch() as code_run, pytest.raises(case.error):
        fr.load_model(path)
    assert code_run == [] and not (work / "MARKER").exists()


# ---------------------------------------------------------------- no code ever runs

@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_pickle_traps_are_armed(tmp_path, fmt):
    """The control: unpickling a planted file on purpose does run its code, and the
    audit hook sees it. So 'marker absent, nothing watched' above means something."""
    f = bad.plant_pickle(tmp_path / "w.bin", tmp_path / "MARKER", fmt)
    with bad.watch() as code_run:
        assert bad.trap_fires(f, tmp_path / "MARKER", fmt)
    assert any(e == "pickle.find_class" for e, _ in code_run)
    with bad.watch() as code_run:
        eval("1 + 1")  # the watch also sees eval of a string
    assert code_run


def test_pickles_beside_safetensors_are_ignored(ckpts, tmp_path):
    """HF repos often ship both: the safetensors index is used, the .bin never opened."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "both")
    marker = tmp_path / "MARKER"
    bad.plant_pickle(path / "pytorch_model.bin", marker)
    bad.plant_pickle(path / "pytorch_model-00001-of-00002.bin", marker)
    bad.plant_pickle(path / "training_args.bin", marker, fmt="pickle")
    model = fr.load_model(ckpts["fp8", 0])
    with bad.watch() as code_run:
        fr.update_weights_from_disk(model, path)
    assert not marker.exists() and code_run == []
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_strings_are_never_evaluated(ckpts, tmp_path, kind):
    """Code-looking strings in shard __metadata__, the index and config.json stay strings."""
    marker = tmp_path / "MARKER"
    code = f"__import__('os').mkdir({str(marker)!r})"
    path = copy_checkpoint(ckpts[kind, 1], tmp_path / "meta")
    for shard in sorted(set(bad.weight_map(path).values())):
        header, data = bad.split_safetensors(path / shard)
        header["__metadata__"] = {"format": "pt", "note": code, code: code}
        bad.join_safetensors(path / shard, header, data)
    index = bad.json.loads((path / bad.INDEX_FILE).read_text())
    index["metadata"] = {"eval": code}
    (path / bad.INDEX_FILE).write_text(bad.json.dumps(index))
    hf = bad.json.loads((path / "config.json").read_text())
    hf["auto_map"] = {"AutoModel": code}
    hf["torch_dtype"] = code
    (path / "config.json").write_text(bad.json.dumps(hf))

    model = fr.load_model(ckpts[kind, 0])
    with bad.watch() as code_run:
        fr.update_weights_from_disk(model, path)
        fresh = fr.load_model(path)
    assert not marker.exists() and code_run == []
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []


def test_library_never_unpickles_or_evaluates():
    """Static guard: no pickle/marshal/torch.load/eval/exec anywhere in fp8_reload."""
    root = Path(fr.__file__).parent
    forbidden_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib"}
    found = []
    for file in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{file.name}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] in forbidden_modules]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in forbidden_modules:
                found.append(f"{file.name}: from {node.module} import")
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
                    found.append(f"{file.name}:{node.lineno}: {f.id}()")
                if isinstance(f, ast.Attribute) and f.attr in ("load", "loads") and \
                        isinstance(f.value, ast.Name) and f.value.id in ("torch", "pickle", "np", "numpy"):
                    found.append(f"{file.name}:{node.lineno}: {f.value.id}.{f.attr}()")
    assert found == []


# ---------------------------------------------------------------- scoped errors

def test_a_filtered_reload_avoiding_the_broken_part_succeeds(built, ckpts):
    """Errors are about what the reload needs: a tensor missing from expert (2, 5) does
    not stop a filtered reload of expert (1, 0)."""
    case = next(c for c in bad.CASES if c.name == "tensor-missing-full")
    path, _, _ = built(case, "fp8")
    model = fr.load_model(ckpts["fp8", 0])
    report = fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({1: [0]}))
    assert report.experts_reloaded == {1: [0]}
    with pytest.raises(fr.MissingTensorError):
        fr.update_weights_from_disk(model, path, fr.generate_weight_name_filter({2: [5]}))


def test_a_failing_filter_is_a_reload_error(ckpts):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)

    def broken_filter(name):
        raise ValueError("filter bug")

    with pytest.raises(fr.ReloadError, match="weight_name_filter raised ValueError: filter bug"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], broken_filter)
    with pytest.raises(TypeError, match="callable"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], ["model.norm.weight"])
    assert unchanged(model, before) == []


def test_out_of_memory_while_staging_is_a_reload_error_and_writes_nothing(ckpts, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    orig = Checkpoint.read

    def read_then_oom(self, names, stats=None, into=None):
        for i, item in enumerate(orig(self, names, stats, into=into)):
            if i == 5:
                raise MemoryError("host out of memory")
            yield item

    monkeypatch.setattr(Checkpoint, "read", read_then_oom)
    with pytest.raises(fr.ReloadError, match="before anything was written: MemoryError"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert unchanged(model, before) == []


# ==========================================================================
# Fault injection in commit and post-processing
# ==========================================================================

class Fault:
    """Wraps `owner.attr`: the `at`-th call runs the original, then raises `exc`
    (or lets the original's own exception through, as upstream code may raise).

    At that moment it records whether the model already differs from `before`
    (bytes, replaced Parameters, or weights staged for quantize-on-load), so each
    test proves its rollback had something to undo.
    """

    def __init__(self, monkeypatch, owner, attr, at, exc, model, before):
        self.calls, self.at, self.exc = 0, at, exc
        self.dirty = None
        orig = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.calls != self.at:
                return orig(*args, **kwargs)
            try:
                orig(*args, **kwargs)
            finally:
                staged = any(getattr(m, "staged", None) for m in model.modules())
                self.dirty = staged or fr.compare_states(before, fr.snapshot(model), identity=True) != []
            raise self.exc

        monkeypatch.setattr(owner, attr, wrapper)


DEVICE_FAULT = RuntimeError("CUDA error: an illegal memory access was encountered")
FILTERED = {1: [0, 3], 2: [5]}

# (name, owner, attribute, at which call): points inside commit ...
COMMIT_POINTS = [
    ("expert-loader", FusedMoE, "_load_into_slot", 4),
    ("linear-loader", proc.FixedFp8LinearMethod, "load_linear", 3),
]
# ... and inside post-processing
PROCESS_POINTS = [
    ("moe-process", proc.FixedFp8MoEMethod, "process_weights_after_loading", 2),
    ("linear-process", proc.FixedFp8LinearMethod, "process_weights_after_loading", 3),
    ("requantize-kernel", moe_processing, "process_fp8_experts_", 1),
    ("quantize-kernel", moe_processing, "quantize_staged_experts_", 2),
]


def _expected_after(ckpts, kind, spec, tmp_path, device="cpu"):
    """Snapshot of a fresh load of what a successful reload from seed 1 gives."""
    if spec is None:
        return fr.snapshot(fr.load_model(ckpts[kind, 1], device=device))
    chosen = {(layer, e) for layer, es in spec.items() for e in es}
    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed",
                            lambda n: expert_key(n) in chosen)
    return fr.snapshot(fr.load_model(mixed, device=device))


def _fault_cases():
    out = []
    for name, owner, attr, at in COMMIT_POINTS + PROCESS_POINTS:
        for kind in KINDS:
            for spec_name, spec in (("full", None), ("filtered", FILTERED)):
                if name == "requantize-kernel" and kind == "bf16":
                    continue  # the FP8-checkpoint path only
                if name == "quantize-kernel" and kind == "fp8":
                    continue  # the quantize-on-load path only
                if name.startswith("linear") and spec is not None:
                    continue  # the filter holds experts only
                out.append(pytest.param(owner, attr, at, kind, spec, id=f"{name}-{kind}-{spec_name}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("owner,attr,at,kind,spec", _fault_cases())
def test_fault_mid_commit_or_processing_rolls_back(ckpts, tiny_cfg, tmp_path, monkeypatch,
                                                   owner, attr, at, kind, spec, device):
    model = fr.load_model(ckpts[kind, 0], device=device)
    x = tokens(tiny_cfg).to(device)
    y0 = model(x)
    before = fr.snapshot(model)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    fault = Fault(monkeypatch, owner, attr, at, DEVICE_FAULT, model, before)
    with pytest.raises(fr.CommitError, match="rolled back, the model is unchanged") as info:
        fr.update_weights_from_disk(model, ckpts[kind, 1], flt)
    assert info.value.__cause__ is DEVICE_FAULT
    assert fault.dirty, "the fault hit before anything was written: nothing was rolled back"
    assert unchanged(model, before) == []
    assert torch.equal(model(x), y0)
    assert "restore" in info.value.report.seconds

    # The restored model behaves like the untouched one: reloading other experts
    # from its own checkpoint changes nothing (no stale staged weights, no stale
    # scope), and the reload that failed now succeeds with the right result.
    monkeypatch.undo()
    fr.update_weights_from_disk(model, ckpts[kind, 0], fr.generate_weight_name_filter({1: [7], 2: [1]}))
    assert unchanged(model, before) == []
    fr.update_weights_from_disk(model, ckpts[kind, 1], flt)
    assert fr.compare_states(_expected_after(ckpts, kind, spec, tmp_path, device), fr.snapshot(model)) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["commit", "process"])
def test_keyboard_interrupt_mid_reload_restores_and_propagates(ckpts, monkeypatch, kind, where):
    model = fr.load_model(ckpts[kind, 0])
    before = fr.snapshot(model)
    owner, attr = ((FusedMoE, "_load_into_slot") if where == "commit"
                   else (proc.FixedFp8MoEMethod, "process_weights_after_loading"))
    fault = Fault(monkeypatch, owner, attr, 2, KeyboardInterrupt(), model, before)
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, ckpts[kind, 1])
    assert fault.dirty
    assert unchanged(model, before) == []


def test_ctrl_c_during_restore_is_deferred_until_the_model_is_whole(ckpts, monkeypatch):
    """A real SIGINT arriving while the backup is restored does not cut the restore short."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, FusedMoE, "_load_into_slot", 20, DEVICE_FAULT, model, before)
    orig = backup_mod.Backup.restore
    progress = []

    def restore_with_sigint(self):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode boundary
        time.sleep(0.01)
        orig(self)
        progress.append("restored")

    monkeypatch.setattr(backup_mod.Backup, "restore", restore_with_sigint)
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert progress == ["restored"]
    assert unchanged(model, before) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("kind", KINDS)
def test_upstream_fault_mid_commit_rolls_back(ckpts, monkeypatch, kind):
    """Upstream mode reads everything and processes every module; norms still load."""
    model = fr.load_model(ckpts[kind, 0], processing="upstream")
    before = fr.snapshot(model)
    norms = lambda n: n.endswith("layernorm.weight")  # noqa: E731
    fault = Fault(monkeypatch, layers, "default_weight_loader", 3, DEVICE_FAULT, model, before)
    with pytest.raises(fr.CommitError, match="while loading tensor"):
        fr.update_weights_from_disk(model, ckpts[kind, 1], norms)
    assert fault.dirty
    assert unchanged(model, before) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["linear", "moe"])
def test_upstream_fault_mid_processing_puts_back_the_replaced_parameters(ckpts, monkeypatch, kind, method):
    """Upstream processing replaces Parameters; the rollback restores the original
    objects (identity), their attributes and their bytes. (On an FP8 checkpoint the
    first MoE module fails by itself: upstream cannot re-process its collapsed
    [E] scale. That too is rolled back.)"""
    model = fr.load_model(ckpts[kind, 0], processing="upstream")
    before = fr.snapshot(model)
    owner = proc.UpstreamFp8LinearMethod if method == "linear" else proc.UpstreamFp8MoEMethod
    norms = lambda n: n.endswith("layernorm.weight")  # noqa: E731
    at = 3 if method == "linear" else 1  # modules run in order: linears of layer 0 come first
    fault = Fault(monkeypatch, owner, "process_weights_after_loading", at, DEVICE_FAULT, model, before)
    with pytest.raises(fr.CommitError, match="while post-processing module"):
        fr.update_weights_from_disk(model, ckpts[kind, 1], norms)
    assert fault.dirty
    assert unchanged(model, before) == []


def test_failed_rollback_is_reported_and_only_a_full_reload_repairs(ckpts, tmp_path, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, FusedMoE, "_load_into_slot", 10, DEVICE_FAULT, model, before)
    Fault(monkeypatch, backup_mod, "index_copy_", 1, RuntimeError("device lost"), model, before)
    with pytest.raises(fr.RollbackError, match="restoring the backup failed too"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(FILTERED))
    monkeypatch.undo()
    assert model.weights_undefined
    with pytest.raises(fr.RollbackError, match="only a full reload"):
        fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [0]}))
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert not model.weights_undefined
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []
    fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [0]}))


# ==========================================================================
# Memory bounds
# ==========================================================================

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", [None, {1: [2]}, FILTERED], ids=["full", "one", "three"])
def test_staged_and_backup_bytes_are_bounded_by_the_reload(ckpts, tiny_cfg, kind, spec):
    path = ckpts[kind, 0]
    ckpt = fr.Checkpoint(path)
    model = fr.load_model(path)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    report = fr.update_weights_from_disk(model, path, flt)
    selected = [n for n in ckpt.names if flt is None or flt(n)]
    assert report.staged_bytes == sum(ckpt.info(n).nbytes for n in selected)
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if spec is None:
        assert report.backup_bytes <= model_bytes
        return
    n = sum(len(v) for v in spec.values())
    h, i, e = tiny_cfg.hidden_size, tiny_cfg.moe_intermediate_size, tiny_cfg.num_experts
    slots = n * 3 * h * i  # fp8 w13 + w2 of the reloaded experts
    small = len(spec) * 4 * (2 * e + e + 4 * e)  # per layer: scales, input scales, buffers
    assert report.backup_bytes <= slots + small < model_bytes / 5
    assert "staged" in report.summary()


def test_device_backup_gives_the_same_rollback(ckpts, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, proc.FixedFp8MoEMethod, "process_weights_after_loading", 1, DEVICE_FAULT,
          model, before)
    with pytest.raises(fr.CommitError):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], backup="device")
    assert unchanged(model, before) == []
    with pytest.raises(ValueError, match="backup must be one of"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], backup="disk")


# ==========================================================================
# Concurrency
# ==========================================================================

class Gate:
    """Pauses the `at`-th call of `owner.attr` (after running it) until opened."""

    def __init__(self, monkeypatch, owner, attr, at=1):
        self.reached, self.open = threading.Event(), threading.Event()
        self.calls = 0
        orig = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.calls += 1
            if self.calls == at:
                self.reached.set()
                assert self.open.wait(WAIT), "gate never opened"
            return out

        monkeypatch.setattr(owner, attr, wrapper)


def _thread(fn, *args):
    result = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


@pytest.fixture(scope="module")
def outputs(ckpts, tiny_cfg):
    """outputs(device): input and forward outputs of fresh seed-0 and seed-1 fp8 models."""
    cache = {}

    def get(device="cpu"):
        if device not in cache:
            x = tokens(tiny_cfg).to(device)
            cache[device] = (x, fr.load_model(ckpts["fp8", 0], device=device)(x),
                             fr.load_model(ckpts["fp8", 1], device=device)(x))
        return cache[device]
    return get


@pytest.mark.parametrize("device", DEVICES)
def test_forward_waits_for_a_commit_and_never_sees_a_half_written_model(ckpts, outputs, monkeypatch,
                                                                       device):
    x, y0, y1 = outputs(device)
    model = fr.load_model(ckpts["fp8", 0], device=device)
    gate = Gate(monkeypatch, FusedMoE, "_load_into_slot", at=40)  # mid-commit
    reload_t, reload_r = _thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    assert gate.reached.wait(WAIT)

    # The control: the model *is* half-written now, and a forward that bypassed the
    # lock would return a mix of old and new weights.
    torn = model.model(x)
    assert not torch.equal(torn, y0) and not torch.equal(torn, y1)

    fwd_t, fwd_r = _thread(model, x)
    fwd_t.join(0.3)
    assert fwd_t.is_alive(), "a forward ran while weights were being written"
    gate.open.set()
    reload_t.join(WAIT)
    fwd_t.join(WAIT)
    assert "error" not in reload_r and "error" not in fwd_r
    assert torch.equal(fwd_r["value"], y1)


def test_forwards_keep_running_while_a_reload_reads_the_checkpoint(ckpts, outputs, monkeypatch):
    """Why a reader/writer rule: staging (disk reads, often most of a reload) does not
    stall serving; only the in-place commit does."""
    x, y0, y1 = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    reached, release = threading.Event(), threading.Event()
    orig = Checkpoint.read

    def slow_read(self, names, stats=None, into=None):
        for i, item in enumerate(orig(self, names, stats, into=into)):
            if i == 1:
                reached.set()
                assert release.wait(WAIT)
            yield item

    monkeypatch.setattr(Checkpoint, "read", slow_read)
    reload_t, reload_r = _thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    assert reached.wait(WAIT)
    fwd_t, fwd_r = _thread(model, x)
    fwd_t.join(WAIT)
    assert not fwd_t.is_alive() and torch.equal(fwd_r["value"], y0)
    release.set()
    reload_t.join(WAIT)
    assert "error" not in reload_r
    assert torch.equal(model(x), y1)


def test_a_waiting_reload_is_not_starved_by_new_forwards(ckpts, outputs, monkeypatch):
    """Writer preference: once a commit waits, forwards that arrive later queue behind it."""
    x, y0, y1 = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    inside, leave = threading.Event(), threading.Event()

    def hold(module, args, out):
        if threading.current_thread().name == "slow-forward":
            inside.set()
            assert leave.wait(WAIT)

    model.model.register_forward_hook(hold)
    slow = threading.Thread(target=model, args=(x,), name="slow-forward", daemon=True)
    slow.start()
    assert inside.wait(WAIT)
    reload_t, reload_r = _thread(fr.update_weights_from_disk, model, ckpts["fp8", 1])
    deadline = time.monotonic() + WAIT
    while model.weights_lock._writers_waiting == 0:  # the commit is queued
        assert time.monotonic() < deadline
        time.sleep(0.005)
    late_t, late_r = _thread(model, x)
    late_t.join(0.2)
    assert late_t.is_alive(), "a new forward overtook the waiting reload"
    leave.set()
    for t in (slow, reload_t, late_t):
        t.join(WAIT)
    assert "error" not in reload_r
    assert torch.equal(late_r["value"], y1)


def test_two_reloads_serialize(ckpts, tmp_path, monkeypatch):
    model = fr.load_model(ckpts["fp8", 0])
    order = []
    orig = FusedMoE._load_into_slot

    def traced(self, *args, **kwargs):
        order.append(threading.current_thread().name)
        time.sleep(0.001)  # widen the window for interleaving
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(FusedMoE, "_load_into_slot", traced)
    start = threading.Barrier(2)
    specs = {"A": {1: [0, 1, 2]}, "B": {2: [3, 4, 5]}}

    def reload(spec):
        start.wait(WAIT)
        return fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(spec))

    threads = [threading.Thread(target=reload, args=(specs[n],), name=n, daemon=True) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert sorted(runs) == ["A", "B"], f"commits interleaved: {runs}"
    chosen = {(layer, e) for spec in specs.values() for layer, es in spec.items() for e in es}
    mixed = mix_checkpoints(ckpts["fp8", 0], ckpts["fp8", 1], tmp_path / "mixed",
                            lambda n: expert_key(n) in chosen)
    assert fr.compare_states(fr.snapshot(fr.load_model(mixed)), fr.snapshot(model)) == []


@pytest.mark.parametrize("device", DEVICES)
def test_many_forwards_during_many_reloads_see_old_or_new_never_a_mix(ckpts, outputs, monkeypatch,
                                                                     device):
    x, y0, y1 = outputs(device)
    model = fr.load_model(ckpts["fp8", 0], device=device)
    orig = FusedMoE._load_into_slot

    def slow(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        time.sleep(0.0002)  # let forwards queue up against the commit
        return out

    monkeypatch.setattr(FusedMoE, "_load_into_slot", slow)
    stop = threading.Event()
    seen = {"old": 0, "new": 0, "mixed": 0}
    reloading = threading.Event()
    during = [0]

    def forwards():
        while not stop.is_set():
            issued_during = reloading.is_set()
            y = model(x)
            key = "old" if torch.equal(y, y0) else "new" if torch.equal(y, y1) else "mixed"
            seen[key] += 1
            during[0] += issued_during

    workers = [threading.Thread(target=forwards, daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        for i in range(8):
            reloading.set()
            fr.update_weights_from_disk(model, ckpts["fp8", (i + 1) % 2])
            reloading.clear()
            time.sleep(0.01)
    finally:
        stop.set()
        for w in workers:
            w.join(WAIT)
    assert seen["mixed"] == 0, seen
    assert during[0] > 0 and seen["old"] > 0 and seen["new"] > 0, (seen, during)


def test_a_reload_from_inside_a_forward_is_refused_not_deadlocked(ckpts, outputs):
    x, y0, _ = outputs()
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    errors = []

    def reload_hook(module, args, out):
        try:
            fr.update_weights_from_disk(model, ckpts["fp8", 1])
        except fr.ReloadError as e:
            errors.append(e)

    handle = model.model.register_forward_hook(reload_hook)
    t, r = _thread(model, x)
    t.join(WAIT)
    handle.remove()
    assert not t.is_alive(), "deadlocked"
    assert len(errors) == 1 and "inside a forward" in str(errors[0])
    assert unchanged(model, before) == []
