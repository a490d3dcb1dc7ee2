"""`fp8-reload rebalance`: an expert-parallel forward on a skewed routing, rebalanced, checked.

Each rank loads its share of a checkpoint under a round-robin placement, routes
its tokens with a skewed (Zipf) routing, runs the expert-parallel forward,
rebalances to the balancer's placement for the all-reduced counts, compares its
whole state with a fresh load under the new placement and runs the forward again
(`rebalance_rank`). Printed per rank: the rebalance (slots, sources, bytes,
time, state == fresh load) and the forward before -> after (tokens and MoE time
per rank, agreement with the single-device forward). Exit 0 when every rank
matches, 1 when one does not, 2 for a request that cannot run (one line).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile

import torch

from ..config import MoEConfig
from ..expert_parallel import MODES, RebalanceReport, default_backend, launched_by_torchrun, run_ranks
from ..kernels import backend_status
from .rebalance_rank import DemoSpec, demo_rank, param_ids

__all__ = ["DemoSpec", "command", "demo_rank", "format_demo", "param_ids"]

KINDS = ("fp8", "bf16")


class Refused(ValueError):
    """A request `fp8-reload rebalance` cannot run (exit status 2)."""


def format_demo(rows: list[dict], backend: str) -> tuple[bool, str]:
    """The per-rank tables and a verdict (True when every checked rank matched)."""
    mib = 2.0 ** 20
    first = rows[0]
    lines = [f"rebalance on {first['world']} ranks ({backend}, {first['device'].split(':')[0]}): "
             f"{first['layers']} MoE layers x {first['experts']} experts, "
             f"{first['slots']} slots per rank"]
    start, new, load = first["start"], first["placement"], first["load"]
    before, after = start.imbalance(load), new.imbalance(load)
    lines.append(f"skewed routing ({first['tokens_per_rank']} tokens per rank, top-{first['top_k']}), "
                 f"predicted max/mean rank load: {before.mean():.2f} -> {after.mean():.2f} (mean over "
                 f"layers; worst layer {before.max():.2f} -> {after.max():.2f}); "
                 f"{start.moved_slots(new)} of {start.table.numel()} physical slots change")
    head = (f"{'kind':<5} {'mode':<7} {'rank':>4} {'slots':>5} {'local':>5} {'p2p':>4} {'disk':>4} "
            f"{'sent MiB':>9} {'recv MiB':>9} {'disk MiB':>9} {'ms':>8}  state == fresh load")
    lines += ["", head, "-" * len(head)]
    ok = True
    order = sorted(rows, key=lambda r: (r["kind"], MODES.index(r["mode"]), r["rank"]))
    for r in order:
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
    head = (f"{'kind':<5} {'mode':<7} {'rank':>4} {'tokens before':>13} {'after':>7} "
            f"{'MoE ms before':>13} {'after':>7}  EP forward vs single device (calc_diff)")
    lines += ["", "expert-parallel forward on the skewed routing, every MoE layer: (token, expert) "
              "pairs computed per rank and their MoE time, before -> after the rebalance",
              "", head, "-" * len(head)]
    for r in order:
        if "forward_matches" in r:
            ok &= r["forward_matches"]
            verdict = (f"{'matches' if r['forward_matches'] else 'DOES NOT MATCH'}: "
                       f"{r['forward_calc_diff']:.2e} (bound {r['forward_bound']:.0e})")
        else:
            verdict = "not checked"
        lines.append(f"{r['kind']:<5} {r['mode']:<7} {r['rank']:>4} {r['tokens_before']:>13} "
                     f"{r['tokens_after']:>7} {r['moe_s_before'] * 1e3:>13.2f} "
                     f"{r['moe_s_after'] * 1e3:>7.2f}  {verdict}")
    lines.append(balance_line(order))
    lines.append("")
    checked = all("diffs" in r and "forward_matches" in r for r in order)
    lines.append("FAIL: some rank differs from a fresh load or from the single-device forward"
                 if not ok else
                 "OK: every rank equals a fresh load under the new placement and its EP forward "
                 "matches the single-device forward" if checked else
                 "NOT CHECKED (--no-check): the ranks were not compared with a fresh load or with "
                 "the single-device forward")
    return ok, "\n".join(lines)


def imbalance(values: list[float]) -> float:
    """Slowest (largest) over mean; 1.0 is perfect balance."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def layer_imbalance(rows: list[dict], key: str) -> list[float]:
    """Slowest rank / mean of `key` (a ``*_by_layer`` field) in each MoE layer of one run:
    every layer waits for its slowest rank, so balance is per layer, not over the sum."""
    per_layer = zip(*(r[key] for r in sorted(rows, key=lambda r: r["rank"])))
    return [imbalance(list(v)) for v in per_layer]


def balance_line(rows: list[dict]) -> str:
    """Max/mean over ranks of tokens and MoE time per layer, before -> after: the mean over
    layers and runs, and the worst layer."""
    runs: dict = {}
    for r in rows:
        runs.setdefault((r["kind"], r["mode"]), []).append(r)
    keys = ("tokens_before", "tokens_after", "moe_s_before", "moe_s_after")
    per = {k: [v for rs in runs.values() for v in layer_imbalance(rs, f"{k}_by_layer")] for k in keys}
    mean = {k: sum(v) / len(v) for k, v in per.items()}
    worst = {k: max(v) for k, v in per.items()}
    return (f"slowest rank / mean per MoE layer: tokens {mean['tokens_before']:.2f} -> "
            f"{mean['tokens_after']:.2f} (worst layer {worst['tokens_before']:.2f} -> "
            f"{worst['tokens_after']:.2f}), MoE time {mean['moe_s_before']:.2f} -> "
            f"{mean['moe_s_after']:.2f} (worst {worst['moe_s_before']:.2f} -> "
            f"{worst['moe_s_after']:.2f}); mean over {len(runs)} runs")


def _validate(args, world: int, torchrun: bool) -> tuple[list, list, str]:
    """(modes, kinds, backend) of a request that can run, else `Refused` naming why."""
    modes = list(MODES) if args.mode == "all" else [m for m in args.mode.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise Refused(f"unknown --mode {','.join(bad) or args.mode!r}; choose from "
                      f"{', '.join(MODES)}, a comma list, or all")
    kinds = [k for k in (args.kind or "fp8").split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        raise Refused(f"--kind {args.kind!r}: choose fp8, bf16 or fp8,bf16")
    if world < 1:
        raise Refused(f"--world-size must be >= 1, got {world}")
    backend = args.backend or default_backend(world)
    if backend == "nccl" and not torchrun and torch.cuda.device_count() < world:
        raise Refused(f"--backend nccl needs one GPU per rank: {world} ranks, "
                      f"{torch.cuda.device_count()} GPUs here")
    if args.checkpoint:
        if len(kinds) > 1:
            raise Refused("--checkpoint takes one checkpoint: give a single --kind")
        if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
            raise Refused(f"--checkpoint {args.checkpoint}: no config.json there")
        from ..checkpoint import Checkpoint

        ckpt = Checkpoint(args.checkpoint)
        if args.kind is not None and kinds != [ckpt.kind]:
            raise Refused(f"--kind {args.kind}: --checkpoint {args.checkpoint} is {ckpt.kind}")
        ckpt.total_bytes()  # every shard's header read and checked here, before a rank starts
        kinds, cfg = [ckpt.kind], ckpt.config
        where = f"--checkpoint {args.checkpoint}"
    else:
        try:
            cfg = MoEConfig.preset(args.preset, **({"num_layers": args.num_layers}
                                                  if args.num_layers is not None else {}))
        except ValueError as e:
            raise Refused(f"--preset/--num-layers: {e}") from None
        where = (f"--preset {args.preset}" if args.num_layers is None else
                 f"--num-layers {args.num_layers}")
    if not cfg.moe_layers:
        raise Refused(f"{where}: the model has no MoE layer (its first {cfg.first_dense_layers} "
                      f"layers are dense)")
    if args.slots_per_rank is not None and args.slots_per_rank * world < cfg.num_experts:
        raise Refused(f"--slots-per-rank {args.slots_per_rank} x {world} ranks cannot hold "
                      f"{cfg.num_experts} experts")
    if not (math.isfinite(args.alpha) and args.alpha >= 0):
        raise Refused(f"--alpha must be a finite number >= 0, got {args.alpha}")
    if args.tokens < 1:
        raise Refused(f"--tokens must be >= 1, got {args.tokens}")
    if not 0 <= args.forward_bound <= 1:
        raise Refused(f"--forward-bound must lie in [0, 1], got {args.forward_bound}")
    if args.exclude_sources is None:  # the default: rank 1, where there is one
        args.exclude_sources = [1] if world > 1 else []
    outside = [r for r in args.exclude_sources if not 0 <= r < world]
    if outside:
        raise Refused(f"--exclude-sources {outside}: ranks lie in [0, {world})")
    if args.moe_backend is not None:
        why = backend_status().get(args.moe_backend, "unknown backend")
        if why is not None:
            raise Refused(f"--moe-backend {args.moe_backend}: {why}")
    return modes, kinds, backend


def command(args) -> int:
    """`fp8-reload rebalance`: spawn (or join under torchrun) the ranks, run `demo_rank`, print."""
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    try:
        modes, kinds, backend = _validate(args, world, torchrun)
    except Refused as e:
        print(f"fp8-reload rebalance: error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fp8-reload-rebalance-") as tmp:
        if args.checkpoint:
            ckpts = {kinds[0]: args.checkpoint}
        else:  # under torchrun every rank of a node must name the same directory
            root = (os.path.join(tempfile.gettempdir(), f"fp8-reload-rebalance-{os.environ['MASTER_PORT']}")
                    if torchrun else tmp)
            tag = f"{args.preset}-{args.num_layers or 'all'}-seed{args.seed}"
            ckpts = {k: os.path.join(root, f"{tag}-{k}") for k in kinds}
        spec = DemoSpec(checkpoints=ckpts, preset=args.preset, num_layers=args.num_layers,
                        modes=modes, slots_per_rank=args.slots_per_rank,
                        exclude_sources=tuple(args.exclude_sources), seed=args.seed,
                        alpha=args.alpha, check=not args.no_check, tokens=args.tokens,
                        moe_backend=args.moe_backend, forward_bound=args.forward_bound)
        try:
            results = run_ranks(demo_rank, world, backend, spec)
        except Exception as e:  # a rank failed: its traceback is on stderr already
            last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
            print(f"fp8-reload rebalance: failed: {last[0]}", file=sys.stderr)
            return 1
        finally:
            if torchrun and not args.checkpoint and int(os.environ.get("LOCAL_RANK", 0)) == 0:
                shutil.rmtree(root, ignore_errors=True)
    rows = results[0]
    for r in rows:
        r["forward_bound"] = spec.forward_bound
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if format_demo(rows, backend)[0] else 1
    ok, text = format_demo(rows, backend)
    print(text)
    if args.json:
        skip = ("report", "placement", "start", "load", "diffs", "identity_kept")
        out = [{"backend": backend, **{k: v for k, v in r.items() if k not in skip},
                "equals_fresh_load": (None if "diffs" not in r else  # None: not checked
                                      not r["diffs"] and r.get("identity_kept", False)),
                **{k: v for k, v in vars(r["report"]).items() if k != "disk_report"}}
               for r in rows]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1
