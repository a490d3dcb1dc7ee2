"""`fp8-reload demo`: the whole story, side by side, on a small model.

For each checkpoint kind and processing mode: load, run an EPLB-style filtered
reload and then a full reload, and after each step check what users care
about: did it work, are the Parameters the same objects, is the state
bit-identical to a fresh load, does the forward still give the same answer.
"""

from __future__ import annotations

import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import write_checkpoint
from ..config import MoEConfig
from ..device import resolve_device
from ..errors import ReloadError
from ..reload import eplb_filter, load_model, update_weights_from_disk
from ..state import compare_states, missing_loaders, snapshot
from .usage import UsageError, progress


@dataclass
class DemoRow:
    kind: str
    mode: str
    step: str
    outcome: str
    identity: str
    loaders: str
    equals_fresh: str
    forward: str
    ms: float
    mib_read: float


def _failure(e: BaseException) -> str:
    """The whole message of what failed: the cause a ReloadError wraps, else `e` itself."""
    cause = e.__cause__ if isinstance(e, ReloadError) and e.__cause__ is not None else e
    return " ".join(f"{type(cause).__name__}: {cause}".split())


def run_demo(preset: str = "small", device: str | None = None, kinds=("fp8", "bf16"),
             modes=("upstream", "identity-only", "fixed"), experts_per_layer: int = 2,
             workdir: str | None = None, num_layers: int | None = None,
             log: Callable[[str], None] = progress) -> list[DemoRow]:
    """Every (kind, mode): load, EPLB filtered reload, full reload, each step checked.

    `log` gets one line when the run starts and one per checkpoint and per (kind,
    mode) as it finishes, so a slow preset never looks stuck."""
    device = resolve_device(device)
    cfg = MoEConfig.preset(preset, num_layers=num_layers)
    if not 1 <= experts_per_layer <= cfg.num_experts:
        raise UsageError(f"--experts {experts_per_layer}: preset {preset!r} has "
                         f"{cfg.num_experts} experts per MoE layer")
    tmp = tempfile.TemporaryDirectory(prefix="fp8-reload-demo-") if workdir is None else None
    root = Path(workdir or tmp.name)
    rows: list[DemoRow] = []
    flt, chosen = eplb_filter(cfg, experts_per_layer)
    log(f"[demo] model: preset {preset!r} ({cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"hidden {cfg.hidden_size}) on {device}; EPLB step reloads experts "
        f"{chosen[cfg.moe_layers[0]]} of each of {len(chosen)} MoE layers")
    try:
        for kind in kinds:
            t0 = time.perf_counter()
            path = write_checkpoint(root / kind, cfg, seed=0, kind=kind)
            log(f"[demo] {kind} checkpoint written ({time.perf_counter() - t0:.1f} s)")
            x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
            x = x.to(torch.bfloat16).to(device)
            for mode in modes:
                t0 = time.perf_counter()
                model = load_model(path, device=device, processing=mode)
                before = snapshot(model)
                with torch.no_grad():
                    y0 = model(x)
                done = []
                for step, f in (("EPLB filtered", flt), ("full", None)):
                    rows.append(_step(model, path, f, before, x, y0, kind, mode, step))
                    done.append(f"{step} {'ok' if rows[-1].outcome == 'ok' else 'FAIL'}")
                del model
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                log(f"[demo] {kind} {mode}: load, {', '.join(done)} "
                    f"({time.perf_counter() - t0:.1f} s)")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


def _step(model, path, flt, before, x, y0, kind, mode, step) -> DemoRow:
    t0 = time.perf_counter()
    try:
        report = update_weights_from_disk(model, path, flt)
        outcome, mib = "ok", report.bytes_read / 2**20
    except ReloadError as e:
        outcome, mib = "FAIL " + _failure(e), float("nan")
    ms = (time.perf_counter() - t0) * 1e3
    after = snapshot(model)
    diffs = compare_states(before, after, identity=True)
    identity = "replaced" if any("replaced" in d or "attributes" in d for d in diffs) else "kept"
    missing = missing_loaders(model)
    loaders = "all" if not missing else f"{len(missing)} missing"
    # Reloading the checkpoint the model was loaded from: a fresh load == `before`.
    equals_fresh = "yes" if not compare_states(before, after) else f"no ({len(diffs)})"
    try:
        with torch.no_grad():
            y = model(x)
        forward = "same" if torch.equal(y, y0) else "CHANGED"
    except Exception as e:  # the double-transposed linear fails here
        forward = "FAIL " + _failure(e)
    return DemoRow(kind, mode, step, outcome, identity, loaders, equals_fresh, forward, ms, mib)


def format_rows(rows: list[DemoRow], width: int = 100) -> str:
    """One table per checkpoint kind, failures as numbered notes below, every line within
    `width` columns: the whole error messages are in the notes, not cut in a cell."""
    notes: dict[str, int] = {}

    def cell(text: str) -> str:
        if not text.startswith("FAIL "):
            return text
        return f"FAIL [{notes.setdefault(text[5:], len(notes) + 1)}]"

    head = ("mode", "reload", "outcome", "params", "loaders", "== fresh", "forward", "ms", "MiB read")
    cells = {r.kind: [] for r in rows}
    for r in rows:
        cells[r.kind].append((r.mode, r.step, cell(r.outcome), r.identity, r.loaders, r.equals_fresh,
                              cell(r.forward), f"{r.ms:.1f}",
                              "-" if r.mib_read != r.mib_read else f"{r.mib_read:.2f}"))
    every = [head] + [c for kind in cells.values() for c in kind]
    widths = [max(len(c[i]) for c in every) for i in range(len(head))]

    def line(c) -> str:
        return "  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip()

    out = []
    for kind, table in cells.items():
        out += ["" if out else None, f"{kind} checkpoint", line(head),
                "  ".join("-" * w for w in widths)] + [line(c) for c in table]
    out = [x for x in out if x is not None]
    if notes:
        out.append("")
        for text, n in notes.items():
            out += textwrap.wrap(text, width, initial_indent=f"[{n}] ",
                                 subsequent_indent=" " * (len(str(n)) + 3))
    return "\n".join(out)


def verdict(rows: list[DemoRow]) -> tuple[bool, str]:
    """The demo passes when every fixed-mode step is clean and upstream shows its bugs."""
    fixed = [r for r in rows if r.mode == "fixed"]
    fixed_ok = all(r.outcome == "ok" and r.identity == "kept" and r.equals_fresh == "yes"
                   and r.forward == "same" for r in fixed)
    upstream_broken = all(r.outcome != "ok" or r.forward != "same" or r.equals_fresh != "yes"
                          for r in rows if r.mode != "fixed" and r.step == "EPLB filtered")
    lines = []
    lines.append("fixed: each reload kept every Parameter, matched a fresh load bit for bit, "
                 "forward unchanged." if fixed_ok else
                 "fixed: SOMETHING IS WRONG (see rows above)")
    if upstream_broken:
        lines.append("upstream / identity-only: the EPLB reload breaks, as in sglang 0.5.23.")
    eplb = {r.mode: r for r in rows if r.step == "EPLB filtered" and r.kind == rows[0].kind}
    full = {r.mode: r for r in rows if r.step == "full" and r.kind == rows[0].kind}
    if "fixed" in eplb and "fixed" in full and full["fixed"].mib_read:
        f, a = eplb["fixed"], full["fixed"]
        lines.append(f"fixed EPLB reload read {f.mib_read:.2f} of {a.mib_read:.2f} MiB "
                     f"({100 * f.mib_read / a.mib_read:.1f}%) in {f.ms:.1f} ms "
                     f"(full reload {a.ms:.1f} ms).")
    return fixed_ok and upstream_broken, "\n".join(lines)


def command(args) -> int:
    """`fp8-reload demo`: progress on stderr, the tables and the verdict on stdout."""
    rows = run_demo(preset=args.preset, device=args.device, experts_per_layer=args.experts,
                    num_layers=args.num_layers)
    print(format_rows(rows))
    ok, text = verdict(rows)
    print()
    print(text)
    return 0 if ok else 1
