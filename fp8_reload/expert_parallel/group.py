"""Process groups for expert parallelism: joining one, the devices ranks talk on, warm-up."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(world_size: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_rank(backend: str, rank: int, world_size: int, init_method: str,
              timeout_s: float = 300.0) -> torch.device:
    """Join the process group; returns this rank's device (its GPU for nccl)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(backend, local_rank)
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share_cpu(backend: str, world_size: int) -> None:
    """CPU ranks on one host split its cores instead of each taking all of them."""
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def warm_up_p2p(group=None) -> None:
    """Exchange one byte with every peer: NCCL sets up its point-to-point
    communicators on first use, which should not be charged to a rebalance."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = comm_device(torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend(group) == "nccl" else torch.device("cpu"), group)
    bufs = {p: (torch.zeros(1, dtype=torch.uint8, device=dev), torch.empty(1, dtype=torch.uint8, device=dev))
            for p in range(world) if p != rank}
    ops = [op for p, (out, inc) in bufs.items()
           for op in (dist.P2POp(dist.isend, out, global_rank(group, p), group),
                      dist.P2POp(dist.irecv, inc, global_rank(group, p), group))]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    dist.barrier(group=group)


def global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (what point-to-point calls take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def comm_device(model_device: torch.device, group) -> torch.device:
    """Where the group's tensors must live: host memory for gloo, the model's GPU for nccl."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else model_device


def failed_ranks(error: BaseException | None, group, device) -> list[int]:
    """The ranks of `group` whose `error` is not None, known to every rank (one all-gather):
    a collective step that fails on one rank fails on all of them together, none waits."""
    world = dist.get_world_size(group)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(flag) for _ in range(world)]
    dist.all_gather(flags, flag, group=group)
    return [r for r, f in enumerate(torch.cat(flags).tolist()) if f]
