"""Adversarial review of session 3's changes (targets planned per model, `load_model`
priming the first reload's parse and plan, `open_regular` through an opener)."""

from __future__ import annotations

import gc

import pytest
from torch.multiprocessing.reductions import StorageWeakRef

import fp8_reload as fr


@pytest.mark.parametrize("reloads", [0, 2], ids=["after-load", "after-reloads"])
def test_release_staging_gives_back_the_memory_of_moved_parameters(ckpts, reloads):
    """The target cache (now per model, and filled by `load_model` itself) and the full
    plan kept with each remembered parse hold views of every Parameter's memory. Once the
    Parameters are rebound to other memory (what `model.to(other_device)` does to each
    `.data`: an offload), the old memory stays referenced by those views, and
    `release_staging` ("give back what reloads hold between calls") did not give it back:
    on a GPU, a whole model's worth of device memory held by an offloaded model."""
    model = fr.load_model(ckpts["fp8", 0])
    for k in range(reloads):  # RL weight sync alternating two checkpoints: both parses kept
        fr.update_weights_from_disk(model, ckpts["fp8", k % 2])
    old = []
    for p in model.parameters():
        old.append(StorageWeakRef(p.untyped_storage()))
        p.data = p.data.clone()
    fr.release_staging(model)
    gc.collect()
    assert sum(not w.expired() for w in old) == 0
    fr.update_weights_from_disk(model, ckpts["fp8", 1])  # still reloads into the new memory
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []
