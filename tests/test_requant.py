"""The Triton post-processing kernels give the torch path's bytes.

On CPU the kernels run in Triton's interpreter (with its FP8 rounding emulated
exactly); on a GPU they run compiled and are compared with the torch path run on
CPU copies of the same tensors: the CPU torch path, the GPU torch path and the
kernels share one arithmetic (`quant.INV_FP8_MAX`, IEEE division where torch
divides two tensors), so all three agree bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fp8_reload.processing import ops
from fp8_reload.quant import FP8_DTYPE, quantize_static
from fp8_reload.testing import assert_bitwise_equal

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
from fp8_reload.kernels.triton import requant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_w13(e: int, inter: int, hidden: int, seed: int = 0):
    """[E, 2I, H] FP8 gate|up halves quantized with their own scales, and the [E, 2] scales:
    some experts with equal halves (nothing to move), tiny values that underflow."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, 2 * inter, hidden, generator=g) * torch.rand(e, 1, 1, generator=g) * 3
    w[:, :, :4] *= 1e-4  # values that round to (signed) zero after requantization
    s = torch.rand(e, 2, generator=g) * 2 + 0.05
    s[1, 1] = s[1, 0]
    q = torch.cat([quantize_static(w[:, :inter], s[:, 0, None, None]),
                   quantize_static(w[:, inter:], s[:, 1, None, None])], dim=1)
    return q, s


@pytest.mark.parametrize("experts", [[0, 1, 2, 3, 4, 5, 6], [5], [1, 3, 6], [2, 3, 4]],
                         ids=["all", "one", "some", "a-run"])
def test_requantize_matches_the_torch_path(experts):
    q, s = fp8_w13(7, 48, 80)
    idx = torch.tensor(experts)
    a13, a2 = torch.rand(7) + 0.5, torch.rand(7) + 0.5
    raw13, raw2 = torch.rand(7), torch.rand(7)
    want = [t.clone() for t in (q, s, a13, raw13, a2, raw2)]
    ops.merge_input_scales_(want[2], want[3], idx)
    ops.merge_input_scales_(want[4], want[5], idx)
    ops.requantize_w13_to_expert_max_(want[0], want[1], idx, 48)

    got = [t.to(DEVICE) for t in (q, s, a13, raw13, a2, raw2)]
    requant.requantize_w13_(got[0], got[1], experts, ((got[2], got[3]), (got[4], got[5])))
    for name, a, b in zip(("w13", "w13_scale", "a13", "a13 raw", "a2", "a2 raw"), want, got):
        assert_bitwise_equal(a, b.cpu(), name)
    untouched = [e for e in range(7) if e not in experts]
    assert torch.equal(got[0].cpu()[untouched].view(torch.uint8), q[untouched].view(torch.uint8))


def test_requantize_twice_changes_nothing():
    q, s = fp8_w13(4, 32, 64, seed=1)
    q, s = q.to(DEVICE), s.to(DEVICE)
    requant.requantize_w13_(q, s, [0, 1, 2, 3])
    once = q.clone()
    requant.requantize_w13_(q, s, [0, 1, 2, 3])
    assert_bitwise_equal(q, once, "w13 processed again")


def fp8_edge_w13(e: int, inter: int, hidden: int):
    """Edge cases, one expert each: equal scales, a half of zeros (and its scale the max),
    +-0, values at +-448, subnormals that underflow or round, a tiny ratio, the up half
    larger (the gate moves), a scale of MIN_SCALE."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(e, 2 * inter, hidden, generator=g) * 100).clamp(-448, 448)
    s = torch.rand(e, 2, generator=g) + 0.1
    s[0, 1] = s[0, 0]  # equal: nothing moves
    w[1, :inter] = 0.0  # a zero half whose scale is the larger one
    s[1, 0] = 3.0
    w[2, :, 0], w[2, :, 1] = 0.0, -0.0  # signed zeros
    w[3, :, :8] = 448.0  # max magnitude
    w[3, :, 8:16] = -448.0
    w[4] = torch.randn(2 * inter, hidden, generator=g) * 2.0 ** -8  # e4m3 subnormals
    s[5] = torch.tensor([1.0, 1e4])  # tiny ratio: the gate flushes to (signed) zero
    s[6] = torch.tensor([0.5, 0.5000001])  # ratio one ulp below 1
    s[7] = torch.tensor([1e-12, 2e-12])
    q = w.to(FP8_DTYPE)  # already on the e4m3 grid with its own scales
    return q, s


@pytest.mark.parametrize("experts", [list(range(8)), [0], [5], [7], [1, 3, 6], [6, 1, 3], [2, 3, 4], [0, 7]],
                         ids=["all", "first", "one", "last", "some", "unsorted", "a-run", "ends"])
@pytest.mark.parametrize("merge", [True, False], ids=["merge", "no-merge"])
def test_requantize_edge_cases_match_the_torch_path(experts, merge):
    """One launch writes the halves and then the scales (the last program's ticket): the
    torch path's bytes on every edge case, any subset of slots, in any order."""
    q, s = fp8_edge_w13(8, 16, 64)
    idx = torch.tensor(experts)
    a13, a2 = torch.rand(8) + 0.5, torch.rand(8) + 0.5
    raw13, raw2 = torch.rand(8), torch.rand(8)
    want = [t.clone() for t in (q, s, a13, raw13, a2, raw2)]
    if merge:
        ops.merge_input_scales_(want[2], want[3], idx)
        ops.merge_input_scales_(want[4], want[5], idx)
    ops.requantize_w13_to_expert_max_(want[0], want[1], idx, 16)
    got = [t.to(DEVICE) for t in (q, s, a13, raw13, a2, raw2)]
    requant.requantize_w13_(got[0], got[1], experts, ((got[2], got[3]), (got[4], got[5])) if merge else None)
    for name, a, b in zip(("w13", "w13_scale", "a13", "a13 raw", "a2", "a2 raw"), want, got):
        assert_bitwise_equal(a, b.cpu(), f"{name} {experts=} {merge=}")
    # and again: the ticket counter was reset, the second launch changes nothing
    requant.requantize_w13_(got[0], got[1], experts, ((got[2], got[3]), (got[4], got[5])) if merge else None)
    assert_bitwise_equal(want[0], got[0].cpu(), "w13 processed twice")


def bf16_experts(slots, inter, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return {s: {n: (torch.randn(*shape, generator=g) * (s + 1)).to(torch.bfloat16)
                for n, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter)))}
            for s in slots}


def bf16_layer(e, inter, hidden, seed):
    """A layer's FP8 w13, [E, 2] scale, FP8 w2 and [E] scale, random (what quantizing overwrites)."""
    g = torch.Generator().manual_seed(seed)
    return [quantize_static(torch.randn(e, 2 * inter, hidden, generator=g), 0.01),
            torch.rand(e, 2, generator=g),
            quantize_static(torch.randn(e, hidden, inter, generator=g), 0.01), torch.rand(e, generator=g)]


def test_quantize_experts_edge_cases_match_the_torch_path():
    """All-zero pieces (the smallest scale), a huge value, +-0, subnormal-sized inputs,
    the amax in the up half: the torch path's bytes, one expert (arguments) and several
    (a table)."""
    e, inter, hidden = 6, 32, 64
    staged = bf16_experts([0, 1, 2, 3, 5], inter, hidden, seed=2)
    staged[1]["w2"].zero_()
    staged[1]["w1"].zero_()
    staged[1]["w3"].zero_()
    staged[2]["w1"][0, 0] = float("1e30")
    staged[2]["w3"][:, :2] = -0.0
    staged[3] = {n: t * 2.0 ** -120 for n, t in staged[3].items()}
    staged[5]["w3"][3, 3] = -1e4
    for slots in ([0, 1, 2, 3, 5], [2], [5], [3, 1]):
        layer = bf16_layer(e, inter, hidden, seed=9)
        want = [t.clone() for t in layer]
        ops.quantize_staged_experts_(*want, {s: staged[s] for s in slots})  # CPU: torch
        got = [t.to(DEVICE) for t in layer]
        ops.quantize_staged_by_address_(*got, {s: {n: t.to(DEVICE) for n, t in staged[s].items()}
                                               for s in slots}, slots)
        for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
            assert_bitwise_equal(a, b.cpu(), f"{name} {slots=}")


def test_quantize_staged_refuses_mismatched_pieces():
    w13 = torch.zeros(2, 8, 4, dtype=FP8_DTYPE, device=DEVICE)
    w2 = torch.zeros(2, 4, 4, dtype=FP8_DTYPE, device=DEVICE)
    s13, s2 = torch.ones(2, 2, device=DEVICE), torch.ones(2, device=DEVICE)
    bad = {0: {"w1": torch.zeros(3, 4, dtype=torch.bfloat16, device=DEVICE),
               "w3": torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE),
               "w2": torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE)}}
    with pytest.raises(ValueError, match="another size"):
        ops.quantize_staged_by_address_(w13, s13, w2, s2, bad, [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the dispatch runs Triton there)")
def test_ops_dispatch_to_triton_on_cuda_with_the_same_bytes():
    assert ops.on_triton(torch.empty(1, device="cuda"))
    q, s = fp8_w13(8, 64, 128, seed=3)
    want_q, want_s = q.clone(), s.clone()
    ops.requantize_w13_to_expert_max_(want_q, want_s, torch.tensor([1, 2, 7]), 64)  # CPU: torch
    got_q, got_s = q.cuda(), s.cuda()
    ops.requantize_w13_to_expert_max_(got_q, got_s, torch.tensor([1, 2, 7]), 64)  # CUDA: Triton
    assert_bitwise_equal(want_q, got_q.cpu(), "w13")
    assert_bitwise_equal(want_s, got_s.cpu(), "w13_scale")


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("where", ["device", "host"], ids=["pieces-on-device", "pieces-on-host"])
def test_quantize_staged_by_address_matches_the_torch_path(seed, where):
    """The layout's addresses instead of a view per piece (the Triton path of
    `quantize_staged_experts_`): the torch path's bytes, every slot elsewhere untouched."""
    e, inter, hidden = 6, 32, 64
    slots = [1, 2, 5]
    staged = bf16_experts(slots, inter, hidden, seed)
    layer = bf16_layer(e, inter, hidden, seed)
    want = [t.clone() for t in layer]
    ops.quantize_staged_experts_(*want, staged)  # CPU tensors: the torch path

    got = [t.to(DEVICE) for t in layer]
    put = DEVICE if where == "device" else "cpu"
    moved = {s: {n: t.to(put) for n, t in p.items()} for s, p in staged.items()}
    ops.quantize_staged_by_address_(*got, moved, slots)
    for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
        assert_bitwise_equal(a, b.cpu(), name)


class _Counted:
    """A Triton kernel whose launches are counted (works compiled and interpreted)."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else str(self.kernel))
        return self.kernel[grid]


class _TorchCalls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


# what would cost a device launch, a host-to-device copy or a sync if it ran on a GPU
DEVICE_WORK = {"item", "tolist", "cpu", "pin_memory", "to", "copy_", "empty", "zeros", "tensor", "fill_",
               "index_select", "index_copy_", "amax", "max", "clone", "contiguous"}


def watch_launches(monkeypatch, seen) -> None:
    """`seen(kernel, compiled, sub, args, fast)` before every launch of the processing kernels,
    which then run as they would (the compiled kernels' own launches too)."""
    real = requant._launch

    def launch(kernel, compiled, sub, grid, args, dev, fast=()):
        seen(kernel, compiled, sub, args, fast)
        real(kernel, compiled, sub, grid, args, dev, fast)

    monkeypatch.setattr(requant, "_launch", launch)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_one_expert_is_one_or_two_launches_and_nothing_else(monkeypatch, kind):
    """One reloaded expert: fp8 one launch, bf16 two (amax, quantize) plus the scratch of
    block maxima; no host-to-device table, no sync, no torch op in between."""
    launches: list = []
    for name in ("_requant_w13_kernel", "_expert_amax_kernel", "_expert_quant_kernel"):
        monkeypatch.setattr(requant, name, _Counted(getattr(requant, name), launches))

    def compiled_launch(kernel, compiled, sub, args, fast):
        if sub in compiled:
            launches.append(f"{kernel.fn.__name__ if hasattr(kernel, 'fn') else kernel} (compiled)")

    watch_launches(monkeypatch, compiled_launch)
    monkeypatch.setattr(ops, "on_triton", lambda t: True)
    e, inter, hidden = 4, 16, 32
    if kind == "fp8":
        q, s = fp8_w13(e, inter, hidden)
        args = [t.to(DEVICE) for t in (q, s, torch.rand(e), torch.rand(e), torch.rand(e), torch.rand(e))]

        def process(slots):
            ops.process_fp8_experts_(args[0], args[1], slots, inter, ((args[2], args[3]), (args[4], args[5])))
    else:
        w = [torch.zeros(e, 2 * inter, hidden, dtype=FP8_DTYPE, device=DEVICE),
             torch.ones(e, 2, device=DEVICE),
             torch.zeros(e, hidden, inter, dtype=FP8_DTYPE, device=DEVICE), torch.ones(e, device=DEVICE)]
        staged = {s: {n: t.to(DEVICE) for n, t in p.items()}
                  for s, p in bf16_experts(range(e), inter, hidden, 5).items()}

        def process(slots):
            ops.quantize_staged_experts_(*w, {s: staged[s] for s in slots})
    process([1])  # first call: the layer's facts cached
    launches.clear()
    with _TorchCalls() as calls:
        process([2])
    assert len(launches) == (1 if kind == "fp8" else 2), launches
    extra = [n for n in calls.names if n in DEVICE_WORK]
    assert extra == ([] if kind == "fp8" else ["empty"]), extra
    launches.clear()
    process([0, 3])  # several experts: still one (fp8) or two (bf16) launches
    assert len(launches) == (1 if kind == "fp8" else 2), launches


def test_quantize_many_experts_of_many_blocks_matches_the_torch_path():
    """Eleven experts of pieces of many blocks (on a GPU: hundreds of programs), slots out
    of order: the torch path's bytes, and a second pass gives them again. On the H200 this
    size found the kernels' division not correctly rounded (`tl.fdiv`): 1 element in 2M
    one e4m3 step away."""
    e, (inter, hidden) = 13, (256, 1024) if DEVICE == "cuda" else (64, 256)
    slots = [12, 0, 3, 4, 5, 7, 8, 9, 10, 11, 1]
    staged = bf16_experts(slots, inter, hidden, seed=6)
    layer = bf16_layer(e, inter, hidden, seed=6)
    want = [t.clone() for t in layer]
    ops.quantize_staged_experts_(*want, staged)  # CPU: torch
    on_device = {s: {n: t.to(DEVICE) for n, t in p.items()} for s, p in staged.items()}
    for _ in range(2):
        got = [t.to(DEVICE) for t in layer]
        ops.quantize_staged_by_address_(*got, on_device, sorted(slots))
        for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
            assert_bitwise_equal(a, b.cpu(), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams)")
def test_layers_quantized_on_two_streams_at_once_give_the_torch_bytes():
    """Four layers quantized three times over on two streams at once (each launch's scratch
    its own): every byte as the torch path gives it."""
    e, inter, hidden = 8, 256, 1024
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = []
    for seed in range(4):
        staged = bf16_experts(range(e), inter, hidden, seed=seed)
        layer = bf16_layer(e, inter, hidden, seed)
        want = [t.clone() for t in layer]
        ops.quantize_staged_experts_(*want, staged)
        cases.append((want, [t.cuda() for t in layer], {s: {n: t.cuda() for n, t in p.items()}
                                                        for s, p in staged.items()}))
    torch.cuda.synchronize()
    for _ in range(3):
        for i, (_, got, on_device) in enumerate(cases):
            with torch.cuda.stream(streams[i % 2]):
                ops.quantize_staged_by_address_(*got, on_device, list(range(e)))
    torch.cuda.synchronize()
    for want, got, _ in cases:
        for name, a, b in zip(("w13", "w13_scale", "w2", "w2_scale"), want, got):
            assert_bitwise_equal(a, b.cpu(), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled launches)")
@pytest.mark.parametrize("prepared", [True, False], ids=["compiled-launch", "through-triton"])
def test_layers_of_other_shapes_never_share_a_compiled_launch(monkeypatch, prepared):
    """A layer's requantization is launched through the kernel Triton compiled for it: a
    16-expert, a 64-expert, then the 16-expert layer again, each for one expert, a run and
    a list (different constexprs), give the torch path's bytes every time, with the fast
    launch and without (FP8_RELOAD_FAST_LAUNCH=0)."""
    monkeypatch.setattr(requant, "PREPARED", prepared)
    layers = {e: fp8_w13(e, 48, 128, seed=e) for e in (16, 64)}
    got = {e: [t.cuda() for t in layers[e]] for e in layers}  # the same tensors every call:
    for e in (16, 64, 16, 64):                                 # the layer's cached launches
        for experts in ([3], [4, 5, 6], [e - 1, 0, 7]):
            want_q, want_s = (t.clone() for t in layers[e])
            ops.requantize_w13_to_expert_max_(want_q, want_s, torch.tensor(experts), 48)
            got_q, got_s = got[e]
            got_q.copy_(layers[e][0])
            got_s.copy_(layers[e][1])
            requant.requantize_w13_(got_q, got_s, experts)
            assert_bitwise_equal(want_q, got_q.cpu(), f"w13 {e=} {experts=}")
            assert_bitwise_equal(want_s, got_s.cpu(), f"w13_scale {e=} {experts=}")


def test_the_layer_cache_checks_again_what_another_view_of_cached_memory_changes():
    """The per-layer cache (what `_fp8_layer` checked, and the compiled launches) is keyed
    by every tensor's address, dtype, shape and strides: a strided input scale or a
    transposed [E, 2] scale at an address first seen contiguous is refused, as it is with
    an empty cache."""
    q, s = (t.to(DEVICE) for t in fp8_w13(4, 16, 32))
    buf = torch.rand(8, device=DEVICE) + 0.5
    raw13, a2, raw2 = (torch.rand(4, device=DEVICE) for _ in range(3))
    cache: dict = {}
    requant.requantize_w13_(q, s, [0], ((buf[:4], raw13), (a2, raw2)), cache)
    with pytest.raises(ValueError, match="contiguous"):
        requant.requantize_w13_(q, s, [1], ((buf[::2], raw13), (a2, raw2)), cache)
    base = torch.rand(2, 4, device=DEVICE) + 0.1
    requant.requantize_w13_(q, base.view(4, 2), [0], None, cache)
    with pytest.raises(ValueError, match="contiguous"):
        requant.requantize_w13_(q, base.t(), [1], None, cache)


def test_experts_or_slots_outside_the_layer_are_refused_before_anything_is_written():
    """The layer is a view of the first experts of a bigger allocation: an expert (fp8) or
    a staged slot (bf16) one past its end is refused, as the torch path refuses it, and no
    byte past the layer changes."""
    e, inter, hidden = 4, 16, 32
    q, s = (t.to(DEVICE) for t in fp8_w13(2 * e, inter, hidden))
    s[:, 0] *= 0.5  # every gate half would move
    before = q.clone(), s.clone()
    with pytest.raises(IndexError):
        requant.requantize_w13_(q[:e], s[:e], [e])
    big = [t.to(DEVICE) for t in bf16_layer(2 * e, inter, hidden, seed=1)]
    kept = [t.clone() for t in big]
    staged = {e: {n: t.to(DEVICE) for n, t in bf16_experts([e], inter, hidden, 2)[e].items()}}
    with pytest.raises(IndexError):
        ops.quantize_staged_by_address_(*[t[:e] for t in big], staged, [e])
    for a, b in zip((*before, *kept), (q, s, *big)):
        assert_bitwise_equal(a, b, "memory past the layer")


def _not_specialized(kernel) -> list[str]:
    """The arguments a kernel's ``triton.jit`` declares ``do_not_specialize`` (interpreted
    or compiled), by name."""
    kwargs = getattr(kernel, "kwargs", None)  # the interpreter keeps what jit was given
    declared = kwargs.get("do_not_specialize") if kwargs is not None else kernel.do_not_specialize
    return [kernel.arg_names[a] if isinstance(a, int) else a for a in declared or ()]


def test_each_cached_launch_binds_to_one_triton_specialization(monkeypatch):
    """Every call that reaches one layer entry's compiled launch under one sub-key binds,
    in Triton's own binder for an sm_90 target (built without a GPU), to the same
    specialization (types, 16-byte alignments, constexprs): the kernel compiled at the
    first launch is the one Triton would pick for each later one."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders = {}
    for kernel in (requant._requant_w13_kernel, requant._expert_amax_kernel, requant._expert_quant_kernel):
        jit = JITFunction(kernel.fn, do_not_specialize=_not_specialized(kernel))  # as requant declares it
        binders[jit.fn.__name__] = create_function_from_signature(jit.signature, jit.params, backend)
    assert _not_specialized(requant._expert_amax_kernel) == requant.ADDRESSES
    seen: dict = {}
    entries = []  # kept alive: no id reused

    def bind(kernel, compiled, sub, args, fast):
        binder = binders[getattr(kernel, "fn", kernel).__name__]
        entries.append(compiled)
        seen.setdefault((id(compiled), sub), set()).add(tuple((t, str(v)) for t, v in binder(*args)[1]))

    watch_launches(monkeypatch, bind)
    for e in (16, 64):
        q, s = (t.to(DEVICE) for t in fp8_w13(e, 16, 32, seed=e))
        scales = tuple((torch.rand(e, device=DEVICE), torch.rand(e, device=DEVICE)) for _ in range(2))
        cache: dict = {}
        for experts in ([0], [1], [15], [e - 1], [3, 4], [0, 1, 2, 3], [5, 2], [e - 1, 0], [1, 9, 4]):
            for merge in (None, scales):
                requant.requantize_w13_(q, s, experts, merge, cache)
    # bf16 experts, one and several, into layers of two shapes, both scale layouts, pieces on
    # 16 bytes and off them (what `aligned` tells the kernels)
    for e, inter, cols, off in ((4, 16, 2, 0), (4, 16, 1, 0), (4, 16, 2, 1), (8, 32, 1, 0)):
        w13 = torch.zeros(e, 2 * inter, 32, dtype=FP8_DTYPE, device=DEVICE)
        w2 = torch.zeros(e, 32, inter, dtype=FP8_DTYPE, device=DEVICE)
        s13, s2 = torch.ones(e, cols, device=DEVICE), torch.ones(e, device=DEVICE)
        staged = {}
        for s, pieces in bf16_experts(range(e), inter, 32, e).items():
            staged[s] = {}
            for n, t in pieces.items():
                buf = torch.empty(t.numel() + off, dtype=t.dtype, device=DEVICE)
                staged[s][n] = buf[off:].view(t.shape).copy_(t)
        for slots in ([0], [1], [e - 1], [0, 1], [2, 0, 3]):
            ops.quantize_staged_by_address_(w13, s13, w2, s2, staged, slots)
    assert seen and all(len(v) == 1 for v in seen.values()), [k for k, v in seen.items() if len(v) > 1]


def test_each_fast_launch_passes_the_addresses_of_the_tensors_triton_would_get(monkeypatch):
    """A compiled launch is given the tensors' addresses as integers (`fast`): for every
    launch, of every kind and scope, they are exactly `args` with each tensor replaced by
    its `data_ptr()`, the other arguments unchanged and in place."""
    calls = []
    watch_launches(monkeypatch, lambda kernel, compiled, sub, args, fast: calls.append((args, fast)))
    for e in (4, 16):
        q, s = (t.to(DEVICE) for t in fp8_w13(e, 16, 32, seed=e))
        scales = tuple((torch.rand(e, device=DEVICE), torch.rand(e, device=DEVICE)) for _ in range(2))
        cache: dict = {}
        for experts in ([0], [e - 1], [1, 2], [3, 0], [2, 2]):
            for merge in (None, scales):
                requant.requantize_w13_(q, s, experts, merge, cache)
    w13 = torch.zeros(4, 32, 32, dtype=FP8_DTYPE, device=DEVICE)
    w2 = torch.zeros(4, 32, 16, dtype=FP8_DTYPE, device=DEVICE)
    s13, s2 = torch.ones(4, 2, device=DEVICE), torch.ones(4, device=DEVICE)
    staged = {k: {n: t.to(DEVICE) for n, t in p.items()}
              for k, p in bf16_experts(range(4), 16, 32, 3).items()}
    for slots in ([1], [0, 2, 3]):
        ops.quantize_staged_by_address_(w13, s13, w2, s2, staged, slots)
    assert len(calls) == 2 * 2 * 5 + 2 * 2
    for args, fast in calls:
        want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        assert len(fast) == len(args) and fast == want, (args, fast)
        assert all(type(f) is int for a, f in zip(args, fast) if isinstance(a, torch.Tensor))


def test_input_scales_as_an_iterator_give_the_same_launch_as_a_tuple(monkeypatch):
    """(review, helper 47) Input scales handed over as an iterator (a `zip`) are read once:
    the layer's entry then held 3 addresses, not 7, and the launches of the same tensors
    afterwards (a tuple too) passed the kernel's sizes and flags where the input scales'
    addresses belong (on a GPU: stores to garbage addresses)."""
    calls = []
    watch_launches(monkeypatch, lambda kernel, compiled, sub, args, fast: calls.append((args, fast)))
    q, s = (t.to(DEVICE) for t in fp8_w13(4, 16, 32))
    a13, raw13, a2, raw2 = (torch.rand(4, device=DEVICE) for _ in range(4))
    want = [t.clone() for t in (q, s, a13, raw13, a2, raw2)]
    for e in (1, 2):  # the torch path, as the two calls below
        idx = torch.tensor([e])
        ops.merge_input_scales_(want[2], want[3], idx)
        ops.merge_input_scales_(want[4], want[5], idx)
        ops._requantize_torch_(want[0], want[1], idx, 16)
    cache: dict = {}
    requant.requantize_w13_(q, s, [1], zip((a13, a2), (raw13, raw2)), cache)
    requant.requantize_w13_(q, s, [2], ((a13, raw13), (a2, raw2)), cache)
    assert len(calls) == 2
    for args, fast in calls:
        assert fast == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    for name, a, b in zip(("w13", "w13_scale", "a13", "a13_raw", "a2", "a2_raw"), want,
                          (q, s, a13, raw13, a2, raw2)):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("experts", [[1.0, 3.0], [np.float64(1), np.float64(2)], {2}, (3,), range(0, 2)],
                         ids=["floats", "numpy floats", "a set", "a tuple", "a range"])
def test_experts_in_any_form_the_torch_path_takes(experts):
    """(review, helper 47) Float slots and collections other than a list: the same bytes as
    the torch path, as before the one-expert shortcut."""
    q, s = (t.to(DEVICE) for t in fp8_w13(4, 16, 32))
    s[:, 0] *= 0.5
    want_q, want_s = q.clone(), s.clone()
    ops._requantize_torch_(want_q, want_s, torch.tensor(sorted(int(e) for e in experts)), 16)
    requant.requantize_w13_(q, s, experts)
    assert_bitwise_equal(want_q, q, "w13")
    assert_bitwise_equal(want_s, s, "w13_scale")


_PTX = """
import os, re
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp8_reload.kernels.triton import requant as R

def ptx(fn, sig, const):
    sig = {**sig, **{k: "constexpr" for k in const}}
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

ptrs = dict(w_ptr="*fp8e4nv", scale_ptr="*fp32", experts_ptr="*i64", first="i32", k="i32", ticket_ptr="*i32",
            a13_ptr="*fp32", a13_raw_ptr="*fp32", a2_ptr="*fp32", a2_raw_ptr="*fp32")
kinds = {"requant": ptx(R._requant_w13_kernel, ptrs,
                        dict(HALF=6144, NUM_E=16, LISTED=True, MERGE_INPUT=True, ITERS=2, BLOCK=4096,
                             BLOCK_K=4, BLOCK_E=16, EXACT=False)),
         "quant": ptx(R._expert_quant_kernel, dict(table_ptr="*i64", **{f"a{i}": "i64" for i in range(7)},
                                                  partial_ptr="*fp32", inv_fp8_max="fp32", min_scale="fp32"),
                      dict(NUMEL=6144, COLS13=2, ONE=False, ITERS=2, BLOCK=4096, RBLOCK=8, EXACT=False,
                           ALIGNED=True))}
for name, text in kinds.items():
    print(name, sorted(set(re.findall(r"\\bdiv\\.[a-z0-9.]+", text))))
"""


def test_the_kernels_divide_with_ieee_rounding_when_compiled_for_the_h200(tmp_path):
    """Compiled for sm_90 on this machine (Triton's compiler runs without a GPU): every
    float32 division of the two kernels that divide is ``div.rn.f32``. Triton 3.6 compiles
    ``tl.fdiv(..., ieee_rounding=True)`` to the approximate ``div.full.f32``, which put one
    element in 2M one e4m3 step away from torch's bytes on the H200."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _PTX], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr:
        pytest.skip(f"Triton's ptxas does not run here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.splitlines():
        name, found = line.split(" ", 1)
        assert "div.rn.f32" in found and "div.full" not in found and "div.approx" not in found, line


@pytest.mark.parametrize("equal", [False, True], ids=["scales differ", "scales equal"])
def test_a_merged_fp8_linear_is_one_launch_with_the_torch_loops_bytes(monkeypatch, equal):
    """gate | up of an FP8 linear (two equal widths) is one expert's w13: on a Triton device
    it is requantized by that kernel, in one launch, to the bytes and scales the torch
    loop gives on CPU; the weight stays one Parameter over the same memory."""
    from fp8_reload.layers import Fp8Linear
    from fp8_reload.processing import linear

    q, s = fp8_w13(2, 48, 80)
    scales = s[1 if equal else 0]
    layers = []
    for device in ("cpu", DEVICE):
        layer = Fp8Linear(80, [48, 48], linear.FixedFp8LinearMethod(True), device=device)
        with torch.no_grad():
            layer.weight.copy_(q[1 if equal else 0])
            layer.weight_scale.copy_(scales)
            layer.input_scale.copy_(torch.tensor([0.5, 0.75]))
        layer.needs_processing = True
        layers.append(layer)
    want, got = layers
    want.quant_method.process_weights_after_loading(want)
    launches: list = []
    monkeypatch.setattr(requant, "_requant_w13_kernel", _Counted(requant._requant_w13_kernel, launches))
    monkeypatch.setattr(requant, "_LAYERS", {})  # (the first launch of a layer goes through Triton)
    for module in (linear, ops):  # (on CPU: Triton's interpreter)
        monkeypatch.setattr(module, "on_triton", lambda t: True)
    weight, ptr = got.weight, got.weight.data_ptr()
    got.quant_method.process_weights_after_loading(got)
    assert launches == ["_requant_w13_kernel"]
    assert got.weight is weight and got.weight.data_ptr() == ptr and got.kernel_layout
    # what the launch checked stays with the layer, not in the module-wide cache (where a
    # dropped model's entries stayed, a device tensor each: the CUDA soak's growth)
    assert requant._LAYERS == {} and len(got.requant_cache) == 1
    for name in ("weight", "weight_scale", "input_scale"):
        assert_bitwise_equal(getattr(want, name).data, getattr(got, name).data.cpu(), name)
    assert torch.equal(got.weight_scale.cpu(), scales.max().expand(2))
