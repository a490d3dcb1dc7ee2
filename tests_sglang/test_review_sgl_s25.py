"""Review s25 of the sglang patch (an attack through sglang's own `WeightUpdater`,
`DefaultModelLoader` and `FusedMoE`). Each case failed before its fix:

* an index that leaves an expert's tensors out (they are in the shard) made a filtered reload
  of that expert report success and load nothing; one that names another shard for them made
  it fail. A fresh load reads each shard's own names either way, so the reload now does too
  where the index is wrong;
* a Parameter shared by two modules (an output head tied to the embedding, as GraniteMoE,
  PhiMoE and HunYuan do) kept one more recording wrapper on its loader after every filtered
  reload, until a call to it recursed past Python's limit.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

import fp8_reload as fr

from .conftest import CFG
from .sgl_model import MOE_LAYER, ServedModel, byte_diffs, fresh_experts
from .test_weight_updater import _experts, _loader, _model_config, served, updater

E = CFG.num_experts
EXPERT = 3


def _bad_index(src, dst, how: str):
    """A copy of `src` whose index leaves expert `EXPERT`'s tensors out, or names another
    shard for them; the shards are untouched."""
    d = shutil.copytree(src, dst)
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    key = f"model.layers.{MOE_LAYER}.mlp.experts.{EXPERT}."
    mine = {n: f for n, f in idx["weight_map"].items() if key in n}
    assert mine
    if how == "left out":
        idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if n not in mine}
    else:
        other = next(f for f in sorted(set(idx["weight_map"].values())) if f not in set(mine.values()))
        idx["weight_map"].update({n: other for n in mine})
    p.write_text(json.dumps(idx))
    return d


@pytest.mark.parametrize("how", ["left out", "another shard"])
def test_a_wrong_index_does_not_change_what_a_filtered_reload_loads(patched, cpu_scaled_fp8_quant,
                                                                    server_args, ckpts, tmp_path, how):
    base = ckpts[("fp8", 0)]
    donor = _bad_index(ckpts[("fp8", 1)], tmp_path / "donor", how)
    model = served(server_args, "fp8", base)
    ok, msg = updater(server_args, model, base).update_weights_from_disk(
        str(donor), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [EXPERT]}))
    assert ok, msg
    expected = fresh_experts(CFG, "fp8", {e: (ckpts[("fp8", 1)] if e == EXPERT else base) for e in range(E)})
    assert byte_diffs(_experts(model), expected) == []


class _TiedModel(ServedModel):
    """The served test model with an output head tied to the input embedding (one Parameter
    owned by two quantized modules), as sglang's GraniteMoE ties them."""

    def __init__(self, kind):
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        super().__init__(CFG, kind)
        self.model.embed_tokens = VocabParallelEmbedding(64, CFG.hidden_size, params_dtype=torch.bfloat16)
        self.lm_head = ParallelLMHead(64, CFG.hidden_size, params_dtype=torch.bfloat16)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_a_tied_parameter_gets_its_own_loader_back_after_every_filtered_reload(
        patched, cpu_scaled_fp8_quant, server_args, ckpts):
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from fp8_reload.sglang_patch.loader import record_loaded_modules

    a, b = ckpts[("fp8", 0)], ckpts[("fp8", 1)]
    model, loader = _TiedModel("fp8"), _loader()
    source = DefaultModelLoader.Source.init_new(_model_config(server_args, a), model)
    loader.load_weights_and_postprocess(model, loader._get_weights_iterator(source), torch.device("cpu"))
    w = model.model.embed_tokens.weight
    assert model.lm_head.weight is w
    own = w.__dict__["weight_loader"]
    for i in range(3):
        ok, msg = updater(server_args, model, a).update_weights_from_disk(
            str(b), "safetensors", weight_name_filter=fr.generate_weight_name_filter({MOE_LAYER: [i]}))
        assert ok, msg
        assert w.__dict__["weight_loader"] is own
    expected = fresh_experts(CFG, "fp8", {e: (b if e < 3 else a) for e in range(E)})
    assert byte_diffs(_experts(model), expected) == []
    for _ in range(sys.getrecursionlimit()):  # what as many filtered reloads leave behind
        with record_loaded_modules(model) as touched:
            w.__dict__["weight_loader"](w, w.detach().clone())  # (inside: both owners recorded)
        assert {id(model.model.embed_tokens), id(model.lm_head)} <= touched
    assert w.__dict__["weight_loader"] is own
