"""`fp8-reload regress BASE HEAD`: run the asv suite against two commits, fail on slowdowns.

Like ``asv continuous``, one benchmark suite (this checkout's ``benchmarks/``)
is run against the code of both commits; unlike it, nothing is built: each
commit is checked out into a temporary git worktree and the suite imports it
from there (``FP8_RELOAD_SRC``), in the Python that runs this command. That
works offline and on GPU hosts where building environments is not possible.

The comparison (`compare`) reads two asv result files and flags every
benchmark x parameter set whose value grew by at least `threshold` (asv
values are "lower is better": times, bytes, calc_diff). The statistic is the
best (minimum) sample when both files carry samples (`regress` runs asv with
``--record-samples``): noise on a shared machine only ever adds time, so the
minimum is the most stable estimate of what the code costs. `regress` runs
BASE and HEAD alternately in several rounds and fails only on a slowdown that
every round shows (`combine_rounds`), in ABBA order. Without samples
it is asv's median, and when both sides carry asv's 99% confidence interval
of the median a change must also be significant (the intervals do not
overlap). A benchmark that ran in BASE and fails in HEAD is a regression too;
skipped or unselected ones (NaN) are ignored.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .usage import UsageError, progress

DEFAULT_THRESHOLD = 0.10


@dataclass
class Change:
    benchmark: str
    params: tuple
    base: float | None
    head: float | None
    unit: str
    significant: bool | None  # None: no confidence intervals to judge by
    status: str  # "slower" | "faster" | "same" | "failed" | "fixed" | "n/a"
    statistic: str = "median"  # or "min" (best sample)
    round_ratios: tuple = ()  # one HEAD/BASE ratio per interleaved round (`combine_rounds`)

    @property
    def ratio(self) -> float | None:
        if self.base is None or self.head is None:
            return None
        if self.base == 0:
            return 1.0 if self.head == 0 else math.inf
        return self.head / self.base

    @property
    def regression(self) -> bool:
        return self.status in ("slower", "failed")

    @property
    def name(self) -> str:
        return f"{self.benchmark}({', '.join(map(str, self.params))})" if self.params else self.benchmark


@dataclass
class _Entry:
    value: float | None  # None: failed; NaN: skipped or not selected
    ci_low: float | None = None
    ci_high: float | None = None
    samples: list | None = None


def _entries(path) -> dict[tuple[str, tuple], _Entry]:
    """(benchmark, params) -> _Entry, one per parameter combination of each benchmark."""
    import itertools

    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("results", {}), dict):
        raise ValueError(f"{path}: no table of benchmark results")
    cols = data.get("result_columns", ["result", "params"])
    out = {}
    for bench, entry in data.get("results", {}).items():
        rec = dict(zip(cols, entry))
        values = rec.get("result")
        if not isinstance(values, list):
            values = [values]
        params = rec.get("params") or []
        combos = list(itertools.product(*params)) if params else [()]
        n = len(combos)
        lo = rec.get("stats_ci_99_a") or [None] * n
        hi = rec.get("stats_ci_99_b") or [None] * n
        samples = rec.get("samples") or [None] * n
        for combo, v, a, b, smp in zip(combos, values, lo, hi, samples):
            out[(bench, tuple(combo))] = _Entry(v, a, b, smp)
    return out


def _units(path) -> dict[str, str]:
    """Units from the benchmarks.json beside the machine directory, if there is one."""
    meta = Path(path).parent.parent / "benchmarks.json"
    if not meta.exists():
        return {}
    with open(meta) as f:
        data = json.load(f)
    return {k: v.get("unit", "") for k, v in data.items() if isinstance(v, dict)}


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _ci_known(a, b) -> bool:
    return _finite(a) and _finite(b) and not math.isinf(a) and not math.isinf(b)


def _best(samples) -> float | None:
    vals = [x for x in samples or [] if _finite(x)]
    return min(vals) if vals else None


def compare(base_file, head_file, threshold: float = DEFAULT_THRESHOLD) -> list[Change]:
    """Every benchmark x parameter set that ran in at least one of the two files, classified."""
    base, head = _entries(base_file), _entries(head_file)
    units = {**_units(base_file), **_units(head_file)}
    changes = []
    for key in sorted(set(base) & set(head)):
        b, h = base[key], head[key]
        if not (_finite(b.value) or _finite(h.value)):
            continue  # skipped, failed or not selected on both sides
        unit = units.get(key[0], "seconds" if ".time_" in key[0] else "")
        params = tuple(str(p).strip("'") for p in key[1])
        bv, hv, sig, stat = b.value, h.value, None, "median"
        if h.value is None:
            status = "failed"
        elif b.value is None:
            status = "fixed"
        elif not (_finite(b.value) and _finite(h.value)):
            status = "n/a"  # skipped on one side
        else:
            if _best(b.samples) is not None and _best(h.samples) is not None:
                bv, hv, stat = _best(b.samples), _best(h.samples), "min"
            elif _ci_known(b.ci_low, b.ci_high) and _ci_known(h.ci_low, h.ci_high):
                sig = h.ci_low > b.ci_high or h.ci_high < b.ci_low
            ratio = (1.0 if hv == 0 else math.inf) if bv == 0 else hv / bv
            if ratio >= 1 + threshold - 1e-12 and sig is not False:
                status = "slower"
            elif ratio <= 1 / (1 + threshold) and sig is not False:
                status = "faster"
            else:
                status = "same"
        changes.append(Change(key[0], params, bv if _finite(bv) else None,
                              hv if _finite(hv) else None, unit, sig, status, stat))
    return changes


def combine_rounds(rounds: list[list[Change]]) -> list[Change]:
    """One verdict from several interleaved BASE/HEAD rounds: "slower" (or "faster")
    only if every round says so, "failed" if any round failed. Machine load that
    comes and goes hits a single round; a real slowdown shows in all of them.
    Values reported: the best (lowest) of the rounds on each side."""
    by_key: dict[tuple, list[Change]] = {}
    for changes in rounds:
        for c in changes:
            by_key.setdefault((c.benchmark, c.params), []).append(c)
    out = []
    for (bench, params), cs in sorted(by_key.items()):
        statuses = {c.status for c in cs}
        if "failed" in statuses:
            status = "failed"
        elif len(cs) == len(rounds) and len(statuses) == 1:
            status = cs[0].status
        elif statuses <= {"slower", "faster", "same"}:
            status = "same"
        else:
            status = "n/a"
        bases = [c.base for c in cs if c.base is not None]
        heads = [c.head for c in cs if c.head is not None]
        sig = {c.significant for c in cs}
        out.append(Change(bench, params, min(bases) if bases else None, min(heads) if heads else None,
                          cs[0].unit, sig.pop() if len(sig) == 1 else None, status, cs[0].statistic,
                          tuple(c.ratio for c in cs)))
    return out


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "seconds":
        return f"{v * 1e3:.3f} ms"
    if unit == "bytes":
        return f"{v / 2**20:.2f} MiB"
    return f"{v:.4g}"


def format_changes(changes: list[Change], threshold: float, show_all: bool = False) -> str:
    rows = [c for c in changes if show_all or c.status != "same"]
    lines = [f"{'status':8s} {'ratio':>8s} {'base':>14s} {'head':>14s} {'stat':6s}  benchmark"]
    for c in sorted(rows, key=lambda c: (not c.regression, c.status, c.name)):
        ratio = "-" if c.ratio is None else f"{c.ratio:.3f}"
        sig = "" if c.significant is None else ("" if c.significant else " (not significant)")
        if len(c.round_ratios) > 1:
            sig += "  rounds: " + " ".join("-" if r is None else f"{r:.2f}" for r in c.round_ratios)
        lines.append(f"{c.status:8s} {ratio:>8s} {_fmt(c.base, c.unit):>14s} "
                     f"{_fmt(c.head, c.unit):>14s} {c.statistic:6s}  {c.name}{sig}")
    n_reg = sum(c.regression for c in changes)
    lines.append(f"{len(changes)} compared, {n_reg} regression(s) at a {threshold:.0%} threshold, "
                 f"{sum(c.status == 'faster' for c in changes)} faster")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Running the suite against a commit
# --------------------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _load_asv_conf(path: Path) -> dict:
    """asv.conf.json allows // comments (whole lines here)."""
    text = "\n".join(line for line in path.read_text().splitlines()
                     if not line.lstrip().startswith("//"))
    return json.loads(text)


def _machine_file(env: dict | None = None) -> Path:
    home = (env or os.environ).get("HOME") or os.path.expanduser("~")
    return Path(home) / ".asv-machine.json"


def _machine_name(explicit: str | None) -> str:
    if explicit:
        return explicit
    path = _machine_file()
    if path.exists():
        names = [k for k in json.loads(path.read_text()) if k != "version"]
        if len(names) == 1:
            return names[0]
    return "fp8-reload-regress"


def ensure_machine(name: str, env: dict | None = None, **extra) -> dict:
    """Make sure asv knows machine `name` (``~/.asv-machine.json``); returns its info.

    A new entry gets asv's detected defaults (os, arch, cpu, num_cpu, ram) plus
    `extra` (e.g. gpu="NVIDIA H200", torch="2.11.0"): asv copies every key into
    the results' machine.json, which `fp8-reload report` prints.
    """
    from asv.machine import Machine

    path = _machine_file(env)
    known = json.loads(path.read_text()) if path.exists() else {"version": 1}
    info = known.get(name) or {**Machine.get_defaults(), "machine": name}
    info.update({k: str(v) for k, v in extra.items()})
    known[name] = info
    path.write_text(json.dumps(known, indent=4))
    return info


def asv_run(repo: Path, sha: str, src: Path, work: Path, bench: list[str], quick: bool,
            launch_method: str, machine: str, extra: list[str], env: dict | None = None,
            log=print) -> Path:
    """`asv run` of `repo`'s suite against the code in `src`, recorded as commit `sha`,
    results under `work`; returns asv's result file."""
    conf = _load_asv_conf(repo / "asv.conf.json")
    results = work / "results"
    conf.update(repo=str(repo), benchmark_dir=str(repo / conf.get("benchmark_dir", "benchmarks")),
                results_dir=str(results), html_dir=str(work / "html"), env_dir=str(work / "env"))
    conf_path = work / "asv.conf.json"
    conf_path.write_text(json.dumps(conf, indent=1))
    cmd = [sys.executable, "-m", "asv", "run", "--config", str(conf_path), "--python=same",
           "--set-commit-hash", sha, "--machine", machine, "--launch-method", launch_method]
    for b in bench:
        cmd += ["--bench", b]
    cmd.append("--quick" if quick else "--record-samples")
    cmd += extra
    run_env = dict(env or os.environ, FP8_RELOAD_SRC=str(src))
    log(f"[regress] {sha[:12]} from {src}: asv {' '.join(cmd[3:])}")
    proc = subprocess.run(cmd, cwd=repo, env=run_env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"asv run for {sha[:12]} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    found = sorted((results / machine).glob(f"{sha[:8]}-*.json"))
    if not found:
        raise RuntimeError(f"asv wrote no results for {sha[:12]} under {results / machine}:\n"
                           f"{proc.stdout[-3000:]}")
    return found[-1]


def checkout(repo: Path, commit: str, work: Path) -> tuple[str, Path]:
    """(full sha, a detached worktree of it under `work`)."""
    sha = _git(repo, "rev-parse", f"{commit}^{{commit}}")
    src = work / f"src-{sha[:12]}"
    if not src.exists():
        _git(repo, "worktree", "add", "--detach", str(src), sha)
    return sha, src


def regress(base: str, head: str, repo=".", bench: list[str] | None = None,
            threshold: float = DEFAULT_THRESHOLD, quick: bool = False,
            launch_method: str = "spawn", machine: str | None = None,
            extra: list[str] | None = None, keep: Path | None = None, rounds: int = 3,
            log=print, progress=progress) -> int:
    """Run the suite against BASE and HEAD, print the comparison; 1 on a regression.

    The runs come in `rounds` pairs in ABBA order (BASE HEAD, HEAD BASE, ...),
    each pair compared on its own (`combine_rounds`): load that comes and goes,
    or an advantage of running first, cannot fake or hide a slowdown. `progress`
    gets a line before and after each side of each round (a side takes about half a
    minute on a CPU box); `log` the comparison.
    """
    try:
        repo = Path(_git(Path(repo), "rev-parse", "--show-toplevel"))
    except subprocess.CalledProcessError:
        raise UsageError(f"{Path(repo).resolve()} is not inside a git repository") from None
    for commit in (base, head):
        try:
            _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            raise UsageError(f"{commit!r} is not a commit of {repo}") from None
    machine = _machine_name(machine)
    ensure_machine(machine)
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="fp8-reload-regress-"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = 1 if quick else max(1, rounds)
    try:
        sides = []
        for label, commit in (("base", base), ("head", head)):
            sha, src = checkout(repo, commit, work)
            progress(f"[regress] {label} {commit} = {sha[:12]}")
            sides.append((sha, src, label))
        per_round = []
        for r in range(rounds):
            files = {}
            # ABBA order: whatever favours the first (or second) run of a pair
            # favours BASE in one round and HEAD in the next, and cancels out
            for sha, src, label in (sides if r % 2 == 0 else sides[::-1]):
                out = work / f"round{r}" / label
                out.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                progress(f"[regress] round {r + 1}/{rounds}: {label} ({sha[:12]}) running")
                files[label] = asv_run(repo, sha, src, out, bench or [], quick, launch_method,
                                       machine, (extra or []) + ["-a", "rounds=1"], log=progress)
                progress(f"[regress] round {r + 1}/{rounds}: {label} done in "
                         f"{time.perf_counter() - t0:.0f} s")
            per_round.append(compare(files["base"], files["head"], threshold))
        changes = combine_rounds(per_round) if rounds > 1 else per_round[0]
        log(format_changes(changes, threshold))
        return _verdict(changes, "BASE and HEAD")
    finally:
        for src in work.glob("src-*"):
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(src)],
                           capture_output=True)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def regress_files(base_file, head_file, threshold: float = DEFAULT_THRESHOLD, show_all=False,
                  log=print) -> int:
    for f in (base_file, head_file):
        if not Path(f).is_file():
            raise UsageError(f"{f}: no such asv result file")
    try:
        changes = compare(base_file, head_file, threshold)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{base_file}, {head_file}: not asv result files ({e})") from None
    log(format_changes(changes, threshold, show_all))
    return _verdict(changes, f"{base_file} and {head_file}")


def _verdict(changes: list[Change], sides: str) -> int:
    """1 on a regression, 0 when none; refused when nothing was compared (that is no pass)."""
    if not changes:
        raise UsageError(f"{sides} have no benchmark result in common: nothing was compared")
    return 1 if any(c.regression for c in changes) else 0


def command(args) -> int:
    """`fp8-reload regress`."""
    if args.files:
        return regress_files(args.base, args.head, args.threshold, show_all=args.all)
    return regress(args.base, args.head, bench=args.bench, threshold=args.threshold,
                   quick=args.quick, launch_method=args.launch_method, machine=args.machine,
                   extra=args.asv_args, keep=args.keep, rounds=args.rounds)
