"""`fp8-reload gate`: the accuracy gate for FP8 MoE hot reload.

Writes checkpoints of both kinds (two seeds each, so the script can go back and
forth), loads one, runs a scripted sequence of reloads (full; filtered to one
expert, to experts of several layers, to every expert of a layer; back and
forth between the two checkpoints) and after every step runs these checks for
every requested MoE forward backend:

    reload         the reload returned (no ReloadError)
    fresh.state    (1) every parameter and buffer equals, bit for bit, a fresh load of
                   what the model should now hold (after a filtered reload from the
                   other checkpoint: a fresh load of the correspondingly mixed checkpoint)
    fresh.forward  (1) the forward output equals the fresh load's, bitwise or within
                   the backend's bound
    ref.model      (2) model output vs a float32 reference forward of the same
                   dequantized weights (no activation quantization), `calc_diff`
    ref.moe        (2) each MoE layer's backend output vs the float32 reference on the
                   same input and routing, worst layer, `calc_diff`
    identity       (3) every Parameter is the object it was after the load, with the
                   same loader attributes, and every parameter a reload reaches through
                   `weight_loader` has one
    untouched      (4) experts outside the filter and every non-expert module kept
                   their bytes (n/a for the load and full reloads)

The numeric bounds live in `gate_bounds.toml`, one entry per backend and
checkpoint kind with its reason. The gate passes only if every check of every
step passed and every check passed at least once (no vacuous pass).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .checkpoint import mix_checkpoints, write_checkpoint
from .config import MoEConfig
from .demo import default_device
from .state import missing_loaders
from .errors import ReloadError
from .kernels import BackendUnavailable, available_backends, run_moe
from .layers import EXPERT_RE, FP8MoEModel, Fp8Linear, FusedMoE, MoEBlock
from .processing import MODES, FixedFp8LinearMethod
from .quant import calc_diff
from .reload import generate_weight_name_filter, load_model, update_weights_from_disk
from .state import Snapshot, bitwise_equal, compare_states, snapshot

BOUNDS_FILE = Path(__file__).with_name("gate_bounds.toml")
KINDS = ("fp8", "bf16")
CHECKS = ("reload", "fresh.state", "fresh.forward", "ref.model", "ref.moe", "identity",
          "untouched")
BOUND_KEYS = ("fresh_forward", "ref_model", "ref_moe")  # calc_diff bounds, 0 = bitwise
# calc_diff 1e-2 is ~14 % relative RMS error, far beyond any FP8 rounding: a bound
# above it would not gate anything (see gate_bounds.toml for what the bounds catch).
MAX_BOUND = 1e-2
NUM_TOKENS = 64


class GateError(Exception):
    """The gate cannot run as asked (unknown backend, bad bounds file, no CUDA)."""


# --------------------------------------------------------------------------
# Bounds
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Bound:
    fresh_forward: float
    ref_model: float
    ref_moe: float
    reason: str


@dataclass
class Bounds:
    path: Path
    version: int
    entries: dict[tuple[str, str], Bound]

    def get(self, backend: str, kind: str) -> Bound:
        try:
            return self.entries[backend, kind]
        except KeyError:
            raise GateError(f"{self.path}: no bounds for backend {backend!r} and checkpoint kind "
                            f"{kind!r}; add a [{backend}.{kind}] table with "
                            f"{', '.join(BOUND_KEYS)} and reason") from None


def load_bounds(path=None) -> Bounds:
    """Read and validate a bounds file (default: the versioned one in the package)."""
    path = Path(path) if path is not None else BOUNDS_FILE
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise GateError(f"{path}: cannot read bounds: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise GateError(f"{path}: not valid TOML: {e}") from None
    version = data.pop("version", None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise GateError(f"{path}: needs an integer top-level `version`")
    entries = {}
    for backend, kinds in data.items():
        if not isinstance(kinds, dict):
            raise GateError(f"{path}: {backend!r} must be a table of checkpoint kinds")
        for kind, table in kinds.items():
            where = f"{path}: [{backend}.{kind}]"
            if kind not in KINDS or not isinstance(table, dict):
                raise GateError(f"{where}: unknown checkpoint kind (use {', '.join(KINDS)})")
            need = set(BOUND_KEYS) | {"reason"}
            if set(table) != need:
                raise GateError(f"{where}: needs exactly {', '.join(sorted(need))}; "
                                f"missing {sorted(need - set(table))}, unknown {sorted(set(table) - need)}")
            for key in BOUND_KEYS:
                v = table[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BOUND:
                    raise GateError(f"{where}: {key} = {v!r} must be a number in [0, {MAX_BOUND:g}]")
            if not isinstance(table["reason"], str) or not table["reason"].strip():
                raise GateError(f"{where}: reason must say why the bound is what it is")
            entries[backend, kind] = Bound(*(float(table[k]) for k in BOUND_KEYS),
                                           table["reason"].strip())
    return Bounds(path, version, entries)


# --------------------------------------------------------------------------
# The float32 reference forward
# --------------------------------------------------------------------------

def dequantized_linear_weight(linear: Fp8Linear) -> torch.Tensor:
    """The layer's weight as float32 ``[out, in]``, read the way its stored state means it.

    Fixed layers keep one scale per logical shard and a checkpoint-layout view;
    upstream layers hold the transposed ``[in, out]`` weight and a per-channel
    scale. Either way the result is what the FP8 GEMM should compute with.
    """
    qm = linear.quant_method
    if isinstance(qm, FixedFp8LinearMethod):
        w = qm.checkpoint_view(linear).float()
        widths = torch.tensor(linear.logical_widths, device=w.device)
        scale = torch.repeat_interleave(linear.weight_scale.float(), widths)
        return w * scale[:, None]
    w = linear.weight.float().t()
    scale = linear.weight_scale.float().reshape(-1)
    if scale.numel() not in (1, w.shape[0]):
        raise RuntimeError(f"weight {tuple(linear.weight.shape)} does not fit its "
                           f"{tuple(linear.weight_scale.shape)} scale")
    return w * (scale[:, None] if scale.numel() > 1 else scale)


def dequantized_expert(layer: FusedMoE, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) float32 of one expert, each half of w13 with its own
    scale column when the layer keeps the ``[E, 2]`` layout."""
    inter = layer.intermediate_size
    s13 = layer.w13_weight_scale.float()
    w13 = layer.w13_weight[slot].float()
    if s13.dim() == 2:
        w13 = torch.cat([w13[:inter] * s13[slot, 0], w13[inter:] * s13[slot, 1]])
    else:
        w13 = w13 * s13[slot]
    return w13, layer.w2_weight[slot].float() * layer.w2_weight_scale[slot].float()


def reference_moe(layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Float32 fused-MoE on the dequantized experts, activations not quantized.

    Written independently of `kernels` (its own dequantization, no
    `moe_kernel_scales`), so a scale bug shared by every backend still shows.
    """
    x = x.float()
    inter = layer.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = dequantized_expert(layer, e)
        h = x.index_select(0, tok) @ w13.t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def _ref_norm(norm, x):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return x * norm.weight.float()


def _ref_linear(linear, x):
    return x @ dequantized_linear_weight(linear).t()


def _ref_mlp(mlp, x):
    g, u = _ref_linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
    return _ref_linear(mlp.down_proj, F.silu(g) * u)


def _ref_attention(attn, x):
    t = x.shape[0]
    q = _ref_linear(attn.q_proj, x).view(t, attn.nh, attn.qk).transpose(0, 1)
    k = _ref_linear(attn.k_proj, x).view(t, attn.nh, attn.qk).transpose(0, 1)
    v = _ref_linear(attn.v_proj, x).view(t, attn.nh, attn.v).transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _ref_linear(attn.o_proj, o.transpose(0, 1).reshape(t, attn.nh * attn.v))


def _ref_route(router, x, topk_ids: Optional[torch.Tensor]):
    """The router's weights in float32 for the given expert choice (its own if None)."""
    if topk_ids is None:
        return router(x)
    probs = (x @ router.weight.float().t()).softmax(dim=-1)
    w = probs.gather(1, topk_ids)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * router.scaling, topk_ids


@torch.no_grad()
def reference_forward(model: FP8MoEModel, x: torch.Tensor,
                      routing: Optional[list[torch.Tensor]] = None
                      ) -> tuple[torch.Tensor, list[tuple[MoEBlock, torch.Tensor, torch.Tensor]]]:
    """The whole model in float32 on its dequantized weights, no activation quantization.

    `routing` (one ``topk_ids`` per MoE block, as `forward_with_routing` records
    them) makes the reference take the FP8 model's expert choices: top-k is
    discontinuous, and a token near a tie flips experts under any perturbation,
    which is not an accuracy error. Returns the output and, per MoE block, the
    float32 input it saw and the expert choice the reference made on it.
    """
    h = x.float()
    moe_inputs = []
    blocks = 0
    for layer in model.model.layers:
        h = h + _ref_attention(layer.self_attn, _ref_norm(layer.input_layernorm, h))
        n = _ref_norm(layer.post_attention_layernorm, h)
        if isinstance(layer.mlp, MoEBlock):
            forced = None if routing is None else routing[blocks]
            blocks += 1
            w, ids = _ref_route(layer.mlp.gate, n, forced)
            moe_inputs.append((layer.mlp, n, layer.mlp.gate(n)[1]))
            y = reference_moe(layer.mlp.experts, n, w, ids)
            if layer.mlp.shared_experts is not None:
                y = y + _ref_mlp(layer.mlp.shared_experts, n)
        else:
            y = _ref_mlp(layer.mlp, n)
        h = h + y
    return _ref_norm(model.model.norm, h), moe_inputs


def forward_with_routing(model: FP8MoEModel, x: torch.Tensor
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """model(x) plus the ``topk_ids`` each MoE router chose (recorded by forward hooks)."""
    routing: list[torch.Tensor] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out: routing.append(out[1]))
             for m in model.modules() if isinstance(m, MoEBlock)]
    try:
        with torch.no_grad():
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return y, routing


# --------------------------------------------------------------------------
# The scripted sequence
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ScriptStep:
    what: str  # short description of the filter
    seed: int  # which checkpoint it reloads from
    experts: Optional[dict[int, tuple[int, ...]]]  # None: full reload

    @property
    def label(self) -> str:
        return f"{self.what} <- s{self.seed}"


def _spec(experts: dict[int, tuple[int, ...]], num_experts: int) -> str:
    return " ".join(f"L{layer}:" + ("all" if len(es) == num_experts else ",".join(map(str, es)))
                    for layer, es in sorted(experts.items()))


def default_script(cfg: MoEConfig) -> list[ScriptStep]:
    """Full and filtered reloads, back and forth between seeds 0 and 1 (model starts on 0)."""
    layers, e = cfg.moe_layers, cfg.num_experts
    if not layers:
        raise GateError(f"preset {cfg.name!r} with {cfg.num_layers} layers has no MoE layer")
    first, last = layers[0], layers[-1]
    one = {first: (min(3, e - 1),)}
    several: dict[int, set[int]] = {}
    for layer, es in ((first, {0, max(e - 3, 0)}), (last, {min(2, e - 1), e - 1})):
        several.setdefault(layer, set()).update(es)
    several_t = {k: tuple(sorted(v)) for k, v in several.items()}
    layer_all = {last: tuple(range(e))}

    def s(what, seed, ex):
        return ScriptStep(what if ex is None else f"{what} {_spec(ex, e)}", seed, ex)

    return [
        s("full", 1, None),
        s("one expert", 0, one),
        s("experts of layers", 0, several_t),
        s("all of a layer", 0, layer_all),
        s("one expert", 1, one),
        s("same again", 1, one),  # the model already holds this: nothing may change
        s("full", 0, None),
        s("experts of layers", 1, several_t),
    ]


@dataclass(frozen=True)
class Provenance:
    """Which checkpoint each part of the model should hold: `base` for everything
    except `other` (layer, expert) pairs, which come from the other seed."""

    base: int
    other: frozenset = frozenset()

    def after(self, step: ScriptStep) -> "Provenance":
        if step.experts is None:
            return Provenance(step.seed)
        pairs = {(layer, e) for layer, es in step.experts.items() for e in es}
        other = self.other - pairs if step.seed == self.base else self.other | pairs
        return Provenance(self.base, frozenset(other))


def _expert_of(name: str) -> Optional[tuple[int, int]]:
    m = EXPERT_RE.match(name)
    return None if m is None else (int(name.split(".")[2]), int(m.group(2)))


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    status: str  # pass | fail | n/a | skip
    measured: Optional[float] = None
    bound: Optional[float] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "n/a")


@dataclass
class StepResult:
    backend: str
    kind: str
    index: int
    label: str
    checks: list[Check]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)


@dataclass
class GateResult:
    preset: str
    device: str
    processing: str
    backends: list[str]
    kinds: list[str]
    bounds_file: str
    bounds_version: int
    bounds: dict[str, dict]
    steps: list[StepResult] = field(default_factory=list)
    skipped_backends: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Every check of every step passed, and every check passed at least once."""
        exercised = {c.name for s in self.steps for c in s.checks if c.status == "pass"}
        return bool(self.steps) and all(s.passed for s in self.steps) and exercised == set(CHECKS)

    def failures(self) -> list[tuple[StepResult, Check]]:
        return [(s, c) for s in self.steps for c in s.checks if not c.ok]

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["torch"] = torch.__version__
        return d


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------

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

    def __init__(self, gate: "_Gate", backend: str, kind: str):
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
                            lambda n: _expert_of(n) in prov.other)
            part.rename(out)
        return out

    def run(self) -> list[StepResult]:
        g = self.g
        model = load_model(self.paths[0], device=g.device, processing=g.processing)
        model.set_backend(self.backend)
        self._probe(model)
        at_load = snapshot(model)
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

        y, routing, y_err = _forward(model, g.x)
        yf, _, yf_err = _forward(fresh, g.x)
        del fresh
        checks.append(self._fresh_forward(y, y_err, yf, yf_err))
        checks += self._reference(model, y, routing, y_err)

        bad = [d for d in compare_states(at_load, now, identity=True)
               if d.endswith("replaced") or "loader attributes" in d]
        bad += [f"{n}: no weight_loader" for n in missing_loaders(model)]
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

    def _fresh_forward(self, y, y_err, yf, yf_err) -> Check:
        bound = self.bound.fresh_forward
        if y_err or yf_err:
            return Check("fresh.forward", "fail", None, bound,
                         f"forward raised {y_err or yf_err} ({'reloaded' if y_err else 'fresh'} model)")
        d = calc_diff(y, yf)
        if bound == 0:
            same = torch.equal(y, yf)
            return Check("fresh.forward", "pass" if same else "fail", d, 0,
                         "bitwise equal" if same else
                         f"not bitwise: calc_diff {d:.3g}, max |diff| {(y.float() - yf.float()).abs().max():.3g}")
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
                    if d >= worst:
                        worst, where = d, f"layer {block.experts.layer_id}"
        except Exception as e:
            return [model_check, Check("ref.moe", "fail", None, b.ref_moe,
                                       f"MoE forward raised {_fail_text(e)}")]
        return [model_check, Check("ref.moe", "pass" if worst <= b.ref_moe else "fail", worst,
                                   b.ref_moe, f"worst {where}: calc_diff {worst:.3g} vs bound {b.ref_moe:g}")]


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
             device: Optional[str] = None, bounds=None, kinds=KINDS,
             num_layers: Optional[int] = None, workdir=None,
             log: Callable[[str], None] = print) -> GateResult:
    """Run the gate; raises `GateError` if it cannot run as asked."""
    t_start = time.perf_counter()
    if processing not in MODES:
        raise GateError(f"unknown processing {processing!r}; choose one of {', '.join(MODES)}")
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GateError("--device cuda asked for, but CUDA is not available here")
    kinds = [k for part in ([kinds] if isinstance(kinds, str) else kinds) for k in part.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise GateError(f"unknown checkpoint kind {k!r}; choose from {', '.join(KINDS)}")
    requested_all = backends in (None, "all") or "all" in list(backends)
    names = resolve_backends(backends)
    bounds = bounds if isinstance(bounds, Bounds) else load_bounds(bounds)
    for name in names:
        for kind in kinds:
            bounds.get(name, kind)  # fail before any work if an entry is missing
    cfg = MoEConfig.preset(preset, **({"num_layers": num_layers} if num_layers else {}))
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
                except BackendUnavailable as e:
                    if not requested_all:
                        raise GateError(f"MoE backend {name!r} cannot run here: {e}") from None
                    result.skipped_backends[name] = str(e)
                    log(f"[gate] skipping backend {name!r}: {e}")
                    break
        result.backends = [n for n in names if n not in result.skipped_backends]
    finally:
        torch.set_num_threads(threads)
        if tmp is not None:
            tmp.cleanup()
    result.seconds = time.perf_counter() - t_start
    return result


def _checkpoint(root: Path, cfg: MoEConfig, kind: str, seed: int) -> Path:
    path = root / f"{cfg.name}-{cfg.num_layers}L-{kind}-s{seed}"
    if (path / "config.json").exists():  # a kept --workdir: checkpoints are deterministic
        return path
    return write_checkpoint(path, cfg, seed=seed, kind=kind)


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------

_COLS = (("reload", "reload"), ("fresh.state", "state"), ("fresh.forward", "fwd=fresh"),
         ("ref.model", "ref.model"), ("ref.moe", "ref.moe"), ("identity", "identity"),
         ("untouched", "untouched"))


def _cell(c: Check) -> str:
    if c.status in ("n/a", "skip"):
        return "-" if c.status == "n/a" else "skip"
    numeric = c.name in ("ref.model", "ref.moe") or (c.name == "fresh.forward" and c.bound)
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
            cells = []
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


def write_json(result: GateResult, path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=1) + "\n")
