"""The gate's output: a table of every step, one line per failed check, the worst values."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .result import CHECKPOINT_BOUND, Check, GateResult, StepResult

_COLS = (("reload", "reload"), ("fresh.state", "state"), ("ckpt.weights", "=ckpt"),
         ("fresh.forward", "fwd=fresh"),
         ("ref.model", "ref.model"), ("ref.moe", "ref.moe"), ("identity", "identity"),
         ("untouched", "untouched"))


def _cell(c: Check) -> str:
    if c.status in ("n/a", "skip"):
        return "-" if c.status == "n/a" else "skip"
    numeric = c.name in ("ckpt.weights", "ref.model", "ref.moe") or (c.name == "fresh.forward"
                                                                     and c.bound)
    value = f"{c.measured:.1e}" if numeric and c.measured is not None else ""
    if c.status == "pass":
        return value or "ok"
    return "FAIL" + (f" {value}" if value else "")


def format_table(result: GateResult) -> str:
    head = ("backend", "kind", "#", "step") + tuple(h for _, h in _COLS) + ("s",)
    rows = [head]
    for s in result.steps:
        by = {c.name: c for c in s.checks}
        rows.append((s.backend, s.kind, str(s.index), s.label)
                    + tuple(_cell(by[n]) for n, _ in _COLS) + (f"{s.seconds:.2f}",))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(len(head))).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt_bound(c: Check) -> str:
    if c.name in ("fresh.state", "identity", "untouched"):
        return "0"
    return "bitwise" if c.bound == 0 else ("-" if c.bound is None else f"{c.bound:g}")


def format_failures(result: GateResult) -> list[str]:
    """One line per (backend, kind, check) that failed: which steps, the first one's
    measured value against its bound and what differed. Checks skipped because
    their reload failed are not repeated."""
    groups: dict[tuple[str, str, str], list[tuple[StepResult, Check]]] = {}
    for s, c in result.failures():
        if c.status == "fail":  # reload failures: one line per distinct cause
            key = (s.backend, s.kind, c.name, c.detail if c.name == "reload" else "")
            groups.setdefault(key, []).append((s, c))
    lines = []
    for (backend, kind, name, _), items in groups.items():
        s, c = items[0]
        steps = ",".join(str(x.index) for x, _ in items)
        measured = "-" if c.measured is None else f"{c.measured:.4g}"
        lines.append(f"FAIL {backend}/{kind} check {name} at step{'s' if len(items) > 1 else ''} "
                     f"{steps}; step {s.index} ({s.label}): measured {measured}, bound "
                     f"{_fmt_bound(c)}: {c.detail}")
    return lines


def format_report(result: GateResult) -> str:
    out = [format_table(result), ""]
    for name, why in result.skipped_backends.items():
        out.append(f"skipped backend {name}: {why}")
    fails = result.failures()
    out += format_failures(result)
    if fails:
        out.append("")
    out.append("worst measured vs bound (calc_diff):")
    for b in result.backends:
        for k in result.kinds:
            steps = [s for s in result.steps if s.backend == b and s.kind == k]
            vals = [c.measured for s in steps for c in s.checks
                    if c.name == "ckpt.weights" and c.measured is not None]
            cells = [f"ckpt.weights {max(vals):.3g}" if vals else "ckpt.weights -"]
            cells[-1] += f" (bound {CHECKPOINT_BOUND:g})"
            for name in ("fresh.forward", "ref.model", "ref.moe"):
                vals = [c.measured for s in steps for c in s.checks
                        if c.name == name and c.measured is not None]
                bound = result.bounds[f"{b}.{k}"][name.replace(".", "_")]
                cells.append(f"{name} {max(vals):.3g}" if vals else f"{name} -")
                cells[-1] += f" (bound {'bitwise' if bound == 0 else f'{bound:g}'})"
            out.append(f"  {b}/{k}: " + ", ".join(cells))
    n_checks = sum(1 for s in result.steps for c in s.checks if c.status != "n/a")
    n_fail = sum(1 for _, c in fails)
    verdict = "PASSED" if result.passed else "FAILED"
    out.append(f"gate {verdict}: {n_checks - n_fail} of {n_checks} checks passed in "
               f"{len(result.steps)} steps (processing {result.processing}, preset {result.preset}, "
               f"{result.device}, backends {', '.join(result.backends) or 'none'}), "
               f"{result.seconds:.1f} s")
    return "\n".join(out)


def _finite(obj):
    """JSON has no NaN or infinity: a measurement that is not finite is written as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: GateResult, path) -> None:
    Path(path).write_text(json.dumps(_finite(result.to_json()), indent=1, allow_nan=False) + "\n")
