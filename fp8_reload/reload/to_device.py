"""Landing a streamed reload on a GPU: asynchronous copies on a copy stream, no staging of
the whole reload, values checked where they land.

Two sources:

* a *registered* shard (`checkpoint.registered`, the file's page cache pinned for the
  DMA engine): each tensor is one host-to-device copy straight into its parameter,
  nothing read by the CPU at all;
* any other file: `chunks.stream_through_ring` (reader threads into pinned buffers),
  and the copies out of each buffer.

Which shards get registered (``FP8_RELOAD_REGISTER``): ``auto`` (default) registers a
shard the second time a reload reads most of it under the same stamps (what EPLB and RL
weight sync do; registering costs about one read of the file, so a checkpoint read once
never pays it), within a budget of locked memory (``FP8_RELOAD_REGISTER_BUDGET`` bytes,
default half the host's memory); ``always``; ``never``.

Every chunk lands in a device slot first (one copy), and goes from there to its places:
FP8 tensors by device-to-device copies, bf16 experts (quantized on load) by the
quantization into their FP8 slots. Device memory beyond the model is one chunk
(``FP8_RELOAD_CHUNK_BYTES``, 64 MiB by default).
"""

from __future__ import annotations

import os

import torch

from .. import trace
from ..checkpoint.registered import RegisteredShards
from ..checkpoint.staging import holder
from ..checkpoint.values import KeptTables, nonfinite_flags
from ..device import copy_async, side_stream
from .chunks import Chunk, invalid_value, make_chunks, ring_for, stream_through_ring
from .targets import Target

REGISTER = os.environ.get("FP8_RELOAD_REGISTER", "auto")
WINDOW_SLACK = 8  # a registered chunk moves as one window while its gaps are <= 1/8 of its bytes


def _register_budget() -> int:
    env = os.environ.get("FP8_RELOAD_REGISTER_BUDGET")
    if env is not None:
        return int(env)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 0


class DeviceSlot:
    """Device scratch one chunk lands in before its tensors go to their places."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int, device) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.device != device:
            self.buffer = None
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffer

    def release(self) -> None:
        self.buffer = None


def registered_files(model, ckpt, chunks: list[Chunk]) -> dict:
    """{file: RegisteredFile} for the chunks' files this reload reads from registered
    memory. `ckpt.reads` counts, per file, the reloads that read most of it (the parsed
    checkpoint lives while the files' stamps are unchanged)."""
    shards: RegisteredShards = holder(model, "registered", RegisteredShards)
    if REGISTER == "never":
        return {}
    read: dict[str, int] = {}
    for c in chunks:
        read[c.file] = read.get(c.file, 0) + c.nbytes
    out = {}
    for fname, nbytes in read.items():
        path = ckpt.path / fname
        size = os.path.getsize(path)
        mostly = 2 * nbytes >= size
        if mostly:
            ckpt.reads[fname] = ckpt.reads.get(fname, 0) + 1
        want = REGISTER == "always" or (mostly and ckpt.reads.get(fname, 0) >= 2)
        current = shards.current(path)
        if current is None and want and shards.nbytes() + size <= _register_budget():
            with trace.range("fp8_reload/register", payload=size):
                current = shards.get(path)
        if current is not None:
            out[fname] = current
    return out


def _quantize_chunk(chunk: Chunk, src: torch.Tensor, checks: list | None) -> None:
    """The bf16 experts of `chunk`, now in device memory `src`, into their FP8 slots (two
    launches per layer shape, each expert a row of addresses); with `checks`, their values'
    flags are appended ((targets, flags))."""
    from ..kernels.triton.requant import quantize_experts_  # needs triton: imported on use

    by_unit: dict = {}
    for t in chunk.targets:
        if t.kind == "quant":
            by_unit.setdefault((t.module_name, tuple(t.slots)), {})[t.shard] = t
    rows_of: dict = {}
    checked = []
    for shards in by_unit.values():
        views = {s: chunk.source(src, t) for s, t in shards.items()}
        checked += [(t, views[s]) for s, t in shards.items()]
        layer = next(iter(shards.values())).module
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
        numel = w2[0].numel()
        if (any(v.dtype != torch.bfloat16 or v.numel() != numel for v in views.values())
                or w13.dtype != torch.float8_e4m3fn or s13.dtype != torch.float32 or s2.dtype != torch.float32
                or not all(t.is_contiguous() for t in (w13, w2, s13, s2)) or w13[0].numel() != 2 * numel):
            raise ValueError(f"quantize-on-load: {next(iter(shards.values())).module_name}: pieces or "
                             "weights of another size, dtype or layout")
        cols = s13.numel() // s13.shape[0]
        rows = rows_of.setdefault((numel, cols), [])
        src3 = (views["w1"].data_ptr(), views["w3"].data_ptr(), views["w2"].data_ptr())
        b13, b2, c13, c2 = w13.data_ptr(), w2.data_ptr(), s13.data_ptr(), s2.data_ptr()
        for slot in next(iter(shards.values())).slots:  # FP8: one byte an element; scales 4
            rows.append(src3 + (b13 + slot * w13.stride(0), b2 + slot * w2.stride(0), c13 + 4 * slot * cols,
                                c2 + 4 * slot))
    if checks is not None:  # checked now, one launch a chunk: the slot is reused by the next one
        checks.append(([t for t, _ in checked], nonfinite_flags([v for _, v in checked])))
    for (numel, cols), rows in rows_of.items():
        quantize_experts_(src.device, numel, cols, rows)


def _land(chunk: Chunk, buf: torch.Tensor, slot: DeviceSlot, device, writable, checks,
          quant_checks, gather: bool = False) -> None:
    """Queue the copies of one chunk out of `buf` (pinned or registered host memory) on
    the current stream (the copy stream): the whole chunk in one host-to-device copy into
    the device slot (one DMA runs at the link's speed; hundreds of tensor-sized ones from
    page-cache pages do not), then each tensor from there to its place at memory speed.
    Only those device-to-device copies wait for the modules' backups. `gather`: `buf` is
    the chunk's whole (registered) file, and each span is copied from its file offset:
    the gaps between the spans of a filtered reload are not moved."""
    stream = torch.cuda.current_stream(device)
    dslot = slot.get(chunk.extent, device)[:chunk.extent]
    if gather:
        for off, n, at in chunk.spans:
            copy_async(dslot[at:at + n], buf[off:off + n], stream)
    else:
        copy_async(dslot, buf[:chunk.extent], stream)
    for t in chunk.targets:
        if t.kind != "copy":
            continue
        writable(t.module)
        src = chunk.source(dslot, t)
        for view in t.views:
            copy_async(view, src, stream)
        checks.append((t, t.views[0]))
    if any(t.kind == "quant" for t in chunk.targets):
        for t in chunk.targets:
            writable(t.module)
        _quantize_chunk(chunk, dslot, quant_checks)


def commit_cuda(model, ckpt, streamed: list[Target], writable, check: bool, stats: dict) -> None:
    """Copy every streamed target into place on `device`, then check the values (one
    read-back). `writable(module)` makes the copy stream wait until `module` may be
    overwritten (its backup is taken)."""
    t0 = streamed[0]
    device = t0.views[0].device if t0.views else t0.module.w13_weight.device
    stream = side_stream(device, "copy")
    stream.wait_stream(torch.cuda.current_stream(device))
    checks: list[tuple[Target, torch.Tensor]] = []
    quant_checks: list | None = [] if check else None
    slot: DeviceSlot = holder(model, "device_slot", DeviceSlot)
    chunks = make_chunks(streamed)
    registered = registered_files(model, ckpt, chunks)
    with torch.cuda.stream(stream):
        direct = [c for c in chunks if c.file in registered]
        with trace.range("fp8_reload/dma", payload=sum(c.nbytes for c in direct)):
            for chunk in direct:
                reg = registered[chunk.file]
                start, end = chunk.spans[0][0], chunk.spans[-1][0] + chunk.spans[-1][1]
                # one DMA of the window where its gaps are small (a full reload's: the scales
                # read before the lock); a filtered reload's are mostly gaps: the spans alone
                if end - start <= chunk.extent + chunk.extent // WINDOW_SLACK:
                    _land(Chunk(chunk.file, chunk.targets, [(o, n, o - start) for o, n, _ in chunk.spans]),
                          reg.view[start:end], slot, device, writable, checks, quant_checks)
                else:
                    _land(chunk, reg.view, slot, device, writable, checks, quant_checks, gather=True)
                stats["bytes_read"] = stats.get("bytes_read", 0) + chunk.nbytes
        rest = [c for c in chunks if c.file not in registered]
        if rest:
            ring = ring_for(model, max(c.nbytes for c in rest), pin=True)

            def land(chunk: Chunk, buf: torch.Tensor):
                _land(chunk, buf, slot, device, writable, checks, quant_checks)
                event = torch.cuda.Event()
                event.record(stream)
                return event

            with trace.range("fp8_reload/ring", payload=sum(c.nbytes for c in rest)):
                stream_through_ring(ckpt, rest, ring, land, stats)
        flags = []
        if check and checks:  # the same views every first reload: their table is kept
            flags.append(nonfinite_flags([v for _, v in checks], holder(model, "value_tables", KeptTables)))
    torch.cuda.current_stream(device).wait_stream(stream)
    if check and (checks or quant_checks):
        for targets, qflags in quant_checks or ():
            checks += [(t, None) for t in targets]
            flags.append(qflags)
        bad = torch.cat(flags).nonzero().flatten().tolist()  # the one read-back of the reload
        if bad:
            raise invalid_value(ckpt, checks[bad[0]][0].info.name, others=len(bad) - 1)
