"""Device-memory peak of full reloads (both kinds) above the model and what reloads keep on the
device between them (its buffers), and MoE processing time, v2-lite slice."""
import tempfile
import time

import torch

import fp8_reload as fr
from fp8_reload.processing import CHUNK_BYTES

cfg = fr.MoEConfig.preset("v2-lite", num_layers=2)
root = tempfile.mkdtemp()
for kind in ("fp8", "bf16"):
    path = fr.write_checkpoint(f"{root}/{kind}", cfg, kind=kind, progress=False)
    model = fr.load_model(path, device="cuda")
    fr.update_weights_from_disk(model, path)  # warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    rep = fr.update_weights_from_disk(model, path)
    t = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held = (base - weights) / 2**20  # what reloads keep between them (device buffers, caches)
    print(f"{kind}: full reload {t*1e3:.1f} ms, device peak above model {peak:.1f} MiB "
          f"(chunk {CHUNK_BYTES >> 20} MiB; {held:.1f} MiB held between reloads), "
          f"process {rep.seconds['process']*1e3:.1f} ms")
    del model
    torch.cuda.empty_cache()
