"""A model on a CUDA device that is not the current one.

Triton launches its kernels on the current CUDA device, not on its tensors': a model on
cuda:1 loaded, reloaded or run while cuda:0 is current must still work on cuda:1
(`device.current_cuda` around each of those; registered and pinned host memory is
portable under unified addressing, so only the launches need it). Needs two GPUs: the 2xH200 host runs it
(`pytest tests/test_second_gpu.py`); a one-GPU or CPU machine has no second device.
"""

from __future__ import annotations

import pytest
import torch

import fp8_reload as fr
from fp8_reload.device import current_cuda, use_in_this_thread

from .conftest import tokens

TWO = pytest.mark.skipif(torch.cuda.device_count() < 2,
                         reason="needs two CUDA GPUs (the 2xH200 run covers this case)")
KINDS = ["fp8", "bf16"]


@TWO
@pytest.mark.parametrize("kind", KINDS)
def test_reloads_and_forwards_on_the_second_gpu(ckpts, tiny_cfg, kind):
    """Full reloads (first, registering, registered), a filtered one and Triton forwards of
    a model on cuda:1 with cuda:0 current: each equals a fresh load on cuda:1 bit for bit,
    every Parameter kept, and its forward equals the same model's on cuda:0."""
    torch.cuda.set_device(0)
    model = fr.load_model(ckpts[kind, 0], device="cuda:1")
    assert torch.cuda.current_device() == 0  # the load left the current device alone
    fresh = {seed: fr.snapshot(fr.load_model(ckpts[kind, seed], device="cuda:1")) for seed in (0, 1)}
    assert fr.compare_states(fresh[0], fr.snapshot(model)) == []
    params = {name: p for name, p in model.named_parameters()}
    for round_, seed in enumerate([1, 0, 1, 0]):  # new stamps, then the shards registered
        fr.update_weights_from_disk(model, ckpts[kind, seed])
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
        assert fr.compare_states(fresh[seed], fr.snapshot(model)) == [], (kind, round_)
        assert all(p is params[name] for name, p in model.named_parameters())
    spec = {layer: [1] for layer in tiny_cfg.moe_layers}
    fr.update_weights_from_disk(model, ckpts[kind, 1], fr.generate_weight_name_filter(spec))
    changed = fr.compare_states(fresh[0], fr.snapshot(model))
    assert changed and all(".experts." in line for line in changed), changed

    on0 = fr.load_model(ckpts[kind, 0], device="cuda:0")
    fr.update_weights_from_disk(on0, ckpts[kind, 1], fr.generate_weight_name_filter(spec))
    assert fr.compare_states(fr.snapshot(on0), fr.snapshot(model)) == []
    x = tokens(tiny_cfg, n=64)
    for m in (model, on0):
        m.set_backend("triton")
    y1 = model(x.to("cuda:1"))
    y0 = on0(x.to("cuda:0"))
    assert y1.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert torch.equal(y1.cpu(), y0.cpu())


@TWO
def test_current_cuda_switches_only_when_needed():
    torch.cuda.set_device(0)
    with current_cuda(torch.device("cuda:1")):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    with current_cuda(torch.empty(1, device="cuda:0")):
        assert torch.cuda.current_device() == 0


def test_current_cuda_leaves_cpu_and_unindexed_devices_alone():
    """(CPU as well) nothing to switch for a CPU tensor or device (also as a string), None
    or bare "cuda"."""
    for where in (torch.empty(1), torch.device("cpu"), "cpu", "meta", None, torch.device("cuda"), "cuda"):
        with current_cuda(where) as entered:
            assert entered is None


def test_a_worker_thread_takes_no_device_for_what_is_not_on_one():
    """(CPU as well) an event not recorded yet (no device), a stand-in without one, a CPU
    device: nothing to make current."""
    for what in (None, object(), "cpu", torch.device("cpu"), torch.empty(1)):
        use_in_this_thread(what)


# Run in a process of its own: the test session has made cuda:0's context long before.
_ONLY_CUDA1 = """
import ctypes, sys, torch
import fp8_reload as fr
import fp8_reload.reload.to_device as to_device
torch.cuda.set_device(1)
to_device.REGISTER = "never"  # every reload through the readers' ring (they wait on events)
model = fr.load_model(sys.argv[1], device="cuda:1")
for path in sys.argv[2:] * 2:
    fr.update_weights_from_disk(model, path)
torch.cuda.synchronize(1)
cuda = ctypes.CDLL("libcuda.so.1")
flags, active = ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
print("cuda:0 context active:", active.value)
"""


@TWO
def test_a_model_on_cuda1_makes_no_context_on_cuda0(ckpts, tmp_path):
    """Reloads of a model on cuda:1 in a process that never used cuda:0: the ring's reader
    threads wait on copy events, and a thread's first CUDA call would make a context on its
    current device, cuda:0, unless it takes the model's (`use_in_this_thread`)."""
    import subprocess
    import sys

    script = tmp_path / "only_cuda1.py"
    script.write_text(_ONLY_CUDA1)
    out = subprocess.run([sys.executable, str(script), str(ckpts["fp8", 0]), str(ckpts["fp8", 1]),
                          str(ckpts["fp8", 0])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cuda:0 context active: 0" in out.stdout, out.stdout
