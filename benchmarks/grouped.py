"""The GPU run's figures in few processes (issue 16): what `gpu/asv_suite.sh` runs.

asv runs every parameter combination of a benchmark in a process of its own; on the
H200 each such process cost ~4-8 s (spawn, torch and CUDA start, the model slice
built from its checkpoint, warm-up, 3 samples) and the suite's 44 figures took 435 s.
Here each group's `setup_cache` (one process per group: reload, forward, and io, the
I/O paths beside the limits, selected on its own: its cold cases read GBs from the disk)
measures every case of the group with the benchmarks' own classes (`reload`,
`processing`, `forward`, `accuracy`, `io`: their `setup`, warm-up and timed method, see
`grouped_measure`), so a checkpoint's model is loaded once for all its figures. The
classes below only look the values up: their processes import neither torch nor the
code under test when ``FP8_RELOAD_BENCH_DEVICE`` is set (`knobs`), so each costs a
Python start.

Names: class and parameter names as in the per-process benchmarks. A time is a
``track_time_*`` (seconds: the best of the samples the class's ``repeat`` asks for, or of
``FP8_RELOAD_BENCH_REPEAT``, default 3, each after the benchmark's `setup`, as asv
samples), which `fp8-reload report` reads as
the ``time_*`` of the same class. Only the cases of `RELOAD_CASES` / `FORWARD_CASES`
are measured (the figures of the report: headline rows and plots); every other
parameter combination skips, so select with ``-b`` as `gpu/asv_suite.sh` does.
"""

from __future__ import annotations

from .knobs import ACCURACY_TOKENS, BACKENDS, FRACTIONS, IO_CACHES, KINDS, ON_CUDA, PRESETS, TOKENS

STRATEGIES = ["fixed", "scan-all", "upstream-style"]  # reload.STRATEGIES
IMPLS = ["upstream", "fixed", "fixed-1-expert"]  # processing.IMPLS
SCALE_MODES = ["precomputed", "cached", "per-forward"]  # forward.DeepGemmScaleMode
# FP8 filtered reloads: the headline's three strategies at one expert per layer, and the
# plot's curves (fixed over the shares, upstream-style at both ends).
FILTERED = [("1/layer", "fixed"), ("1/layer", "scan-all"), ("1/layer", "upstream-style"),
            ("10%", "fixed"), ("100%", "fixed"), ("100%", "upstream-style")]


VALIDATE_TIMES = ("time_validate", "time_validate_resident", "time_check_landed", "time_first_reload")


def reload_cases() -> list[tuple[str, tuple]]:
    """(Class.method, parameters) the reload group measures, each checkpoint's cases
    together (one model on the device at a time)."""
    out = [("DeviceMemoryBound.track_bound_bytes", ())]
    for p in PRESETS:
        for k in KINDS:
            if k == "fp8":
                out += [("FilteredReload.time_reload", (p, k, e, s)) for e, s in FILTERED]
            out += [("FullReload.time_reload", (p, k))]
            out += [("ReloadDeviceMemory.track_peak_bytes", (p, k, e)) for e in ("1/layer", "full")]
            shares = ["1/layer", "10%", "100%", "full"] if k == "fp8" else ["full"]
            out += [("RawReadCopy.time_read_copy", (p, k, e, "preadv")) for e in shares]
            out += [("RawReadCopy.time_read_copy", (p, k, "full", "safetensors"))]
            out += [(f"ValidateStaged.{m}", (p, k)) for m in VALIDATE_TIMES]
            out += [("ProcessMoELayer.time_process", (p, k, i)) for i in IMPLS]
    return out


def forward_cases() -> list[tuple[str, tuple]]:
    """The forward at the fewest and most tokens (torch: the most only), the accuracy of
    every backend, DeepGEMM's scale modes at the fewest tokens."""
    lo, hi = min(TOKENS), max(TOKENS)
    out = []
    for p in PRESETS:
        for b in BACKENDS:
            out += [("MoEForward.time_forward", (p, b, t)) for t in ([hi] if b == "torch" else [lo, hi])]
        out += [("ForwardAccuracy.track_calc_diff", (p, b, t)) for b in BACKENDS for t in ACCURACY_TOKENS]
        out += [("DeepGemmScaleMode.time_forward", (p, m, lo)) for m in SCALE_MODES]
    return out


IOS = ["limit-h2d", "limit-read", "limit-read-direct", "fp8-reload", "fp8-reload-direct",
       "fp8-reload-staged", "instanttensor", "fastsafetensors", "safetensors"]  # io.IOS
# (CUDA only: on a CPU one case, which skips, keeps the smoke run short)
IO_PARAMS = ((PRESETS, KINDS, IOS, ["full", "1/layer"], ["warm", "cold"]) if ON_CUDA
             else (PRESETS[:1], KINDS[:1], IOS[:1], ["full"], ["warm"]))


def io_cases() -> list[tuple[str, tuple]]:
    """`io.IOPaths`, every I/O path beside the limits: warm cases first, a checkpoint at a
    time (one model on the device), each library's cases together."""
    presets, kinds, ios, scopes, caches = IO_PARAMS
    # IO_CACHES picks the cases, not the grid: a grid without "cold" would make asv drop the
    # cold figures a commit's results already hold
    return [("IOPaths.time_move", (p, k, io, scope, cache)) for p in presets for k in kinds
            for cache in caches if cache in IO_CACHES for io in ios for scope in scopes
            if not (io.startswith("limit") and scope != "full")]


GROUPS = {"reload": reload_cases, "forward": forward_cases, "io": io_cases}


def _lookup(cache: dict, name: str, params: tuple):
    """The value measured for (name, params): NotImplementedError (asv: skipped) where
    the case was skipped or not measured, RuntimeError (asv: failed) where it failed."""
    status, value = cache.get((name, tuple(params)), ("skip", f"{name}{params}: not a case of this group"))
    if status == "skip":
        raise NotImplementedError(value)
    if status == "failed":
        raise RuntimeError(f"{name}{params} failed in the group's setup_cache:\n{value}")
    return value


class _ReloadGroup:
    timeout = 120.0

    def setup_cache(self):
        from .grouped_measure import measure

        return measure(reload_cases())

    setup_cache.timeout = 1800.0


class _ForwardGroup:
    timeout = 120.0

    def setup_cache(self):
        from .grouped_measure import measure

        return measure(forward_cases())

    setup_cache.timeout = 1800.0


class _IOGroup:
    timeout = 120.0

    def setup_cache(self):
        from .grouped_measure import measure

        return measure(io_cases())

    setup_cache.timeout = 1800.0


def _lookup_class(group: type, cls_name: str, method: str, params: tuple, names: list[str],
                  unit: str) -> type:
    """A class named `cls_name` whose `track_<method>` returns the value its group measured
    (`track_time_reload` for a `time_reload`)."""
    key = f"{cls_name}.{method}"
    track = method if method.startswith("track_") else f"track_{method}"

    def setup(self, cache, *p):
        self.value = _lookup(cache, key, p)

    def track_value(self, cache, *p):
        return self.value

    track_value.unit = unit
    track_value.__name__ = track
    body = {"__module__": __name__, "__doc__": f"`{key}`, measured by its group's setup_cache.",
            "setup": setup, track: track_value}
    if params:  # asv: a benchmark without parameters has no params attribute
        body.update(params=params, param_names=names)
    return type(cls_name, (group,), body)


_R, _F = _ReloadGroup, _ForwardGroup
FilteredReload = _lookup_class(_R, "FilteredReload", "time_reload", (PRESETS, KINDS, FRACTIONS, STRATEGIES),
                               ["preset", "kind", "experts", "strategy"], "seconds")
FullReload = _lookup_class(_R, "FullReload", "time_reload", (PRESETS, KINDS), ["preset", "kind"], "seconds")
RawReadCopy = _lookup_class(_R, "RawReadCopy", "time_read_copy",
                            (PRESETS, KINDS, FRACTIONS + ["full"], ["safetensors", "preadv"]),
                            ["preset", "kind", "experts", "reader"], "seconds")
ReloadDeviceMemory = _lookup_class(_R, "ReloadDeviceMemory", "track_peak_bytes",
                                   (PRESETS, KINDS, FRACTIONS + ["full"]), ["preset", "kind", "experts"],
                                   "bytes")
DeviceMemoryBound = _lookup_class(_R, "DeviceMemoryBound", "track_bound_bytes", (), [], "bytes")
ProcessMoELayer = _lookup_class(_R, "ProcessMoELayer", "time_process", (PRESETS, KINDS, IMPLS),
                                ["preset", "kind", "impl"], "seconds")
MoEForward = _lookup_class(_F, "MoEForward", "time_forward", (PRESETS, BACKENDS, TOKENS),
                           ["preset", "backend", "tokens"], "seconds")
ForwardAccuracy = _lookup_class(_F, "ForwardAccuracy", "track_calc_diff",
                                (PRESETS, BACKENDS, ACCURACY_TOKENS), ["preset", "backend", "tokens"],
                                "calc_diff")
IOPaths = _lookup_class(_IOGroup, "IOPaths", "time_move", IO_PARAMS,
                        ["preset", "kind", "io", "scope", "cache"], "seconds")
DeepGemmScaleMode = _lookup_class(_F, "DeepGemmScaleMode", "time_forward", (PRESETS, SCALE_MODES, TOKENS),
                                  ["preset", "scale_mode", "tokens"], "seconds")


class ValidateStaged(_ReloadGroup):
    """`reload.ValidateStaged`'s times, measured by the reload group's setup_cache."""

    params = (PRESETS, KINDS)
    param_names = ["preset", "kind"]

    def setup(self, cache, preset, kind):
        self.values = {m: _lookup(cache, f"ValidateStaged.{m}", (preset, kind)) for m in VALIDATE_TIMES}

    def track_time_validate(self, cache, preset, kind):
        return self.values["time_validate"]

    def track_time_validate_resident(self, cache, preset, kind):
        return self.values["time_validate_resident"]

    def track_time_check_landed(self, cache, preset, kind):
        return self.values["time_check_landed"]

    def track_time_first_reload(self, cache, preset, kind):
        return self.values["time_first_reload"]

    track_time_validate.unit = track_time_validate_resident.unit = "seconds"
    track_time_check_landed.unit = track_time_first_reload.unit = "seconds"


def selection(groups=("reload", "forward")) -> list[str]:
    """asv ``--bench`` regexes of exactly the measured cases of `groups` (`gpu/asv_suite.sh`):
    one lookup process per figure, none for the combinations that would only skip."""
    import re

    out = []
    for name, params in (case for g in groups for case in GROUPS[g]()):
        cls, method = name.split(".")
        track = method if method.startswith("track_") else f"track_{method}"
        shown = f"({', '.join(map(repr, params))})" if params else ""
        out.append("^" + re.escape(f"grouped.{cls}.{track}{shown}") + "$")
    return out


if __name__ == "__main__":  # python -m benchmarks.grouped [GROUP,...]: the selection, a regex a line
    import sys

    groups = sys.argv[1].split(",") if len(sys.argv) > 1 else ["reload", "forward"]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        sys.exit(f"unknown group(s) {', '.join(unknown)}: choose from {', '.join(GROUPS)}")
    print("\n".join(selection(groups)))
