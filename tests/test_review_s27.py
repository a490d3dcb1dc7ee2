"""Attack s27 on the reload (helper 59). Each case failed before its fix:

* a Ctrl-C landing as `update_weights_from_disk` got the model's reload lock (raised in
  contextlib's frames of the `@contextmanager` that held it) left that lock owned and the
  reload marked as running on this thread while the KeyboardInterrupt's traceback lived:
  the next reload on this thread was refused, one on another thread waited forever; the
  same for a forward's read count (tests in `test_lock_interrupts.py`);
* `load_model` given a `Checkpoint` opened before its directory was replaced built the
  model from the old config.json and the new shards: no fresh load gives that model.
"""

from __future__ import annotations

import os
import shutil

import fp8_reload as fr
from fp8_reload.checkpoint import Checkpoint, write_checkpoint


def test_load_model_of_a_checkpoint_opened_before_its_directory_was_replaced(tmp_path, tiny_cfg):
    d, new = tmp_path / "ckpt", tmp_path / "new"
    write_checkpoint(d, tiny_cfg, seed=0)
    write_checkpoint(new, fr.MoEConfig(**{**tiny_cfg.__dict__, "routed_scaling_factor": 2.5}), seed=1)
    opened = Checkpoint(d)
    for f in os.listdir(new):  # a writer renames a complete new version into place
        shutil.copy(new / f, d / (f + ".tmp"))
        os.replace(d / (f + ".tmp"), d / f)
    model = fr.load_model(opened)
    fresh = fr.load_model(d)
    assert model.config == fresh.config and model.config.routed_scaling_factor == 2.5
    assert fr.compare_states(fr.snapshot(fresh), fr.snapshot(model)) == []
    fr.update_weights_from_disk(model, d, fr.generate_weight_name_filter({1: [0]}))  # it fits
