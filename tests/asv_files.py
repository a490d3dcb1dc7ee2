"""Synthetic asv results directories (format version 2), for report and regress tests.

The layout and the columns are those `asv run` writes (checked against real runs
in results/asv): ``benchmarks.json``, ``<machine>/machine.json`` and
``<machine>/<commit[:8]>-<env>.json`` whose ``result`` lists hold one value per
parameter combination (itertools.product order), ``None`` for a failure and NaN
for a skip.
"""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a",
           "stats_ci_99_b", "stats_q_25", "stats_q_75", "stats_number", "stats_repeat", "samples"]


def _q(v) -> str:
    return repr(v)


def write_benchmarks_json(root: Path, specs: dict) -> None:
    """specs: {name: (param_names, params, unit[, setup_cache_key])}: the key names the
    grouped suite's group (its `setup_cache`), as asv writes it."""
    data = {"version": 2}
    for name, (names, params, unit, *key) in specs.items():
        data[name] = {"name": name, "param_names": names,
                      "params": [[_q(v) for v in ps] for ps in params], "unit": unit,
                      "type": name.rsplit(".", 1)[-1].split("_", 1)[0], "version": "x"}
        if key:
            data[name]["setup_cache_key"] = key[0]
    root.mkdir(parents=True, exist_ok=True)
    (root / "benchmarks.json").write_text(json.dumps(data))


def write_machine(root: Path, machine: str, **extra) -> None:
    info = {"machine": machine, "cpu": "Test CPU", "num_cpu": "2", "ram": "1000", "os": "Linux",
            "arch": "x86_64", "version": 1, **extra}
    (root / machine).mkdir(parents=True, exist_ok=True)
    (root / machine / "machine.json").write_text(json.dumps(info))


def write_result(root: Path, machine: str, commit: str, results: dict, started_at: int = 1000,
                 env: str = "existing-py_python") -> Path:
    """results: {name: (params, values[, ci_low, ci_high[, samples]])}, values in product order."""
    out = {}
    for name, spec in results.items():
        params, values = spec[0], spec[1]
        entry = [values, [[_q(v) for v in ps] for ps in params], "x", started_at, 1.0]
        if len(spec) > 2:
            entry += [spec[2], spec[3], values, values, [1] * len(values), [1] * len(values)]
        if len(spec) > 4:
            entry.append(spec[4])
        out[name] = entry
    data = {"commit_hash": commit, "env_name": env, "date": 1, "params": {"machine": machine},
            "python": "3.11", "requirements": {}, "env_vars": {}, "result_columns": COLUMNS,
            "results": out, "durations": {}, "version": 2}
    path = root / machine / f"{commit[:8]}-{env}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan: asv writes NaN for skipped benchmarks
    path.write_text(json.dumps(data, allow_nan=True))
    return path
