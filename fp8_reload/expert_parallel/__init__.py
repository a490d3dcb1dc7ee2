"""Expert parallelism: which rank holds which expert, the forward through that placement,
and moving experts between ranks.

    placement  the physical -> logical slot table and EPLB's balancing policy
    workload   synthetic skewed loads and routings, controlled moves (benchmarks, tests)
    dispatch   which replica computes each routed token; which tokens a rank owns
    forward    the collective MoE forward: dispatch, local experts, combine
    slots      a rank's share of the model; a slot's state packed as one row of bytes
    plan       what every rank changes and where each new expert comes from
    agree      every rank takes rank 0's request, or every rank refuses it (no rank left waiting)
    transfer   a rebalance's buffers and runs of rows, laid out once for all layers
    rows       slot rows moved between Parameters and those buffers
    rebalance  the collective transaction: agree, stage, exchange / read, commit, roll back
    undo       what a failed rebalance puts back, and which ranks could not
    group      process groups: joining, communication devices, warm-up
    launch     spawning ranks (or joining under torchrun), a persistent pool of ranks
"""

from .dispatch import choose_replicas, owned_tokens
from .forward import DispatchError, EPForwardStats, ep_moe_forward, local_expert_forward
from .group import default_backend, init_rank, launched_by_torchrun, warm_up_p2p
from .launch import RankPool, run_ranks
from .placement import Placement, balance_placement, default_slots_per_rank
from .plan import MODES, Fetch, RankPlan, RebalancePlan
from .rebalance import RebalanceReport, rebalance
from .slots import (
                        RebalanceError,
                        load_rank_model,
                        moe_layer_map,
                        row_bytes,
                        slot_tensors,
)
from .transfer import pack_slots, write_slots
from .workload import move_experts, routing_load, skewed_routing, synthetic_load

__all__ = ["DispatchError", "EPForwardStats", "Fetch", "MODES", "Placement", "RankPlan",
           "RankPool", "RebalanceError", "RebalancePlan", "RebalanceReport", "balance_placement",
           "choose_replicas", "default_backend", "default_slots_per_rank", "ep_moe_forward",
           "init_rank", "launched_by_torchrun", "load_rank_model", "local_expert_forward",
           "moe_layer_map", "move_experts", "owned_tokens", "pack_slots", "rebalance",
           "routing_load", "row_bytes", "run_ranks", "skewed_routing", "slot_tensors",
           "synthetic_load", "warm_up_p2p", "write_slots"]
