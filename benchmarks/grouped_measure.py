"""The measuring half of `grouped`: every case of a group in this one process, with the
per-process benchmarks' own classes, sampled the way asv samples them.

For a ``time_*`` case: the benchmark's `setup` (which warms up: a first reload, the
forward's JIT, the raw read), one untimed call unless the class sets
``warmup_time = 0`` (asv's warm-up; `ProcessMoELayer` sets it: an untimed call would
leave a processed layer), then samples as the class's ``repeat`` asks asv for them (at
least ``min``, then more while fewer than ``max`` and ``max_time`` seconds have not
passed; `REPEAT` for a class that does not say), each a `setup` and ``number`` timed
calls (the class's, or as asv picks it: enough for `SAMPLE_TIME`) with the suite's timer
(`common.TIMER`; the device synchronized around each call, `common.synchronized`); the
value is the best sample's time per call, what `fp8-reload report` takes from asv's
samples. A ``track_*`` case: `setup`, then the method's value.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback

from . import accuracy, common, forward, io, processing, reload

REPEAT = int(os.environ.get("FP8_RELOAD_BENCH_REPEAT", "3"))
SAMPLE_TIME = 0.01  # asv's default sample_time
MAX_NUMBER = 1000
MODULES = (reload, processing, forward, accuracy, io)


def _class(name: str) -> type:
    for mod in MODULES:
        if hasattr(mod, name):
            return getattr(mod, name)
    raise LookupError(f"no benchmark class {name} in {[m.__name__ for m in MODULES]}")


def _number(call, args, timer) -> int:
    """Calls per sample for a class that leaves ``number`` to asv: as asv picks it, enough
    that one sample lasts `SAMPLE_TIME` (a sub-millisecond forward timed once per sample
    measures what follows the setup as much as the forward)."""
    t = timer()
    call(*args)
    once = timer() - t
    return max(1, min(MAX_NUMBER, math.ceil(SAMPLE_TIME / once))) if once > 0 else MAX_NUMBER


def _repeat(cls, repeat: int | None) -> tuple[int, int, float]:
    """(min samples, max samples, seconds after which no sample more starts), as asv reads
    a class's ``repeat``: a tuple ``(min, max, max_time)``, or an int n (n samples); 0 or
    nothing: `REPEAT` here."""
    asked = getattr(cls, "repeat", 0) if repeat is None else repeat
    if isinstance(asked, tuple):
        lo, hi, seconds = asked
        return lo, hi, seconds
    n = asked or REPEAT
    return n, n, math.inf


def measure_one(paths: dict, name: str, params: tuple, repeat: int | None = None):
    """(status, value) of one case: ("ok", number), ("skip", why) or ("failed", traceback)."""
    cls_name, method = name.split(".")
    cls = _class(cls_name)
    bench = cls()
    args = ((paths,) if hasattr(cls, "setup_cache") else ()) + tuple(params)
    call = getattr(bench, method)
    setup = getattr(bench, "setup", lambda *a: None)
    try:
        setup(*args)
        if method.startswith("track_"):
            return "ok", float(call(*args))
        if getattr(cls, "warmup_time", -1) != 0:
            call(*args)
        timer = getattr(cls, "timer", common.TIMER)
        number = getattr(cls, "number", 0) or _number(call, args, timer)
        lo, hi, seconds = _repeat(cls, repeat)
        samples: list[float] = []
        start = time.perf_counter()
        # asv: never more than max, at least one, then on until min and until max_time
        while len(samples) < max(hi, 1) and (len(samples) < max(lo, 1)
                                             or time.perf_counter() - start < seconds):
            setup(*args)
            t = timer()
            for _ in range(number):
                call(*args)
            samples.append((timer() - t) / number)
        return "ok", min(samples)
    except NotImplementedError as e:
        return "skip", str(e)
    except Exception:  # noqa: BLE001  (recorded: the lookup fails that one benchmark in asv)
        return "failed", traceback.format_exc()
    finally:
        if hasattr(bench, "teardown"):
            bench.teardown(*args)


def measure(cases: list[tuple[str, tuple]], paths: dict | None = None) -> dict:
    """{(Class.method, params): (status, value)} of every case, in order. `paths`: the
    checkpoints (default: `CheckpointSuite.setup_cache`, written or reused)."""
    t0 = time.perf_counter()
    paths = paths if paths is not None else common.CheckpointSuite().setup_cache()
    print(f"grouped: checkpoints ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    out = {}
    for name, params in cases:
        t = time.perf_counter()
        out[(name, tuple(params))] = result = measure_one(paths, name, params)
        print(f"grouped: {name}{params}: {result[0]} in {time.perf_counter() - t:.1f} s",
              file=sys.stderr)
    print(f"grouped: {len(cases)} cases in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out
