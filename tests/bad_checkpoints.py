"""A corpus of bad checkpoints, each built from a real good one on disk.

Every `BadCase` breaks one thing and says what a reload must do about it: the
exact `ReloadError` subclass, and the strings (file and/or tensor names) the
message must contain. `build(good, work, kind, cfg)` writes the bad checkpoint
under `work` and returns (path, mentions).

Also here, the proof that loading runs no code from a checkpoint:

* pickle traps: `plant_pickle` writes a pickle/torch.save file whose unpickling
  creates a marker directory, so a test can show nothing was unpickled (the
  marker never appears); `trap_fires` shows the trap is armed;
* `watch()`: a process-wide audit hook (PEP 578) records, inside the block,
  every global an unpickler resolves (``pickle.find_class``: no pickle can do
  anything without one) and every compile/exec of source text (``eval``/
  ``exec`` of a string). Module imports compile from files and do not count.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import fp8_reload as fr
from fp8_reload.checkpoint import INDEX_FILE

# Tensors the corpus breaks: one routed expert of the last MoE layer (its shard
# is opened by a full reload and by a filtered reload of that expert).
EXPERT = (2, 5)
WEIGHT = "model.layers.2.mlp.experts.5.up_proj.weight"
SCALE = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
DOWN = "model.layers.2.mlp.experts.5.down_proj.weight"


# --------------------------------------------------------------------------
# File surgery
# --------------------------------------------------------------------------

def weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def write_index(path: Path, wm: dict) -> None:
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}, indent=1))


def shard_of(path: Path, name: str) -> Path:
    return path / weight_map(path)[name]


def split_safetensors(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_safetensors(file: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(h)) + h + data)


def edit_tensors(path: Path, fn: Callable[[dict], None], name: str) -> None:
    """Load the shard holding `name`, let fn edit its {name: tensor} dict, save it."""
    file = shard_of(path, name)
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def last_tensor(file: Path) -> str:
    header, _ = split_safetensors(file)
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


# --------------------------------------------------------------------------
# Pickle traps
# --------------------------------------------------------------------------

class Trap:
    """Unpickling this calls os.mkdir(marker): visible proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant_pickle(file: Path, marker: Path, fmt: str = "torch") -> Path:
    """`fmt` "torch": torch.save zip (what .bin/.pt weights are); "pickle": a raw pickle."""
    payload = {"model.layers.2.mlp.experts.5.up_proj.weight": Trap(marker)}
    if fmt == "torch":
        torch.save(payload, str(file))
    else:
        file.write_bytes(pickle.dumps(payload, protocol=4))
    return file


def trap_fires(file: Path, marker: Path, fmt: str = "torch") -> bool:
    """Unpickle the planted file on purpose (the control): does the marker appear?"""
    assert not marker.exists()
    if fmt == "torch":
        torch.load(str(file), weights_only=False)
    else:
        pickle.loads(file.read_bytes())
    fired = marker.exists()
    if fired:
        marker.rmdir()
    return fired


# --------------------------------------------------------------------------
# Code-execution watch
# --------------------------------------------------------------------------
_events: list[tuple[str, str]] = []
_watching = [0]


def _hook(event: str, args) -> None:
    if not _watching[0]:
        return
    if event == "pickle.find_class":
        _events.append((event, repr(args)[:200]))
    elif event == "compile" and len(args) > 1 and args[1] in ("<string>", "<unknown>"):
        _events.append((event, repr(args)[:200]))
    elif event == "exec" and getattr(args[0], "co_filename", "") == "<string>":
        _events.append((event, repr(args)[:200]))


sys.addaudithook(_hook)  # hooks cannot be removed; it records only inside watch()


@contextmanager
def watch():
    """Yields the list of events seen inside the block (empty: no code was run)."""
    seen: list[tuple[str, str]] = []
    start = len(_events)
    _watching[0] += 1
    try:
        yield seen
    finally:
        _watching[0] -= 1
        seen.extend(_events[start:])
        del _events[start:]


# --------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class BadCase:
    name: str
    what: str  # the fault, for the README table
    error: type
    build: Callable  # (good, work, kind, cfg) -> (path, mentions)
    kinds: tuple[str, ...] = ("fp8", "bf16")
    layer_experts: dict | None = None  # reload filter; None: full reload
    bad_alone: bool = True  # broken on its own (a fresh load_model fails too)
    modes: tuple[str, ...] = ("fixed", "upstream")
    plants_pickle: bool = False


def _copy(good: Path, work: Path) -> Path:
    out = work / "ckpt"
    shutil.copytree(good, out)
    return out


def missing_directory(good, work, kind, cfg):
    p = work / "no-such-checkpoint"
    return p, [str(p)]


def missing_config(good, work, kind, cfg):
    p = _copy(good, work)
    (p / "config.json").unlink()
    return p, [str(p / "config.json"), "missing"]


def corrupt_config(good, work, kind, cfg):
    p = _copy(good, work)
    raw = (p / "config.json").read_text()
    (p / "config.json").write_text(raw[: len(raw) // 2])
    return p, [str(p / "config.json"), "corrupt JSON"]


def config_mismatch(good, work, kind, cfg):
    p = fr.write_checkpoint(work / "other", cfg.replace(moe_intermediate_size=48), seed=0, kind=kind)
    return p, [str(p), "moe_intermediate_size: model 32 vs checkpoint 48"]


def routing_mismatch(good, work, kind, cfg):
    """Same shapes, another routed_scaling_factor: the weights would load bit for bit and
    the model would still compute other outputs than a fresh load of the checkpoint."""
    p = _copy(good, work)
    hf = json.loads((p / "config.json").read_text())
    hf["routed_scaling_factor"] = 2.5
    (p / "config.json").write_text(json.dumps(hf))
    return p, [str(p), "routed_scaling_factor: model 1.0 vs checkpoint 2.5"]


def kind_mismatch(good, work, kind, cfg):
    other = "bf16" if kind == "fp8" else "fp8"
    p = fr.write_checkpoint(work / "other", cfg, seed=0, kind=other)
    return p, [str(p), f"model loaded from {kind} vs checkpoint {other}"]


def block_quantized(good, work, kind, cfg):
    p = _copy(good, work)
    hf = json.loads((p / "config.json").read_text())
    hf["quantization_config"]["weight_block_size"] = [128, 128]
    (p / "config.json").write_text(json.dumps(hf))
    return p, [str(p / "config.json"), "weight_block_size"]


def missing_shard(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    shard.unlink()
    return p, [shard.name, "does not exist"]


def unreadable_shard(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    shard.unlink()
    shard.mkdir()  # exists, cannot be read as a file (chmod does not stop root)
    return p, [str(shard), "cannot read"]


def truncated_data(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    last = last_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-100])
    return p, [str(shard), "truncated", last]


def truncated_header(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    shard.write_bytes(shard.read_bytes()[:100])
    return p, [str(shard), "truncated"]


def empty_shard(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    shard.write_bytes(b"")
    return p, [str(shard), "truncated"]


def corrupt_header_json(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("[")  # the header's opening brace
    raw[20:28] = b"\xff\xfe\x00garb"
    shard.write_bytes(bytes(raw))
    return p, [str(shard), "corrupt"]


def header_length_lies(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    return p, [str(shard), "claims 1099511627776 bytes"]


def overlapping_offsets(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    header, data = split_safetensors(shard)
    begin, end = header[WEIGHT]["data_offsets"]
    other = next(k for k, v in header.items() if k not in ("__metadata__", WEIGHT)
                 and v["data_offsets"][1] - v["data_offsets"][0] == end - begin)
    header[other]["data_offsets"] = [begin, end]  # two tensors on one byte range
    join_safetensors(shard, header, data)
    return p, [str(shard), "corrupt header"]


def trailing_bytes(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    shard.write_bytes(shard.read_bytes() + b"\0" * 64)
    return p, [str(shard), "64 bytes after the last tensor"]


def corrupt_index(good, work, kind, cfg):
    p = _copy(good, work)
    (p / INDEX_FILE).write_text('{"weight_map": {"model.norm.weight": ')
    return p, [str(p / INDEX_FILE), "corrupt JSON"]


def index_names_missing_file(good, work, kind, cfg):
    p = _copy(good, work)
    wm = weight_map(p)
    wm[WEIGHT] = "model-00009-of-00009.safetensors"
    write_index(p, wm)
    return p, ["model-00009-of-00009.safetensors", "does not exist", str(p / INDEX_FILE)]


def index_names_missing_tensor(good, work, kind, cfg):
    p = _copy(good, work)
    wm = weight_map(p)
    wrong = next(f for f in sorted(set(wm.values())) if f != wm[WEIGHT])
    wm[WEIGHT] = wrong
    write_index(p, wm)
    return p, [WEIGHT, wrong, "does not hold it"]


def tensor_missing(good, work, kind, cfg):
    p = _copy(good, work)
    edit_tensors(p, lambda t: t.pop(DOWN), DOWN)
    wm = weight_map(p)
    del wm[DOWN]
    write_index(p, wm)
    return p, [DOWN, "missing"]


def unknown_tensor(good, work, kind, cfg):
    p = _copy(good, work)
    extra = "model.layers.2.mlp.experts.99.up_proj.weight"

    def add(t):
        t[extra] = t[WEIGHT].clone()

    edit_tensors(p, add, WEIGHT)
    wm = weight_map(p)
    wm[extra] = wm[WEIGHT]
    write_index(p, wm)
    return p, [extra, wm[WEIGHT], "unknown"]


def wrong_shape(good, work, kind, cfg):
    p = _copy(good, work)

    def transpose(t):
        t[WEIGHT] = t[WEIGHT].t().contiguous()

    edit_tensors(p, transpose, WEIGHT)
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    return p, [WEIGHT, shard_of(p, WEIGHT).name, f"shape ({h}, {i}), the model expects ({i}, {h})"]


def wrong_dtype(good, work, kind, cfg):
    p = _copy(good, work)
    new = torch.float8_e5m2 if kind == "fp8" else torch.float16

    def retype(t):
        t[WEIGHT] = t[WEIGHT].view(new) if kind == "fp8" else t[WEIGHT].to(new)

    edit_tensors(p, retype, WEIGHT)
    return p, [WEIGHT, f"dtype {new}"]


def _bad_scale(value: float):
    def build(good, work, kind, cfg):
        p = _copy(good, work)

        def set_scale(t):
            t[SCALE] = torch.full_like(t[SCALE], value)

        edit_tensors(p, set_scale, SCALE)
        return p, [SCALE, shard_of(p, SCALE).name, "finite and positive"]
    return build


def filter_names_unknown_expert(good, work, kind, cfg):
    return good, [str(good), "layer 2 expert 99"]


def pickle_only(good, work, kind, cfg):
    p = work / "pickled"
    p.mkdir()
    shutil.copy(good / "config.json", p / "config.json")
    plant_pickle(p / "pytorch_model.bin", work / "MARKER")
    return p, ["pytorch_model.bin", "pickle"]


def index_names_pickle(good, work, kind, cfg):
    p = _copy(good, work)
    wm = weight_map(p)
    wm[WEIGHT] = "pytorch_model-00002-of-00004.bin"
    plant_pickle(p / wm[WEIGHT], work / "MARKER")
    write_index(p, wm)
    return p, ["pytorch_model-00002-of-00004.bin", "pickle"]


def pickle_named_safetensors(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    plant_pickle(shard, work / "MARKER", fmt="torch")
    return p, [str(shard), "torch.save", "not safetensors"]


def raw_pickle_named_safetensors(good, work, kind, cfg):
    p = _copy(good, work)
    shard = shard_of(p, WEIGHT)
    plant_pickle(shard, work / "MARKER", fmt="pickle")
    return p, [str(shard), "a pickle (protocol 4)"]


def not_safetensors(good, work, kind, cfg):
    p = _copy(good, work)
    wm = weight_map(p)
    gguf = p / "model-00002-of-00004.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    wm[WEIGHT] = gguf.name
    write_index(p, wm)
    return p, [gguf.name, "not safetensors"]


def path_outside(good, work, kind, cfg):
    p = _copy(good, work)
    wm = weight_map(p)
    outside = work / "elsewhere"
    outside.mkdir()
    shutil.copy(p / wm[WEIGHT], outside / wm[WEIGHT])  # a real shard, outside the checkpoint
    wm[WEIGHT] = f"../elsewhere/{wm[WEIGHT]}"
    write_index(p, wm)
    return p, [wm[WEIGHT], "outside the checkpoint directory"]


# ---- files that are not regular files (each must be refused without blocking)

def _special(role: str, make):
    """Replace the config, the index or WEIGHT's shard by what `make(path, work)` creates."""
    def build(good, work, kind, cfg):
        p = _copy(good, work)
        target = {"config": p / "config.json", "index": p / INDEX_FILE}.get(role) or shard_of(p, WEIGHT)
        target.unlink()
        make(target, work)
        return p, [str(target), "not a regular file"]
    return build


def make_fifo(path: Path, work: Path) -> None:
    os.mkfifo(path)


def make_symlink_to_fifo(path: Path, work: Path) -> None:
    os.mkfifo(work / "pipe")
    os.symlink(work / "pipe", path)


def make_socket(path: Path, work: Path) -> None:
    """A unix socket file, bound under a short directory (socket paths are limited to
    ~100 bytes) and moved into place."""
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(short / "s"))
    os.replace(short / "s", path)
    short.rmdir()


def make_dev_zero(path: Path, work: Path) -> None:
    os.symlink("/dev/zero", path)


def make_dev_urandom(path: Path, work: Path) -> None:
    os.symlink("/dev/urandom", path)


def make_directory(path: Path, work: Path) -> None:
    path.mkdir()


def single_file_fifo(good, work, kind, cfg):
    """A single-file checkpoint (no index) whose model.safetensors is a FIFO."""
    p = work / "single"
    p.mkdir()
    shutil.copy(good / "config.json", p / "config.json")
    os.mkfifo(p / "model.safetensors")
    return p, [str(p / "model.safetensors"), "FIFO"]


# ---- an index entry in a subfolder: read exactly that file, or fail naming it

def subfolder_entry_missing(good, work, kind, cfg):
    """The index names sub/<shard>, which does not exist; <shard> itself does (a leftover)."""
    p = _copy(good, work)
    shard = weight_map(p)[WEIGHT]
    write_index(p, {n: f"sub/{f}" if f == shard else f for n, f in weight_map(p).items()})
    return p, [str(p / INDEX_FILE), f"sub/{shard}", "does not exist"]


# ---- values a header cannot show

ROUTER = "model.layers.2.mlp.gate.weight"
NORM = "model.layers.2.input_layernorm.weight"
FINAL_NORM = "model.norm.weight"


def _bad_value(name: str, value, index: int = 7, raw: bool = False):
    """Set element `index` of tensor `name` to `value` (`raw`: a byte of an FP8 tensor)."""
    def build(good, work, kind, cfg):
        p = _copy(good, work)

        def poke(t):
            x = t[name].clone()
            if raw:
                x.reshape(-1).view(torch.uint8)[index] = value
            else:
                x.reshape(-1)[index] = value
            t[name] = x

        edit_tensors(p, poke, name)
        what = "encodes NaN" if raw else "value NaN" if value != value else f"value {float(value)}"
        return p, [shard_of(p, name).name, repr(name), what, "weights must be finite"]
    return build


# ---- config.json values that must not pass

def _bad_config(field: str, raw_value: str):
    """config.json with `field` set to the JSON text `raw_value` (written as text:
    1e999 is how JSON spells a number that parses to inf)."""
    def build(good, work, kind, cfg):
        p = _copy(good, work)
        hf = json.loads((p / "config.json").read_text())
        hf[field] = "@@"
        (p / "config.json").write_text(json.dumps(hf).replace('"@@"', raw_value))
        return p, [str(p / "config.json"), repr(field)]
    return build


E = fr.errors
CASES: list[BadCase] = [
    BadCase("missing-directory", "checkpoint directory does not exist", E.CheckpointNotFoundError,
            missing_directory),
    BadCase("missing-config", "config.json missing", E.CheckpointNotFoundError, missing_config),
    BadCase("corrupt-config", "config.json is not valid JSON", E.CorruptCheckpointError, corrupt_config),
    BadCase("config-mismatch", "checkpoint of a model with other sizes", E.CheckpointMismatchError,
            config_mismatch, bad_alone=False),
    BadCase("routing-mismatch", "same shapes, another routed_scaling_factor",
            E.CheckpointMismatchError, routing_mismatch, bad_alone=False),
    BadCase("kind-mismatch", "bf16 checkpoint for a model loaded from fp8 (or back)",
            E.CheckpointMismatchError, kind_mismatch, bad_alone=False),
    BadCase("block-quantized", "block-wise FP8 quantization_config", E.UnsupportedCheckpointError,
            block_quantized, kinds=("fp8",)),
    BadCase("missing-shard", "shard named by the index is missing", E.CheckpointNotFoundError,
            missing_shard),
    BadCase("unreadable-shard", "shard exists but cannot be read", E.UnreadableCheckpointError,
            unreadable_shard),
    BadCase("truncated-data", "shard cut short in its tensor data", E.CorruptCheckpointError,
            truncated_data),
    BadCase("truncated-header", "shard cut short in its header", E.CorruptCheckpointError,
            truncated_header),
    BadCase("empty-shard", "shard of 0 bytes", E.CorruptCheckpointError, empty_shard),
    BadCase("corrupt-header", "header bytes are not JSON", E.CorruptCheckpointError, corrupt_header_json),
    BadCase("header-length-lies", "header length field larger than the file", E.CorruptCheckpointError,
            header_length_lies),
    BadCase("overlapping-offsets", "two tensors claim one byte range", E.CorruptCheckpointError,
            overlapping_offsets),
    BadCase("trailing-bytes", "bytes after the last tensor", E.CorruptCheckpointError, trailing_bytes),
    BadCase("corrupt-index", "index is not valid JSON", E.CorruptCheckpointError, corrupt_index),
    BadCase("index-missing-file", "index names a file that does not exist", E.CheckpointNotFoundError,
            index_names_missing_file),
    BadCase("index-missing-tensor", "index names a tensor its file does not hold",
            E.MissingTensorError, index_names_missing_tensor),
    BadCase("tensor-missing-full", "tensor absent, full reload", E.MissingTensorError, tensor_missing),
    BadCase("tensor-missing-expert", "tensor absent from an expert a filtered reload takes",
            E.MissingTensorError, tensor_missing, layer_experts={2: [5]}, modes=("fixed",)),
    BadCase("unknown-tensor", "tensor the model has no parameter for", E.CheckpointMismatchError,
            unknown_tensor),
    BadCase("wrong-shape", "tensor of the wrong shape", E.CheckpointMismatchError, wrong_shape),
    BadCase("wrong-dtype", "tensor of the wrong dtype (FP8 e5m2 / fp16)", E.CheckpointMismatchError,
            wrong_dtype),
    BadCase("nan-scale", "weight_scale is NaN", E.InvalidTensorError, _bad_scale(float("nan")),
            kinds=("fp8",)),
    BadCase("inf-scale", "weight_scale is +Inf", E.InvalidTensorError, _bad_scale(float("inf")),
            kinds=("fp8",)),
    BadCase("zero-scale", "weight_scale is 0", E.InvalidTensorError, _bad_scale(0.0), kinds=("fp8",)),
    BadCase("negative-scale", "weight_scale is negative", E.InvalidTensorError, _bad_scale(-0.5),
            kinds=("fp8",)),
    BadCase("filter-names-unknown-expert", "weight_name_filter names an expert the model lacks",
            E.UnknownExpertError, filter_names_unknown_expert, layer_experts={2: [99]},
            bad_alone=False),
    BadCase("pickle-only", "only a pytorch_model.bin (armed pickle)", E.UnsafeCheckpointError,
            pickle_only, plants_pickle=True),
    BadCase("index-names-pickle", "index names a .bin shard (armed pickle)", E.UnsafeCheckpointError,
            index_names_pickle, plants_pickle=True),
    BadCase("torch-save-as-safetensors", "torch.save file (armed) named .safetensors",
            E.UnsafeCheckpointError, pickle_named_safetensors, plants_pickle=True),
    BadCase("pickle-as-safetensors", "raw pickle (armed) named .safetensors", E.UnsafeCheckpointError,
            raw_pickle_named_safetensors, plants_pickle=True),
    BadCase("not-safetensors", "index names a GGUF file", E.UnsupportedCheckpointError, not_safetensors),
    BadCase("path-outside", "index names ../elsewhere/shard", E.UnsafeCheckpointError, path_outside),
    BadCase("fifo-config", "config.json is a FIFO", E.UnreadableCheckpointError,
            _special("config", make_fifo)),
    BadCase("fifo-index", "the index is a FIFO", E.UnreadableCheckpointError,
            _special("index", make_fifo)),
    BadCase("fifo-shard", "a shard is a FIFO", E.UnreadableCheckpointError,
            _special("shard", make_fifo)),
    BadCase("symlink-to-fifo", "a shard is a symlink to a FIFO", E.UnreadableCheckpointError,
            _special("shard", make_symlink_to_fifo)),
    BadCase("fifo-single-file", "model.safetensors (no index) is a FIFO", E.UnreadableCheckpointError,
            single_file_fifo),
    BadCase("socket-shard", "a shard is a unix socket", E.UnreadableCheckpointError,
            _special("shard", make_socket)),
    BadCase("dev-zero-shard", "a shard is a symlink to /dev/zero", E.UnreadableCheckpointError,
            _special("shard", make_dev_zero)),
    BadCase("dev-urandom-config", "config.json is a symlink to /dev/urandom",
            E.UnreadableCheckpointError, _special("config", make_dev_urandom)),
    BadCase("directory-config", "config.json is a directory", E.UnreadableCheckpointError,
            _special("config", make_directory)),
    BadCase("directory-index", "the index is a directory", E.UnreadableCheckpointError,
            _special("index", make_directory)),
    BadCase("subfolder-entry-missing", "index names sub/<shard>, absent (top-level leftover)",
            E.CheckpointNotFoundError, subfolder_entry_missing),
    BadCase("fp8-nan-0x7f", "FP8 weight byte 0x7f (NaN in e4m3fn)", E.InvalidTensorError,
            _bad_value(WEIGHT, 0x7F, raw=True), kinds=("fp8",)),
    BadCase("fp8-nan-0xff", "FP8 weight byte 0xff (-NaN in e4m3fn)", E.InvalidTensorError,
            _bad_value(WEIGHT, 0xFF, index=0, raw=True), kinds=("fp8",)),
    BadCase("fp8-nan-expert", "FP8 NaN byte in an expert a filtered reload takes",
            E.InvalidTensorError, _bad_value(DOWN, 0x7F, index=100, raw=True), kinds=("fp8",),
            layer_experts={2: [5]}, modes=("fixed",)),
    BadCase("bf16-inf-weight", "+inf in a bf16 expert weight", E.InvalidTensorError,
            _bad_value(WEIGHT, float("inf")), kinds=("bf16",)),
    BadCase("bf16-nan-weight", "NaN in a bf16 expert weight", E.InvalidTensorError,
            _bad_value(DOWN, float("nan"), index=0), kinds=("bf16",)),
    BadCase("nan-router", "NaN in a router (gate) weight", E.InvalidTensorError,
            _bad_value(ROUTER, float("nan"))),
    BadCase("inf-norm", "-inf in a norm weight", E.InvalidTensorError, _bad_value(NORM, float("-inf"))),
    BadCase("nan-final-norm", "NaN in the final norm", E.InvalidTensorError,
            _bad_value(FINAL_NORM, float("nan"), index=63)),
    BadCase("config-string-eps", 'config.json: "rms_norm_eps": "-inf"', E.CorruptCheckpointError,
            _bad_config("rms_norm_eps", '"-inf"')),
    BadCase("config-string-scaling", 'config.json: "routed_scaling_factor": "nan"',
            E.CorruptCheckpointError, _bad_config("routed_scaling_factor", '"nan"')),
    BadCase("config-inf-eps", "config.json: rms_norm_eps 1e999 (parses to inf)",
            E.CorruptCheckpointError, _bad_config("rms_norm_eps", "1e999")),
    BadCase("config-huge-experts", "config.json: n_routed_experts 10**30", E.CorruptCheckpointError,
            _bad_config("n_routed_experts", str(10**30))),
    BadCase("config-string-size", 'config.json: "hidden_size": "64"', E.CorruptCheckpointError,
            _bad_config("hidden_size", '"64"')),
    BadCase("config-float-size", "config.json: hidden_size 64.9", E.CorruptCheckpointError,
            _bad_config("hidden_size", "64.9")),
    BadCase("config-bool-size", "config.json: moe_intermediate_size true", E.CorruptCheckpointError,
            _bad_config("moe_intermediate_size", "true")),
    BadCase("config-top-k", "config.json: num_experts_per_tok above n_routed_experts",
            E.CorruptCheckpointError, _bad_config("num_experts_per_tok", "9")),
    # (attack s28: both loaded, and served softmax top-k routing)
    BadCase("config-sigmoid-scores", 'config.json: "scoring_func": "sigmoid" (DeepSeek-V3)',
            E.UnsupportedCheckpointError, _bad_config("scoring_func", '"sigmoid"')),
    BadCase("config-grouped-top-k", 'config.json: "topk_method": "group_limited_greedy" (DeepSeek-V2)',
            E.UnsupportedCheckpointError, _bad_config("topk_method", '"group_limited_greedy"')),
]


def weight_name_filter(case: BadCase):
    return None if case.layer_experts is None else fr.generate_weight_name_filter(case.layer_experts)


def random_finite_fp8(n: int, g, dtype):
    """`n` random FP8 values of `dtype` with no non-finite byte among them (the tests plant
    those themselves): bytes drawn uniformly, those at or past the non-finite thresholds
    moved 8 below them."""
    import torch

    from fp8_reload.checkpoint.values import FP8_NONFINITE

    pos, neg = FP8_NONFINITE[dtype]
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.int32)
    raw = torch.where((raw >= neg) | ((raw < 128) & (raw >= pos)), raw - 8, raw)
    return raw.to(torch.uint8).view(dtype)
