"""Value checks on staged tensors: what a header cannot tell.

A tensor with the right name, shape and dtype can still hold values that make
every forward wrong: FP8 bytes that encode NaN (e4m3fn has no infinity; 0x7f
and 0xff are its NaNs), NaN or +-inf in a bf16/fp16/fp32 weight (a bf16
checkpoint is quantized on load: one inf becomes an inf scale and a zeroed
expert), in a router or a norm, and scales that are not finite and positive.
The reload refuses them with `InvalidTensorError`, before anything is written.

Why it is cheap: on a CUDA device where Triton runs, one launch checks a whole batch
from raw bits at HBM speed (`kernels.triton.value_check`; the streaming reload keeps its
table for the views it checks on every first reload, `KeptTables`). Elsewhere (CPU,
GPUs without Triton, float64, non-contiguous tensors) torch reductions do, never an
elementwise temporary: an FP8 NaN/inf byte is at or above a threshold in the int8 view
(positive values) or the uint8 view (negative ones); NaN and +-inf carry through max
|x| (`torch._foreach_norm`) or min and max; scales are gathered into one vector, finite
and > 0. Both flag exactly the same tensors (`tests/test_value_kernel.py`).

Where it runs: `ValueCheck(device)` checks on `device`. A GPU reload stages
tensors in pinned host memory; the check copies them, batch by batch, into one
reused device buffer (a single copy per contiguous run of the staging arena)
and runs its kernels there, asynchronously, while the staging reads are still
running; only `first_invalid` waits, once. The device memory it needs is one
batch (`BATCH_BYTES`, or the largest tensor), not the reload.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..errors import InvalidTensorError
from ..kernels.registry import triton_unavailable

# FP8 formats: (lowest int8, lowest uint8) value of a non-finite byte: its exponent
# bits are all ones (e4m3fn: only 0x7f/0xff, both NaN; e5m2: 0x7c.. inf, then NaN).
FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7C, 0xFC)}
BATCH_BYTES = 64 * 2**20
_GAP = 64  # staging arena slices start 64-byte aligned: a run continues across such gaps


def _rule(name: str, t: torch.Tensor) -> str | None:
    if t.numel() == 0:
        return None
    if t.dtype in FP8_NONFINITE:
        return "fp8"
    if t.is_floating_point():
        return "scale" if name.endswith("_scale") else "float"
    return None  # integers and booleans have no invalid values


def _maxima(ts: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(torch._foreach_max(ts))
    except (AttributeError, NotImplementedError, RuntimeError):  # a torch without it for this dtype
        return torch.stack([t.max() for t in ts])


def _fp8_bad(ts: list[torch.Tensor]) -> torch.Tensor:
    pos, neg = FP8_NONFINITE[ts[0].dtype]
    signed = _maxima([t.view(torch.int8) for t in ts])
    unsigned = _maxima([t.view(torch.uint8) for t in ts])
    return (signed.to(torch.int16) >= pos) | (unsigned.to(torch.int16) >= neg)


def _float_bad(ts: list[torch.Tensor]) -> torch.Tensor:
    if ts[0].device.type == "cuda":  # max |x|, all tensors of the batch in one kernel
        try:
            return ~torch.isfinite(torch.stack(torch._foreach_norm(ts, math.inf)))
        except (AttributeError, NotImplementedError, RuntimeError):
            pass  # a torch without it: one reduction per tensor below
    lo, hi = zip(*(torch.aminmax(t) for t in ts))  # CPU: a single pass per tensor
    return ~(torch.isfinite(torch.stack(lo)) & torch.isfinite(torch.stack(hi)))


def _scale_bad(ts: list[torch.Tensor]) -> torch.Tensor:
    values = torch.cat([t.reshape(-1).float() for t in ts])
    bad = ~(torch.isfinite(values) & (values > 0))
    if values.numel() == len(ts):
        return bad
    owner = torch.repeat_interleave(torch.arange(len(ts), device=values.device),  # (its size given:
                                    torch.tensor([t.numel() for t in ts], device=values.device),
                                    output_size=values.numel())  # on a GPU, no wait for the device)
    return torch.zeros(len(ts), dtype=torch.int32, device=values.device).index_add_(
        0, owner, bad.to(torch.int32)) > 0


_RULES = {"fp8": _fp8_bad, "float": _float_bad, "scale": _scale_bad}


@functools.cache
def _triton_runs_here() -> bool:
    return triton_unavailable() is None


def _kernel_module(kernel: bool | None, tensors):
    """`kernels.triton.value_check` if a tensor of `tensors` is checked by it (`kernel`:
    forced on or off; None: CUDA tensors where Triton runs), else None."""
    if kernel is False or not tensors:
        return None
    if kernel is None and not (any(t.is_cuda for t in tensors) and _triton_runs_here()):
        return None
    from ..kernels.triton import value_check  # needs triton: imported on use

    return value_check


def invalid_flags(named: list[tuple[str, torch.Tensor]],
                  kernel: bool | None = None) -> tuple[list[str], torch.Tensor]:
    """(names, flags): flags[i] is nonzero where tensor names[i] holds an invalid value.

    Runs where the tensors are, asynchronously (no host synchronization); tensors
    without anything to check (integers, empty) are left out of `names`. `kernel`:
    check with the one-launch Triton kernel (True: also CPU tensors, under Triton's
    interpreter), with torch reductions (False), or the kernel for CUDA tensors where
    Triton runs (None).
    """
    checked = [(name, t, rule) for name, t in named if (rule := _rule(name, t)) is not None]
    vc = _kernel_module(kernel, [t for _, t, _ in checked])
    fused: list[tuple[str, torch.Tensor, str]] = []
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t, rule in checked:
        if (vc is not None and (kernel or t.is_cuda) and vc.supported(t, rule == "scale")
                and (not fused or fused[0][1].device == t.device)):
            fused.append((name, t, rule))
        else:
            key = (rule, t.dtype if rule != "scale" else None, t.device)
            groups.setdefault(key, []).append((name, t))
    names, flags = [n for n, _, _ in fused], []
    if fused:  # one launch for all of them
        flags.append(vc.value_flags_([t for _, t, _ in fused], [r == "scale" for _, _, r in fused]))
    for (rule, _, _), items in groups.items():
        names += [n for n, _ in items]
        flags.append(_RULES[rule]([t for _, t in items]))
    if not flags:
        return [], torch.zeros(0, dtype=torch.bool)
    if len({f.device for f in flags}) > 1:
        flags = [f.cpu() for f in flags]
    return names, flags[0] if len(flags) == 1 else torch.cat(flags)


def nonfinite_flags(tensors: list[torch.Tensor], tables: KeptTables | None = None) -> torch.Tensor:
    """Flags in the order of `tensors` (nonzero: a NaN or infinity, an FP8 NaN encoding),
    queued where they are, nothing read back: the streaming reload's check of the values
    where they landed (it reads and checks scales on the host). One launch of the kernel
    where it takes every tensor (its table kept in `tables` when given), else
    `invalid_flags`' split."""
    vc = _kernel_module(None, tensors)
    if vc is not None:
        table = tables.get(tensors) if tables is not None else None
        if table is None and all(vc.supported(t) for t in tensors):
            table = vc.ValueTable(tensors, [False] * len(tensors))
            if tables is not None:
                tables.put(tensors, table)
        if table is not None:
            return table.flags()
    names, flags = invalid_flags([(str(i), t) for i, t in enumerate(tensors)])
    if not names:  # nothing to check (integers, empty tensors): no flag, where they are
        return torch.zeros(len(tensors), dtype=torch.bool, device=tensors[0].device if tensors else None)
    order = [int(n) for n in names]
    if order == list(range(len(tensors))):
        return flags
    out = torch.zeros(len(tensors), dtype=flags.dtype, device=flags.device)
    if order:
        out[torch.tensor(order, device=flags.device)] = flags
    return out


class KeptTables:
    """The kernel's tables of the lists of tensors a model's reloads check again and again
    (the streaming reload's landed views: the same Parameter views on every first reload
    of new files). Building a table walks every tensor; finding a kept one costs a key of
    each tensor's address, size and dtype, a few times cheaper. A table keeps its tensors
    (so their memory stays where it points) until `release` (`release_staging`)."""

    KEEP = 2  # RL's two alternating checkpoints land on the same views: one table

    def __init__(self):
        self.tables: dict = {}

    @staticmethod
    def _key(tensors):
        # a contiguous tensor of this address, size and dtype covers exactly the bytes the
        # table reads; a strided one with the same three does not
        return (tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(torch.Tensor.numel, tensors)),
                tuple(t.dtype for t in tensors), tuple(map(torch.Tensor.is_contiguous, tensors)))

    def get(self, tensors):
        return self.tables.get(self._key(tensors))

    def put(self, tensors, table):
        if len(self.tables) >= self.KEEP:
            self.tables.clear()
        self.tables[self._key(tensors)] = table

    def release(self) -> None:
        self.tables = {}


def describe_invalid(name: str, t: torch.Tensor) -> str | None:
    """What is wrong with `t`, in words (None if nothing). The slow, exact path,
    run only for a tensor the batched check flagged."""
    rule = _rule(name, t)
    if rule is None:
        return None
    flat = t.detach().reshape(-1)
    if rule == "scale":
        f = flat.float()
        if bool((torch.isfinite(f) & (f > 0)).all()):
            return None
        return f"scale must be finite and positive, got {t.tolist()}"
    if rule == "fp8":
        pos, neg = FP8_NONFINITE[t.dtype]
        raw = flat.view(torch.uint8)
        bad = (raw.view(torch.int8) >= pos) | (raw >= neg)
    else:
        bad = ~torch.isfinite(flat)
    hits = bad.nonzero()
    if hits.numel() == 0:
        return None
    i = int(hits[0])
    where = _unravel(i, t.shape)
    if rule == "fp8":
        byte = int(raw[i])
        what = "NaN" if t.dtype == torch.float8_e4m3fn or byte & 0x03 else "inf"
        fmt = str(t.dtype).replace("torch.float8_", "FP8 ")
        return (f"{fmt} byte 0x{byte:02x} at index {where} encodes {what} "
                f"({_count(hits.numel())}); weights must be finite")
    return (f"value {_show(float(flat[i]))} at index {where} ({_count(hits.numel())}); weights "
            "must be finite")


def _show(v: float) -> str:
    return "NaN" if v != v else str(v)


def _unravel(i: int, shape) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def _count(n: int) -> str:
    return f"{n} invalid value{'s' if n != 1 else ''} in the tensor"


class ValueCheck:
    """Checks the values of tensors fed one at a time (staging order), in batches.

    `device`: where the checks run (None: wherever each tensor is). Tensors on
    another device are copied there into one reused buffer; `copy=True` packs
    them into that buffer even when they are already there (tests use it to run
    the GPU path's packing on a CPU). `kernel`: as `invalid_flags`'s (None: the
    Triton kernel on a CUDA device where Triton runs).

    With the kernel, tensors already on `device` do not count towards a batch: they
    need no buffer, and the fewer batches, the fewer launches (all of a resident
    checkpoint is one launch).
    """

    def __init__(self, device=None, batch_bytes: int = BATCH_BYTES, copy: bool | None = None,
                 kernel: bool | None = None):
        self.device = None if device is None else _exact(torch.device(device))
        self.batch_bytes = batch_bytes
        self.copy = copy
        self.kernel = kernel
        self._resident_free = (self.device is not None and not copy and kernel is not False
                               and (kernel or (self.device.type == "cuda" and _triton_runs_here())))
        self.sources: dict[str, torch.Tensor] = {}  # name -> tensor as given (for the message)
        self.order: dict[str, int] = {}
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._results: list[tuple[list[str], torch.Tensor]] = []
        self._buffer: torch.Tensor | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.sources[name] = tensor
        self.order.setdefault(name, len(self.order))
        self._pending.append((name, tensor))
        if self._resident_free and tensor.device == self.device:
            return
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= self.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._results.append(invalid_flags(self._on_device(self._pending), self.kernel))
        self._pending, self._pending_bytes = [], 0

    def _on_device(self, batch):
        device = self.device
        if device is None or (not self.copy and all(t.device == device for _, t in batch)):
            return batch
        # with the kernel, tensors already there stay where they are (they were not counted)
        keep = [(n, t) for n, t in batch if self._resident_free and t.device == device]
        runs = _contiguous_runs([(n, t) for n, t in batch  # empty: nothing to check
                                 if t.numel() and not (self._resident_free and t.device == device)])
        total = sum(_align(hi - lo) for _, lo, hi, _ in runs)
        if self._buffer is None or self._buffer.numel() < total or self._buffer.device != device:
            self._buffer = None
            self._buffer = torch.empty(total, dtype=torch.uint8, device=device)
        out, pos = keep, 0
        for src, lo, hi, members in runs:
            # one copy per run; stream-ordered after the kernels that read the buffer before
            self._buffer[pos:pos + hi - lo].copy_(src, non_blocking=True)
            for name, t, off in members:
                start = pos + off - lo
                view = self._buffer[start:start + t.numel() * t.element_size()]
                out.append((name, view.view(t.dtype).view(t.shape)))
            pos += _align(hi - lo)
        return out

    def first_invalid(self) -> tuple[str, str] | None:
        """(name, what is wrong) of the first invalid tensor in staging order, or None.
        Waits for the queued checks (one synchronization)."""
        self._flush()
        self._buffer = None
        hits = [(names, flags) for names, flags in self._results if flags.numel()]
        self._results = []
        if not hits:
            return None
        flags = torch.cat([f.to(hits[0][1].device) for _, f in hits])
        if not bool(flags.any()):
            return None
        names = [n for ns, _ in hits for n in ns]
        bad = sorted((names[i] for i in flags.nonzero().reshape(-1).tolist()), key=self.order.get)
        for name in bad:
            what = describe_invalid(name, self.sources[name].cpu())
            if what is not None:
                return name, what
        return bad[0], "holds a non-finite value"  # not reached: both checks agree

    def raise_if_invalid(self, where: Callable[[str], str]) -> None:
        """`InvalidTensorError` naming `where(name)` (file and tensor) and the value."""
        found = self.first_invalid()
        if found is not None:
            raise InvalidTensorError(f"{where(found[0])}: {found[1]}")


def invalid_tensor_error(where: str, name: str, tensor: torch.Tensor | None,
                         others: int = 0) -> InvalidTensorError:
    """The error for tensor `name` (at `where`, its file), described from `tensor`'s
    values when given; `others`: how many more tensors were found bad."""
    what = describe_invalid(name, tensor.cpu()) if tensor is not None else None
    more = f" ({others} more invalid tensor{'s' if others != 1 else ''})" if others else ""
    return InvalidTensorError(f"{where}: tensor {name!r}: {what or 'NaN or infinite values'}{more}")


def check_values(named, where: Callable[[str], str], device=None) -> None:
    """Check every (name, tensor) at once; `InvalidTensorError` for the first bad one."""
    check = ValueCheck(device)
    for name, t in named:
        check.add(name, t)
    check.raise_if_invalid(where)


def _exact(device: torch.device) -> torch.device:
    """`device` as tensors on it report theirs ("cuda" -> "cuda:<current>", "cpu:0" ->
    "cpu"): compared with ``tensor.device``, "cuda" would never match "cuda:0"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type == "cpu" else device


def _align(n: int) -> int:
    return (n + _GAP - 1) // _GAP * _GAP


def _contiguous_runs(batch):
    """Group tensors into runs of one storage laid out in increasing address order
    (slices of the staging arena), each copied as one span: [(src, lo, hi, members)]."""
    runs: list[list] = []
    for name, t in batch:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        storage = t.untyped_storage()
        base = storage.data_ptr()
        off = t.data_ptr() - base
        n = t.numel() * t.element_size()
        run = runs[-1] if runs else None
        if (run is not None and run[4] == base and run[2] <= off < run[2] + _GAP
                and (off - run[1]) % t.element_size() == 0):
            run[2] = off + n
            run[3].append((name, t, off))
        else:
            runs.append([storage, off, off + n, [(name, t, off)], base, t.device])
    out = []
    for storage, lo, hi, members, _, dev in runs:
        src = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, lo, (hi - lo,), (1,))
        out.append((src, lo, hi, members))
    return out
