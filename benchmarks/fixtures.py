"""Per-process fixtures of the asv suite, built lazily and cached (asv re-runs `setup`
before every sample, so the expensive part is built once per process): a loaded model, a
processed MoE block, a routed batch, an unprocessed layer for the post-processing figures."""

from __future__ import annotations

import torch

import fp8_reload as fr
from fp8_reload import kernels

from .common import DEVICE, Checkpoint, sync

_MODELS: dict = {}


def loaded_model(path: str, processing: str = "fixed") -> fr.FP8MoEModel:
    """A model freshly loaded from `path` on `DEVICE`, built once per process."""
    key = (path, processing)
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time: v2-lite slices are GiBs on the device
        _MODELS[key] = fr.load_model(path, device=DEVICE, processing=processing)
    return _MODELS[key]


def first_moe_layer(model: fr.FP8MoEModel) -> int:
    return model.config.moe_layers[0]


def layer_tensor_names(ckpt: Checkpoint, layer: int, experts=None) -> list[str]:
    """Checkpoint names of the routed experts (all, or `experts`) of `layer`."""
    prefix = f"model.layers.{layer}.mlp.experts."
    names = [n for n in ckpt.names if n.startswith(prefix)]
    if experts is not None:
        keep = {int(e) for e in experts}
        names = [n for n in names if int(n[len(prefix):].split(".", 1)[0]) in keep]
    return names


_LAYERS: dict = {}


def processed_moe_block(path: str):
    """(model, MoE block) with only the first MoE layer's router and experts loaded and
    post-processed (fixed mode), built once per process: forward benchmarks need one
    layer, not the whole model read from disk."""
    if path not in _LAYERS:
        _LAYERS.clear()
        ckpt = Checkpoint(path)
        model = fr.FP8MoEModel(ckpt.config, fr.MODES["fixed"], ckpt.kind, device=DEVICE)
        model.eval()
        layer_id = first_moe_layer(model)
        block = model.model.layers[layer_id].mlp
        names = layer_tensor_names(ckpt, layer_id) + [f"model.layers.{layer_id}.mlp.gate.weight"]
        with torch.no_grad():
            model.load_weights(ckpt.read(names))
            block.experts.quant_method.process_weights_after_loading(block.experts)
        sync()
        _LAYERS[path] = (model, block)
    return _LAYERS[path]


class RoutedBatch:
    """The first MoE layer of a checkpoint plus `tokens` routed tokens for it."""

    def __init__(self, path: str, tokens: int, seed: int = 0):
        model, block = processed_moe_block(path)
        self.model = model
        self.layer = block.experts
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, model.config.hidden_size, generator=g).to(torch.bfloat16)
        self.x = x.to(DEVICE)
        with torch.no_grad():
            self.topk_weights, self.topk_ids = block.gate(self.x)

    def forward(self, backend: str):
        with torch.no_grad():
            return kernels.run_moe(self.layer, self.x, self.topk_weights, self.topk_ids,
                                   backend=backend)

    def reference(self):
        """float32 reference of the same dequantized weights (no activation quantization)."""
        with torch.no_grad():
            return kernels.moe_forward_torch(self.layer, self.x, self.topk_weights,
                                             self.topk_ids, quantize_activations=False)


class UnprocessedLayer:
    """The first MoE layer of a `processing`-mode model, loaded but not post-processed.

    `scope` "all": every expert was just loaded (a fresh load); "one": the layer
    was loaded and processed, then expert 0 loaded again (a one-expert reload).
    `restore()` puts back the exact unprocessed state (Parameter objects and
    bytes; for "one" only what processing one expert writes, checked once to be
    exact), so every timed post-processing starts from the same place.

    Both modes start with the loaded values on `DEVICE`: upstream holds bf16
    checkpoints in bf16 Parameters there, and the fixed mode's staged bf16 pieces
    are moved there too, so neither side pays a host-to-device copy in the timing.
    """

    _cache: dict = {}

    @classmethod
    def get(cls, path: str, processing: str, scope: str) -> UnprocessedLayer:
        key = (path, processing, scope)
        if key not in cls._cache:
            cls._cache.clear()
            cls._cache[key] = cls(path, processing, scope)
        return cls._cache[key]

    def __init__(self, path: str, processing: str, scope: str):
        ckpt = Checkpoint(path)
        mode = fr.MODES[processing]
        # Only the one layer gets bytes; the rest of the model stays unallocated garbage.
        self.model = fr.FP8MoEModel(ckpt.config, mode, ckpt.kind, device=DEVICE)
        layer_id = first_moe_layer(self.model)
        self.layer = self.model.model.layers[layer_id].mlp.experts
        with torch.no_grad():
            self.model.load_weights(ckpt.read(layer_tensor_names(ckpt, layer_id)))
            if scope == "one":
                self.process()
                self.model.load_weights(ckpt.read(layer_tensor_names(ckpt, layer_id, [0])))
            elif scope != "all":
                raise ValueError(f"unknown scope {scope!r}")
        staged = getattr(self.layer, "staged", {})
        for slot, pieces in staged.items():  # like-for-like with upstream: on the device
            staged[slot] = {k: v.to(DEVICE) for k, v in pieces.items()}
        sync()
        self._save()
        # "one": `restore` puts back the reloaded slots of the two expert weights and the
        # small tensors, what processing one expert writes, as an EPLB reload leaves the
        # layer (only that expert's bytes just written); copying the whole layer back
        # before every sample left the caches cold for the timed call (H200: 34.4 against
        # 28.4 us, results/h200/kernels-probe/launch_probe-processing-wip1.txt, "[after]")
        self.slots = sorted(self.loaded) if scope == "one" else None
        self.process()  # warm-up (first-call costs, kernel loading), then back
        self.restore()
        if self.slots is not None:  # what was not put back is exactly what was saved
            for k, saved in self.bytes.items():
                if not torch.equal(_raw(self.params[k].data), _raw(saved)):
                    raise RuntimeError(f"processing one expert wrote {k} outside slots {self.slots}")

    def process(self) -> None:
        with torch.no_grad():
            self.layer.quant_method.process_weights_after_loading(self.layer)

    def _save(self) -> None:
        layer = self.layer
        self.params = dict(layer._parameters)
        self.bytes = {k: p.data.clone() for k, p in self.params.items() if p is not None}
        self.buffers = {k: b.clone() for k, b in layer._buffers.items() if b is not None}
        self.attrs = {k: getattr(layer, k) for k in ("w13_input_scale", "w2_input_scale")
                      if k not in self.params and hasattr(layer, k)}
        self.loaded = set(layer.loaded_experts)
        self.staged = {s: dict(v) for s, v in getattr(layer, "staged", {}).items()}
        self.version = layer.weights_version

    def restore(self) -> None:
        layer = self.layer
        for k in list(layer._parameters):
            if k not in self.params:
                del layer._parameters[k]
        for k, p in self.params.items():
            if k in layer.__dict__:
                del layer.__dict__[k]
            layer._parameters[k] = p
        with torch.no_grad():
            for k, saved in self.bytes.items():
                dst, src = _raw(self.params[k].data), _raw(saved)
                if self.slots is not None and k in ("w13_weight", "w2_weight"):
                    for s in self.slots:
                        dst[s].copy_(src[s])
                else:
                    dst.copy_(src)
            for k, saved in self.buffers.items():
                layer._buffers[k].copy_(saved)
        for k, v in self.attrs.items():
            setattr(layer, k, v)
        layer.loaded_experts = set(self.loaded)
        if hasattr(layer, "staged"):
            layer.staged = {s: dict(v) for s, v in self.staged.items()}
        layer.weights_version = self.version
        sync()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
