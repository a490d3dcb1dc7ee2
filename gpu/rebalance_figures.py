"""The figures issue 17 asks for, from the JSON files gpu/rebalance_2gpu.sh wrote (compact, so
they fit the end of the run's output): `python gpu/rebalance_figures.py OUT_DIR`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"  {path.name}: missing or unreadable ({type(e).__name__})")
        return None


def cli(path: Path, label: str) -> None:
    rows = _load(path)
    if not rows:
        return
    runs: dict = {}
    for r in rows:
        runs.setdefault((r["kind"], r["mode"]), []).append(r)
    for (kind, mode), rs in sorted(runs.items()):
        rs.sort(key=lambda r: r["rank"])
        tok = " ".join(f"r{r['rank']} {r['tokens_before']}->{r['tokens_after']}" for r in rs)
        moe = " ".join(f"r{r['rank']} {r['moe_s_before'] * 1e3:.2f}->{r['moe_s_after'] * 1e3:.2f}"
                       for r in rs)
        diff = max(r.get("forward_calc_diff", float("nan")) for r in rs)
        ok = all(r.get("forward_matches") and r["equals_fresh_load"] for r in rs)
        print(f"  {label} {kind} {mode} ({rs[0]['backend']}, {rs[0].get('moe_backend', 'torch')}): "
              f"tokens {tok}; MoE ms {moe}; EP vs "
              f"single device calc_diff <= {diff:.1e} (bound {rs[0]['forward_bound']:.0e}); "
              f"{'all ranks match, state == fresh load' if ok else 'MISMATCH'}")


def main(out: str) -> int:
    out = Path(out)
    cli(out / "rebalance_nccl_small.json", "small")
    cli(out / "rebalance_nccl_v2lite.json", "bench checkpoint")
    cli(out / "multinode.json", "2 torchrun nodes")
    bench = _load(out / "rebalance_bench.json")
    if bench:
        for line in bench["meta"]["headline"]:
            print(f"  {line}")
    ep = _load(out / "ep_balance.json")
    if ep:
        m = ep["meta"]
        print(f"  EP forward ({m['spec']}, {m['tokens_per_rank']} tokens/rank, {m['moe_backend']}):")
        for line in m["summary"]:
            print(f"    {line}")
    tars = sorted(out.glob("asv_*.tar.gz"))
    print(f"  asv results: {', '.join(t.name for t in tars) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
