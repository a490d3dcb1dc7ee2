"""Running the gate: checkpoints, the script on one model per (backend, kind), the checks."""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...checkpoint import Checkpoint, mix_checkpoints, write_checkpoint
from ...config import MoEConfig
from ...device import resolve_device
from ...errors import BackendUnavailable, DeviceUnavailableError, ReloadError
from ...kernels import available_backends, run_moe
from ...kernels.bounds import KINDS, Bounds, BoundsError, load_bounds
from ...layers import FP8MoEModel, MoEBlock, expert_of
from ...processing import MODES
from ...reload import generate_weight_name_filter, load_model, update_weights_from_disk
from ...state import Snapshot, bitwise_equal, compare_states, missing_loaders, snapshot
from ...testing.numeric import calc_diff, worse
from ...testing.reference import (
    checkpoint_weight_diff,
    forward_with_routing,
    reference_forward,
    reference_moe,
)
from .result import CHECKPOINT_BOUND, CHECKS, Check, GateError, GateResult, StepResult
from .script import Provenance, ScriptStep, default_script

NUM_TOKENS = 64


def resolve_backends(requested) -> list[str]:
    """``all`` -> every registered backend; otherwise the names, each of which must exist."""
    names = [n for part in ([requested] if isinstance(requested, str) else requested)
             for n in str(part).split(",") if n]
    avail = available_backends()
    if not names or "all" in names:
        return avail
    for n in names:
        if n not in avail:
            raise GateError(f"MoE backend {n!r} is not available here (available: "
                            f"{', '.join(avail)}); GPU backends need CUDA plus triton or deep_gemm")
    return list(dict.fromkeys(names))


def _fail_text(e: BaseException) -> str:
    cause = e.__cause__ if isinstance(e, ReloadError) and e.__cause__ is not None else e
    msg = str(cause).split("\n")[0]
    return f"{type(cause).__name__}: {msg[:200]}"


def _diff_summary(diffs: list[str], n: int = 3) -> str:
    more = f" (+{len(diffs) - n} more)" if len(diffs) > n else ""
    return "; ".join(diffs[:n]) + more


_EXPERTS_PARAM = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")
# Per-expert tensors of a FusedMoE (dim 0 is the local slot). Merged input scales are
# layer-wide: reloading any expert of the layer may change them.
PER_EXPERT = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
              "w13_input_scale_per_expert", "w2_input_scale_per_expert")


def untouched_diffs(before: Snapshot, after: Snapshot, slots: dict[int, set[int]]) -> list[str]:
    """What changed outside the reload scope `slots` ({layer: local slots reloaded})."""
    diffs = []
    for name in sorted(before.tensors):
        a, b = before.tensors[name], after.tensors.get(name)
        if b is None:
            diffs.append(f"{name}: gone")
            continue
        m = _EXPERTS_PARAM.match(name)
        chosen = slots.get(int(m.group(1)), set()) if m else set()
        if not chosen:
            if not bitwise_equal(a, b):
                diffs.append(f"{name}: changed (no expert of its module was reloaded)")
        elif m.group(2) in PER_EXPERT:
            if a.shape != b.shape or a.dtype != b.dtype:
                diffs.append(f"{name}: {tuple(a.shape)} {a.dtype} -> {tuple(b.shape)} {b.dtype}")
                continue
            moved = [e for e in range(a.shape[0])
                     if e not in chosen and not bitwise_equal(a[e], b[e])]
            if moved:
                diffs.append(f"{name}: experts {moved} changed but were not reloaded")
    return diffs


class _Sequence:
    """One (backend, checkpoint kind) run of the script on one model."""

    def __init__(self, gate: _Gate, backend: str, kind: str):
        self.g, self.backend, self.kind = gate, backend, kind
        self.bound = gate.bounds.get(backend, kind)
        self.paths = gate.checkpoints[kind]

    def expected_path(self, prov: Provenance) -> Path:
        if not prov.other:
            return self.paths[prov.base]
        key = ",".join(f"{layer}.{e}" for layer, e in sorted(prov.other))
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        cfg = self.g.cfg
        out = self.g.root / f"{cfg.name}-{cfg.num_layers}L-{self.kind}-mix-b{prov.base}-{digest}"
        if not out.exists():  # written aside and renamed: a kept --workdir never holds half a mix
            part = out.with_name(out.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            mix_checkpoints(self.paths[prov.base], self.paths[1 - prov.base], part,
                            lambda n: expert_of(n) in prov.other)
            part.rename(out)
        return out

    def run(self) -> list[StepResult]:
        g = self.g
        model = load_model(self.paths[0], device=g.device, processing=g.processing)
        model.set_backend(self.backend)
        self._probe(model)
        at_load = snapshot(model)
        self.storage = _storage(model)
        prov = Provenance(0)
        steps = [self.check(0, "load s0", model, prov, at_load, at_load, None, time.perf_counter())]
        before = at_load
        for i, step in enumerate(g.script, start=1):
            g.log(f"[gate] {self.backend}/{self.kind} {i}/{len(g.script)}: {step.label}")
            t0 = time.perf_counter()
            flt = None if step.experts is None else generate_weight_name_filter(step.experts)
            try:
                update_weights_from_disk(model, self.paths[step.seed], flt)
            except ReloadError as e:
                checks = [Check("reload", "fail", detail=_fail_text(e))]
                checks += [Check(n, "skip", detail="reload failed") for n in CHECKS[1:]]
                steps.append(StepResult(self.backend, self.kind, i, step.label, checks,
                                        time.perf_counter() - t0))
                continue
            prov = prov.after(step)
            now = snapshot(model)
            steps.append(self.check(i, step.label, model, prov, at_load, before, step, t0, now))
            before = now
        return steps

    def _probe(self, model: FP8MoEModel) -> None:
        """Raise BackendUnavailable if the backend cannot run this device/shape at all.
        Any other error is left for the checks to report, step by step."""
        block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        try:
            with torch.no_grad():
                w, ids = block.gate(self.g.x)
                run_moe(block.experts, self.g.x, w, ids, backend=self.backend)
        except BackendUnavailable:
            raise
        except Exception:
            pass

    def check(self, index, label, model, prov, at_load, before, step, t0, now=None) -> StepResult:
        g = self.g
        now = now if now is not None else snapshot(model)
        checks = [Check("reload", "pass", detail="load" if step is None else "returned")]

        fresh = load_model(self.expected_path(prov), device=g.device, processing=g.processing)
        fresh.set_backend(self.backend)
        diffs = compare_states(snapshot(fresh), now)
        checks.append(Check("fresh.state", "fail" if diffs else "pass", len(diffs), 0,
                            _diff_summary(diffs) if diffs else "bitwise equal to a fresh load"))
        checks.append(self._checkpoint(model, self.expected_path(prov)))

        y, routing, y_err = _forward(model, g.x)
        yf, _, yf_err = _forward(fresh, g.x)
        del fresh
        checks.append(self._fresh_forward(y, y_err, yf, yf_err))
        checks += self._reference(model, y, routing, y_err)

        bad = [d for d in compare_states(at_load, now, identity=True)
               if d.endswith("replaced") or "loader attributes" in d]
        bad += [f"{n}: no weight_loader" for n in missing_loaders(model)]
        bad += [f"{n}: moved to new memory (a captured CUDA graph reads the old)"
                for n, ptr in _storage(model).items() if self.storage.get(n, ptr) != ptr]
        checks.append(Check("identity", "fail" if bad else "pass", len(bad), 0,
                            _diff_summary(bad) if bad else "same Parameters, loaders kept"))

        if step is None or step.experts is None:
            checks.append(Check("untouched", "n/a", detail="load / full reload"))
        else:
            layers = dict((m.layer_id, m) for _, m in model.moe_layers())
            slots = {layer: {s for e in es for s in layers[layer].local_slots(e)}
                     for layer, es in step.experts.items()}
            moved = untouched_diffs(before, now, slots)
            checks.append(Check("untouched", "fail" if moved else "pass", len(moved), 0,
                                _diff_summary(moved) if moved else "outside the filter: bitwise"))
        if g.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return StepResult(self.backend, self.kind, index, label, checks, time.perf_counter() - t0)

    def _checkpoint(self, model, path) -> Check:
        """The experts against the checkpoint itself, read without this package: what a
        fresh load shares with the reload (the loaders, processing) cannot hide there."""
        try:
            d, where = checkpoint_weight_diff(model, path)
        except Exception as e:
            return Check("ckpt.weights", "fail", None, CHECKPOINT_BOUND,
                         f"reading the checkpoint raised {_fail_text(e)}")
        return Check("ckpt.weights", "pass" if d <= CHECKPOINT_BOUND else "fail", d,
                     CHECKPOINT_BOUND, f"worst {where}: calc_diff {d:.3g} vs bound {CHECKPOINT_BOUND:g}")

    def _fresh_forward(self, y, y_err, yf, yf_err) -> Check:
        bound = self.bound.fresh_forward
        if y_err or yf_err:
            return Check("fresh.forward", "fail", None, bound,
                         f"forward raised {y_err or yf_err} ({'reloaded' if y_err else 'fresh'} model)")
        if not (torch.isfinite(y).all() and torch.isfinite(yf).all()):  # (NaN never equals NaN)
            which = [n for n, t in (("reloaded", y), ("fresh", yf)) if not torch.isfinite(t).all()]
            return Check("fresh.forward", "fail", None, bound,
                         f"output not finite ({' and '.join(which)} model)")
        d = calc_diff(y, yf)
        if bound == 0:
            same = torch.equal(y, yf)
            return Check("fresh.forward", "pass" if same else "fail", d, 0,
                         "bitwise equal" if same else
                         f"not bitwise: calc_diff {d:.3g}, "
                         f"max |diff| {(y.float() - yf.float()).abs().max():.3g}")
        return Check("fresh.forward", "pass" if d <= bound else "fail", d, bound,
                     f"calc_diff {d:.3g} vs bound {bound:g}")

    def _reference(self, model, y, routing, y_err) -> list[Check]:
        b = self.bound
        try:
            yr, moe_inputs = reference_forward(model, self.g.x, routing)
        except Exception as e:  # a broken layout cannot even be dequantized
            why = f"reference forward raised {_fail_text(e)}"
            return [Check("ref.model", "fail", None, b.ref_model, why),
                    Check("ref.moe", "fail", None, b.ref_moe, why)]
        if y_err:
            model_check = Check("ref.model", "fail", None, b.ref_model, f"forward raised {y_err}")
        else:
            d = calc_diff(y, yr)
            flips = sum(int((a.sort(-1).values != own.sort(-1).values).any(-1).sum())
                        for a, (_, _, own) in zip(routing, moe_inputs))
            model_check = Check("ref.model", "pass" if d <= b.ref_model else "fail", d, b.ref_model,
                                f"calc_diff {d:.3g} vs bound {b.ref_model:g} on the FP8 model's "
                                f"routing ({flips} token-layer expert choices differ in float32)")
        worst, where = 0.0, ""
        try:
            with torch.no_grad():
                for block, n, _ in moe_inputs:
                    xb = n.to(torch.bfloat16)
                    w, ids = block.gate(xb)
                    got = run_moe(block.experts, xb, w, ids, backend=self.backend)
                    d = calc_diff(got, reference_moe(block.experts, xb, w, ids))
                    if worse(d, worst):  # (a NaN layer is the worst)
                        worst, where = d, f"layer {block.experts.layer_id}"
        except Exception as e:
            return [model_check, Check("ref.moe", "fail", None, b.ref_moe,
                                       f"MoE forward raised {_fail_text(e)}")]
        return [model_check, Check("ref.moe", "pass" if worst <= b.ref_moe else "fail", worst,
                                   b.ref_moe, f"worst {where}: calc_diff {worst:.3g} vs bound {b.ref_moe:g}")]


def _storage(model) -> dict[str, int]:
    """Where each Parameter's storage lives: a reload in place leaves every one where it was."""
    return {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}


def _forward(model, x):
    """(output, routing, None) or (None, None, why it raised)."""
    try:
        y, routing = forward_with_routing(model, x)
        return y, routing, None
    except Exception as e:
        return None, None, _fail_text(e)


@dataclass
class _Gate:
    cfg: MoEConfig
    device: str
    processing: str
    bounds: Bounds
    root: Path
    checkpoints: dict[str, dict[int, Path]]
    script: list[ScriptStep]
    x: torch.Tensor
    log: Callable[[str], None]


def run_gate(preset: str = "tiny", processing: str = "fixed", backends="all",
             device: str | None = None, bounds=None, kinds=KINDS,
             num_layers: int | None = None, workdir=None,
             log: Callable[[str], None] = print) -> GateResult:
    """Run the gate; raises `GateError` if it cannot run as asked."""
    t_start = time.perf_counter()
    if processing not in MODES:
        raise GateError(f"unknown processing {processing!r}; choose one of {', '.join(MODES)}")
    try:
        device = resolve_device(device)
    except DeviceUnavailableError as e:
        raise GateError(str(e)) from None
    kinds = [k for part in ([kinds] if isinstance(kinds, str) else kinds) for k in part.split(",") if k]
    if not kinds:
        raise GateError(f"--kind names no checkpoint kind; choose from {', '.join(KINDS)}")
    for k in kinds:
        if k not in KINDS:
            raise GateError(f"unknown checkpoint kind {k!r}; choose from {', '.join(KINDS)}")
    asked = [n for part in ([backends] if isinstance(backends, str) else backends or ())
             for n in str(part).split(",") if n]
    requested_all = not asked or "all" in asked
    names = resolve_backends(backends)
    try:
        bounds = bounds if isinstance(bounds, Bounds) else load_bounds(bounds)
        for name in names:
            for kind in kinds:
                bounds.get(name, kind)  # fail before any work if an entry is missing
    except BoundsError as e:
        raise GateError(str(e)) from None
    cfg = MoEConfig.preset(preset, num_layers=num_layers)
    script = default_script(cfg)

    tmp = tempfile.TemporaryDirectory(prefix="fp8-reload-gate-") if workdir is None else None
    root = Path(workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    # On CPU, one torch thread: the gate's 64-token ops gain nothing from threads, and
    # on a busy 2-core runner spinning OpenMP workers made it ~25x slower. Restored below.
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    result = GateResult(preset, device, processing, names, kinds, str(bounds.path), bounds.version,
                        {f"{b}.{k}": asdict(bounds.get(b, k)) for b in names for k in kinds})
    try:
        log(f"[gate] preset {preset!r} ({cfg.num_layers} layers, {cfg.num_experts} experts), "
            f"processing {processing}, device {device}, backends {', '.join(names)}, "
            f"kinds {', '.join(kinds)}; writing checkpoints to {root}")
        checkpoints = {k: {s: _checkpoint(root, cfg, k, s) for s in (0, 1)} for k in kinds}
        x = torch.randn(NUM_TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        gate = _Gate(cfg, device, processing, bounds, root, checkpoints, script,
                     x.to(torch.bfloat16).to(device), log)
        for name in names:
            for kind in kinds:
                try:
                    result.steps += _Sequence(gate, name, kind).run()
                except BackendUnavailable as e:  # (for this kind: the others are still tried)
                    if not requested_all:
                        raise GateError(f"MoE backend {name!r} cannot run here: {e}") from None
                    result.skipped_backends[f"{name} ({kind})"] = str(e)
                    log(f"[gate] skipping backend {name!r} for {kind}: {e}")
            skipped = [f"{name} ({k})" for k in kinds]
            if all(k in result.skipped_backends for k in skipped):  # every kind: the backend
                result.skipped_backends[name] = result.skipped_backends[skipped[0]]
                for k in skipped:
                    del result.skipped_backends[k]
        result.backends = [n for n in names if any(s.backend == n for s in result.steps)]
        if not result.steps:
            raise GateError("no backend could run here: " + "; ".join(
                f"{n}: {why}" for n, why in result.skipped_backends.items()))
    finally:
        torch.set_num_threads(threads)
        if tmp is not None:
            tmp.cleanup()
    result.seconds = time.perf_counter() - t_start
    return result


def _checkpoint(root: Path, cfg: MoEConfig, kind: str, seed: int) -> Path:
    """The gate's checkpoint of `kind` and `seed`, written once. One a kept --workdir holds is
    used only if it says it is that checkpoint (else the reloads from "the other seed" could
    load the same bytes, and every check would pass for nothing)."""
    path = root / f"{cfg.name}-{cfg.num_layers}L-{kind}-s{seed}"
    if (path / "config.json").exists():  # a kept --workdir: checkpoints are deterministic
        try:
            ckpt = Checkpoint(path)
            made = ckpt.hf_config.get("fp8_reload")
        except Exception as e:
            raise GateError(f"{path}: unreadable ({e}); remove it or use another --workdir") from None
        if made != {"kind": kind, "seed": seed, "fill": "seeded"} or ckpt.config != cfg:
            raise GateError(f"{path} holds another checkpoint ({made}), not the gate's {kind} seed "
                            f"{seed} of this preset: remove it or use another --workdir")
        return path
    return write_checkpoint(path, cfg, seed=seed, kind=kind)

