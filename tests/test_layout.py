"""The shape of the package: imports run down the tree, no cycles, no private names across
modules, no module over 400 lines.

Imports are read from the source with `ast`, wherever they stand (module level or
inside a function), so a cycle hidden behind a deferred import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8_reload"

# Top-level units from the bottom of the tree up: a unit may import only units below it.
ORDER = ["version", "errors", "knobs", "config", "quant", "trace", "interrupts", "locks", "device",
         "kernels", "layers", "checkpoint", "state", "processing", "reload", "expert_parallel",
         "sglang_patch", "testing", "tools", "__init__", "__main__"]
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported fp8_reload module, names taken from it, line) for every import in `module`."""
    path = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("fp8_reload")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            if not target.startswith("fp8_reload"):
                continue
            plain = []
            for a in node.names:  # `from . import trace` imports the submodule
                if f"{target}.{a.name}" in MODULES:
                    out.append((f"{target}.{a.name}", [], node.lineno))
                else:
                    plain.append(a.name)
            if plain:
                out.append((target, plain, node.lineno))
    return [(t, names, line) for t, names, line in out if t in MODULES]


GRAPH = {m: sorted({t for t, _, _ in imports(m)}) for m in MODULES}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_place_in_the_order():
    units = {_unit(m) for m in MODULES}
    assert units <= set(ORDER), f"units not in ORDER: {sorted(units - set(ORDER))}"


def test_imports_run_down_the_tree():
    rank = {u: i for i, u in enumerate(ORDER)}
    bad = [f"{m} imports {t} ({_unit(m)} may only import units below it)"
           for m, targets in GRAPH.items() for t in targets
           if _unit(t) != _unit(m) and rank[_unit(t)] >= rank[_unit(m)]]
    assert not bad, "\n".join(bad)


def test_nothing_outside_tools_imports_tools():
    bad = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
           if _unit(t) == "tools" and _unit(m) not in ("tools", "__main__")]
    assert not bad, "\n".join(bad)


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for t in graph.get(m, []):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle_counting_deferred_imports():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = dict(GRAPH)
    graph["fp8_reload.quant"] = GRAPH["fp8_reload.quant"] + ["fp8_reload.layers"]
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and "fp8_reload.quant" in cycle


def test_no_module_imports_another_modules_private_names():
    bad = []
    for m in MODULES:
        for target, names, line in imports(m):
            bad += [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} takes {n} from {target}"
                    for n in names if n.startswith("_") and not n.startswith("__") and target != m]
        # `module._name` on a module bound by an import
        tree = ast.parse(MODULES[m].read_text())
        bound = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(m, MODULES[m].name == "__init__.py", node)
                bound |= {a.asname or a.name for a in node.names if f"{target}.{a.name}" in MODULES}
            elif isinstance(node, ast.Import):
                bound |= {a.asname for a in node.names if a.asname and a.name.startswith("fp8_reload")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{MODULES[m].relative_to(PACKAGE.parent)}:{node.lineno} uses "
                           f"{node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[module]}: {n} lines (split it along its seams)"
