"""Where a model lives, and waiting for its device: the one place that synchronizes a GPU.

A GPU call returns once its kernels are queued; code that times work, reuses
staging memory or hands weights to other threads waits here first.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import torch
from torch import nn

from .errors import DeviceUnavailableError


def default_device() -> str:
    """``cuda`` where a GPU is usable, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None = None) -> str:
    """`device` checked against this machine (None: `default_device()`), as a string.

    Loads, the demo, the gate and the profiler call this before they read or
    write anything, so asking for CUDA on a CPU box fails in one line
    (`DeviceUnavailableError`) instead of in torch's lazy CUDA initialization.
    """
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailableError(f"unknown device {str(device)!r}: expected cpu, cuda or "
                                     "cuda:N") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {str(device)!r} asked for, but CUDA is not "
                                         "available here (no GPU, or a CPU-only torch build)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"device {str(device)!r} asked for, but this machine has "
                                         f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise DeviceUnavailableError(f"device {str(device)!r} is not supported: expected cpu, "
                                     "cuda or cuda:N")
    return str(device)


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None for a model without any)."""
    p = next(model.parameters(), None)
    return None if p is None else p.device


def on_cuda(model: nn.Module) -> bool:
    device = model_device(model)
    return device is not None and device.type == "cuda"


def synchronize(target: nn.Module | torch.Tensor | torch.device | str | None = None) -> None:
    """Wait for the queued work of `target`'s CUDA device; nothing on CPU.

    `target` is a module (its parameters' device), a tensor, a device, or None
    (the current CUDA device, when this process has initialized CUDA).
    """
    if target is None:
        # the current device, straight to the runtime: `torch.cuda.synchronize` spends a few
        # microseconds of Python on the device guard, and benchmarks of one reloaded expert
        # pay it on each side of every sample. Nothing initialized: nothing was queued.
        if torch.cuda.is_initialized():
            torch._C._cuda_synchronize()
        return
    if isinstance(target, nn.Module):
        target = model_device(target)
    elif isinstance(target, torch.Tensor):
        target = target.device
    if target is not None and torch.device(target).type == "cuda":
        torch.cuda.synchronize(target)


def current_cuda(device) -> contextlib.AbstractContextManager:
    """A block in which `device` (a CUDA device or its name, or a tensor on one) is the
    current CUDA device; nothing to do (a look at the current one, under a microsecond)
    when it already is, or for a CPU one.
    Triton launches its kernels on the current device, not its tensors': a model on
    cuda:1 called while cuda:0 is current would otherwise run them where its memory
    is not (an illegal address that poisons the whole CUDA context)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    elif isinstance(device, str):
        device = torch.device(device)
    # (a tensor's or a model's device is a torch.device: a stand-in (tests) is left alone)
    if not isinstance(device, torch.device) or device.type != "cuda" or device.index is None \
            or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


_THREAD = threading.local()


def use_in_this_thread(device) -> None:
    """Make `device` (a CUDA device, or an event or tensor on one) current in this worker
    thread, once per thread. A new thread's current device is cuda:0: its first CUDA call
    (a reader waiting on a copy's event) would otherwise create a context on cuda:0 (some
    hundreds of MiB there) in a process whose model lives on another GPU."""
    if not isinstance(device, (str, torch.device)):
        device = getattr(device, "device", None)  # (an event not recorded yet: None)
    if device is None:
        return
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is not None and getattr(_THREAD, "device", None) != index:
        torch.cuda.set_device(index)
        _THREAD.device = index


_SIDE_STREAMS: dict = {}


def side_stream(device, role: str) -> torch.cuda.Stream:
    """The process's CUDA stream for `role` ("copy": a reload's host-to-device writes,
    "backup": its device-to-host backups) on `device`, made once and reused."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, role)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[key]


@functools.cache
def _runtime_paths() -> tuple[str, ...]:
    """The CUDA runtime libraries torch loaded (from /proc/self/maps; none on another OS)."""
    try:
        with open("/proc/self/maps") as maps:
            return tuple(sorted({line.split()[-1] for line in maps if "libcudart.so" in line}))
    except OSError:
        return ()


@functools.cache
def _cudart():
    """The CUDA runtime torch loaded with ``cudaMemcpyAsync`` typed, or None (another OS,
    a static runtime): then copies go through torch. Called holding the GIL
    (`ctypes.PyDLL`): an asynchronous copy returns in microseconds, and taking the GIL
    back after each one cost a ring reload's thread 3x that while its reader threads ran
    (H200: 15 vs 5 us median, 57 vs 7 us p90)."""
    for path in _runtime_paths():
        try:
            lib = ctypes.PyDLL(path)
            fn = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return lib
    return None


@functools.cache
def _cudart_unlocked():
    """The same runtime through `ctypes.CDLL`, whose calls let the GIL go, for the calls
    that take long: registering a page-cached shard takes ~25 ms per GiB on an H200 host,
    and torch's binding holds the GIL all that time, so every other thread of the process,
    forwards included, stopped (`gpu/register_probe.py`). None: torch's binding."""
    for path in _runtime_paths():
        try:
            lib = ctypes.CDLL(path)
            register, unregister = lib.cudaHostRegister, lib.cudaHostUnregister
        except (OSError, AttributeError):
            continue
        register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        unregister.argtypes = [ctypes.c_void_p]
        register.restype = unregister.restype = lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def host_register(ptr: int, nbytes: int, flags: int = 0) -> bool:
    """``cudaHostRegister`` with the GIL released; False when refused (the runtime's last
    error is cleared: left set, torch would raise it at its next launch check)."""
    lib = _cudart_unlocked()
    if lib is not None:
        err = lib.cudaHostRegister(ptr, nbytes, flags)
        if err:
            lib.cudaGetLastError()
        return err == 0
    rt = torch.cuda.cudart()
    if rt.cudaHostRegister(ptr, nbytes, flags) == rt.cudaError.success:
        return True
    try:  # torch exposes no cudaGetLastError: one tiny launch reads (and clears) it
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass
    return False


def host_unregister(ptr: int) -> None:
    lib = _cudart_unlocked()
    if lib is not None:
        lib.cudaHostUnregister(ptr)
    else:
        torch.cuda.cudart().cudaHostUnregister(ptr)


_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """``dst.copy_(src, non_blocking=True)`` on `stream`, within one CUDA device or between
    it and pinned or registered host memory (either way), which the caller keeps alive
    until the copy has run. Contiguous pairs of one dtype and shape go straight to the runtime: a
    torch copy costs ~30 µs of host time, which for the ~700 tensors of a v2-lite slice is
    most of a reload's time on the host."""
    lib = _cudart() if torch.cuda.is_available() else None
    fn = None if lib is None else lib.cudaMemcpyAsync
    one_device = dst.device == src.device if dst.is_cuda and src.is_cuda else dst.is_cuda or src.is_cuda
    if (fn is None or not one_device or src.dtype != dst.dtype or src.shape != dst.shape
            or not dst.is_contiguous() or not src.is_contiguous()):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return
    nbytes = dst.numel() * dst.element_size()
    err = fn(dst.data_ptr(), src.data_ptr(), nbytes, _DEFAULT, stream.cuda_stream)
    if err:
        # read (and so clear) the runtime's last error: left set, torch would raise it at its
        # next launch check, e.g. inside the rollback this error is about to start
        lib.cudaGetLastError()
        raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed (CUDA error {err})")
