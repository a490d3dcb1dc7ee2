"""Reading a checkpoint directory: config, index, shard headers, then tensor bytes.

Nothing is read before it is needed: opening a `Checkpoint` reads `config.json`
and the index, a shard's header is parsed on first use, and tensor bytes are
read with positional reads at the offsets the validated header gives.
"""

from __future__ import annotations

import dataclasses
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import wait
from pathlib import Path, PurePosixPath

import torch

from .. import trace
from ..config import MoEConfig, UnsupportedConfigError
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from . import files
from .files import read_span
from .header import (
    OTHER_WEIGHT_SUFFIXES,
    PICKLE_SUFFIXES,
    ShardHeader,
    TensorInfo,
    check_weight_file_name,
    load_shard_header,
    parse_json,
)
from .layout import INDEX_FILE, SINGLE_FILE
from .staging import PIECE_BYTES, READ_THREADS, aligned, reader_pool


def _read_tensor(handle, fpath: Path, info: TensorInfo, out: torch.Tensor | None = None,
                 piece: tuple[int, int] | None = None) -> torch.Tensor:
    """The bytes of one tensor, viewed with its dtype and shape; of a `piece` ``(lo, hi)`` of
    it (a tensor read by several threads), bytes ``[lo, hi)`` into ``out[lo:hi]``, raw."""
    lo, hi = piece or (0, info.nbytes)
    buf = read_span(handle, fpath, info.offset + lo, hi - lo, out if piece is None else out[lo:hi],
                    what=f"tensor {info.name!r}" + (f" (its bytes {lo} to {hi})" if piece else ""))
    return buf if piece else buf.view(info.dtype).reshape(info.shape)


class Checkpoint:
    """A checkpoint directory: config, kind, and an index from tensor name to file.

    Opening it reads `config.json`, the index and validates them; each shard's
    header is read and validated on first use; no tensor data is read until
    `read` is called.
    """

    @trace.range("fp8_reload/index_read")
    def __init__(self, path):
        self.path = files.directory_path(path)
        self._check_directory()
        # What config.json and the index were parsed from: {name: (bytes, stamp, settled)},
        # None for no index. With each parsed shard header, what `unchanged()` checks.
        self.sources: dict[str, tuple[bytes, tuple, bool] | None] = {}
        self._headers: dict[str, ShardHeader] = {}
        self.hf_config = parse_json(self._read_source("config.json"), self.path / "config.json")
        if not isinstance(self.hf_config, dict):
            raise CorruptCheckpointError(f"{self.path / 'config.json'}: not a JSON object")
        try:
            self.config = MoEConfig.from_hf_config(self.hf_config)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            bad = (UnsupportedCheckpointError if isinstance(e, UnsupportedConfigError)
                   else CorruptCheckpointError)
            raise bad(f"{self.path / 'config.json'}: {e}") from None
        self.kind, self.activation_scheme = self._quantization(self.hf_config.get("quantization_config"))
        self.weight_map = self._weight_map()
        self.shard_files = sorted(set(self.weight_map.values()))
        # kept with this parsed checkpoint, i.e. while `unchanged()`:
        self.checked: set[str] = set()  # tensors whose values a reload has checked
        self.plans: dict = {}  # by model: what planning its reloads works out once (reload/plan.py)
        self.scalars: dict[str, float] = {}  # 0-dim scales read once (reload/chunks.py)
        self.advised: set[tuple[str, int, int]] = set()  # read-ahead asked for (reload/chunks.py)

    def _check_directory(self) -> None:
        try:
            st = files.stat_path(self.path)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: checkpoint directory does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointNotFoundError(f"{self.path}: is not a directory")

    def _read_source(self, name: str) -> bytes:
        raw, stamp = files.read_small(self.path / name)
        self.sources[name] = raw, stamp, files.settled(stamp)
        return raw

    def unchanged(self) -> bool:
        """Whether config.json, the index and every shard header parsed so far are
        still what was parsed: then this parse can be reused.

        The stamps (inode, size, times; taken on the open file before it was read,
        so never a stamp of one file over the parse of another) must match. A file
        that was still fresh when it was read (`files.settled`) is compared byte for
        byte too: rewritten in place within one timestamp tick at the same size, it
        keeps its stamp. Once it has settled since (a stat after the comparison still
        gives its stamp, now old enough), what was compared is final and the parse
        counts as settled from then on: what is read from the file later may be kept.
        A checkpoint at rest costs one stat per file.
        """
        try:
            for name, source in self.sources.items():
                path = self.path / name
                if source is None:
                    if files.exists(path):
                        return False
                    continue
                raw, stamp, settled = source
                if files.stamp(files.stat_path(path)) != stamp:
                    return False
                if not settled:
                    if files.read_small(path)[0] != raw:
                        return False
                    if _settled_since(path, stamp):
                        self.sources[name] = raw, stamp, True
            for fname, header in list(self._headers.items()):
                path = self.path / fname
                if files.stamp(files.stat_path(path)) != header.stamp:
                    return False
                if not header.settled:
                    with files.open_regular(path) as f:
                        if not header.unchanged(f, path):
                            return False
                    if _settled_since(path, header.stamp):
                        self._headers[fname] = dataclasses.replace(header, settled=True)
        except CheckpointError:
            return False
        return True

    def same_index(self, other: Checkpoint) -> bool:
        """Whether `other`, an earlier parse of this directory, was parsed from the same
        config.json and index bytes: the same names in the same files, in the same order."""
        def raw(sources):
            return {name: None if src is None else src[0] for name, src in sources.items()}

        return raw(self.sources) == raw(other.sources) and \
            list(self.weight_map.items()) == list(other.weight_map.items())

    def parsed_headers(self) -> dict[str, dict[str, TensorInfo]]:
        """{shard: its `TensorInfo`s} of every shard parsed so far (`same_headers`)."""
        return {fname: h.tensors for fname, h in self._headers.items()}

    def same_headers(self, parsed: dict[str, dict[str, TensorInfo]]) -> bool:
        """Whether each shard of `parsed` (`parsed_headers` of this or an earlier parse)
        parses here to the very same `TensorInfo`s (`header.parse_shard_header` keeps them
        by name, size and header bytes): then what was planned from those holds here."""
        try:
            return all(self._header(f) is tensors for f, tensors in parsed.items())
        except CheckpointError:  # (a shard gone or broken: the plan that follows says what)
            return False

    def _quantization(self, qc) -> tuple[str, str]:
        where = f"{self.path / 'config.json'}: quantization_config"
        if qc is None:
            return "bf16", "dynamic"
        if not isinstance(qc, dict):
            raise CorruptCheckpointError(f"{where} is not an object: {str(qc)[:100]}")
        if qc.get("quant_method") != "fp8":
            raise UnsupportedCheckpointError(f"{where}: quant_method {qc.get('quant_method')!r} is "
                                             "not supported (only per-tensor 'fp8')")
        if qc.get("weight_block_size") is not None:
            raise UnsupportedCheckpointError(f"{where}: block-wise FP8 (weight_block_size "
                                             f"{qc['weight_block_size']}) is not supported; only "
                                             "per-tensor scales")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedCheckpointError(f"{where}: fmt {qc.get('fmt')!r} is not supported (only e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "static":
            raise UnsupportedCheckpointError(f"{where}: only the static activation scheme is supported "
                                             f"for FP8 checkpoints, got {scheme!r}")
        return "fp8", scheme

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, from the index (or the single file's header)."""
        index_file = self.path / INDEX_FILE
        if files.exists(index_file):
            index = parse_json(self._read_source(INDEX_FILE), index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CorruptCheckpointError(f"{index_file}: no weight_map (an object from tensor "
                                             "name to file)")
            named = set()
            for fname in weight_map.values():
                if not isinstance(fname, str):
                    raise CorruptCheckpointError(f"{index_file}: weight file name {str(fname)[:100]!r} "
                                                 "is not a string")
                named.add(fname)
            for fname in sorted(named):
                check_weight_file_name(index_file, fname)
            return weight_map
        self.sources[INDEX_FILE] = None
        if files.exists(self.path / SINGLE_FILE):
            return {n: SINGLE_FILE for n in self._header(SINGLE_FILE)}
        names = files.list_dir(self.path)
        pickles = [f for f in names if PurePosixPath(f).suffix.lower() in PICKLE_SUFFIXES]
        if pickles:
            raise UnsafeCheckpointError(
                f"{self.path}: only pickle weight files ({', '.join(pickles[:5])}); refusing to "
                "load them (unpickling runs code from the file). Convert the checkpoint to safetensors.")
        others = [f for f in names if PurePosixPath(f).suffix.lower() in OTHER_WEIGHT_SUFFIXES]
        if others:
            raise UnsupportedCheckpointError(f"{self.path}: weight files {', '.join(others[:5])} are "
                                             "not safetensors; only safetensors weights are loaded")
        raise CheckpointNotFoundError(f"{self.path}: no {INDEX_FILE} and no {SINGLE_FILE}")

    def _header(self, fname: str) -> dict[str, TensorInfo]:
        """A shard's parsed header; read on first use so a filtered reload opens only
        the shards that hold selected tensors. `fname` is the name the index gives
        (a subfolder path too): header and tensor bytes come from that one file."""
        if fname not in self._headers:
            fpath = self.path / fname
            try:
                self._headers[fname] = load_shard_header(fpath, fname)
            except CheckpointNotFoundError:
                if self.sources.get(INDEX_FILE) is None or files.exists(fpath):
                    raise
                raise CheckpointNotFoundError(f"{self.path / INDEX_FILE}: names file {fname}, "
                                              f"which does not exist ({fpath})") from None
        return self._headers[fname].tensors

    def settled(self, fname: str) -> bool:
        """Whether shard `fname` was settled (`files.settled`) when its header was parsed,
        or has been found settled since (`unchanged`): then any later rewrite moves its
        stamp, and what is read from it may be kept with this parse. A fresh one can be
        rewritten in place within one timestamp tick without its stamp moving: only its
        header bytes are compared, not its data."""
        self._header(fname)
        return self._headers[fname].settled

    def parsed_stamp(self, fname: str) -> tuple:
        """Shard `fname`'s stamp when its header was parsed. Bytes read other than through
        `open_shard` (a registered mapping of the file) are this parse's only if the file
        read has this stamp."""
        self._header(fname)
        return self._headers[fname].stamp

    def open_shard(self, fname: str):
        """Open shard `fname` for its tensor bytes, if it is still the file whose header was
        parsed (same stamp and header bytes): (file, its stamp). A shard replaced or rewritten
        since then is refused: never read at another file's offsets, and never a file newer
        than the plan (one shard of a new version beside the others of the old one)."""
        fpath = self.path / fname
        self._header(fname)
        f = files.open_regular(fpath)
        try:
            if not self._headers[fname].unchanged(f, fpath):
                raise CorruptCheckpointError(f"{fpath}: changed after its header was read (rewritten "
                                             "or replaced while loading); nothing was read from it")
            stamp = files.stamp(files.fstat(f, fpath))
        except BaseException:
            f.close()
            raise
        return f, stamp

    def _open_shard(self, fname: str, stamps: dict):
        f, stamps[fname] = self.open_shard(fname)
        return f

    def info(self, name: str) -> TensorInfo:
        fname = self.weight_map.get(name)
        if fname is None:
            raise MissingTensorError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        info = self._header(fname).get(name)
        if info is None:
            raise MissingTensorError(f"{self.path / INDEX_FILE}: names tensor {name!r} in {fname}, "
                                     f"but {self.path / fname} does not hold it")
        return info

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def read(self, names: Iterable[str], stats: dict | None = None,
             into=None, threads: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, CPU tensor) for `names`, opening only the shards that hold them,
        in file and offset order. `stats` (if given) accumulates bytes_read and files_opened.

        Bytes are read at the offsets the validated header gives (no mmap: a file changed
        or truncated later cannot fault a commit; nothing is kept per read, where
        safetensors 0.8.0's `get_tensor` kept ~60 bytes a call). By default into fresh host
        memory, a tensor at a time; with `into` (a `staging.PinnedArena`) into that reused
        (pinned) buffer, in `PIECE_BYTES` pieces by `READ_THREADS` threads (at most `threads`
        reads at a time): each later host-to-device copy is a single DMA."""
        infos = [self.info(name) for name in names]
        infos.sort(key=lambda i: (i.file, i.offset))
        stats = stats if stats is not None else {}
        stats.setdefault("bytes_read", 0)
        stats.setdefault("files_opened", 0)
        handles: dict[str, object] = {}
        stamps: dict[str, tuple] = {}  # of each opened shard, when opened
        try:
            if into is not None:
                yield from self._read_parallel(infos, into, handles, stamps, stats, threads)
                return
            for info in infos:
                fpath = self.path / info.file
                if info.file not in handles:
                    for f, h in handles.items():
                        self._check_untouched(f, h, stamps[f])
                        h.close()
                    handles.clear()
                    with trace.range("fp8_reload/shard_open"):
                        handles[info.file] = self._open_shard(info.file, stamps)
                    stats["files_opened"] += 1
                with trace.range("fp8_reload/tensor_read", payload=info.nbytes):
                    tensor = _read_tensor(handles[info.file], fpath, info)
                stats["bytes_read"] += info.nbytes
                yield info.name, tensor
            for f, h in handles.items():
                self._check_untouched(f, h, stamps[f])
        finally:
            for h in handles.values():
                h.close()

    def _check_untouched(self, fname: str, handle, stamp: tuple) -> None:
        """After its tensors were read: a shard written to meanwhile (in place, same
        size) may have given a torn mix of old and new bytes; its size and mtime tell,
        and its ctime when the writer put the mtime back (``rsync --inplace``, ``cp -p``).
        A moved ctime alone is accepted from a file linked nowhere any more: a writer
        that renames a new version over it unlinks the copy being read (bytes intact)."""
        fpath = self.path / fname
        st = files.fstat(handle, fpath)
        now = files.stamp(st)
        if now[:4] != stamp[:4] or (now[4] != stamp[4] and st.st_nlink > 0):
            raise CorruptCheckpointError(f"{fpath}: changed while it was being read (written to "
                                         "during the load); its tensors are not used")

    def _read_parallel(self, infos, arena, handles, stamps, stats, threads: int | None):
        """Read into the arena from `READ_THREADS` threads (or `threads` reads at a time, each
        started as the one `threads` before it is taken); yield each tensor, in order, as
        soon as it (and all before it) has been read, so that a consumer (the value check)
        works while later reads are still running."""
        arena.reset(sum(aligned(i.nbytes) for i in infos))
        slots = [arena.take(i.nbytes) for i in infos]
        with trace.range("fp8_reload/shard_open"):
            for f in sorted({i.file for i in infos}):
                handles[f] = self._open_shard(f, stamps)
                stats["files_opened"] += 1
        total = sum(i.nbytes for i in infos)
        # tensors in pieces, each a read: whole, a bf16 checkpoint's 45 MB linears were read
        # at one thread's speed (8 tensors, 124 MB: ~10 ms of a first reload on the H200 host)
        pieces = [(k, lo, min(i.nbytes, lo + PIECE_BYTES)) for k, i in enumerate(infos)
                  for lo in range(0, max(1, i.nbytes), PIECE_BYTES)]
        ends = [p for p in range(1, len(pieces) + 1) if p == len(pieces) or pieces[p][0] != pieces[p - 1][0]]

        def work(p):
            k, lo, hi = pieces[p]
            info = infos[k]
            return _read_tensor(handles[info.file], self.path / info.file, info, slots[k], (lo, hi))

        with trace.range("fp8_reload/tensor_read", payload=total):
            window = len(pieces) if threads is None else threads
            if len(pieces) <= 1 or READ_THREADS <= 1 or window <= 1:
                for k, info in enumerate(infos):
                    tensor = _read_tensor(handles[info.file], self.path / info.file, info, out=slots[k])
                    stats["bytes_read"] += info.nbytes
                    yield info.name, tensor
                for f, h in handles.items():
                    self._check_untouched(f, h, stamps[f])
                return
            futures = []
            try:
                pool = reader_pool()
                for k, info in enumerate(infos):
                    for p in range(ends[k - 1] if k else 0, ends[k]):
                        # (one by one: a failed submit leaves the others waited for)
                        while len(futures) < min(len(pieces), p + window):
                            futures.append(pool.submit(work, len(futures)))
                        futures[p].result()
                    stats["bytes_read"] += info.nbytes
                    yield info.name, slots[k].view(info.dtype).reshape(info.shape)
            finally:  # an error, or the consumer stopped: no read outlives the handles
                for future in futures:
                    future.cancel()
                wait(futures)
        for f, h in handles.items():
            self._check_untouched(f, h, stamps[f])

    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.weight_map)


def _settled_since(path, stamp: tuple[int, ...]) -> bool:
    """Whether the file at `path`, just compared byte for byte with what was parsed,
    still has `stamp` and has settled (`files.settled`): no write since the comparison
    could have kept its stamp, so what was compared is what the file holds for good."""
    st = files.stamp(files.stat_path(path))
    return st == stamp and files.settled(st)
