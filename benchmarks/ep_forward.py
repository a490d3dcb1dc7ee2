"""Expert-parallel forward: tokens and MoE time per rank on a skewed routing, before and after
`balance_placement` + `rebalance`.

Two ranks (`ep_common`: the checkpoint pool) route ``TOKENS`` tokens each through every
MoE layer with a Zipf(``ALPHA``) routing over experts (`skewed_routing`, fixed seed; the
same hot experts on every rank, as a real gate gives). ``start`` is the round-robin
placement; ``balanced`` the balancer's placement for the all-ranks expert counts of that
same routing, reached by a p2p `rebalance` of the pool. Per rank: the (token, expert)
pairs its experts compute (``track_tokens``) and the time of that local compute
(``track_moe_seconds``: the backend's forward on the received rows, device synchronized,
median of 3); per placement: the slowest rank over the mean, per layer, averaged over
layers (``EPBalance``: every layer waits for its slowest rank), and the wall time of one
collective forward of every MoE layer (``EPForward.time_forward``).

Goal (on the H200 pair): the slowest rank's MoE time within 10% of the mean after
rebalancing. Run standalone for a table, JSON and a plot: ``python benchmarks/ep_forward.py``.
Environment: ``FP8_RELOAD_BENCH_EP_TOKENS`` (per rank), ``FP8_RELOAD_BENCH_EP_BACKEND``
(default triton on CUDA where it runs, else torch), and those of `ep_common`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import require
    from benchmarks.ep_common import ON_CUDA, SPEC, WORLD, checkpoint_start, rank_pool
else:
    from .common import require
    from .ep_common import ON_CUDA, SPEC, WORLD, checkpoint_start, rank_pool

import torch

PLACEMENTS = ["start", "balanced"]
TOKENS = int(os.environ.get("FP8_RELOAD_BENCH_EP_TOKENS") or (4096 if ON_CUDA else 256))
ALPHA = 1.2
SEED = 0
REPEAT = 3
RUN = ("fp8_reload.testing.ep_bench:ep_forward_run",)
ONCE = ("fp8_reload.testing.ep_bench:ep_forward_once",)
SKEWED_ROUTING = ("fp8_reload.expert_parallel:skewed_routing",)
ROUTING_LOAD = ("fp8_reload.expert_parallel:routing_load",)
BALANCE = ("fp8_reload.expert_parallel:balance_placement",)

_RESULTS: dict = {}  # placement name -> per-rank results of `ep_forward_run`


def ep_backend() -> str:
    """The MoE backend of the ranks' local experts: triton on CUDA where it runs, else torch."""
    chosen = os.environ.get("FP8_RELOAD_BENCH_EP_BACKEND")
    if chosen:
        return chosen
    if ON_CUDA:
        from fp8_reload.kernels import backend_status

        if backend_status().get("triton") is None:
            return "triton"
    return "torch"


def measured_load(start) -> torch.Tensor:
    """[layers, experts] pairs routed to each expert by every rank's skewed routing: EPLB's
    statistics, computed here from the same seeds the ranks use."""
    import fp8_reload as fr

    cfg = fr.MoEConfig.from_spec(SPEC)
    skewed, count = require(*SKEWED_ROUTING), require(*ROUTING_LOAD)
    rows = []
    for layer in start.layers:
        rows.append(sum(count(skewed(TOKENS, cfg.num_experts, cfg.top_k, layer, seed=SEED,
                                     alpha=ALPHA, rank=r)[1], cfg.num_experts)
                        for r in range(WORLD)))
    return torch.stack(rows)


def target(name: str):
    start = checkpoint_start()
    return start if name == "start" else require(*BALANCE)(measured_load(start), start)


def move_pool(name: str):
    pool = rank_pool()
    new = target(name)
    if pool.placement != new:
        pool.rebalance(new, "p2p")
    return pool


def results(name: str) -> list[dict]:
    """Per-rank `ep_forward_run` under placement `name` (measured once per process)."""
    if name not in _RESULTS:
        _RESULTS[name] = move_pool(name).call(require(*RUN), TOKENS, SEED, ALPHA, ep_backend(), REPEAT)
    return _RESULTS[name]


def layer_imbalance(per_rank: list[dict], key: str) -> list[float]:
    """Slowest rank / mean of `key` ("rows" or "moe_s") in each MoE layer."""
    out = []
    for values in zip(*(r[key] for r in per_rank)):
        mean = sum(values) / len(values)
        out.append(max(values) / mean if mean > 0 else 1.0)
    return out


class EPForwardRank:
    """Per rank: pairs computed and MoE seconds, summed over the MoE layers."""

    params = [PLACEMENTS, list(range(WORLD))]
    param_names = ["placement", "rank"]
    timeout = 900

    def setup(self, placement, rank):
        self.result = results(placement)[rank]

    def track_tokens(self, placement, rank):
        return sum(self.result["rows"])

    track_tokens.unit = "tokens"

    def track_moe_seconds(self, placement, rank):
        return sum(self.result["moe_s"])

    track_moe_seconds.unit = "seconds"


class EPBalance:
    """Slowest rank / mean per MoE layer, averaged over layers (1.0 is perfect balance)."""

    params = [PLACEMENTS]
    param_names = ["placement"]
    timeout = 900

    def setup(self, placement):
        self.per_rank = results(placement)

    def track_tokens_imbalance(self, placement):
        v = layer_imbalance(self.per_rank, "rows")
        return sum(v) / len(v)

    track_tokens_imbalance.unit = "slowest/mean"

    def track_moe_imbalance(self, placement):
        v = layer_imbalance(self.per_rank, "moe_s")
        return sum(v) / len(v)

    track_moe_imbalance.unit = "slowest/mean"


class EPForward:
    """Wall time of one collective EP forward of every MoE layer, as the driver sees it."""

    params = [PLACEMENTS]
    param_names = ["placement"]
    number = 1
    repeat = (3, 10, 20.0)
    rounds = 1
    warmup_time = 0
    timeout = 900

    def setup(self, placement):
        self.once = require(*ONCE)
        self.pool = move_pool(placement)
        self.pool.call(self.once, TOKENS, SEED, ALPHA, ep_backend())  # warm-up, builds the routing

    def time_forward(self, placement):
        self.pool.call(self.once, TOKENS, SEED, ALPHA, ep_backend())


if __name__ == "__main__":
    from benchmarks.ep_forward_report import main

    sys.exit(main())
