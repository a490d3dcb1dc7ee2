"""Strict safetensors header parsing, and the rules for weight file names.

Safety: weight files are parsed as safetensors only (an 8-byte length, a JSON
header, raw bytes). Nothing is unpickled and no string from a checkpoint is
evaluated: JSON is parsed with `json`, tensor bytes are read at the offsets the
validated header gives. Every failure surfaces as a `CheckpointError` subclass
naming the file.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from .. import trace
from ..errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from . import files
from .layout import nbytes

# Weight files in these formats are unpickled by their usual loaders: refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Other weight formats we recognise only to name them in the error.
OTHER_WEIGHT_SUFFIXES = (".gguf", ".npz", ".npy", ".h5", ".msgpack", ".onnx")
SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                      "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
                      "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                      "BOOL": torch.bool}
# safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
# Tensors per file. Real shards hold hundreds to a few thousand; a header of 100 MB of
# empty entries holds 1.45 million, and parsing them costs ~16 s and 1.7 GB (measured).
MAX_HEADER_ENTRIES = 1 << 18
# Members of all JSON objects: four per tensor entry, one per `__metadata__` entry (one
# object however many members: 7 million of them, 97 MB, cost 10 s and 1.3 GB to parse).
MAX_HEADER_MEMBERS = 5 * MAX_HEADER_ENTRIES


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file
    nbytes: int


def _sniff_format(head: bytes) -> str | None:
    """Name the format of a file that failed to parse as safetensors, if recognisable."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (torch.save format: its data.pkl is a pickle)"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a pickle (protocol {head[1]})"
    if head.startswith(b"GGUF"):
        return "a GGUF file"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    return None


def _refuse_sniffed(file: Path, head: bytes) -> None:
    fmt = _sniff_format(head)
    if fmt is None:
        return
    if "pickle" in fmt:
        raise UnsafeCheckpointError(f"{file}: is {fmt}, not safetensors; refusing to load it "
                                    "(unpickling runs code from the file)")
    raise UnsupportedCheckpointError(f"{file}: is {fmt}, not safetensors")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_object(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json(raw: bytes, what) -> object:
    """Strict JSON (UTF-8, no NaN/Infinity, no duplicate keys); CorruptCheckpointError otherwise."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant,
                          object_pairs_hook=_unique_object)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(f"{what}: corrupt JSON: {str(e)[:200]}") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Where:
    """"<file>: header entry for tensor <name>", formatted only for an error message (a
    checkpoint's thousands of valid entries never need it)."""

    __slots__ = ("file", "name")

    def __init__(self, file, name):
        self.file, self.name = file, name

    def __str__(self) -> str:
        return f"{self.file}: header entry for tensor {self.name!r}"


def _parse_entry(file: Path, fname: str, name: str, meta, data_start: int,
                 data_len: int) -> TensorInfo:
    where = _Where(file, name)
    if not isinstance(meta, dict) or not ("dtype" in meta and "shape" in meta and "data_offsets" in meta):
        raise CorruptCheckpointError(f"{where} is not {{dtype, shape, data_offsets}}: {str(meta)[:200]}")
    dtype_name, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype_name, str):
        raise CorruptCheckpointError(f"{where}: dtype {dtype_name!r} is not a string")
    dtype = SAFETENSORS_DTYPES.get(dtype_name)
    if dtype is None:
        raise UnsupportedCheckpointError(f"{where}: dtype {dtype_name[:40]!r} is not supported")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"{where}: shape {str(shape)[:100]} is not a list of "
                                     "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(v) for v in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise CorruptCheckpointError(f"{where}: data_offsets {str(offsets)[:100]} is not "
                                     "[begin, end] with 0 <= begin <= end")
    begin, end = offsets
    size = nbytes(shape, dtype)
    if end - begin != size:
        raise CorruptCheckpointError(f"{where}: data_offsets [{begin}, {end}) hold {end - begin} "
                                     f"bytes, but {dtype_name} {shape} needs {size}")
    if end > data_len:
        raise CorruptCheckpointError(f"{file}: truncated: tensor {name!r} needs data bytes up to "
                                     f"{end}, the file has {data_len}")
    return TensorInfo(name, fname, dtype, tuple(shape), data_start + begin, size)


@dataclass(frozen=True)
class ShardHeader:
    """A shard's validated header and exactly what it was validated from.

    `stamp` (`files.stamp` of the open file, taken before its header was read)
    and `head` (the 8-byte length and the JSON) identify the parsed file; the
    offsets hold for the file while `unchanged` says it is still that file.
    """

    stamp: tuple[int, ...]
    head: bytes
    tensors: dict[str, TensorInfo]
    settled: bool = False  # `files.settled` when read: the stamp alone tells a rewrite

    @property
    def size(self) -> int:
        return self.stamp[2]

    def unchanged(self, f, path) -> bool:
        """Whether the open file `f` is still the parsed one: same stamp (so the same
        inode: not a replacement, even one with the same layout) and same header bytes
        (a rewrite in place within one timestamp tick keeps the stamp)."""
        return files.stamp(files.fstat(f, path)) == self.stamp and \
            files.pread(f, len(self.head), 0, path) == self.head


def read_header_bytes(f, file: Path) -> tuple[tuple[int, ...], bytes]:
    """(stamp, the 8-byte length and the JSON header) of the open file `f`, refusing
    lengths the file cannot hold; no tensor data is read."""
    stamp = files.stamp(files.fstat(f, file))
    size = stamp[2]
    head = files.pread(f, 8, 0, file)
    if len(head) < 8:
        _refuse_sniffed(file, head)
        raise CorruptCheckpointError(f"{file}: truncated: {len(head)} bytes, no safetensors header")
    (hlen,) = struct.unpack("<Q", head)
    if hlen > min(size - 8, MAX_HEADER_BYTES):
        _refuse_sniffed(file, head)
        raise CorruptCheckpointError(
            f"{file}: corrupt or truncated header: claims {hlen} bytes, the file has "
            f"{size - 8} after the length")
    raw = files.pread(f, hlen, 8, file)
    if len(raw) < hlen:  # the file shrank while we read it
        raise CorruptCheckpointError(f"{file}: truncated header")
    # A C scan before any JSON is parsed: each entry is a JSON object, and no escape can
    # spell a brace outside a string, so this bounds the entries (strings may add more).
    entries = raw.count(b"{") - 1
    if entries > MAX_HEADER_ENTRIES:
        raise CorruptCheckpointError(f"{file}: corrupt header: {entries} tensor entries, more than "
                                     f"{MAX_HEADER_ENTRIES} (parsing them would take seconds and GBs)")
    # every member has one ':' outside strings (those inside strings only add to the bound)
    members = raw.count(b":")
    if members > MAX_HEADER_MEMBERS:
        raise CorruptCheckpointError(f"{file}: corrupt header: up to {members} JSON members, more than "
                                     f"{MAX_HEADER_MEMBERS} (parsing them would take seconds and GBs)")
    return stamp, head + raw


@trace.range("fp8_reload/shard_header")
def load_shard_header(file: Path, name: str | None = None) -> ShardHeader:
    """Open `file` (a regular file only, see `files`), read and validate its header.

    `name` is what `TensorInfo.file` records: the file name as the index gives it
    (``sub/model-00001-of-00002.safetensors``), so the tensor bytes are later read
    from exactly the file whose header was parsed.
    """
    file = Path(file)
    with files.open_regular(file) as f:
        stamp, head = read_header_bytes(f, file)
    return ShardHeader(stamp, head, parse_shard_header(file, name or file.name, stamp[2], head),
                       files.settled(stamp))


def read_safetensors_header(file: Path, name: str | None = None) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header without reading tensor data."""
    return load_shard_header(file, name).tensors


# Headers parsed, by (the name the index gives the file, its size, its header bytes): what
# they parse to depends on nothing else. RL weight sync writes new files of one layout at
# every step, and a file touched keeps its bytes: parsed once, and the same `TensorInfo`s
# let the plans made from them be reused as they are. The last `PARSED_KEEP` are kept
# (two alternating checkpoints of a model of hundreds of shards).
_PARSED: dict[tuple[str, int, bytes], dict[str, TensorInfo]] = {}
_PARSED_LOCK = threading.Lock()  # reloads of several models may parse at once
PARSED_KEEP = 512


def forget_parsed() -> None:
    """Drop every kept parse (`release_staging`): a few MiB per checkpoint of a large model."""
    with _PARSED_LOCK:
        _PARSED.clear()


def parse_shard_header(file: Path, name: str, size: int, head: bytes) -> dict[str, TensorInfo]:
    """`head` parsed (`_parse_shard_header`), or what the same name, size and bytes parsed
    to before. The dict returned is shared: read it, never change it."""
    key = (name, size, head)
    tensors = _PARSED.get(key)
    if tensors is None:
        tensors = _parse_shard_header(file, name, size, head)
        with _PARSED_LOCK:
            while len(_PARSED) >= PARSED_KEEP:
                _PARSED.pop(next(iter(_PARSED)), None)
            _PARSED[key] = tensors
    return tensors


def _parse_shard_header(file: Path, name: str, size: int, head: bytes) -> dict[str, TensorInfo]:
    """Validate the header bytes `head` of a file of `size` bytes.

    As strict as the safetensors library: known dtypes, byte counts that match
    shapes, data regions that tile the data section exactly. So a header that
    passes here is one `safe_open` accepts, and every defect gets a message
    naming the file (and the tensor) instead of a library error.
    """
    hlen = len(head) - 8
    try:
        header = parse_json(head[8:], f"{file}: header")
    except CorruptCheckpointError:
        _refuse_sniffed(file, head[:8])
        raise
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{file}: corrupt header: not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise CorruptCheckpointError(f"{file}: corrupt header: __metadata__ is not a string map")
    data_start = 8 + hlen
    data_len = size - data_start
    out = {t: _parse_entry(file, name, t, m, data_start, data_len)
           for t, m in header.items() if t != "__metadata__"}
    # The data regions must tile [0, data_len) exactly, in offset order: first no
    # overlaps (two tensors sharing bytes), then no gaps.
    ordered = sorted(out.values(), key=lambda i: (i.offset, i.nbytes))
    end, last = data_start, None
    for info in ordered:
        if info.offset < end:
            raise CorruptCheckpointError(f"{file}: corrupt header: tensor {info.name!r} overlaps "
                                         f"the data of tensor {last!r}")
        end, last = info.offset + info.nbytes, info.name
    pos, last = 0, None
    for info in ordered:
        begin = info.offset - data_start
        if begin != pos:
            raise CorruptCheckpointError(f"{file}: corrupt header: {begin - pos} bytes before tensor "
                                         f"{info.name!r} belong to no tensor")
        pos, last = begin + info.nbytes, info.name
    if pos != data_len:
        raise CorruptCheckpointError(f"{file}: corrupt: {data_len - pos} bytes after the last "
                                     f"tensor ({last!r}) that no header entry covers")
    return out


def _encodable(name: str) -> bool:
    """Whether the OS can take `name` as a path (a lone surrogate from JSON cannot)."""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def check_weight_file_name(index_file: Path, fname) -> None:
    """An index may only name safetensors files inside the checkpoint directory."""
    if not isinstance(fname, str) or not fname or "\x00" in fname or not _encodable(fname):
        raise CorruptCheckpointError(f"{index_file}: weight file name {str(fname)[:100]!r} is not a "
                                     "file name")
    p = PurePosixPath(fname)
    if p.is_absolute() or ".." in p.parts or "\\" in fname:
        raise UnsafeCheckpointError(f"{index_file}: weight file {fname[:200]!r} lies outside the "
                                    "checkpoint directory; refusing it")
    suffix = p.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise UnsafeCheckpointError(f"{index_file}: weight file {fname[:200]!r} is a pickle format; "
                                    "refusing to load it (unpickling runs code from the file). "
                                    "Convert the checkpoint to safetensors.")
    if suffix != ".safetensors":
        raise UnsupportedCheckpointError(f"{index_file}: weight file {fname[:200]!r} is not "
                                         "safetensors; only safetensors weights are loaded")

