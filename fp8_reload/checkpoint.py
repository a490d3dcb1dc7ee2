"""HF-layout safetensors checkpoints: a deterministic writer and an index-aware reader.

Layout written: ``model-0000k-of-0000n.safetensors`` shards,
``model.safetensors.index.json`` and ``config.json``. Kind ``fp8`` stores
per-tensor FP8 weights with a ``weight_scale`` and a static ``input_scale`` per
projection and a ``quantization_config``; kind ``bf16`` stores plain bf16
weights and no quantization config (the loader quantizes on load, like
sglang's ``--quantization fp8``).

Every tensor is a pure function of (seed, tensor name), so two checkpoints with
the same seed agree tensor for tensor however they are sharded, and checkpoints
mixing experts of two seeds can be built for tests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Optional

import torch
from safetensors.torch import load_file, save_file

from .config import MoEConfig
from .errors import (CheckpointNotFoundError, CorruptCheckpointError, MissingTensorError,
                     UnreadableCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError)
from .quant import FP8_MAX, amax_scale, quantize_static
from . import trace

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight files in these formats are unpickled by their usual loaders: refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Other weight formats we recognise only to name them in the error.
OTHER_WEIGHT_SUFFIXES = (".gguf", ".npz", ".npy", ".h5", ".msgpack", ".onnx")
KINDS = ("fp8", "bf16")
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                       "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                       "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
                       "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                       "BOOL": torch.bool}
# safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000


# --------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Projection:
    """One linear map of the model: its checkpoint prefix and shape."""

    prefix: str  # e.g. model.layers.1.mlp.experts.3.gate_proj
    out_features: int
    in_features: int
    role: str  # expert_gate | expert_up | expert_down | gate | up | down | attn_in | attn_out


def projections(cfg: MoEConfig) -> list[Projection]:
    h = cfg.hidden_size
    out: list[Projection] = []
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        nh = cfg.num_heads
        out += [Projection(f"{p}.self_attn.q_proj", nh * cfg.qk_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.k_proj", nh * cfg.qk_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.v_proj", nh * cfg.v_head_dim, h, "attn_in"),
                Projection(f"{p}.self_attn.o_proj", h, nh * cfg.v_head_dim, "attn_out")]
        if not cfg.is_moe_layer(layer):
            i = cfg.intermediate_size
            out += [Projection(f"{p}.mlp.gate_proj", i, h, "gate"),
                    Projection(f"{p}.mlp.up_proj", i, h, "up"),
                    Projection(f"{p}.mlp.down_proj", h, i, "down")]
            continue
        if cfg.num_shared_experts:
            i = cfg.shared_intermediate_size
            out += [Projection(f"{p}.mlp.shared_experts.gate_proj", i, h, "gate"),
                    Projection(f"{p}.mlp.shared_experts.up_proj", i, h, "up"),
                    Projection(f"{p}.mlp.shared_experts.down_proj", h, i, "down")]
        i = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            out += [Projection(f"{p}.mlp.experts.{e}.gate_proj", i, h, "expert_gate"),
                    Projection(f"{p}.mlp.experts.{e}.up_proj", i, h, "expert_up"),
                    Projection(f"{p}.mlp.experts.{e}.down_proj", h, i, "expert_down")]
    return out


def tensor_layout(cfg: MoEConfig, kind: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor in file order: (name, shape, dtype)."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose one of {', '.join(KINDS)}")
    h = cfg.hidden_size
    norms = lambda layer: [(f"model.layers.{layer}.input_layernorm.weight", (h,), torch.bfloat16),  # noqa: E731
                           (f"model.layers.{layer}.post_attention_layernorm.weight", (h,), torch.bfloat16)]
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    by_layer: dict[int, list[Projection]] = {}
    for proj in projections(cfg):
        by_layer.setdefault(int(proj.prefix.split(".")[2]), []).append(proj)
    for layer in range(cfg.num_layers):
        out += norms(layer)
        if cfg.is_moe_layer(layer):
            out.append((f"model.layers.{layer}.mlp.gate.weight", (cfg.num_experts, h), torch.bfloat16))
        for proj in by_layer[layer]:
            shape = (proj.out_features, proj.in_features)
            if kind == "fp8":
                out += [(f"{proj.prefix}.weight", shape, torch.float8_e4m3fn),
                        (f"{proj.prefix}.weight_scale", (), torch.float32),
                        (f"{proj.prefix}.input_scale", (), torch.float32)]
            else:
                out.append((f"{proj.prefix}.weight", shape, torch.bfloat16))
    out.append(("model.norm.weight", (h,), torch.bfloat16))
    return out


# --------------------------------------------------------------------------
# Deterministic content
# --------------------------------------------------------------------------

def _gen(seed: int, key: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    return g


def _uniform(seed: int, key: str) -> float:
    return float(torch.rand((), generator=_gen(seed, "u:" + key)))


def _gain(seed: int, prefix: str, role: str) -> float:
    """Output std of a projection on unit inputs. Experts spread over 2^-1.5..2^1.5 so
    that gate and up scales of one expert differ by up to 8x."""
    spread = 3.0 if role.startswith("expert") else 1.0
    return 2.0 ** (spread * (_uniform(seed, prefix) - 0.5))


def master_weight(seed: int, proj: Projection) -> torch.Tensor:
    """The bf16 weight both checkpoint kinds derive from."""
    std = _gain(seed, proj.prefix, proj.role) / math.sqrt(proj.in_features)
    w = torch.randn(proj.out_features, proj.in_features, generator=_gen(seed, proj.prefix)) * std
    return w.to(torch.bfloat16)


def _input_amax(seed: int, proj: Projection) -> float:
    """A generous estimate of the largest activation entering `proj` (static scheme).

    Inputs to gate/up/q/k/v are RMS-normalized (|x| < ~5); down_proj sees
    silu(gate) * up whose size follows the two gains; o_proj sees averages of v.
    """
    if proj.role in ("expert_down", "down"):
        base = proj.prefix.rsplit(".", 1)[0]
        gate_role, up_role = ("expert_gate", "expert_up") if proj.role == "expert_down" else ("gate", "up")
        g = _gain(seed, f"{base}.gate_proj", gate_role)
        u = _gain(seed, f"{base}.up_proj", up_role)
        return 14.0 * g * u
    if proj.role == "attn_out":
        v = proj.prefix.replace("o_proj", "v_proj")
        return 6.0 * _gain(seed, v, "attn_in")
    return 6.0


def projection_tensors(seed: int, proj: Projection, kind: str) -> dict[str, torch.Tensor]:
    w = master_weight(seed, proj)
    if kind == "bf16":
        return {f"{proj.prefix}.weight": w}
    scale = amax_scale(w)
    jitter = 0.8 + 0.45 * _uniform(seed, proj.prefix + ".input_scale")
    return {
        f"{proj.prefix}.weight": quantize_static(w, scale),
        f"{proj.prefix}.weight_scale": scale.reshape(()).clone(),
        f"{proj.prefix}.input_scale": torch.tensor(_input_amax(seed, proj) * jitter / FP8_MAX,
                                                   dtype=torch.float32),
    }


def other_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = _gen(seed, name)
    if name.endswith("mlp.gate.weight"):  # router: peaky enough to spread tokens
        return (torch.randn(*shape, generator=g) * (2.0 / math.sqrt(shape[1]))).to(torch.bfloat16)
    return (1.0 + 0.1 * torch.randn(*shape, generator=g)).to(torch.bfloat16)  # norms


class _Content:
    """Produces tensors by name, generating each projection once."""

    def __init__(self, cfg: MoEConfig, kind: str, seed: int):
        self.kind, self.seed = kind, seed
        self.by_prefix = {p.prefix: p for p in projections(cfg)}
        self._last: tuple[str, dict[str, torch.Tensor]] = ("", {})

    def __call__(self, name: str, shape) -> torch.Tensor:
        prefix = name.rsplit(".", 1)[0]
        proj = self.by_prefix.get(prefix)
        if proj is None:
            return other_tensor(self.seed, name, shape)
        if self._last[0] != prefix:
            self._last = (prefix, projection_tensors(self.seed, proj, self.kind))
        return self._last[1][name]


# --------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------

def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def write_checkpoint(path, cfg: MoEConfig, seed: int = 0, kind: str = "fp8",
                     max_shard_bytes: int = 1 << 30, min_shards: int = 4,
                     progress: Optional[bool] = None) -> Path:
    """Write an HF-layout checkpoint of `cfg` to `path` (created if needed).

    Returns the directory. ``progress=None`` shows a progress bar for checkpoints
    over 256 MiB.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose one of {', '.join(KINDS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = tensor_layout(cfg, kind)
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in layout]
    total = sum(sizes)
    n = min(len(layout), max(min_shards, math.ceil(total / max_shard_bytes)))
    # Cut the ordered tensor list into n shards of about equal size.
    bounds, acc, k = [], 0, 1
    for i, size in enumerate(sizes):
        if acc >= k * total / n and len(bounds) < n - 1 and i > (bounds[-1] if bounds else 0):
            bounds.append(i)
            k += 1
        acc += size
    starts = [0] + bounds
    ends = bounds + [len(layout)]
    n = len(starts)

    content = _Content(cfg, kind, seed)
    weight_map: dict[str, str] = {}
    show = total > (256 << 20) if progress is None else progress
    bar = _progress(total, f"writing {path.name}", show)
    for k, (a, b) in enumerate(zip(starts, ends), start=1):
        fname = shard_name(k, n)
        tensors = {}
        for name, shape, _dtype in layout[a:b]:
            tensors[name] = content(name, shape).contiguous()
            weight_map[name] = fname
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        bar.update(sum(sizes[a:b]))
    bar.close()

    with open(path / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    hf = cfg.to_hf_config()
    if kind == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    hf["fp8_reload"] = {"kind": kind, "seed": seed}
    with open(path / "config.json", "w") as f:
        json.dump(hf, f, indent=1)
    return path


def mix_checkpoints(base, donor, out, take) -> Path:
    """Write to `out` a checkpoint equal to `base` except that tensors with
    ``take(name)`` True come from `donor`.

    The state a filtered reload from `donor` must reach is a fresh load of this
    mix. `base` and `donor` must share one layout (same config, kind and
    sharding, as `write_checkpoint` gives for any two seeds).
    """
    base, donor, out = Path(base), Path(donor), Path(out)
    shutil.copytree(base, out)
    weight_map = json.loads((base / INDEX_FILE).read_text())["weight_map"]
    for fname in sorted(set(weight_map.values())):
        tensors = load_file(str(base / fname))
        donor_tensors = load_file(str(donor / fname))
        for name in tensors:
            if take(name):
                tensors[name] = donor_tensors[name]
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    return out


def _progress(total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not show)


# --------------------------------------------------------------------------
# Reader
#
# Safety: weight files are parsed as safetensors only (an 8-byte length, a JSON
# header, raw bytes). Nothing is unpickled and no string from a checkpoint is
# evaluated: JSON is parsed with `json`, tensor bytes are read at the offsets the
# validated header gives. Every failure surfaces as a `CheckpointError` subclass
# naming the file.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file
    nbytes: int


def _sniff_format(head: bytes) -> Optional[str]:
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


def _parse_entry(file: Path, name: str, meta, data_start: int, data_len: int) -> TensorInfo:
    where = f"{file}: header entry for tensor {name!r}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise CorruptCheckpointError(f"{where} is not {{dtype, shape, data_offsets}}: {str(meta)[:200]}")
    dtype_name, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype_name, str):
        raise CorruptCheckpointError(f"{where}: dtype {dtype_name!r} is not a string")
    dtype = _SAFETENSORS_DTYPES.get(dtype_name)
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
    nbytes = _nbytes(shape, dtype)
    if end - begin != nbytes:
        raise CorruptCheckpointError(f"{where}: data_offsets [{begin}, {end}) hold {end - begin} "
                                     f"bytes, but {dtype_name} {shape} needs {nbytes}")
    if end > data_len:
        raise CorruptCheckpointError(f"{file}: truncated: tensor {name!r} needs data bytes up to "
                                     f"{end}, the file has {data_len}")
    return TensorInfo(name, file.name, dtype, tuple(shape), data_start + begin, nbytes)


@trace.range("fp8_reload/shard_header")
def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header without reading tensor data.

    As strict as the safetensors library: known dtypes, byte counts that match
    shapes, data regions that tile the data section exactly. So a header that
    passes here is one `safe_open` accepts, and every defect gets a message
    naming the file (and the tensor) instead of a library error.
    """
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                _refuse_sniffed(file, head)
                raise CorruptCheckpointError(f"{file}: truncated: {len(head)} bytes, no safetensors header")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(size - 8, MAX_HEADER_BYTES):
                _refuse_sniffed(file, head)
                raise CorruptCheckpointError(
                    f"{file}: corrupt or truncated header: claims {hlen} bytes, the file has "
                    f"{size - 8} after the length")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{file}: missing") from None
    except OSError as e:
        raise UnreadableCheckpointError(f"{file}: cannot read: {e.strerror or e}") from None
    if len(raw) < hlen:  # the file shrank while we read it
        raise CorruptCheckpointError(f"{file}: truncated header")
    try:
        header = parse_json(raw, f"{file}: header")
    except CorruptCheckpointError:
        _refuse_sniffed(file, head)
        raise
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{file}: corrupt header: not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise CorruptCheckpointError(f"{file}: corrupt header: __metadata__ is not a string map")
    data_start = 8 + hlen
    data_len = size - data_start
    out = {name: _parse_entry(file, name, m, data_start, data_len)
           for name, m in header.items() if name != "__metadata__"}
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


def _check_weight_file_name(index_file: Path, fname) -> None:
    """An index may only name safetensors files inside the checkpoint directory."""
    if not isinstance(fname, str) or not fname or "\x00" in fname:
        raise CorruptCheckpointError(f"{index_file}: weight file name {str(fname)[:100]!r} is not a file name")
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


def _open(fpath: Path):
    try:
        return open(fpath, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{fpath}: vanished while reading") from None
    except OSError as e:
        raise UnreadableCheckpointError(f"{fpath}: cannot open: {e.strerror or e}") from None


def _read_tensor(handle, fpath: Path, info: TensorInfo,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bytes of one tensor (validated offsets), into `out` (uint8, e.g. a pinned
    staging slice) or fresh CPU memory. Positional reads: threads may share `handle`."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8) if out is None else out
    view = memoryview(buf.numpy())
    fd = handle.fileno()
    got = 0
    try:
        while got < info.nbytes:  # one read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[got:]], info.offset + got)
            if not n:
                raise CorruptCheckpointError(
                    f"{fpath}: truncated while reading tensor {info.name!r}: got {got} of "
                    f"{info.nbytes} bytes (the file changed after its header was read?)")
            got += n
    except OSError as e:
        raise UnreadableCheckpointError(f"{fpath}: cannot read tensor {info.name!r}: "
                                        f"{e.strerror or e}") from None
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
                _check_weight_file_name(index_file, fname)
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

    def read(self, names: Iterable[str], stats: Optional[dict] = None,
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
                        handles[info.file] = _open(fpath)
                    stats["files_opened"] += 1
                with trace.range("fp8_reload/tensor_read", payload=info.nbytes):
                    tensor = _read_tensor(handles[info.file], fpath, info)
                stats["bytes_read"] += info.nbytes
                yield info.name, tensor
        finally:
            for h in handles.values():
                h.close()

    def _read_parallel(self, infos, arena, handles, stats):
        from .staging import READ_THREADS, ALIGN

        arena.reset(sum((i.nbytes + ALIGN - 1) // ALIGN * ALIGN for i in infos))
        slots = [arena.take(i.nbytes) for i in infos]
        with trace.range("fp8_reload/shard_open"):
            for f in sorted({i.file for i in infos}):
                handles[f] = _open(self.path / f)
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
