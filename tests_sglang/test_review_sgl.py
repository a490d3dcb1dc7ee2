"""Review (sglang path): cases found by breaking the patched sglang 0.5.23 on the CPU.

Every model here is loaded by sglang's own `DefaultModelLoader` and reloaded through its
`WeightUpdater.update_weights_from_disk`; "a fresh load" is a model sglang loaded from the
checkpoint at startup (its reader's order), not one of this project's readers.
"""

from __future__ import annotations

import json
import shutil

import fp8_reload as fr

from .conftest import CFG
from .sgl_model import MOE_LAYER, byte_diffs
from .test_weight_updater import _experts, served, updater

E = CFG.num_experts


def _up_before_gate(src, dst):
    """`src` with an index that lists each expert's up_proj before its gate_proj (JSON
    order is free; sglang's reader goes by the shards' sorted names, not the index)."""
    d = shutil.copytree(src, dst)
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(index["weight_map"], key=lambda n: n.replace("up_proj", "a_proj"))
    index["weight_map"] = {n: index["weight_map"][n] for n in names}
    path.write_text(json.dumps(index))
    return d


def test_filtered_reload_reads_in_sglang_order(patched, cpu_scaled_fp8_quant, server_args, ckpts,
                                               tmp_path):
    """gate_proj and up_proj input scales both land in w13_input_scale[e] (the last one read
    wins, in sglang too): a filtered reload must read a shard's tensors in the order sglang's
    startup load does, or the merged input scale differs from a fresh load."""
    base = _up_before_gate(ckpts[("fp8", 0)], tmp_path / "base")
    donor = _up_before_gate(ckpts[("fp8", 1)], tmp_path / "donor")
    model = served(server_args, "fp8", base)
    ok, msg = updater(server_args, model, donor).update_weights_from_disk(
        str(donor), "safetensors",
        weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: range(E)}))
    assert ok, msg
    assert byte_diffs(_experts(model), _experts(served(server_args, "fp8", donor))) == []
