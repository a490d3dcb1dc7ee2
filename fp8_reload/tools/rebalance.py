"""`fp8-reload rebalance`: a synthetic skewed load, rebalanced across ranks and checked.

Each rank loads its share of a checkpoint under a round-robin placement, draws a
skewed (Zipf) per-expert load, all-reduces it, rebalances to the balancer's
placement and compares its whole state with a fresh load under the new placement.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checkpoint import Checkpoint, ensure_checkpoint
from ..expert_parallel import (
    MODES,
    Placement,
    RebalanceReport,
    balance_placement,
    default_backend,
    default_slots_per_rank,
    launched_by_torchrun,
    load_rank_model,
    rebalance,
    run_ranks,
    synthetic_load,
    warm_up_p2p,
)
from ..expert_parallel.group import comm_device
from ..state import compare_states, snapshot


@dataclass
class DemoSpec:
    """What each rank of `fp8-reload rebalance` runs (picklable for spawn)."""

    checkpoints: dict  # kind -> checkpoint dir (written by rank 0 if missing)
    preset: str
    num_layers: int | None
    modes: list
    slots_per_rank: int | None = None
    exclude_sources: tuple = ()  # applied to hybrid runs
    seed: int = 0
    alpha: float = 1.2
    check: bool = True


def param_ids(model) -> dict[str, int]:
    return {n: id(p) for n, p in model.named_parameters()}


def demo_rank(rank: int, world: int, device: torch.device, spec: DemoSpec) -> list[dict]:
    """One rank of the demo: for each (kind, mode) load under the start placement,
    rebalance to the balancer's placement for a synthetic skewed load, and check
    the state equals a fresh load under the new placement. Returns every rank's
    rows (all-gathered), so rank 0 can print them."""
    if rank == 0:
        for kind, path in spec.checkpoints.items():
            ensure_checkpoint(path, spec.preset, spec.num_layers, kind, seed=spec.seed)
    warm_up_p2p()  # also a barrier: the checkpoints exist from here on
    comm = comm_device(device, None)
    rows = []
    for kind, path in spec.checkpoints.items():
        for mode in spec.modes:
            cfg = Checkpoint(path).config
            slots = spec.slots_per_rank or default_slots_per_rank(cfg.num_experts, world)
            start = Placement.round_robin(cfg.moe_layers, cfg.num_experts, world, slots)
            model = load_rank_model(path, start, rank, device)
            load = synthetic_load(start.layers, cfg.num_experts, seed=spec.seed * 1000 + rank,
                                  alpha=spec.alpha).to(comm)
            dist.all_reduce(load, group=None)  # EPLB sums the ranks' statistics
            load = load.cpu()
            new = balance_placement(load, start) if rank == 0 else None
            ids = param_ids(model)
            exclude = spec.exclude_sources if mode == "hybrid" else ()
            dist.barrier()
            t0 = time.perf_counter()
            report = rebalance(model, new, mode=mode, exclude_sources=exclude)
            dist.barrier()
            wall = time.perf_counter() - t0
            row = {"kind": kind, "mode": mode, "rank": rank, "world": world,
                   "device": str(device), "wall_s": wall, "report": report,
                   "placement": model.placement, "start": start, "load": load,
                   "layers": len(start.layers), "experts": cfg.num_experts, "slots": slots}
            if spec.check:
                fresh = load_rank_model(path, model.placement, rank, device)
                row["diffs"] = compare_states(snapshot(model), snapshot(fresh))
                row["identity_kept"] = param_ids(model) == ids
                del fresh
            del model
            rows.append(row)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    return [r for per_rank in gathered for r in per_rank]


def format_demo(rows: list[dict], backend: str) -> tuple[bool, str]:
    """The per-rank table and a verdict (True when every checked rank matched)."""
    mib = 2.0 ** 20
    first = rows[0]
    lines = [f"rebalance on {first['world']} ranks ({backend}, {first['device'].split(':')[0]}): "
             f"{first['layers']} MoE layers x {first['experts']} experts, "
             f"{first['slots']} slots per rank"]
    start, new, load = first["start"], first["placement"], first["load"]
    before, after = start.imbalance(load), new.imbalance(load)
    lines.append(f"synthetic skewed load, max/mean rank load: {before.mean():.2f} -> "
                 f"{after.mean():.2f} (mean over layers; worst layer {before.max():.2f} -> "
                 f"{after.max():.2f}); {start.moved_slots(new)} of {start.table.numel()} "
                 "physical slots change")
    head = (f"{'kind':<5} {'mode':<7} {'rank':>4} {'slots':>5} {'local':>5} {'p2p':>4} {'disk':>4} "
            f"{'sent MiB':>9} {'recv MiB':>9} {'disk MiB':>9} {'ms':>8}  state == fresh load")
    lines += ["", head, "-" * len(head)]
    ok = True
    for r in sorted(rows, key=lambda r: (r["kind"], MODES.index(r["mode"]), r["rank"])):
        rep: RebalanceReport = r["report"]
        if "diffs" in r:
            good = not r["diffs"] and r["identity_kept"]
            ok &= good
            verdict = ("yes, Parameters kept" if good else
                       f"NO: {len(r['diffs'])} diffs, e.g. {r['diffs'][:2]}"
                       + ("" if r["identity_kept"] else "; Parameters replaced"))
        else:
            verdict = "not checked"
        lines.append(f"{r['kind']:<5} {r['mode']:<7} {r['rank']:>4} {rep.slots_changed:>5} "
                     f"{rep.experts_local:>5} {rep.experts_p2p:>4} {rep.experts_disk:>4} "
                     f"{rep.bytes_sent / mib:>9.3f} {rep.bytes_received / mib:>9.3f} "
                     f"{rep.bytes_disk / mib:>9.3f} {r['wall_s'] * 1e3:>8.1f}  {verdict}")
    lines.append("")
    lines.append("OK: every rank equals a fresh load under the new placement" if ok else
                 "FAIL: some rank differs from a fresh load under the new placement")
    return ok, "\n".join(lines)


def command(args) -> int:
    """`fp8-reload rebalance`: spawn (or join under torchrun) the ranks, run `demo_rank`, print."""
    modes = list(MODES) if args.mode == "all" else args.mode.split(",")
    kinds = args.kind.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown --mode {m!r}; choose from {', '.join(MODES)} or all")
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    backend = args.backend or default_backend(world)
    with tempfile.TemporaryDirectory(prefix="fp8-reload-rebalance-") as tmp:
        if args.checkpoint:
            if len(kinds) > 1:
                raise SystemExit("--checkpoint takes one checkpoint: give a single --kind")
            ckpts = {kinds[0]: args.checkpoint}
        else:  # under torchrun every rank must name the same directory
            root = (os.path.join(tempfile.gettempdir(), f"fp8-reload-rebalance-{os.environ['MASTER_PORT']}")
                    if torchrun else tmp)
            tag = f"{args.preset}-{args.num_layers or 'all'}-seed{args.seed}"
            ckpts = {k: os.path.join(root, f"{tag}-{k}") for k in kinds}
        spec = DemoSpec(checkpoints=ckpts, preset=args.preset, num_layers=args.num_layers,
                        modes=modes, slots_per_rank=args.slots_per_rank,
                        exclude_sources=tuple(args.exclude_sources), seed=args.seed,
                        alpha=args.alpha, check=not args.no_check)
        try:
            results = run_ranks(demo_rank, world, backend, spec)
        finally:
            if torchrun and not args.checkpoint and int(os.environ["RANK"]) == 0:
                shutil.rmtree(root, ignore_errors=True)
    rows = results[0]
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if format_demo(rows, backend)[0] else 1
    ok, text = format_demo(rows, backend)
    print(text)
    if args.json:
        out = [{"kind": r["kind"], "mode": r["mode"], "rank": r["rank"], "world": r["world"],
                "backend": backend, "device": r["device"], "wall_s": r["wall_s"],
                "equals_fresh_load": (not r.get("diffs")) and r.get("identity_kept", False),
                **{k: v for k, v in vars(r["report"]).items() if k not in ("disk_report",)}}
               for r in rows]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


