"""Shared fixtures: real checkpoints on disk, written once per test session."""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8_reload as fr
import fp8_reload.reload.transaction as transaction_mod
from fp8_reload.checkpoint import INDEX_FILE, mix_checkpoints  # noqa: F401  (tests import it from here)
from fp8_reload.layers import FusedMoE
from fp8_reload.reload.chunks import Chunk

# The test models are tiny: intra-op threads only add contention on a 2-core CI box.
torch.set_num_threads(1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
WAIT = 10.0  # seconds a test waits for a thread or event before failing (never hang)


def unchanged(model, before) -> list[str]:
    """How `model` differs from snapshot `before`: bytes, Parameter objects, loader attributes."""
    return fr.compare_states(before, fr.snapshot(model), identity=True)


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """Every invariant test runs on CPU, and on the GPU where there is one."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (the GPU run covers this case)")
    return request.param


# A shell that starts pytest as a background job without job control (`bash .ci/run &`)
# hands it SIGINT ignored, and every process it starts inherits that: the Ctrl-C tests
# (test_cli, test_reliability) would then send signals nobody receives. The session takes
# Python's usual handler, as a terminal's pytest has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Without CUDA, Triton kernels run only in Triton's interpreter, which must be
# chosen before anything imports triton (tests/test_kernels.py relies on it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


ENGINES = ["stream", "staged"]
# A point inside each engine's commit that runs once per tensor written.
WRITE_POINT = {"staged": (FusedMoE, "_load_into_slot"), "stream": (Chunk, "offset_of")}


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """Run the test under each reload engine (`reload.transaction.ENGINE`)."""
    monkeypatch.setattr(transaction_mod, "ENGINE", request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_cfg() -> fr.MoEConfig:
    return fr.MoEConfig.preset("tiny")


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory, tiny_cfg):
    """{(kind, seed): path} for the tiny preset, both kinds, seeds 0 and 1."""
    root = tmp_path_factory.mktemp("ckpt")
    return {(kind, seed): fr.write_checkpoint(root / f"{kind}-{seed}", tiny_cfg, seed=seed, kind=kind)
            for kind in ("fp8", "bf16") for seed in (0, 1)}


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensor(path: Path, name: str, fn) -> None:
    """Replace tensor `name` in its shard by fn(old tensor), in place."""
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    fname = weight_map[name]
    tensors = load_file(str(path / fname))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path / fname), metadata={"format": "pt"})


def tokens(cfg: fr.MoEConfig, n: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16)


class Hang(KeyboardInterrupt):
    """Raised by `time_limit`. A KeyboardInterrupt so that no handler in the code under
    test can mistake it for a checkpoint error: it always reaches the test."""


@contextmanager
def time_limit(seconds: float):
    """Interrupt the block (main thread) with `Hang` after `seconds`: a test that would
    hang, e.g. in a blocking open() of a FIFO, fails instead (PEP 475: a signal handler
    that raises ends the blocking system call)."""

    def on_alarm(signum, frame):
        raise Hang(f"ran over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def fail_if_hangs(seconds: float):
    """`time_limit`, with a hang reported as this test's failure (a bare KeyboardInterrupt
    would end the whole pytest session)."""
    try:
        with time_limit(seconds):
            yield
    except Hang as e:
        pytest.fail(f"hung: {e}")


@pytest.fixture
def rewrite_mid_stream(monkeypatch):
    """``arm(path)``: the first time the streaming reload takes a tensor out of a chunk, a
    writer gives that tensor's shard under `path` a new stamp (same bytes): a file changed
    while it was read. ``monkeypatch.undo()`` disarms it."""
    from fp8_reload.reload.chunks import Chunk

    orig = Chunk.source

    def arm(path):
        touched = []

        def touch_then_source(self, buf, target):
            if not touched:
                shard = path / target.info.file
                st = shard.stat()
                os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
                touched.append(shard)
            return orig(self, buf, target)

        monkeypatch.setattr(Chunk, "source", touch_then_source)

    return arm


def raising_on_call(fn, n: int, exc: BaseException):
    """`fn` wrapped: its `n`-th call raises `exc` instead of running (a fault injected)."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return fn(*args, **kwargs)

    return wrapper


class FakeStream:
    """A CUDA stream stand-in for driving a GPU reload path on CPU: every queued copy runs
    at once, in program order, so waits have nothing to wait for."""

    device = torch.device("cpu")

    def wait_event(self, event):
        pass

    def wait_stream(self, other):
        pass


class FakeEvent:
    def __init__(self, **kw):  # (blocking=..., as torch.cuda.Event takes)
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def fake_cuda_streams(monkeypatch, *modules) -> None:
    """torch.cuda's events and streams, and each of `modules`' `side_stream`, as stand-ins."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    for mod in modules:
        monkeypatch.setattr(mod, "side_stream", lambda device, role: FakeStream())
