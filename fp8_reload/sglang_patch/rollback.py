"""A failed filtered reload leaves the patched MoE layers as they were.

sglang 0.5.23's `WeightUpdater.update_weights_from_disk` answers a failed load by
loading again from ``model_config.model_path``, which it has already set to the *new*
path: its "rollback" re-reads the checkpoint that failed. After a passing fault the
experts hold the new weights while the call reports "Rolling back to original
weights"; after a tensor it cannot load it raises again with the experts half written
(and the patch's bookkeeping, slots loaded or bf16 experts staged, left to spoil the
next reload).

`ExpertBackup` keeps, for one update call, what each patched layer had before its
first loader call: the layer's small tensors whole (weight and input scales), the
w13 / w2 rows of each expert slot before it is
first written, and the bookkeeping, all copied to host memory (a GPU needs no room
for them; each slot costs one device-to-host copy). `restore()` puts all of it back in
place (the same Parameter objects). Only the slots a reload writes are copied.
"""

from __future__ import annotations

import threading

ROWS = ("w13_weight", "w2_weight")


def _host_copy(t):
    return t.detach().to("cpu", copy=True)


def _own_tensors(layer) -> dict:
    out = dict(layer.named_parameters(recurse=False))
    out.update(layer.named_buffers(recurse=False))
    return out


class _LayerState:
    def __init__(self, layer):
        self.layer = layer
        self.whole = {n: _host_copy(t) for n, t in _own_tensors(layer).items() if n not in ROWS}
        self.rows: dict[int, list] = {}
        self.loaded = set(layer._fp8r_loaded)
        self.parts = {slot: set(p) for slot, p in layer._fp8r_parts.items()}
        self.staged = set(getattr(layer, "_fp8r_staged", {}))
        self.processed = layer._fp8r_processed
        for slot in self.loaded | self.staged:  # processing will write these too
            self.save_rows(slot)

    def save_rows(self, slot: int) -> None:
        if slot not in self.rows:
            self.rows[slot] = [_host_copy(getattr(self.layer, n).data[slot]) for n in ROWS]

    def restore(self) -> None:
        layer = self.layer
        now = _own_tensors(layer)
        for name, saved in self.whole.items():
            now[name].data.copy_(saved)
        for slot, saved in self.rows.items():
            for name, t in zip(ROWS, saved):
                getattr(layer, name).data[slot].copy_(t)
        layer._fp8r_loaded.clear()
        layer._fp8r_loaded.update(self.loaded)
        layer._fp8r_parts.clear()
        layer._fp8r_parts.update(self.parts)
        staged = getattr(layer, "_fp8r_staged", None)
        if staged is not None:
            for slot in [s for s in staged if s not in self.staged]:
                del staged[slot]
        layer._fp8r_processed = self.processed


class ExpertBackup:
    """What the patched MoE layers of `model` had before an update call wrote them.

    Installed on each such layer (``_fp8r_backup``) for the call, so loaders running
    in sglang's thread pools find it too; `save` is called by the patched loader
    before it writes an expert slot.
    """

    def __init__(self, model):
        self._lock = threading.Lock()
        self._layers: dict[int, _LayerState] = {}
        self._installed = [m for m in model.modules() if hasattr(m, "_fp8r_loaded")]
        for layer in self._installed:
            layer._fp8r_backup = self

    def save(self, layer, slot: int) -> None:
        with self._lock:
            state = self._layers.get(id(layer))
            if state is None:
                state = self._layers[id(layer)] = _LayerState(layer)
            state.save_rows(slot)

    def restore(self) -> None:
        for state in self._layers.values():
            state.restore()
        self._layers.clear()

    def close(self) -> None:
        for layer in self._installed:
            layer.__dict__.pop("_fp8r_backup", None)
        self._layers.clear()
