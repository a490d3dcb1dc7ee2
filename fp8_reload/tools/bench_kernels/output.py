"""The tables of `fp8-reload bench-kernels` (Markdown and CSV) and their verdict."""

from __future__ import annotations

import csv
from pathlib import Path

from ...kernels import GEMM_BOUND, MOE_LAYER_BOUND
from ..markdown import markdown_table
from .cases import GEMM_TARGET_TFLOPS, SCALE_TARGET

TITLES = {
    "scales": "DeepGEMM MoE forward (contiguous, {shape}): where the block scales come from",
    "gemm": "DeepGEMM grouped contiguous FP8 GEMM, per-tensor weight scales as 128x128 blocks",
    "forward": "Whole MoE layer forward, {shape}",
}
NOTES = {
    "scales": (f"`ms`: median CUDA-event time per forward, the three modes timed in alternating "
               "batches. `vs_precomputed`: throughput relative to "
               f"precomputed block scales; target for `cached` >= {SCALE_TARGET:.0%}. `per-forward` "
               "is sglang 0.5.23's repeat_interleave expansion on every call."),
    "gemm": (f"`kernel_ms`: GPU time of the GEMM kernel (profiler). `calc_diff` against the float64 "
             f"product of the unquantized bf16 operands (bound {GEMM_BOUND:g}). Target "
             f">= {GEMM_TARGET_TFLOPS:g} TFLOPS."),
    "forward": ("`ms`: median CUDA-event time per eager forward (launch overhead included); "
                "`kernel_ms`: sum of GPU kernel times per forward; `kernels`: launches per forward; "
                "`graph_ms`: one replay of the forward captured in a CUDA graph. TFLOPS (from `ms`) count "
                "routed rows only (6 x tokens x top_k x hidden x inter). `calc_diff` against the "
                f"float32 reference of the same FP8 weights (bound {MOE_LAYER_BOUND:g}). Roofline: "
                "`gb_s` is the bytes a forward must move (FP8 weights of every expert a token is routed "
                "to, bf16 tokens in and out) over the faster of `ms` and `graph_ms`; `roofline_ms` the "
                "least time the roofline limits above allow (each says where it came from) "
                "and `of_roofline` how close the forward comes to it."),
}


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


def write_results(result: dict, out_dir) -> list[Path]:
    """kernels.md (all tables) and kernels_<table>.csv in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    md = ["# MoE forward kernels", "",
          "Environment: " + ", ".join(f"{k} `{v}`" for k, v in result["env"].items()), ""]
    if result.get("limits"):
        md += [f"Roofline limits: {result['limits']}.", ""]
    if result.get("prewarm"):
        total = sum(s for _, s, _ in result["prewarm"])
        md += [f"JIT prewarm: {len(result['prewarm'])} cases, {total:.0f} s of compile work in "
               "parallel processes before timing.", ""]
    for table in ("scales", "gemm", "forward"):
        rows = result.get(table) or []
        if not rows:
            continue
        title = TITLES[table].format(shape=result.get("shape", ""))
        md += [f"## {title}", "", NOTES[table], "", markdown_table(rows) + "\n"]
        path = out / f"kernels_{table}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=_columns(rows))
            writer.writeheader()
            writer.writerows(rows)
        written.append(path)
    path = out / "kernels.md"
    path.write_text("\n".join(md))
    written.insert(0, path)
    return written


def verdict(result: dict) -> tuple[bool, list[str]]:
    """Targets and accuracy bounds, one line each."""
    lines, ok = [], True
    for table, key in (("scales", "target"), ("gemm", "target"), ("forward", "within_bound")):
        for r in result.get(table) or []:
            if "error" in r:
                ok = False
                lines.append(f"ERROR {table} {r}")
            elif r.get(key) in ("MISS", "NO"):
                ok = False
                lines.append(f"MISS  {table} {r}")
    return ok, lines
