"""Weight values: the batched check flags exactly the tensors an elementwise
reference flags, on CPU and on the GPU, and a reload refuses them before writing.

* property (hypothesis): for random tensors of every checked dtype, with random
  special values and bytes planted anywhere, `invalid_flags` and `ValueCheck`
  (with and without the packing into one buffer that a GPU reload uses) agree
  with an elementwise reference, and the message names the first bad element;
* end to end (hypothesis): random bytes written into a real shard's tensor data;
  the reload raises `InvalidTensorError` exactly when the reference finds an
  invalid value among the tensors it reads, else succeeds like a fresh load;
* each tensor is read from disk once (the check works on the staged bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fp8_reload as fr
from fp8_reload.checkpoint import INDEX_FILE, PinnedArena, staging
from fp8_reload.checkpoint.values import (
    FP8_NONFINITE,
    ValueCheck,
    check_values,
    describe_invalid,
    invalid_flags,
)

from .bad_checkpoints import random_finite_fp8
from .conftest import Hang, time_limit

SCALE = float(os.environ.get("FP8_RELOAD_FUZZ_SCALE", "1"))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]


def reference_bad(name: str, t: torch.Tensor) -> bool:
    """Elementwise, through float32 (slow, obviously right)."""
    if t.numel() == 0 or not t.is_floating_point():
        return False
    f = t.float()
    if name.endswith("_scale") and t.dtype not in FP8_NONFINITE:
        return not bool((torch.isfinite(f) & (f > 0)).all())
    return not bool(torch.isfinite(f).all())


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES + [torch.int64]))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype in FP8_NONFINITE:  # random finite bytes (non-finite ones planted below)
        t = random_finite_fp8(n, g, dtype)
    elif dtype == torch.int64:
        t = torch.randint(-9, 9, (n,), generator=g)
    else:
        t = (torch.randn(n, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e4]))).to(dtype)
    for _ in range(draw(st.integers(0, 2)) if n else 0):
        i = draw(st.integers(0, n - 1))
        if dtype in FP8_NONFINITE:
            t.view(torch.uint8)[i] = draw(st.sampled_from([0x7F, 0xFF, 0x7C, 0xFC, 0x7E, 0x80, 0]))
        elif dtype != torch.int64:
            t[i] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -1.0,
                                         3e38 if dtype != torch.float16 else 6e4]))
    name = draw(st.sampled_from(["w.weight", "w.weight_scale", "w.input_scale", "norm.weight"]))
    return name, t.reshape(shape)


@settings(max_examples=int(300 * SCALE), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(items=st.lists(tensors(), min_size=1, max_size=8), copy=st.booleans(),
       batch=st.sampled_from([1, 64, 1 << 20]))
def test_batched_check_agrees_with_the_elementwise_reference(items, copy, batch):
    named = [(f"{i}.{name}", t) for i, (name, t) in enumerate(items)]
    want = {n for n, t in named if reference_bad(n, t)}
    names, flags = invalid_flags(named)
    assert {n for n, f in zip(names, flags.tolist()) if f} == want
    # staged the way a GPU reload stages them: slices of one arena, packed into one buffer
    arena = PinnedArena(pin=False)
    arena.reset(sum(staging.aligned(t.numel() * t.element_size()) for _, t in named))
    staged = []
    for n, t in named:
        dst = staging.typed_slice(arena, t.dtype, t.shape)
        dst.copy_(t)
        staged.append((n, dst))
    check = ValueCheck("cpu", batch_bytes=batch, copy=copy)
    for n, t in staged:
        check.add(n, t)
    found = check.first_invalid()
    if not want:
        assert found is None
        return
    first = min(want, key=[n for n, _ in named].index)
    assert found is not None and found[0] == first
    assert found[1] == describe_invalid(first, dict(named)[first])
    with pytest.raises(fr.InvalidTensorError, match=f"^file: tensor {first}: "):
        check_values(named, lambda n: f"file: tensor {n}")


def test_the_packed_copy_is_one_copy_per_arena_run():
    """A batch of arena slices is copied as one span (its views line up with the
    tensors), a batch of separate tensors one copy each."""
    arena = PinnedArena(pin=False)
    arena.reset(3 * 64)
    a, b = staging.typed_slice(arena, torch.bfloat16, (5,)), staging.typed_slice(arena, torch.float32, ())
    a.copy_(torch.arange(5.0)), b.fill_(2.0)
    check = ValueCheck("cpu", copy=True)
    out = check._on_device([("a", a), ("b", b), ("c", torch.ones(3))])
    assert [torch.equal(x, y) for (_, x), y in zip(out, (a, b, torch.ones(3)))] == [True] * 3
    assert out[0][1].untyped_storage().data_ptr() == check._buffer.untyped_storage().data_ptr()
    assert out[1][1].data_ptr() - out[0][1].data_ptr() == 64  # same offsets as in the arena


@CUDA
def test_the_check_runs_on_the_device_for_pinned_staging():
    pinned = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    t = pinned[:1000].view(torch.float8_e4m3fn)
    t.view(torch.uint8)[999] = 0x7F
    check = ValueCheck("cuda")
    check.add("x.weight", t)
    check._flush()
    names, flags = check._results[0]
    assert flags.device.type == "cuda" and check._buffer.device.type == "cuda"
    assert check.first_invalid()[0] == "x.weight"


# --------------------------------------------------------------------------
# End to end: random bytes in a real shard's tensor data
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_model(ckpts):
    model = fr.load_model(ckpts["fp8", 0])
    return model, fr.snapshot(model)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_each_tensor_is_read_once(ckpts, engine, kind):
    """The checks work on the bytes read for the reload: nothing is read twice."""
    model = fr.load_model(ckpts[kind, 0])
    report = fr.update_weights_from_disk(model, ckpts[kind, 1])
    assert report.bytes_read == fr.Checkpoint(ckpts[kind, 1]).total_bytes()
    if engine == "staged":
        assert report.staged_bytes == report.bytes_read


@settings(max_examples=int(60 * SCALE), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pokes=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(
           [0x7F, 0xFF, 0x7C, 0x80, 0x00, 0xFE, 0x3F])), min_size=1, max_size=6),
       which=st.integers(0, 3), full=st.booleans())
def test_random_bytes_in_tensor_data_end_to_end(ckpts, fp8_model, pokes, which, full):
    model, before = fp8_model
    good = ckpts["fp8", 1]
    wm = json.loads((good / INDEX_FILE).read_text())["weight_map"]
    shard = sorted(set(wm.values()))[which]
    raw = bytearray((good / shard).read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    start = 8 + hlen
    for where, value in pokes:
        raw[start + int(where * (len(raw) - start))] = value
    flt = None if full else fr.generate_weight_name_filter({1: [0, 5], 2: [3, 7]})
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ckpt"
        shutil.copytree(good, d)
        (d / shard).write_bytes(bytes(raw))
        read = load_file(str(d / shard))
        ckpt = fr.Checkpoint(d)
        selected = [n for n in ckpt.names if flt is None or flt(n)]  # whole experts already
        bad = [n for n in selected if n in read and reference_bad(n, read[n])]
        event("refused" if bad else "reloaded")  # both show in --hypothesis-show-statistics
        pre = fr.snapshot(model)
        try:
            with time_limit(20):
                fr.update_weights_from_disk(model, d, flt)
            outcome = None
        except fr.InvalidTensorError as e:
            outcome = e
        except Hang:
            pytest.fail("reload hung")
        if bad:
            assert outcome is not None and any(repr(n) in str(outcome) for n in bad), outcome
            assert fr.compare_states(pre, fr.snapshot(model), identity=True) == []
        else:
            assert outcome is None, outcome
            if full:
                assert fr.compare_states(fr.snapshot(fr.load_model(d)), fr.snapshot(model)) == []
    fr.update_weights_from_disk(model, ckpts["fp8", 0])  # back for the next example
    assert fr.compare_states(before, fr.snapshot(model)) == []


@CUDA
@pytest.mark.parametrize("case", ["fp8-nan-0x7f", "bf16-inf-weight", "nan-router"])
def test_a_gpu_reload_checks_values_on_the_device_before_writing(ckpts, tmp_path, monkeypatch, case):
    """On a GPU the staged engine's (pinned host) tensors are checked on the device, and an
    invalid value is refused before anything is written, as on CPU."""
    import fp8_reload.checkpoint.values as values
    import fp8_reload.reload.transaction as transaction_mod

    monkeypatch.setattr(transaction_mod, "ENGINE", "staged")

    from . import bad_checkpoints as bad

    spec = next(c for c in bad.CASES if c.name == case)
    kind = spec.kinds[0]
    path, mentions = spec.build(ckpts[kind, 1], tmp_path, kind, fr.MoEConfig.preset("tiny"))
    model = fr.load_model(ckpts[kind, 0], device="cuda")
    before = fr.snapshot(model)
    seen = set()
    real = values.invalid_flags

    def spy(named, *args):
        seen.update(t.device.type for _, t in named)
        return real(named, *args)

    monkeypatch.setattr(values, "invalid_flags", spy)
    with pytest.raises(fr.InvalidTensorError) as info:
        fr.update_weights_from_disk(model, path)
    assert seen == {"cuda"}, seen
    assert all(m in str(info.value) for m in mentions), info.value
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []
    fr.update_weights_from_disk(model, ckpts[kind, 1])
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts[kind, 1], device="cuda")),
                             fr.snapshot(model)) == []
