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
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .config import MoEConfig
from .errors import CheckpointError
from .quant import FP8_MAX, amax_scale, quantize_static
from . import trace

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
KINDS = ("fp8", "bf16")
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16,
                       "F32": torch.float32, "F16": torch.float16}


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
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size()


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
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file
    nbytes: int


@trace.range("fp8_reload/shard_header")
def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header without reading tensor data."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated (no safetensors header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(size - 8, 100 << 20):
                raise CheckpointError(f"{file}: corrupt header (claims {hlen} bytes)")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt header: {e}") from None
    data_start = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {meta!r}") from None
        nbytes = _nbytes(shape, dtype)
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} data [{begin}, {end}) does not fit "
                f"(expected {nbytes} bytes, file has {size - data_start} data bytes): truncated file?")
        out[name] = TensorInfo(name, file.name, dtype, shape, data_start + begin, nbytes)
    return out


class Checkpoint:
    """A checkpoint directory: config, kind, and an index from tensor name to file.

    Opening it reads `config.json`, the index and each shard's header, and
    validates them; no tensor data is read until `read` is called.
    """

    @trace.range("fp8_reload/index_read")
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        self.hf_config = self._read_json(self.path / "config.json")
        try:
            self.config = MoEConfig.from_hf_config(self.hf_config)
        except ValueError as e:
            raise CheckpointError(f"{self.path / 'config.json'}: {e}") from None
        qc = self.hf_config.get("quantization_config")
        if qc is None:
            self.kind, self.activation_scheme = "bf16", "dynamic"
        elif qc.get("quant_method") == "fp8":
            self.kind, self.activation_scheme = "fp8", qc.get("activation_scheme", "dynamic")
            if self.activation_scheme != "static":
                raise CheckpointError(f"{self.path}: only the static activation scheme is supported "
                                      f"for FP8 checkpoints, got {self.activation_scheme!r}")
        else:
            raise CheckpointError(f"{self.path}: unsupported quantization_config {qc!r}")
        self.weight_map = self._weight_map()
        self._headers: dict[str, dict[str, TensorInfo]] = {}

    @staticmethod
    def _read_json(file: Path) -> dict:
        try:
            with open(file) as f:
                return json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: missing") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: unreadable: {e}") from None

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file, from the index (or the single file's header)."""
        index_file = self.path / INDEX_FILE
        if index_file.exists():
            weight_map = self._read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_file}: no weight_map")
            for fname in sorted(set(weight_map.values())):
                if not isinstance(fname, str) or not fname.endswith(".safetensors"):
                    raise CheckpointError(f"{index_file}: weight file {fname!r} is not safetensors; "
                                          "refusing to load it (pickle formats can run code)")
            return weight_map
        if (self.path / SINGLE_FILE).exists():
            return {n: SINGLE_FILE for n in self._header(SINGLE_FILE)}
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{self.path}: only pickle weight files ({', '.join(pickles)}); refusing to "
                "load them (unpickling can run code). Convert the checkpoint to safetensors.")
        raise CheckpointError(f"{self.path}: no {INDEX_FILE} and no {SINGLE_FILE}")

    def _header(self, fname: str) -> dict[str, TensorInfo]:
        """A shard's parsed header; read on first use so a filtered reload opens only
        the shards that hold selected tensors."""
        if fname not in self._headers:
            fpath = self.path / fname
            if not fpath.exists():
                raise CheckpointError(f"{self.path / INDEX_FILE}: names missing file {fname}")
            self._headers[fname] = read_safetensors_header(fpath)
        return self._headers[fname]

    def info(self, name: str) -> TensorInfo:
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        info = self._header(fname).get(name)
        if info is None:
            raise CheckpointError(f"{self.path / INDEX_FILE}: tensor {name!r} is not in {fname}")
        return info

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def read(self, names: Iterable[str], stats: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, CPU tensor) for `names`, opening only the shards that hold them,
        in file and offset order. `stats` (if given) accumulates bytes_read and files_opened.
        """
        infos = [self.info(name) for name in names]
        infos.sort(key=lambda i: (i.file, i.offset))
        stats = stats if stats is not None else {}
        stats.setdefault("bytes_read", 0)
        stats.setdefault("files_opened", 0)
        current, handle = None, None
        for info in infos:
            if info.file != current:
                fpath = self.path / info.file
                try:
                    with trace.range("fp8_reload/shard_open"):
                        handle = safe_open(str(fpath), framework="pt")
                except Exception as e:  # safetensors raises its own error types
                    raise CheckpointError(f"{fpath}: cannot open: {e}") from None
                current = info.file
                stats["files_opened"] += 1
            try:
                with trace.range("fp8_reload/tensor_read", payload=info.nbytes):
                    tensor = handle.get_tensor(info.name)
            except Exception as e:
                raise CheckpointError(f"{self.path / info.file}: cannot read tensor {info.name!r}: {e}") from None
            stats["bytes_read"] += info.nbytes
            yield info.name, tensor

    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.weight_map)

