"""Reliability: whatever goes wrong, the model stays exactly as it was.

* the bad-checkpoint corpus (`bad_checkpoints.CASES`): right error class, a
  message naming the file/tensor, model bit-identical (bytes, Parameter objects,
  loader attributes) and forward output unchanged; no code from the checkpoint
  ever runs (armed pickle traps never fire, no unpickler global, no eval);
* fault injection in the middle of commit and of post-processing, both
  checkpoint kinds, fixed and upstream modes, device errors and Ctrl-C;
* memory: staged and backup bytes are bounded by the reload.
"""

from __future__ import annotations

import ast
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import fp8_reload as fr
import fp8_reload.layers.model as layers  # (where load_weights finds default_weight_loader)
import fp8_reload.processing as proc
import fp8_reload.processing.moe as moe_processing
import fp8_reload.reload.backup as backup_mod
import fp8_reload.reload.chunks as chunks_mod
import fp8_reload.reload.stream as stream_mod
import fp8_reload.reload.targets as targets_mod
import fp8_reload.reload.to_device as to_device
import fp8_reload.reload.transaction as transaction_mod
from fp8_reload.checkpoint import Checkpoint
from fp8_reload.layers import FusedMoE, expert_of
from fp8_reload.reload.chunks import Chunk

from . import bad_checkpoints as bad
from .conftest import (
    CUDA,
    DEVICES,
    WAIT,
    WRITE_POINT,
    copy_checkpoint,
    fail_if_hangs,
    mix_checkpoints,
    tokens,
    unchanged,
)

KINDS = ["fp8", "bf16"]


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
    with fail_if_hangs(WAIT), bad.watch() as code_run, pytest.raises(fr.ReloadError) as info:
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
    with fail_if_hangs(WAIT), bad.watch() as code_run, pytest.raises(case.error):
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


def test_out_of_memory_while_staging_is_a_reload_error_and_writes_nothing(ckpts, monkeypatch, engine):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    orig = Checkpoint.read

    def read_then_oom(self, names, stats=None, into=None):
        for i, item in enumerate(orig(self, names, stats, into=into)):
            if i == 5:
                raise MemoryError("host out of memory")
            yield item

    def scales_then_oom(*args, **kwargs):
        raise MemoryError("host out of memory")

    if engine == "staged":
        monkeypatch.setattr(Checkpoint, "read", read_then_oom)
    else:  # what the streaming engine reads before the lock: the scales
        monkeypatch.setattr(stream_mod, "read_scalars", scales_then_oom)
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
                if torch.cuda.is_available():  # what was queued so far has run
                    torch.cuda.synchronize()
                staged = any(getattr(m, "staged", None) for m in model.modules())
                self.dirty = staged or fr.compare_states(before, fr.snapshot(model), identity=True) != []
            raise self.exc

        monkeypatch.setattr(owner, attr, wrapper)


DEVICE_FAULT = RuntimeError("CUDA error: an illegal memory access was encountered")
FILTERED = {1: [0, 3], 2: [5]}

# (name, owner, attribute, at which call): points inside commit ...
COMMIT_POINTS = [
    ("stream-copy", Chunk, "offset_of", 4),  # the streaming engine (default)
    ("expert-loader", FusedMoE, "_load_into_slot", 4),  # the staged engine's loaders
    ("stream-quant", to_device, "_quantize_chunk", 2),  # bf16 experts quantized in the stream (GPU)
    ("linear-loader", proc.FixedFp8LinearMethod, "load_linear", 3),
    # bf16 linears quantized where they land (GPU), or in post-processing (CPU)
    ("linear-quant", proc.FixedFp8LinearMethod, "quantize_shards_", 3),
]
# ... and inside post-processing
PROCESS_POINTS = [
    ("moe-process", proc.FixedFp8MoEMethod, "process_weights_after_loading", 2),
    ("linear-process", proc.FixedFp8LinearMethod, "process_weights_after_loading", 3),
    ("requantize-kernel", moe_processing, "process_fp8_experts_", 1),
    ("quantize-kernel", moe_processing, "quantize_staged_experts_", 2),
]


@CUDA
def test_a_commit_failing_before_its_first_write_rolls_back(ckpts, monkeypatch):
    """A commit that fails before any write rolls back: the model as it was, and the next
    reload works. A first reload of new files queues the whole backup while its first
    reads run (`Backup.queue_all`), so here one backup may have started; a repeated
    reload starts it when the commit first asks for an event."""
    model = fr.load_model(ckpts["fp8", 0], device="cuda")
    before = fr.snapshot(model)
    started, real_start = [], backup_mod.Backup.start

    def start(self):
        started.append(self)
        real_start(self)

    def land(*a, **k):
        raise RuntimeError("injected before the first write")

    monkeypatch.setattr(backup_mod.Backup, "start", start)
    monkeypatch.setattr(to_device, "_write_out", land)
    with pytest.raises(fr.CommitError, match="injected before the first write"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert len(started) <= 1 and unchanged(model, before) == []
    monkeypatch.setattr(to_device, "_write_out", _REAL_WRITE_OUT)
    fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert 1 <= len(started) <= 2
    fresh = fr.load_model(ckpts["fp8", 1], device="cuda")
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []


_REAL_WRITE_OUT = to_device._write_out


def _expected_after(ckpts, kind, spec, tmp_path, device="cpu"):
    """Snapshot of a fresh load of what a successful reload from seed 1 gives."""
    if spec is None:
        return fr.snapshot(fr.load_model(ckpts[kind, 1], device=device))
    chosen = {(layer, e) for layer, es in spec.items() for e in es}
    mixed = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed",
                            lambda n: expert_of(n) in chosen)
    return fr.snapshot(fr.load_model(mixed, device=device))


def _fault_cases():
    out = []
    for name, owner, attr, at in COMMIT_POINTS + PROCESS_POINTS:
        for kind in KINDS:
            for spec_name, spec in (("full", None), ("filtered", FILTERED)):
                if name == "requantize-kernel" and kind == "bf16":
                    continue  # the FP8-checkpoint path only
                if name in ("quantize-kernel", "stream-quant", "linear-quant") and kind == "fp8":
                    continue  # the quantize-on-load path only
                if name.startswith("linear") and spec is not None:
                    continue  # the filter holds experts only
                if name == "stream-copy" and kind == "bf16" and spec is not None:
                    continue  # bf16 experts are quantized on load: no plain copy to fault
                out.append(pytest.param(owner, attr, at, kind, spec, id=f"{name}-{kind}-{spec_name}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("owner,attr,at,kind,spec", _fault_cases())
def test_fault_mid_commit_or_processing_rolls_back(ckpts, tiny_cfg, tmp_path, monkeypatch,
                                                   owner, attr, at, kind, spec, device):
    if attr in ("_load_into_slot", "load_linear") and kind == "fp8":
        # FP8 tensors take a loader only in the staged engine (bf16 ones, quantized on
        # load, take theirs on CPU in both)
        monkeypatch.setattr(transaction_mod, "ENGINE", "staged")
    if attr == "_quantize_chunk" and device != "cuda":
        pytest.skip("bf16 experts are quantized in the stream on a GPU only (on CPU: their loaders)")
    if attr == "_load_into_slot" and kind == "bf16" and device == "cuda":
        monkeypatch.setattr(targets_mod, "STREAM_QUANT", ())  # (FP8_RELOAD_STREAM_QUANT=0)
    if attr == "load_linear" and kind == "bf16" and device == "cuda":  # (on a GPU they stream)
        monkeypatch.setattr(targets_mod, "STREAM_QUANT", ("experts",))  # (FP8_RELOAD_STREAM_QUANT=experts)
    if attr in ("offset_of", "_quantize_chunk") and device == "cuda":
        # on a GPU a chunk's tensors are written together (one scatter): fault the landing
        # of the second of many small chunks, the first one written
        if attr == "offset_of":
            owner, attr, at = to_device, "_write_out", 2
        monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 4096)
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
def test_keyboard_interrupt_mid_reload_restores_and_propagates(ckpts, monkeypatch, kind, where, engine):
    model = fr.load_model(ckpts[kind, 0])
    before = fr.snapshot(model)
    owner, attr = (WRITE_POINT[engine] if where == "commit"
                   else (proc.FixedFp8MoEMethod, "process_weights_after_loading"))
    fault = Fault(monkeypatch, owner, attr, 2, KeyboardInterrupt(), model, before)
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, ckpts[kind, 1])
    assert fault.dirty
    assert unchanged(model, before) == []


def test_ctrl_c_during_restore_is_deferred_until_the_model_is_whole(ckpts, monkeypatch, engine):
    """A real SIGINT arriving while the backup is restored does not cut the restore short."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, *WRITE_POINT[engine], 20, DEVICE_FAULT, model, before)
    progress = []
    _restore_with_sigint(monkeypatch, progress)  # defined with the handler tests below
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


def test_failed_rollback_is_reported_and_only_a_full_reload_repairs(ckpts, tmp_path, monkeypatch, engine):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, *WRITE_POINT[engine], 5, DEVICE_FAULT, model, before)
    Fault(monkeypatch, backup_mod, "index_copy_", 1, RuntimeError("device lost"), model, before)
    waited, real = [], backup_mod.synchronize
    monkeypatch.setattr(backup_mod, "synchronize", lambda m: (waited.append(m), real(m)))
    with pytest.raises(fr.RollbackError, match="restoring the backup failed too"):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(FILTERED))
    monkeypatch.undo()
    assert model.weights_undefined
    assert waited == [model]  # (review, helper 34) what was queued finished before the shards go
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
def test_staged_and_backup_bytes_are_bounded_by_the_reload(ckpts, tiny_cfg, kind, spec, engine):
    path = ckpts[kind, 0]
    ckpt = fr.Checkpoint(path)
    model = fr.load_model(path)
    flt = None if spec is None else fr.generate_weight_name_filter(spec)
    report = fr.update_weights_from_disk(model, path, flt)
    selected = [n for n in ckpt.names if flt is None or flt(n)]
    assert report.bytes_read == sum(ckpt.info(n).nbytes for n in selected)
    if engine == "staged":
        assert report.staged_bytes == report.bytes_read
    else:  # only what takes a Python loader is staged (on CPU: bf16 experts); the rest streams
        assert report.staged_bytes <= report.bytes_read
        assert kind == "bf16" or report.staged_bytes < report.bytes_read
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


# ---------------------------------------------------------------- Ctrl-C during a restore
# goes to whatever handler was installed before

def _restore_with_sigint(monkeypatch, progress):
    orig = backup_mod.Backup.restore

    def restore(self):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode boundary
        time.sleep(0.01)
        orig(self)
        progress.append("restored")

    monkeypatch.setattr(backup_mod.Backup, "restore", restore)


@pytest.fixture
def sigint_handler():
    """Install a SIGINT handler for the test; the previous one is put back after."""
    old = signal.getsignal(signal.SIGINT)
    yield lambda h: signal.signal(signal.SIGINT, h)
    signal.signal(signal.SIGINT, old)


class AppInterrupt(Exception):
    pass


@pytest.mark.parametrize("previous", ["ignored", "app-handler", "app-handler-raises"])
def test_ctrl_c_during_restore_goes_to_the_previous_handler(ckpts, monkeypatch, sigint_handler,
                                                            previous, engine):
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, *WRITE_POINT[engine], 20, DEVICE_FAULT, model, before)
    progress: list = []
    _restore_with_sigint(monkeypatch, progress)

    def app_handler(signum, frame):
        progress.append(("handler", signum, frame is not None))
        if previous == "app-handler-raises":
            raise AppInterrupt("the application's own Ctrl-C")

    handler = signal.SIG_IGN if previous == "ignored" else app_handler
    sigint_handler(handler)
    expected = {"ignored": fr.CommitError, "app-handler": fr.CommitError,
                "app-handler-raises": AppInterrupt}[previous]
    with pytest.raises(expected):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    if previous == "ignored":
        assert progress == ["restored"]
    else:  # called once, after the restore, with (SIGINT, a frame)
        assert progress == ["restored", ("handler", signal.SIGINT, True)]
    assert signal.getsignal(signal.SIGINT) is handler
    assert unchanged(model, before) == []


def test_a_handler_not_installed_from_python_is_left_alone(ckpts, monkeypatch, engine):
    """`signal.getsignal` returns None for a handler installed outside Python: it could
    not be put back once replaced, so the restore installs nothing at all."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, *WRITE_POINT[engine], 20, DEVICE_FAULT, model, before)
    installed = []
    real_signal, real_getsignal = signal.signal, signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGINT else real_getsignal(s))
    monkeypatch.setattr(signal, "signal", lambda s, h: installed.append((s, h)) or real_signal(s, h))
    with pytest.raises(fr.CommitError):
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    assert [s for s, _ in installed] == [] and unchanged(model, before) == []


_SIG_DFL_CHILD = r"""
import os, signal, sys, time
import fp8_reload as fr
import fp8_reload.reload.backup as backup_mod
from fp8_reload.layers import FusedMoE
model = fr.load_model(sys.argv[1])
calls = [0]
load = FusedMoE._load_into_slot
def failing(self, *a, **k):
    calls[0] += 1
    load(self, *a, **k)
    if calls[0] == 20:
        raise RuntimeError("device fault")
FusedMoE._load_into_slot = failing
restore = backup_mod.Backup.restore
def restore_with_sigint(self):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
    restore(self)
    print("restored", flush=True)
backup_mod.Backup.restore = restore_with_sigint
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    fr.update_weights_from_disk(model, sys.argv[2])
finally:
    print("still running after the restore", flush=True)
"""


def test_ctrl_c_under_sig_dfl_ends_the_process_after_the_restore(ckpts):
    """SIG_DFL means: Ctrl-C terminates the process. It still does, once the model is whole."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "FP8_RELOAD_ENGINE": "staged"}  # its loaders fault
    proc = subprocess.run([sys.executable, "-c", _SIG_DFL_CHILD, str(ckpts["fp8", 0]),
                           str(ckpts["fp8", 1])], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.splitlines() == ["restored"], proc.stdout


def test_ctrl_c_during_a_failing_restore_still_marks_the_model(ckpts, monkeypatch, engine):
    """The restore fails and Ctrl-C arrives meanwhile: KeyboardInterrupt reaches the
    caller, and the model is marked undefined first (only a full reload is accepted)."""
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    Fault(monkeypatch, *WRITE_POINT[engine], 5, DEVICE_FAULT, model, before)
    Fault(monkeypatch, backup_mod, "index_copy_", 1, RuntimeError("device lost"), model, before)
    _restore_with_sigint(monkeypatch, [])
    with pytest.raises(KeyboardInterrupt):
        fr.update_weights_from_disk(model, ckpts["fp8", 1], fr.generate_weight_name_filter(FILTERED))
    assert model.weights_undefined and "restoring the backup failed too" in model.weights_undefined
    monkeypatch.undo()
    with pytest.raises(fr.RollbackError, match="only a full reload"):
        fr.update_weights_from_disk(model, ckpts["fp8", 0], fr.generate_weight_name_filter({1: [0]}))
