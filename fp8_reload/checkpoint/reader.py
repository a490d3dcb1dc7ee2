"""Reading a checkpoint directory: config, index, shard headers, then tensor bytes.

Nothing is read before it is needed: opening a `Checkpoint` reads `config.json`
and the index, a shard's header is parsed on first use, and tensor bytes are
read with positional reads at the offsets the validated header gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import torch

from .. import trace
from ..config import MoEConfig
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from .header import (
    OTHER_WEIGHT_SUFFIXES,
    PICKLE_SUFFIXES,
    TensorInfo,
    check_weight_file_name,
    parse_json,
    read_safetensors_header,
)
from .layout import INDEX_FILE, SINGLE_FILE
from .staging import READ_THREADS, aligned


def open_shard(fpath: Path):
    """A shard opened for positional reads (a file object: use it in a ``with``)."""
    try:
        return open(fpath, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{fpath}: vanished while reading") from None
    except OSError as e:
        raise UnreadableCheckpointError(f"{fpath}: cannot open: {e.strerror or e}") from None


def read_span(handle, fpath: Path, offset: int, nbytes: int, out: torch.Tensor | None = None,
              what: str = "data") -> torch.Tensor:
    """`nbytes` bytes at `offset` (validated by the caller against the header), into `out`
    (uint8, e.g. a pinned staging slice) or fresh CPU memory. Positional reads: threads may
    share `handle`."""
    buf = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
    view = memoryview(buf.numpy())
    fd = handle.fileno()
    got = 0
    try:
        while got < nbytes:  # one read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                raise CorruptCheckpointError(
                    f"{fpath}: truncated while reading {what}: got {got} of {nbytes} bytes "
                    "(the file changed after its header was read?)")
            got += n
    except OSError as e:
        raise UnreadableCheckpointError(f"{fpath}: cannot read {what}: {e.strerror or e}") from None
    return buf


def _read_tensor(handle, fpath: Path, info: TensorInfo,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of one tensor, viewed with its dtype and shape."""
    buf = read_span(handle, fpath, info.offset, info.nbytes, out, what=f"tensor {info.name!r}")
    return buf.view(info.dtype).reshape(info.shape)


class Checkpoint:
    """A checkpoint directory: config, kind, and an index from tensor name to file.

    Opening it reads `config.json`, the index and validates them; each shard's
    header is read and validated on first use; no tensor data is read until
    `read` is called.
    """

    @trace.range("fp8_reload/index_read")
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "checkpoint directory does not exist"
            raise CheckpointNotFoundError(f"{self.path}: {what}")
        self.hf_config = self._read_json(self.path / "config.json")
        if not isinstance(self.hf_config, dict):
            raise CorruptCheckpointError(f"{self.path / 'config.json'}: not a JSON object")
        try:
            self.config = MoEConfig.from_hf_config(self.hf_config)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(f"{self.path / 'config.json'}: {e}") from None
        self.kind, self.activation_scheme = self._quantization(self.hf_config.get("quantization_config"))
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self.weight_map = self._weight_map()
        # kept with this parsed checkpoint, i.e. while its files' stamps are unchanged:
        self.checked: set[str] = set()  # tensors whose values a reload has checked
        self.reads: dict[str, int] = {}  # per shard, reloads that read most of it
        self.plans: dict = {}  # full-reload plans by model (reload/transaction.py)

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

    @staticmethod
    def _read_json(file: Path):
        try:
            raw = file.read_bytes()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{file}: missing") from None
        except OSError as e:
            raise UnreadableCheckpointError(f"{file}: cannot read: {e.strerror or e}") from None
        return parse_json(raw, file)

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, from the index (or the single file's header)."""
        index_file = self.path / INDEX_FILE
        if index_file.exists():
            index = self._read_json(index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CorruptCheckpointError(f"{index_file}: no weight_map (an object from tensor "
                                             "name to file)")
            files = set()
            for fname in weight_map.values():
                if not isinstance(fname, str):
                    raise CorruptCheckpointError(f"{index_file}: weight file name {str(fname)[:100]!r} "
                                                 "is not a string")
                files.add(fname)
            for fname in sorted(files):
                check_weight_file_name(index_file, fname)
            return weight_map
        if (self.path / SINGLE_FILE).exists():
            return {n: SINGLE_FILE for n in self._header(SINGLE_FILE)}
        files = sorted(p.name for p in self.path.iterdir())
        pickles = [f for f in files if PurePosixPath(f).suffix.lower() in PICKLE_SUFFIXES]
        if pickles:
            raise UnsafeCheckpointError(
                f"{self.path}: only pickle weight files ({', '.join(pickles[:5])}); refusing to "
                "load them (unpickling runs code from the file). Convert the checkpoint to safetensors.")
        others = [f for f in files if PurePosixPath(f).suffix.lower() in OTHER_WEIGHT_SUFFIXES]
        if others:
            raise UnsupportedCheckpointError(f"{self.path}: weight files {', '.join(others[:5])} are "
                                             "not safetensors; only safetensors weights are loaded")
        raise CheckpointNotFoundError(f"{self.path}: no {INDEX_FILE} and no {SINGLE_FILE}")

    def _header(self, fname: str) -> dict[str, TensorInfo]:
        """A shard's parsed header; read on first use so a filtered reload opens only
        the shards that hold selected tensors."""
        if fname not in self._headers:
            fpath = self.path / fname
            if not fpath.exists():
                raise CheckpointNotFoundError(f"{self.path / INDEX_FILE}: names file {fname}, "
                                              f"which does not exist ({fpath})")
            self._headers[fname] = read_safetensors_header(fpath)
        return self._headers[fname]

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
             into=None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, CPU tensor) for `names`, opening only the shards that hold them,
        in file and offset order. `stats` (if given) accumulates bytes_read and files_opened.

        Each tensor's bytes are read at the offsets the validated header gives (no
        mmap: a file changed or truncated later cannot fault a commit, and nothing is
        retained per read; safetensors' own `get_tensor` keeps ~60 bytes per call,
        measured with 0.8.0). By default into fresh host memory, one tensor at a time;
        with `into` (a `staging.PinnedArena`) all of them are read up front into that
        reused (pinned) buffer by `staging.READ_THREADS` threads, so that each later
        host-to-device copy is a single DMA.
        """
        infos = [self.info(name) for name in names]
        infos.sort(key=lambda i: (i.file, i.offset))
        stats = stats if stats is not None else {}
        stats.setdefault("bytes_read", 0)
        stats.setdefault("files_opened", 0)
        handles: dict[str, object] = {}
        try:
            if into is not None:
                yield from self._read_parallel(infos, into, handles, stats)
                return
            for info in infos:
                fpath = self.path / info.file
                if info.file not in handles:
                    for h in handles.values():
                        h.close()
                    handles.clear()
                    with trace.range("fp8_reload/shard_open"):
                        handles[info.file] = open_shard(fpath)
                    stats["files_opened"] += 1
                with trace.range("fp8_reload/tensor_read", payload=info.nbytes):
                    tensor = _read_tensor(handles[info.file], fpath, info)
                stats["bytes_read"] += info.nbytes
                yield info.name, tensor
        finally:
            for h in handles.values():
                h.close()

    def _read_parallel(self, infos, arena, handles, stats):
        arena.reset(sum(aligned(i.nbytes) for i in infos))
        slots = [arena.take(i.nbytes) for i in infos]
        with trace.range("fp8_reload/shard_open"):
            for f in sorted({i.file for i in infos}):
                handles[f] = open_shard(self.path / f)
                stats["files_opened"] += 1
        total = sum(i.nbytes for i in infos)

        def work(k):
            info = infos[k]
            return _read_tensor(handles[info.file], self.path / info.file, info, out=slots[k])

        with trace.range("fp8_reload/tensor_read", payload=total):
            if len(infos) > 1 and READ_THREADS > 1:
                with ThreadPoolExecutor(min(READ_THREADS, len(infos))) as pool:
                    tensors = list(pool.map(work, range(len(infos))))
            else:
                tensors = [work(k) for k in range(len(infos))]
        stats["bytes_read"] += total
        yield from ((i.name, t) for i, t in zip(infos, tensors))

    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.weight_map)
