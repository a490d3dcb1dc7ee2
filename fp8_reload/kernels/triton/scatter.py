"""Two small launches the streaming reload needs on the device.

* `write_scalars_`: thousands of 0-dim scales written in one launch (one float per
  address), instead of one copy each.
* `check_values_`: whether tensors already on the device hold values a checkpoint must
  not (`quant.has_bad_values`: FP8 NaN encodings, non-finite bf16 or float32). One
  flag per tensor, set only where a bad value is found, one launch for all of them.
"""

from __future__ import annotations

import torch

from .requant import device_ints
from .runtime import check_device, tl, triton

BLOCK = 8192
KIND = {torch.float8_e4m3fn: 1, torch.bfloat16: 2, torch.float32: 3}


@triton.jit
def _scalars_kernel(addr_ptr, value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dst = tl.load(addr_ptr + i, mask=ok, other=0).to(tl.pointer_type(tl.float32))
    tl.store(dst, tl.load(value_ptr + i, mask=ok, other=0.0), mask=ok)


@triton.jit
def _check_kernel(addr_ptr, count_ptr, kind_ptr, flag_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    count = tl.load(count_ptr + t)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    if start < count:
        kind = tl.load(kind_ptr + t)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        addr = tl.load(addr_ptr + t)
        if kind == 1:  # e4m3: S.1111.111 is NaN (no infinities)
            b = tl.load(addr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask, other=0)
            bad = (b & 0x7F) == 0x7F
        elif kind == 2:  # bf16 of exponent all ones
            h = tl.load(addr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0).to(tl.int32)
            bad = (h & 0x7F80) == 0x7F80
        else:  # float32
            w = tl.load(addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0)
            bad = (w & 0x7F800000) == 0x7F800000
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.store(flag_ptr + t, 1)


def write_scalars_(views: list[torch.Tensor], values: list[float]) -> None:
    """``views[i].fill_(values[i])`` for float32 0-dim views on one device, in one launch."""
    check_device(views[0])
    dev = views[0].device
    addrs = device_ints([v.data_ptr() for v in views], dev)
    vals = torch.tensor(values, dtype=torch.float32).pin_memory().to(dev, non_blocking=True)
    _scalars_kernel[(triton.cdiv(len(views), 1024),)](addrs, vals, len(views), BLOCK=1024)


def check_values_(tensors: list[torch.Tensor], flags: torch.Tensor | None = None) -> torch.Tensor:
    """Flags (int32, one per tensor, 1 where a NaN / non-finite value was found) for
    contiguous tensors on one device. Nothing is read back: the caller looks at the
    flags once, after everything else was queued."""
    check_device(tensors[0])
    dev = tensors[0].device
    if flags is None:
        flags = torch.zeros(len(tensors), dtype=torch.int32, device=dev)
    if not tensors:
        return flags
    for t in tensors:
        if not t.is_contiguous() or t.dtype not in KIND:
            raise ValueError(f"check_values_: contiguous float tensors only, got {t.dtype}")
    counts = [t.numel() for t in tensors]
    table = device_ints([t.data_ptr() for t in tensors] + counts + [KIND[t.dtype] for t in tensors],
                        dev).view(3, -1)
    _check_kernel[(len(tensors), triton.cdiv(max(counts), BLOCK))](table[0], table[1], table[2], flags,
                                                                    BLOCK=BLOCK)
    return flags

