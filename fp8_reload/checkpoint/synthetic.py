"""Synthetic HF-layout checkpoints: a deterministic writer, mixes of two seeds.

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
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import MoEConfig
from ..quant import FP8_MAX, amax_scale, quantize_static
from .layout import INDEX_FILE, Projection, check_kind, nbytes, projections, shard_name, tensor_layout


def _gen(seed: int, key: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    return g


def _uniform(seed: int, key: str) -> float:
    return float(torch.rand((), generator=_gen(seed, "u:" + key)))


def gain(seed: int, prefix: str, role: str) -> float:
    """Output std of a projection on unit inputs. Experts spread over 2^-1.5..2^1.5 so
    that gate and up scales of one expert differ by up to 8x."""
    spread = 3.0 if role.startswith("expert") else 1.0
    return 2.0 ** (spread * (_uniform(seed, prefix) - 0.5))


def master_weight(seed: int, proj: Projection) -> torch.Tensor:
    """The bf16 weight both checkpoint kinds derive from."""
    std = gain(seed, proj.prefix, proj.role) / math.sqrt(proj.in_features)
    w = torch.randn(proj.out_features, proj.in_features, generator=_gen(seed, proj.prefix)) * std
    return w.to(torch.bfloat16)


def input_amax(seed: int, proj: Projection) -> float:
    """A generous estimate of the largest activation entering `proj` (static scheme).

    Inputs to gate/up/q/k/v are RMS-normalized (|x| < ~5); down_proj sees
    silu(gate) * up whose size follows the two gains; o_proj sees averages of v.
    """
    if proj.role in ("expert_down", "down"):
        base = proj.prefix.rsplit(".", 1)[0]
        gate_role, up_role = ("expert_gate", "expert_up") if proj.role == "expert_down" else ("gate", "up")
        g = gain(seed, f"{base}.gate_proj", gate_role)
        u = gain(seed, f"{base}.up_proj", up_role)
        return 14.0 * g * u
    if proj.role == "attn_out":
        v = proj.prefix.replace("o_proj", "v_proj")
        return 6.0 * gain(seed, v, "attn_in")
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
        f"{proj.prefix}.input_scale": torch.tensor(input_amax(seed, proj) * jitter / FP8_MAX,
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


class _FastContent:
    """Valid values at memory speed, for I/O benchmarks of whole models: every weight is
    a slice of one random pool (FP8 bytes that are never NaN, or bf16 normals), scales
    are fixed. Deterministic by (seed, name); not the seeded model (no accuracy meaning)."""

    POOL = 64 << 20

    def __init__(self, kind: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        if kind == "fp8":
            pool = torch.randint(0, 0x7F, (self.POOL,), generator=g, dtype=torch.uint8)  # 0x7f: NaN
            pool |= torch.randint(0, 2, (self.POOL,), generator=g, dtype=torch.uint8) << 7
            self.pool = pool.view(torch.float8_e4m3fn)
        else:
            self.pool = (torch.randn(self.POOL // 2, generator=g) * 0.02).to(torch.bfloat16)

    def __call__(self, name: str, shape) -> torch.Tensor:
        if name.endswith("_scale"):
            return torch.tensor(1e-3 if name.endswith("weight_scale") else 0.02, dtype=torch.float32)
        if not name.endswith("proj.weight"):
            return other_tensor(0, name, shape)
        n = math.prod(shape)
        start = zlib.crc32(name.encode()) % max(1, self.pool.numel() - n)
        if n <= self.pool.numel():
            return self.pool[start:start + n].view(shape).clone()
        reps = -(-n // self.pool.numel())
        return self.pool.repeat(reps)[:n].view(shape)


def write_checkpoint(path, cfg: MoEConfig, seed: int = 0, kind: str = "fp8",
                     max_shard_bytes: int = 1 << 30, min_shards: int = 4,
                     progress: bool | None = None, fill: str = "seeded") -> Path:
    """Write an HF-layout checkpoint of `cfg` to `path` (created if needed).

    Returns the directory. ``progress=None`` shows a progress bar for checkpoints
    over 256 MiB. ``fill="fast"`` writes valid but meaningless values at disk speed
    (`_FastContent`: whole-model I/O benchmarks); the default is the seeded model.
    """
    if fill not in ("seeded", "fast"):
        raise ValueError(f"fill must be 'seeded' or 'fast', got {fill!r}")
    check_kind(kind)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = tensor_layout(cfg, kind)
    sizes = [nbytes(shape, dtype) for _, shape, dtype in layout]
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

    content = _Content(cfg, kind, seed) if fill == "seeded" else _FastContent(kind, seed)
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
    hf["fp8_reload"] = {"kind": kind, "seed": seed, "fill": fill}
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


def ensure_checkpoint(path, preset: str, num_layers: int | None, kind: str, seed: int = 0,
                      fill: str = "seeded") -> Path:
    """Write the synthetic checkpoint at `path` unless it is already there (`fill` as
    `write_checkpoint`'s: the GPU probes' large ones are "fast").

    Written aside and renamed into place, so concurrent callers (ranks, benchmark
    processes) never see half a checkpoint; the loser of a race discards its copy.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    overrides = {"num_layers": num_layers} if num_layers else {}
    cfg = MoEConfig.preset(preset, **overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    write_checkpoint(tmp, cfg, seed=seed, kind=kind, fill=fill)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
