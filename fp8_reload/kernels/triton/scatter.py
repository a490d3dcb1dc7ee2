"""`write_scalars_`: thousands of 0-dim scales written in one launch (one float per
address), instead of one copy each. (A chunk's tensors go to their places by
`copy_rows`; the streaming reload's value check is `value_check.value_flags_`, shared
with `checkpoint.values`.)"""

from __future__ import annotations

import torch

from .runtime import cdiv, check_device, device_ints, tl, triton


@triton.jit
def _scalars_kernel(addr_ptr, value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    dst = tl.load(addr_ptr + i, mask=ok, other=0).to(tl.pointer_type(tl.float32))
    tl.store(dst, tl.load(value_ptr + i, mask=ok, other=0.0), mask=ok)


def write_scalars_(views: list[torch.Tensor], values: list[float]) -> None:
    """``views[i].fill_(values[i])`` for float32 0-dim views on one device, in one launch."""
    check_device(views[0])
    dev = views[0].device
    addrs = device_ints([v.data_ptr() for v in views], dev)
    vals = torch.tensor(values, dtype=torch.float32)
    if dev.type == "cuda":  # from pinned memory: no wait for the device
        vals = vals.pin_memory().to(dev, non_blocking=True)
    _scalars_kernel[(cdiv(len(views), 1024),)](addrs, vals, len(views), BLOCK=1024)
