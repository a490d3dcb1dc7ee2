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
    ckpt.weights   every expert and FP8 linear, dequantized, vs the checkpoint's own tensors
                   read with safetensors (a bug a fresh load shares shows here)
    fresh.forward  (1) the forward output equals the fresh load's, bitwise or within
                   the backend's bound
    ref.model      (2) model output vs a float32 reference forward of the same
                   dequantized weights (no activation quantization), `calc_diff`
    ref.moe        (2) each MoE layer's backend output vs the float32 reference on the
                   same input and routing, worst layer, `calc_diff`
    identity       (3) every Parameter is the object it was after the load, with the
                   same loader attributes and storage, and every parameter a reload reaches through
                   `weight_loader` has one
    untouched      (4) experts outside the filter and every non-expert module kept
                   their bytes (n/a for the load and full reloads)

The numeric bounds live in `kernels/bounds.toml`, one entry per backend and
checkpoint kind with its reason. The gate passes only if every check of every
step passed and every check passed at least once (no vacuous pass).

    result   checks, steps, the run's verdict
    script   the scripted reloads and the provenance of every expert
    run      the checks of every step, for every backend and checkpoint kind
    report   the table, the failures, the worst values against their bounds
"""

from ...kernels.bounds import KINDS, MAX_BOUND, Bounds, BoundsError, load_bounds
from ...testing.reference import dequantized_linear_weight, reference_forward, reference_moe
from .command import command
from .report import format_failures, format_report, format_table, write_json
from .result import CHECKS, Check, GateError, GateResult, StepResult
from .run import resolve_backends, run_gate, untouched_diffs
from .script import Provenance, ScriptStep, default_script

__all__ = ["Bounds", "BoundsError", "CHECKS", "Check", "GateError", "GateResult", "KINDS",
           "MAX_BOUND", "Provenance", "ScriptStep", "StepResult", "command", "default_script",
           "dequantized_linear_weight", "format_failures", "format_report", "format_table",
           "load_bounds", "reference_forward", "reference_moe", "resolve_backends", "run_gate",
           "untouched_diffs", "write_json"]
