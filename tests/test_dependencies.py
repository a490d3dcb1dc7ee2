"""pyproject.toml declares what the code imports.

Read from the source (`ast`), every import of a third-party package in `fp8_reload/` must be a
base dependency, or sit inside a function or a `try: ... except ImportError` and belong to an
extra (or to the host application the sglang patch patches); `tests/` and `benchmarks/` may
use the `test` extra as well. Then every module is imported in a fresh interpreter where the
packages outside the base install cannot be imported, as on a machine with only
`pip install fp8-reload`: only the modules that are an extra's (the Triton kernels) may fail,
and only for that extra. Triton is installed in CI (the `test` extra), so this blocks it
rather than relying on its absence.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Not ours to install: the server `fp8_reload.sglang_patch` patches in place.
HOST = {"sglang"}
# Packages that are an extra's by nature: their modules import its package at module level and
# are only ever imported on demand (the kernel registry imports a backend when asked for it,
# processing imports the Triton requantization only on a GPU).
EXTRA_PACKAGES = {"fp8_reload.kernels.triton": "gpu"}


def extra_of(module: str) -> str | None:
    return next((extra for pkg, extra in EXTRA_PACKAGES.items()
                 if module == pkg or module.startswith(pkg + ".")), None)


def _dist(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


BASE = {_dist(r) for r in PROJECT["dependencies"]}
EXTRAS = {name: {_dist(r) for r in reqs} for name, reqs in PROJECT["optional-dependencies"].items()}
_INSTALLED = {name: {d.lower().replace("_", "-") for d in dists}
              for name, dists in md.packages_distributions().items()}


# Import names whose distribution is named otherwise, for packages not installed here.
DISTRIBUTIONS = {"deep_gemm": {"sgl-deep-gemm"}}


def dists_of(import_name: str) -> set[str]:
    """Distributions that provide top-level package `import_name` (by its name if not installed)."""
    return (_INSTALLED.get(import_name) or DISTRIBUTIONS.get(import_name)
            or {import_name.lower().replace("_", "-")})


def _guarded(parents: list[ast.AST]) -> bool:
    for node in parents:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
        if isinstance(node, ast.Try):
            caught = [h.type for h in node.handlers]
            names = {n.id for t in caught if t is not None
                     for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & {"ImportError", "ModuleNotFoundError"}:
                return True
    return False


def third_party_imports(root: Path) -> list[tuple[str, str, int, bool]]:
    """(file, top-level package, line, guarded) for every non-stdlib, non-project import."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            chain, p = [], parents.get(node)
            while p is not None:
                chain.append(p)
                p = parents.get(p)
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("fp8_reload", "benchmarks", "tests"):
                    continue
                out.append((str(path.relative_to(root.parent)), top, node.lineno, _guarded(chain)))
    return out


def _module_of(file: str) -> str:
    parts = list(Path(file).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_reader_tells_import_time_from_deferred_and_guarded_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import os\nimport yaml.x\n"
        "def f():\n    import triton\n"
        "try:\n    import nvtx\nexcept ImportError:\n    nvtx = None\n"
        "try:\n    import zmq\nexcept ValueError:\n    pass\n")
    assert [(top, guarded) for _, top, _, guarded in third_party_imports(tmp_path / "pkg")] == \
        [("yaml", False), ("triton", True), ("nvtx", True), ("zmq", False)]


def test_the_package_imports_only_what_pyproject_declares():
    optional = set().union(*EXTRAS.values())
    bad = []
    for file, top, line, guarded in third_party_imports(REPO / "fp8_reload"):
        dists = dists_of(top)
        if dists & BASE or top in HOST:
            continue
        extra = extra_of(_module_of(file))
        if extra is not None and dists & EXTRAS[extra]:
            continue  # an extra's own module
        if not guarded:
            bad.append(f"{file}:{line}: `{top}` at import time, but it is no base dependency")
        elif not dists & optional:
            bad.append(f"{file}:{line}: `{top}` is in no extra of pyproject.toml")
    assert not bad, "\n".join(bad)


def test_tests_and_benchmarks_need_only_the_test_extra():
    """At import time the base install and the test extra; inside a function or a guard (a
    skip when the package is missing) any extra."""
    allowed = BASE | EXTRAS["test"]
    optional = set().union(*EXTRAS.values())
    found = [i for root in ("tests", "benchmarks") for i in third_party_imports(REPO / root)]
    bad = [f"{file}:{line}: `{top}`" for file, top, line, guarded in found
           if not dists_of(top) & (allowed | (optional if guarded else set()))]
    assert not bad, "not in the base install nor the test extra:\n" + "\n".join(bad)


def test_the_extras_name_real_import_paths():
    assert EXTRAS["gpu"] >= {"triton"} and {"instanttensor", "fastsafetensors"} <= EXTRAS["io"]
    assert "torch" not in set().union(*EXTRAS.values())  # torch: the host's own build
    assert not any("==" in r for r in PROJECT["dependencies"])


BLOCKER = """
import importlib, importlib.abc, json, sys
BLOCKED = set(sys.argv[1].split(","))

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the base install)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
failed = {}
for name in sys.argv[2].split(","):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        failed[name] = e.name.split(".")[0]
print(json.dumps(failed))
"""


def test_every_module_imports_with_only_the_base_install():
    imported = {top for _, top, _, _ in third_party_imports(REPO / "fp8_reload")}
    blocked = {top for top in imported if not dists_of(top) & BASE}
    blocked |= {"pytest", "hypothesis", "_pytest"}
    assert "triton" in blocked and "torch" not in blocked
    # every module by its file (a package that fails would hide its submodules from a walk);
    # not the __main__ entry points, which run a command when imported
    modules = sorted(_module_of(str(p.relative_to(REPO))) for p in (REPO / "fp8_reload").rglob("*.py")
                     if p.stem != "__main__")
    res = subprocess.run([sys.executable, "-c", BLOCKER, ",".join(sorted(blocked)), ",".join(modules)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(failed) == {m for m in modules if extra_of(m)}, failed
    for module, missing in failed.items():
        assert dists_of(missing) & EXTRAS[extra_of(module)], (module, missing)
