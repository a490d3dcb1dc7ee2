"""Running ranks: spawned on this host or joined under torchrun, and a persistent pool.

Results travel between processes as JSON (`encode` / `decode`), never as
pickles: the library never unpickles anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..reload import ReloadReport
from ..state import compare_states, snapshot
from .group import free_port, init_rank, launched_by_torchrun, share_cpu, warm_up_p2p
from .placement import Placement
from .rebalance import RebalanceReport, rebalance
from .slots import load_rank_model

# Dataclasses a rank may return (decoded back by name).
_REPORTS = {"ReloadReport": ReloadReport, "Placement": Placement,
            "RebalanceReport": RebalanceReport}


def encode(obj):
    """JSON-ready form of a rank's result: keeps tuples, non-string dict keys and reports."""
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _REPORTS:
        return {"__report__": type(obj).__name__,
                "fields": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                           if f.init}}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    return obj


def decode(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__report__", "fields"}:
            return _REPORTS[obj["__report__"]](**decode(obj["fields"]))
        if set(obj) == {"__tensor__", "dtype"}:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        if set(obj) == {"__items__"}:
            return {decode(k): decode(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(decode(v) for v in obj["__tuple__"])
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def _spawn_entry(rank, world_size, backend, port, fn, args, out_dir):
    os.environ["LOCAL_RANK"] = str(rank)
    share_cpu(backend, world_size)
    device = init_rank(backend, rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        result = fn(rank, world_size, device, *args)
        # JSON, not pickle: the library never unpickles anything (tests/test_reliability.py)
        with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
            json.dump(encode(result), f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, backend: str, *args) -> list:
    """Run ``fn(rank, world_size, device, *args)`` on every rank; results by rank.

    Under torchrun (RANK/WORLD_SIZE/MASTER_* set) this process is one rank: it
    joins the group from the environment and returns ``[its result]``.
    Otherwise it spawns `world_size` processes on this host.
    """
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = init_rank(backend, rank, world, "env://")
        try:
            return [fn(rank, world, device, *args)]
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory(prefix="fp8-reload-ranks-") as out:
        mp.spawn(_spawn_entry, args=(world_size, backend, free_port(), fn, args, out),
                 nprocs=world_size, join=True)
        results = []
        for r in range(world_size):
            with open(Path(out) / f"rank{r}.json") as f:
                results.append(decode(json.load(f)))
        return results


# --------------------------------------------------------------------------
# A persistent pool of ranks (the benchmarks time rebalances on it)
# --------------------------------------------------------------------------

def _pool_worker(rank, world, backend, port, checkpoint, start, conn, builder):
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        share_cpu(backend, world)
        device = init_rank(backend, rank, world, f"tcp://127.0.0.1:{port}")
        model = (builder or load_rank_model)(checkpoint, start, rank, device)
        warm_up_p2p()
        conn.send(("ok", str(device)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "stop":
                break
            if cmd == "rebalance":
                new, mode, exclude, phase_times = args
                dist.barrier()
                t0 = time.perf_counter()
                report = rebalance(model, new if rank == 0 else None, mode=mode,
                                   exclude_sources=exclude, phase_times=phase_times)
                conn.send(("ok", {"wall_s": time.perf_counter() - t0, "report": report}))
            elif cmd == "call":
                fn, fargs = args
                conn.send(("ok", fn(model, *fargs)))
            elif cmd == "verify":
                fresh = load_rank_model(checkpoint, model.placement, rank, device)
                diffs = compare_states(snapshot(model), snapshot(fresh))
                del fresh
                conn.send(("ok", diffs))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` rank processes, each holding one process group membership and
    its share of the model under a placement, driven by commands over pipes.

    The benchmarks time rebalances on it without paying process start-up,
    process-group set-up, NCCL communicator set-up or model loading each time.
    `builder(checkpoint, start, rank, device)` makes a rank's model (default:
    `load_rank_model`); `call(fn, *args)` runs ``fn(model, *args)`` on every rank
    (`fn` importable by name: it crosses a process boundary).
    """

    def __init__(self, world_size: int, backend: str, checkpoint, start: Placement,
                 timeout_s: float = 600.0, builder: Callable | None = None):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world_size, self.backend, self.checkpoint = world_size, backend, str(checkpoint)
        self.placement = self.start = start
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_worker, daemon=True, name=f"fp8-reload-rank{rank}",
                               args=(rank, world_size, backend, port, self.checkpoint, start, child,
                                     builder))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.devices = self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self) -> list:
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                # its late answer (and the later ranks') would be taken as the next command's:
                # the pool is given up, not reused out of step
                self.broken = f"rank {rank} did not answer within {self.timeout_s:.0f} s"
                for proc in self.procs:
                    proc.terminate()
                self.close()
                raise TimeoutError(f"{self.broken}; the rank pool is closed")
            status, value = conn.recv()
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {rank}: {value}")
        if errors:
            raise RuntimeError("rank pool command failed:\n" + "\n".join(errors))
        return results

    def _call(self, *cmd) -> list:
        if self.broken or not self.conns:
            raise RuntimeError(f"the rank pool is closed ({self.broken or 'close() was called'})")
        for conn in self.conns:
            conn.send(cmd)
        return self._collect()

    def rebalance(self, new: Placement, mode: str = "p2p", exclude_sources=(),
                  phase_times: bool = False) -> list[dict]:
        """Rebalance every rank to `new`; per rank ``{"wall_s", "report"}`` (`phase_times`:
        the report's phases timed on the device, a wait after each)."""
        out = self._call("rebalance", new, mode, tuple(exclude_sources), bool(phase_times))
        self.placement = new
        return out

    def call(self, fn: Callable, *args) -> list:
        """``fn(model, *args)`` on every rank (collectively); results by rank."""
        return self._call("call", fn, args)

    def verify(self) -> list[list[str]]:
        """Per rank: differences from a fresh load under the current placement."""
        return self._call("verify")

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.is_alive():
                    conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.procs, self.conns = [], []
