"""Landing a streamed reload on a GPU: asynchronous copies, no staging of the whole
reload, values checked where they land.

Two sources:

* a *registered* shard (`checkpoint.registered`, the file's page cache pinned for the
  DMA engine): each chunk is one host-to-device copy of its file window, nothing read
  by the CPU at all;
* any other file: `ring.stream_through_ring` (readers into pinned buffers),
  and one copy out of each buffer.

Which shards get registered (``FP8_RELOAD_REGISTER``): ``auto`` (default) registers a
shard the second time a reload reads it under the same stamps (EPLB, RL weight sync:
registering costs about one read of the file, so a checkpoint read once never pays it),
within ``FP8_RELOAD_REGISTER_BUDGET`` bytes of locked memory (default half the host's:
files changed or gone, then those used longest ago, are dropped to make room and
unregistered under the weights lock, `release_dropped`); ``always``; ``never``. A reload
that reads little of a shard (an EPLB step) registers at most ``FP8_RELOAD_REGISTER_STEP``
bytes of such shards (default 4 GiB, ~0.1 s of page-cached file on an H200 host; or one
shard if larger; 0: none), so a large checkpoint is registered over several steps.
Registration runs before the weights lock, in pieces (`checkpoint.registered`: the driver
holds the process's other CUDA calls while it pins one, ~2 ms), so forwards go on in
between. Under ``FP8_RELOAD_IO=direct`` ``auto`` registers nothing (direct reads keep the
page cache clear).

Every chunk lands in one of two device buffers first, on the "h2d" stream, and goes from
there to its places on the writes stream ("copy"), which waits for the backup of the
slots it overwrites: FP8 tensors by one copy launch per chunk (`copy_rows`, its table
kept between reloads), bf16 weights by their quantization into FP8 places. While one
buffer is scattered the next chunk fills the other: the link runs without gaps. Device
memory beyond the model is two chunks (``FP8_RELOAD_CHUNK_BYTES``, 64 MiB each by default).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

from .. import trace
from ..checkpoint.registered import RegisteredShards
from ..checkpoint.staging import held, holder
from ..checkpoint.values import KeptTables, nonfinite_flags
from ..device import copy_async, side_stream
from ..knobs import env_choice, env_int
from ..layers import FusedMoE
from ..processing.ops import expert_rows, fp8_expert_layout, on_triton
from . import chunks as _chunks
from .chunks import Chunk, invalid_value
from .ring import ring_for, stream_through_ring
from .targets import Target

REGISTER = env_choice("FP8_RELOAD_REGISTER", "auto", ("auto", "always", "never"))
REGISTER_STEP = env_int("FP8_RELOAD_REGISTER_STEP", 4 << 30)
# A chunk whose copy table is not kept (a filtered reload's) writes at most this many views
# with a copy each: building a table and sending it to the device cost 0.2-0.3 ms of host
# time a chunk on the H200, ten copies less (`gpu/host_timeline.py --filtered`).
FEW_ROWS = 16


def _register_budget() -> int:
    try:
        half = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        half = 0
    return env_int("FP8_RELOAD_REGISTER_BUDGET", half, minimum=None)  # (<= 0: register nothing)


class DeviceSlots:
    """Two device buffers chunks land in by turns: while one chunk's tensors go from its
    buffer to their places (the writes stream, after their backup), the next chunk's copy
    fills the other ("h2d"): the link waits for the writes of the chunk two back only.
    Each remembers the event after which it may be filled again."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.free: list = [None, None]

    def reserve(self, nbytes: int, device) -> None:
        """Buffers of at least `nbytes` on `device`. Called before a reload queues anything:
        no copy of an earlier reload is still using them (the transaction waited for it)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not self.buffers or self.buffers[0].numel() < nbytes or self.buffers[0].device != device:
            self.buffers = []  # (the old ones freed first)
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.free = [None, None]

    def release(self) -> None:
        self.buffers, self.free = [], [None, None]


class RowTables:
    """The copy tables of the chunks a model's full reloads land (`copy_rows.row_table`),
    by device buffer and copies: a repeated full reload lands the same copies, and finds
    its tables here. A filtered reload's copies differ from one rebalance to the next:
    its tables are built and dropped (kept, they piled up to `KEEP`)."""

    KEEP = 4096  # tables: a whole model's chunks, both buffers, two alternating checkpoints

    def __init__(self):
        self.tables: dict = {}

    def get(self, base: int, copies: tuple, device, keep: bool = True):
        key = (base, copies)
        table = self.tables.get(key)
        if table is None:
            from ..kernels.triton.copy_rows import row_table  # needs triton: imported on use

            cols = np.array(copies, dtype=np.int64).reshape(-1, 3)  # (numpy: host time, see row_table)
            table = row_table(cols[:, 0] + base, cols[:, 1], cols[:, 2], device)
            if keep:
                if len(self.tables) >= self.KEEP:
                    self.tables.clear()
                self.tables[key] = table
        return table

    def release(self) -> None:
        self.tables = {}


def registered_files(model, ckpt, read: dict[str, int]) -> dict:
    """{file: RegisteredFile} for the files of `read` ({file: bytes this reload reads})
    that this reload reads from registered memory, registering those the policy wants.
    Registering pins a file's pages: the transaction calls this before it takes the
    weights lock, so forwards are not locked out meanwhile (the driver holds their CUDA
    calls a piece at a time, `checkpoint.registered`). The registry counts, per file and
    stamps, the reloads that read from it; `release_staging` forgets the counts."""
    shards: RegisteredShards = holder(model, "registered", RegisteredShards)
    if REGISTER == "never":
        return {}
    cache_ok = _chunks.READ_IO != "direct"  # (direct reads keep the page cache clear)
    out, step, budget = {}, REGISTER_STEP, _register_budget()
    first = REGISTER_STEP > 0  # a step may take one shard larger than itself
    keep = {str(ckpt.path / f) for f in read}
    for fname, nbytes in read.items():
        path = ckpt.path / fname
        parsed = ckpt.parsed_stamp(fname)  # (size is its third field: no stat here)
        size = parsed[2]
        mostly = 2 * nbytes >= size  # registering costs this reload about nothing extra
        reads = shards.count_read(path, parsed)
        want = REGISTER == "always" or (reads >= 2 and cache_ok
                                        and (mostly or size <= step or first))
        current = shards.current(path)
        if current is None and want and not shards.refused_now(path) and shards.make_room(size, budget, keep):
            with trace.range("fp8_reload/register", payload=size):
                current = shards.get(path)
            if current is not None and not mostly:
                step, first = step - size, False
        # a writer may have renamed a new version in since the plan: its bytes are not at
        # the parsed offsets; the ring's `open_shard` refuses it with a clear error
        if current is not None and current.stamp == parsed:
            out[fname] = current
    return out


def registered_now(model, ckpt, files) -> set[str]:
    """Which of `files` a reload reads from registered memory already (registered under the
    stamps parsed): nothing counted, nothing registered (`registered_files` does that, once
    the reload's checks before the lock have passed)."""
    shards = held(model).get("registered")
    if shards is None or REGISTER == "never":
        return set()
    return {f for f in files if (reg := shards.current(ckpt.path / f)) is not None
            and reg.stamp == ckpt.parsed_stamp(f)}


def release_dropped(model) -> None:
    """Unregister the registrations `registered_files` stopped using (files changed, room
    made): the driver's unregister waits for the whole device, so the transaction calls
    this under the weights lock, once the device is idle (`RegisteredShards.release_dropped`)."""
    shards = held(model).get("registered")
    if shards is not None:
        shards.release_dropped()


def _from_host(dst: torch.Tensor, src: torch.Tensor, stream, base: int, piece: int | None) -> None:
    """`src` (host bytes) into `dst` on `stream`. From a registered file (`piece`: bytes
    per registration; `base`: `src`'s offset in the file) one copy per registration it
    spans: to the driver, a range across two registrations is not pinned memory."""
    if piece is None:
        copy_async(dst, src, stream)
        return
    at, n = 0, src.numel()
    while at < n:
        end = min(n, ((base + at) // piece + 1) * piece - base)
        copy_async(dst[at:end], src[at:end], stream)
        at = end


def _quantize_chunk(chunk: Chunk, src: torch.Tensor, checks: list | None) -> None:
    """The bf16 weights of `chunk`, now in device memory `src`, into their FP8 places: its
    experts into their slots (two launches per layer shape, each expert a row of addresses),
    its linears by their `quantize_shards_`; with `checks`, their values' flags are
    appended ((targets, flags))."""
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
        if not isinstance(layer, FusedMoE):  # a linear's shards (torch ops, on this stream)
            layer.quant_method.quantize_shards_(layer, views)
            continue
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
        numel = w2[0].numel()
        if (any(v.dtype != torch.bfloat16 or v.numel() != numel for v in views.values())
                or not fp8_expert_layout(w13, s13, w2, s2) or w13[0].numel() != 2 * numel):
            raise ValueError(f"quantize-on-load: {next(iter(shards.values())).module_name}: pieces or "
                             "weights of another size, dtype or layout")
        rows = rows_of.setdefault((numel, s13.numel() // s13.shape[0]), [])
        src3 = (views["w1"].data_ptr(), views["w3"].data_ptr(), views["w2"].data_ptr())
        row = expert_rows(w13, s13, w2, s2)
        for slot in next(iter(shards.values())).slots:  # (what was staged for it is superseded)
            rows.append(row(slot, src3))
            layer.staged.pop(slot, None)
    if checks is not None:  # checked now, one launch a chunk: the slot is reused by the next one
        checks.append(([t for t, _ in checked], nonfinite_flags([v for _, v in checked])))
    for (numel, cols), rows in rows_of.items():
        quantize_experts_(src.device, numel, cols, rows)


def _land(chunk: Chunk, buf: torch.Tensor, k: int, slots: DeviceSlots, tables: RowTables, keep: bool,
          writable, checks, quant_checks, gather: bool = False, base: int = 0, piece: int | None = None,
          lo: int = 0, last: bool = True):
    """Queue one chunk out of `buf` (pinned or registered host memory): its host-to-device
    copy into device buffer ``k % 2`` (`_to_slot`), then, with its `last` part, its writes
    (`_write_out`). A chunk read in parts (`ring.parts_of`) comes a part at a time: `buf`
    holds its buffer's bytes from `lo` on. Returns the event after which `buf` may be
    refilled."""
    landed = _to_slot(chunk, buf, k, slots, gather, base, piece, lo)
    if last:
        _write_out(chunk, k, landed, slots, tables, keep, writable, checks, quant_checks)
    return landed


def _to_slot(chunk: Chunk, buf: torch.Tensor, k: int, slots: DeviceSlots, gather: bool = False, base: int = 0,
             piece: int | None = None, lo: int = 0):
    """The whole chunk (or its part from `lo`) in one host-to-device copy into device buffer
    ``k % 2`` on the "h2d" stream (one DMA runs at the link's speed; hundreds of
    tensor-sized ones from page-cache pages do not). `gather`: `buf` is the chunk's whole
    (registered) file, and each span is copied from its file offset: the gaps between the
    spans of a filtered reload are not moved. A registered file's `piece` and `buf`'s offset
    in it (`base`) split the copies where its registrations meet (`_from_host`). Returns the
    event after which the copy has landed (and `buf` may be refilled)."""
    h2d = side_stream(torch.cuda.current_stream().device, "h2d")
    i = k % 2
    dslot = slots.buffers[i][:chunk.extent]
    if lo == 0 and slots.free[i] is not None:
        h2d.wait_event(slots.free[i])
    if gather:
        for off, n, at in chunk.spans:
            _from_host(dslot[at:at + n], buf[off:off + n], h2d, off, piece)
    elif lo < chunk.extent:  # (an aligned chunk's buffer ends on a whole block past its extent)
        end = min(chunk.extent, lo + buf.numel())
        _from_host(dslot[lo:end], buf[:end - lo], h2d, base, piece)
    # waited on before `buf` is refilled (by reader threads, or by this thread before it asks
    # reader processes for the next part): a blocking event sleeps, a default one spins a core
    landed = torch.cuda.Event(blocking=True)
    landed.record(h2d)
    return landed


def _write_out(chunk: Chunk, k: int, landed, slots: DeviceSlots, tables: RowTables, keep: bool, writable,
               checks, quant_checks) -> None:
    """Chunk `k`'s tensors from device buffer ``k % 2`` to their places on the current stream
    (the writes), once `landed` (its copy in) has run and the backup of what they overwrite
    is taken: one launch for all (`copy_rows`), a copy for a strided destination (or each,
    without Triton, or for a few views whose table would not be kept); bf16 experts
    quantized into their FP8 slots."""
    place = torch.cuda.current_stream()
    i = k % 2
    dslot = slots.buffers[i][:chunk.extent]
    place.wait_event(landed)  # (the h2d stream runs in order: the chunk's earlier parts too)
    rows, others = [], []
    # (triton is an optional extra: without it, a copy each)
    kernel = on_triton(dslot) and (keep or sum(len(t.views) for t in chunk.targets) > FEW_ROWS)
    for t in chunk.targets:
        writable(t.module, t.slots)
        if t.kind != "copy":
            continue
        at, nbytes = chunk.offset_of(t), t.info.nbytes
        for view in t.views:
            if kernel and view.is_contiguous():
                rows += (at, view.data_ptr(), nbytes)
            else:
                others.append((view, t))
        checks.append((t, t.views[0]))
    if rows:
        from ..kernels.triton.copy_rows import launch_rows_  # needs triton: imported on use

        launch_rows_(tables.get(dslot.data_ptr(), tuple(rows), dslot.device, keep), dslot.device)
    for view, t in others:
        copy_async(view, chunk.source(dslot, t), place)
    if any(t.kind == "quant" for t in chunk.targets):
        _quantize_chunk(chunk, dslot, quant_checks)
    slots.free[i] = torch.cuda.Event()
    slots.free[i].record(place)


def commit_cuda(model, ckpt, chunks: list[Chunk], writable, check: bool, stats: dict, device,
                keep_tables: bool = True, backup_ahead=None, registered: dict | None = None) -> None:
    """Copy every streamed target (in `chunks`, `chunks.make_chunks`) into place on `device`
    (the model's), then check the values (one read-back). `writable(module, slots)` makes
    the writes stream wait until those slots of `module` (all of it, for no slots) may be
    overwritten (their backup is taken). `backup_ahead()`, if given, queues the whole
    backup: called while the ring's first reads run, where reader threads read
    (`ring.stream_through_ring`). `registered`: the files read from registered memory
    (`registered_files`, called before the weights lock); the rest go through the ring."""
    stream = side_stream(device, "copy")
    stream.wait_stream(torch.cuda.current_stream(device))
    side_stream(device, "h2d").wait_stream(stream)
    checks: list[tuple[Target, torch.Tensor]] = []
    quant_checks: list | None = [] if check else None
    registered = registered or {}
    direct, rest, windows = [], [], []
    for chunk in chunks:
        if chunk.file not in registered:
            rest.append(chunk)
            continue
        direct.append(chunk.window)
        windows.append(direct[-1][0].extent)
    slots: DeviceSlots = holder(model, "device_slots", DeviceSlots)
    slots.reserve(max(windows + [c.extent for c in rest]), device)
    tables: RowTables = holder(model, "row_tables", RowTables)
    landing = (slots, tables, keep_tables, writable, checks, quant_checks)
    flags = []
    try:
        with torch.cuda.stream(stream):
            with trace.range("fp8_reload/dma", payload=sum(c.nbytes for c, _, _ in direct)):
                # each chunk's copy in is queued before the writes of the one before: the link
                # carries it while the host queues those (at the first: and the backup's start)
                behind = None
                for k, (chunk, start, end) in enumerate(direct):
                    reg = registered[chunk.file]
                    if start is None:
                        landed = _to_slot(chunk, reg.view, k, slots, gather=True, piece=reg.piece)
                    else:
                        landed = _to_slot(chunk, reg.view[start:end], k, slots, base=start, piece=reg.piece)
                    stats["bytes_read"] = stats.get("bytes_read", 0) + chunk.nbytes
                    if behind is not None:
                        _write_out(*behind, *landing)
                    behind = (chunk, k, landed)
                if behind is not None:
                    _write_out(*behind, *landing)
            if rest:
                # bf16 chunks (quantized in the stream) land whole: in parts, a first reload of
                # v2-lite:4 bf16 took a median 236.5 ms against 188.5 (fp8: 75.3 against 90.5)
                parts = _chunks.PART_BYTES if ckpt.kind == "fp8" else 0
                ring = ring_for(model, max(c.buffer_bytes for c in rest), True, parts)
                turn = itertools.count(len(direct))  # which device buffer: the two alternate, by chunk
                now = [0]

                def land(chunk, buf, lo, last):
                    if lo == 0:
                        now[0] = next(turn)
                        lead = chunk.quant_lead() if last else 0  # (direct reads: see quant_lead)
                        chunk, buf = (chunk.moved(lead), buf[lead:]) if lead else (chunk, buf)
                    return _land(chunk, buf, now[0], *landing, lo=lo, last=last)

                with trace.range("fp8_reload/ring", payload=sum(c.nbytes for c in rest)):
                    stream_through_ring(ckpt, rest, ring, land, stats, reading=backup_ahead)
            if check and checks:  # the same views every first reload: their table is kept
                kept = holder(model, "value_tables", KeptTables)
                flags.append(nonfinite_flags([v for _, v in checks], kept))
    finally:  # also on a failure: a restore (on the current stream) must come after every write
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        current.wait_stream(side_stream(device, "h2d"))
    if check and (checks or quant_checks):
        for targets, qflags in quant_checks or ():
            checks += [(t, None) for t in targets]
            flags.append(qflags)
        bad = torch.cat(flags).nonzero().flatten().tolist()  # the one read-back of the reload
        if bad:
            raise invalid_value(ckpt, checks[bad[0]][0].info.name, others=len(bad) - 1)
