"""Reading asv's results directory into one tidy pandas frame."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

MACHINE_KEYS = ("machine", "cpu", "num_cpu", "ram", "os", "arch", "gpu", "torch", "cuda")


def _literal(v):
    """asv stores parameter values as their repr ("'small'", "128")."""
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v


def _load_json(path: Path) -> dict:
    """A JSON object from `path`; anything else is a ValueError naming the file. (asv writes
    NaN for skipped benchmarks; json accepts it.)"""
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, where an object was expected")
    return data


def _product(params: list[list]) -> list[tuple]:
    return list(itertools.product(*params)) if params else [()]


def result_dirs(results_dirs) -> list[Path]:
    """One directory or several, as a list of paths."""
    return [Path(results_dirs)] if isinstance(results_dirs, (str, Path)) else [Path(d) for d in results_dirs]


def machine_dirs(results_dirs) -> dict[str, Path]:
    """{machine: its directory} over one or several asv results directories (the curated
    `results/asv` beside a local `.asv/results`); a machine name in two of them is an error."""
    out: dict[str, Path] = {}
    for root in result_dirs(results_dirs):
        for mdir in sorted(p for p in root.iterdir() if p.is_dir()):
            if mdir.name in out:
                raise ValueError(f"machine {mdir.name!r} is in both {out[mdir.name].parent} and "
                                 f"{root}: give your machine another name (asv machine)")
            out[mdir.name] = mdir
    return out


def load_results(results_dir, machine: str | None = None, commit: str | None = None):
    """One row per (machine, commit, benchmark, parameter set), from one asv results
    directory or a list of them.

    Columns: machine, commit, date, benchmark, module, bench_type (time/track),
    unit, params (dict), value (asv's result: the median for times), best (the
    lowest sample, where asv recorded samples), failed, plus one column per parameter name
    (e.g. preset, kind = checkpoint kind, experts, strategy, backend, tokens). For each
    machine the newest run's results (by asv's ``started_at``) are kept, with the grouped
    suite's groups it did not run from their newest run (`_newest_runs`), unless `commit`
    (a hash prefix) picks one run.
    """
    import pandas as pd

    meta = {}
    for root in result_dirs(results_dir)[::-1]:  # the first directory's descriptions win
        # benchmarks.json, and beside it those of other machines' suites (benchmarks-h200.json)
        for described in sorted(root.glob("benchmarks*.json"), reverse=True):
            meta.update({k: v for k, v in _load_json(described).items() if isinstance(v, dict)})
    rows = []
    for name, mdir in sorted(machine_dirs(results_dir).items()):
        if machine and name != machine:
            continue
        for f in sorted(mdir.glob("*.json")):
            if f.name == "machine.json":
                continue
            data = _load_json(f)
            if "results" not in data or "commit_hash" not in data:
                continue
            if not isinstance(data["results"], dict) or not isinstance(data["commit_hash"], str):
                raise ValueError(f"{f}: not an asv result file ('results' is not a table of "
                                 "benchmarks, or 'commit_hash' not a string)")
            if commit and not data["commit_hash"].startswith(commit):
                continue
            cols = data.get("result_columns", ["result", "params"])
            started = [dict(zip(cols, e)).get("started_at") or 0 for e in data["results"].values()]
            run_at = max(started, default=0)
            for bench, entry in data["results"].items():
                rec = dict(zip(cols, entry))
                values = rec.get("result")
                params = [[_literal(v) for v in ps] for ps in (rec.get("params") or [])]
                info = meta.get(bench, {})
                names = info.get("param_names") or [f"p{i}" for i in range(len(params))]
                if not isinstance(values, list):
                    values = [values]
                samples = rec.get("samples") or [None] * len(values)
                bench, kind = _canonical(bench, info)
                for combo, value, smp in zip(_product(params), values, samples):
                    good = [x for x in smp or [] if x is not None and x == x]
                    row = {"machine": mdir.name, "commit": data["commit_hash"],
                           # the group process a grouped class's figures come from
                           "group": info.get("setup_cache_key") if bench.startswith("grouped.") else None,
                           "date": data.get("date"), "run_at": run_at, "file": f.name,
                           "benchmark": bench,
                           "module": bench.split(".", 1)[0],
                           "bench_type": kind,
                           "unit": "seconds" if kind == "time" else info.get("unit", ""),
                           "params": dict(zip(names, combo)),
                           "value": float("nan") if value is None else float(value),
                           "best": min(good) if good and value is not None else float("nan"),
                           "failed": value is None}
                    row.update(dict(zip(names, combo)))
                    rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    if not commit:
        df = _newest_runs(df)
    return _one_per_figure(df).reset_index(drop=True)


def _newest_runs(df):
    """Per machine the newest run and, if it is a run of some of the grouped suite's
    groups (`BENCH_GROUPS=io`), each group it did not run from that group's newest run:
    one group's figures are all from one run, and a group that ran replaces its older
    figures whole (a class it no longer measures is not brought back). A run is one
    results file; of runs started at the same time the last file name counts as newer."""
    keep = []
    for _, rows in df.groupby("machine"):
        last = _last_run(rows)
        keep.append(rows[rows["file"] == last])
        ran = set(keep[-1]["group"].dropna())
        if not ran:  # not a grouped run: nothing is added to it
            continue
        older = rows[rows["group"].notna() & ~rows["group"].isin(ran)]
        for _, group in older.groupby("group"):
            keep.append(group[group["file"] == _last_run(group)])
    return df.loc[sorted(i for part in keep for i in part.index)]


def _last_run(rows) -> str:
    return max(zip(rows["run_at"], rows["file"]))[1]


def bench_class(df):
    """The benchmark class of each row (``grouped.FullReload.time_reload``: FullReload)."""
    return df["benchmark"].str.split(".").str[-2]


def _canonical(bench: str, info: dict) -> tuple[str, str]:
    """(name, type) the report reads a benchmark as: `grouped`'s ``track_time_*`` (a time
    measured in its group's process, the best sample) is the ``time_*`` of its class."""
    head, _, method = bench.rpartition(".")
    if method.startswith("track_time_"):
        return f"{head}.{method[len('track_'):]}", "time"
    return bench, info.get("type") or method.split("_", 1)[0]


def _one_per_figure(df):
    """Where a run has a figure from both the per-process and the grouped benchmarks
    (a CPU run of the whole suite), the per-process one: one row per figure."""
    grouped = df["module"] == "grouped"
    if not grouped.any() or grouped.all():
        return df
    key = df["benchmark"].str.split(".", n=1).str[1] + df["params"].map(lambda p: repr(sorted(p.items())))
    have = set((df["machine"] + key)[~grouped & df["value"].notna()])
    return df[~(grouped & (df["machine"] + key).isin(have))]


def machine_info(results_dir, machine: str) -> dict:
    path = machine_dirs(results_dir).get(machine, Path(machine)) / "machine.json"
    if not path.exists():
        return {"machine": machine}
    info = _load_json(path)
    return {k: info[k] for k in MACHINE_KEYS if k in info} | {
        k: v for k, v in info.items() if k not in MACHINE_KEYS and k != "version"}

