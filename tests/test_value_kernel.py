"""The one-launch value check (`kernels.triton.value_check`) flags exactly the tensors the
torch reductions flag (`checkpoint.values.invalid_flags(..., kernel=False)`).

On CPU the kernel runs in Triton's interpreter, called with CPU tensors; on a GPU it
runs compiled on CUDA copies of the same tensors.

* property (hypothesis): random tensors of every checked dtype, sizes around the
  kernel's block, NaN / inf / 0x7f / 0xff / 0x7c / 0xfc / negative / zero / -0.0 /
  subnormal planted at random places, under weight and scale names;
* empty tensors, tensors of many blocks, a program spanning several blocks, many
  tensors of different sizes, tensors not 16-byte aligned;
* `ValueCheck` with the kernel: the same first invalid tensor and the same message;
* the kernel compiles for sm90 (offline, Triton's ptxas) with 16-byte vector loads.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8_reload.checkpoint.values import FP8_NONFINITE, ValueCheck, invalid_flags

from .bad_checkpoints import random_finite_fp8

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
from fp8_reload.kernels.triton import value_check  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = value_check.BLOCK
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]
SIZES = [0, 1, 2, 7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3]
FP8_BYTES = [0x7F, 0xFF, 0x7C, 0xFC, 0x7E, 0x7B, 0xFB, 0x80, 0x00, 0x01]
FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, -1e-30, 1e-40, 3e38]


def positive(name: str, t: torch.Tensor) -> bool:
    """What `checkpoint.values` asks of a tensor: scales (not FP8 ones) must be > 0."""
    return name.endswith("_scale") and t.dtype not in FP8_NONFINITE


def torch_flags(named) -> dict[str, bool]:
    names, flags = invalid_flags(named, kernel=False)
    return dict(zip(names, map(bool, flags.tolist())))


def kernel_flags(named) -> dict[str, bool]:
    """`value_flags_` on the tensors the torch path checks (not empty, floating) that the
    kernel takes (whole aligned words; the others go through torch: `invalid_flags`)."""
    named = [(n, t.to(DEVICE)) for n, t in named if t.numel() and t.is_floating_point()]
    named = [(n, t) for n, t in named if value_check.supported(t, positive(n, t))]
    if not named:
        return {}
    flags = value_check.value_flags_([t for _, t in named], [positive(n, t) for n, t in named])
    return {n: bool(f) for (n, _), f in zip(named, flags.tolist())}


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.sampled_from(SIZES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype in FP8_NONFINITE:  # random finite bytes (non-finite ones planted below)
        t = random_finite_fp8(n, g, dtype)
    else:  # positive, so that a scale is valid until something is planted
        t = (torch.rand(n, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e4])) + 1e-3).to(dtype)
    for _ in range(draw(st.integers(0, 3)) if n else 0):
        i = draw(st.one_of(st.integers(0, n - 1), st.sampled_from([0, n - 1, min(n - 1, BLOCK)])))
        if dtype in FP8_NONFINITE:
            t.view(torch.uint8)[i] = draw(st.sampled_from(FP8_BYTES))
        else:
            t[i] = draw(st.sampled_from(FLOATS if dtype != torch.float16 else FLOATS[:-1] + [6e4]))
    name = draw(st.sampled_from(["w.weight", "w.weight_scale", "w.input_scale", "norm.weight"]))
    return name, t


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(items=st.lists(tensors(), min_size=1, max_size=6))
def test_the_kernel_flags_what_the_torch_path_flags(items):
    named = [(f"{i}.{name}", t) for i, (name, t) in enumerate(items)]
    want = torch_flags(named)
    got = kernel_flags(named)
    assert got == {n: want[n] for n in got}, [(n, t.dtype, t.numel()) for n, t in named]
    names, flags = invalid_flags([(n, t.to(DEVICE)) for n, t in named], kernel=True)
    assert dict(zip(names, map(bool, flags.tolist()))) == want


def test_empty_tensors_and_an_empty_list():
    assert value_check.value_flags_([], []).numel() == 0
    named = [("a.weight", torch.zeros(0, dtype=torch.bfloat16)), ("b.weight_scale", torch.zeros(0)),
             ("c.weight", torch.full((3,), float("nan")))]
    flags = value_check.value_flags_([t.to(DEVICE) for _, t in named], [False, True, False])
    assert flags.tolist() == [0, 0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 1, 3, -1, 0.5, 1.5, 3.25, 4.75])  # in blocks; -1: the last value
@pytest.mark.parametrize("lane", [0, 1, 2, 3])  # the value's place in its 32-bit word
def test_one_bad_value_anywhere_in_a_tensor_of_many_blocks(dtype, where, lane):
    per_block = BLOCK * 4 // dtype.itemsize  # BLOCK counts 32-bit words
    lane %= 4 // dtype.itemsize
    where = 5 * per_block - 1 if where == -1 else int(where * per_block) // 4 * 4 + lane
    t = torch.ones(5 * per_block, dtype=torch.float32).to(dtype)
    t.view(torch.uint8 if dtype.itemsize == 1 else torch.int16 if dtype.itemsize == 2
           else torch.int32)[where] = {1: 0x7F if dtype == torch.float8_e4m3fn else 0x7C,
                                       2: 0x7F80 if dtype == torch.bfloat16 else 0x7C00,
                                       4: 0x7F800000}[dtype.itemsize]
    clean = torch.ones(5 * per_block, dtype=torch.float32).to(dtype)
    assert value_check.value_flags_([clean.to(DEVICE), t.to(DEVICE)], [False, False]).tolist() == [0, 1]


def test_programs_of_several_blocks(monkeypatch):
    """A batch larger than MAX_PROGRAMS blocks: each program walks several blocks."""
    monkeypatch.setattr(value_check, "MAX_PROGRAMS", 3)
    ts = [torch.ones(n) for n in (1, 3 * BLOCK + 1, 7 * BLOCK, 2)]
    ts[1][3 * BLOCK] = float("nan")  # the last, partial block of a program's last block
    ts[2][6 * BLOCK + 17] = -1.0  # only bad for a scale
    assert value_check.value_flags_([t.to(DEVICE) for t in ts], [False] * 4).tolist() == [0, 1, 0, 0]
    assert value_check.value_flags_([t.to(DEVICE) for t in ts], [True] * 4).tolist() == [0, 1, 1, 0]


def test_many_tensors_of_different_sizes_and_alignments():
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(40 * BLOCK, generator=g) + 0.5).to(DEVICE)
    named, start = [], 1  # views at odd element offsets: not 16-byte aligned
    for i in range(150):
        n = int(torch.randint(0, 3 * BLOCK if i % 10 == 0 else 40, (), generator=g))
        named.append((f"{i}.weight_scale" if i % 3 else f"{i}.weight", base[start:start + n]))
        start += n + 1
    for i in (4, 50, 51, 120):
        t = named[i][1]
        if t.numel():
            t[-1] = [float("nan"), -2.0, 0.0, float("-inf")][i % 4]
    assert {n for n, f in kernel_flags(named).items() if f} == {n for n, f in torch_flags(named).items() if f}


def test_what_the_kernel_does_not_take_goes_through_torch():
    """float64, non-contiguous tensors, bytes that are not whole aligned 32-bit words and
    scales that are not float32 are checked by torch inside the kernel path."""
    assert not value_check.supported(torch.ones(3, dtype=torch.float64))
    assert not value_check.supported(torch.ones(4, 4).t())
    assert not value_check.supported(torch.ones(3, dtype=torch.bfloat16))  # 6 bytes
    assert not value_check.supported(torch.ones(9, dtype=torch.bfloat16)[1:5])  # 2-byte aligned
    assert not value_check.supported(torch.ones(4, dtype=torch.bfloat16), positive=True)
    assert value_check.supported(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="value_flags_"):
        value_check.value_flags_([torch.ones(3, dtype=torch.float64)], [False])
    strided = torch.ones(4, 4)
    strided[3, 0] = float("nan")
    named = [("a.weight", strided.t()), ("b.weight_scale", torch.tensor([1e-320], dtype=torch.float64)),
             ("c.weight", torch.ones(3, dtype=torch.int64)), ("d.weight", torch.ones(5)),
             ("e.weight", torch.tensor([1.0, float("inf"), 1.0], dtype=torch.bfloat16)),
             ("f.weight_scale", torch.tensor([0.5, -0.5], dtype=torch.bfloat16))]
    names, flags = invalid_flags([(n, t.to(DEVICE)) for n, t in named], kernel=True)
    assert dict(zip(names, map(bool, flags.tolist()))) == {
        "d.weight": False, "a.weight": True, "b.weight_scale": True, "e.weight": True,
        "f.weight_scale": True}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(items=st.lists(tensors(), min_size=1, max_size=6), copy=st.booleans(),
       batch=st.sampled_from([1, 4096, 1 << 20]))
def test_value_check_with_the_kernel_finds_what_torch_finds(items, copy, batch):
    named = [(f"{i}.{name}", t) for i, (name, t) in enumerate(items)]
    found = []
    for kernel in (False, True):
        check = ValueCheck(DEVICE, batch_bytes=batch, copy=copy, kernel=kernel)
        for n, t in named:
            check.add(n, t)
        found.append(check.first_invalid())
    assert found[0] == found[1]


def test_the_kernel_compiles_for_sm90_with_vector_loads():
    """Compiled offline (no GPU needed: Triton's own ptxas) for the H200: whole blocks of
    aligned tensors load as 16-byte vectors. Skipped where this Triton cannot compile."""
    import os
    import re
    import subprocess
    import sys

    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from fp8_reload.kernels.triton import value_check as vc\n"
        "src = ASTSource(fn=vc._value_check_kernel, signature={'table_ptr': '*i64', 'flag_ptr': '*i64',\n"
        "                'n': 'i32',\n"
        "                'span': 'i32', 'BLOCK': 'constexpr'}, constexprs={'BLOCK': vc.BLOCK},\n"
        "                attrs={(0,): [['tt.divisibility', 16]]})\n"
        "print(triton.compile(src, target=GPUTarget('cuda', 90, 32)).asm['ptx'])\n")
    # a process of its own: triton imported before the kernels, so not in interpreter mode
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    if done.returncode != 0:
        if "CompilationError" in done.stderr:
            pytest.fail(done.stderr[-3000:])
        pytest.skip(f"cannot compile for sm90 here: {done.stderr.strip().splitlines()[-1:]}")
    loads = set(re.findall(r"ld\.global[\w.]*", done.stdout))
    assert "ld.global.v4.b32" in loads, loads


@pytest.mark.parametrize("spelled", ["exact", "bare"])
def test_tensors_already_on_the_device_are_checked_where_they_are(monkeypatch, spelled):
    """With the kernel, tensors on the check's device are neither counted towards a batch
    nor copied, however the device is spelled ("cuda" for tensors on "cuda:0", "cpu:0"
    for "cpu"): a resident checkpoint is one launch, no copy."""
    import fp8_reload.checkpoint.values as values

    device = {"exact": DEVICE, "bare": "cuda" if DEVICE == "cuda" else "cpu:0"}[spelled]
    copies, launches = [], []
    real_runs, real_flags = values._contiguous_runs, value_check.value_flags_
    monkeypatch.setattr(values, "_contiguous_runs", lambda batch: copies.append(batch) or real_runs(batch))
    monkeypatch.setattr(value_check, "value_flags_",
                        lambda *a: launches.append(a) or real_flags(*a))
    named = [(f"{i}.weight", torch.ones(1024).to(DEVICE)) for i in range(6)]
    named[4][1][7] = float("nan")
    check = ValueCheck(device, batch_bytes=1024, kernel=True)  # every tensor fills a batch
    for n, t in named:
        check.add(n, t)
    assert check.first_invalid()[0] == "4.weight"
    assert copies == [] and len(launches) == 1


def test_kept_tables_read_live_memory_and_follow_rebinds(monkeypatch):
    """The streaming reload keeps the kernel's table of its landed views (`KeptTables`): a
    kept table reads the tensors' memory as it is now (a value planted after the table
    was built is found), a tensor moved to other memory or resized gets a new table, a
    list the kernel cannot take goes through torch (in order, nothing kept), and
    `release` drops every table."""
    import fp8_reload.checkpoint.values as values

    monkeypatch.setattr(values, "_kernel_module", lambda kernel, tensors: value_check)  # CPU: interpreter
    tables = values.KeptTables()
    ts = [torch.ones(1000 + 8 * i).to(DEVICE) for i in range(4)]
    assert values.nonfinite_flags(ts, tables).tolist() == [0, 0, 0, 0]
    ts[2][5] = float("nan")
    assert values.nonfinite_flags(ts, tables).tolist() == [0, 0, 1, 0]
    assert len(tables.tables) == 1  # the same table, read again
    ts[1].data = torch.full((64,), float("inf")).to(DEVICE)  # other memory, another size
    assert values.nonfinite_flags(ts, tables).tolist() == [0, 1, 1, 0]
    assert len(tables.tables) == 2
    odd = ts + [torch.tensor([1.0, float("nan"), 1.0], dtype=torch.bfloat16).to(DEVICE)]  # 6 bytes
    assert [bool(f) for f in values.nonfinite_flags(odd, tables).tolist()] == [False, True, True, False, True]
    assert len(tables.tables) == 2
    base = torch.zeros(4, 8, dtype=torch.bfloat16).to(DEVICE)  # helper 11's case: a strided
    assert not values.nonfinite_flags([base[:2].reshape(-1)], tables).any()  # tensor of the same
    base[3, 0] = float("nan")  # address, size and dtype as a kept contiguous one gets its own check
    assert values.nonfinite_flags([base[:, :4]], tables).tolist() == [True]
    tables.release()
    assert tables.tables == {}
