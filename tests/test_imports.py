"""Imports point one way: no module of mha_lab takes part in an import cycle, and the layers of
DESIGN.md hold (cpu below everything; plots, grading, bench and the command line on top).

The graph is read from the source with ``ast``, function-level imports included, so a lazy
import cannot hide a cycle; imports under ``if TYPE_CHECKING:`` (annotations only) are left
out. An edge goes to the module an import names: ``from mha_lab.cpu import softmax`` depends
on ``mha_lab.cpu`` (its ``__init__``), ``from mha_lab.plots import bench`` on ``mha_lab.plots.bench``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mha_lab"

# (modules under this prefix, may not import modules under these prefixes, why)
LAYERS = [
    ("mha_lab.cpu", None, "the NumPy reference imports nothing of ours outside mha_lab.cpu (but BOTTOM)"),
    ("mha_lab.kv_cache", (), "the cache's bookkeeping needs nothing of ours"),
    ("mha_lab.measure", (), "measurement sits below everything that is measured or plotted"),
    ("mha_lab.analysis", (), "cost formulas need nothing of ours"),
    ("mha_lab.cuda", ("mha_lab.cpu", "mha_lab.plots", "mha_lab.grading", "mha_lab.bench", "mha_lab.parallel",
                      "mha_lab.model"), "cuda uses the NumPy reference in tests only, and nothing above it"),
    ("mha_lab.model", ("mha_lab.plots", "mha_lab.grading", "mha_lab.instructor", "mha_lab.bench"),
     "the course's model is built from cpu's and cuda's parts; the figures and grading sit above it"),
    ("mha_lab.plots", ("mha_lab.grading", "mha_lab.__main__"), "figures sit below grading and the command line"),
    ("mha_lab.grading", ("mha_lab.instructor",), "the grading engine imports nothing of the instructor's wing, "
     "which calls it"),
    ("mha_lab", ("mha_lab.__main__",), "nothing imports the command line"),
]
BOTTOM = ("mha_lab.kv_cache",)  # array-library-neutral code under both cpu and cuda
BELOW_PLOTS = ("mha_lab.cpu", "mha_lab.cuda", "mha_lab.analysis", "mha_lab.measure", "mha_lab.bench",
               "mha_lab.tables", "mha_lab.testing", "mha_lab.gradcheck", "mha_lab.parallel", "mha_lab.toy", *BOTTOM)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The mha_lab modules that ``name`` imports anywhere in its source (module or function level)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    annotations_only = type_checking_only(tree)
    for node in ast.walk(tree):
        if node in annotations_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" names the submodule when there is one, else the package itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import mha_lab.cpu.attention as x -> that module
                target = target.rpartition(".")[0]
            if target.startswith("mha_lab") and target != name:
                found.add(target)
    return found


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations only, never run."""
    return {inner for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_sees_function_level_and_from_package_imports():
    graph = import_graph()
    assert "mha_lab.cuda.flash" in graph["mha_lab.cuda"]  # imported inside __getattr__
    assert "mha_lab.cpu.functional" in graph["mha_lab.cpu.attention"]
    assert graph["mha_lab.measure"] == set()


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(("prefix", "forbidden", "why"), LAYERS, ids=[layer[0] for layer in LAYERS])
def test_imports_point_one_way(prefix, forbidden, why):
    bad = []
    for name, targets in import_graph().items():
        if not within(name, prefix):
            continue
        for target in targets:
            outside = forbidden is None and not within(target, prefix) and target not in BOTTOM
            if outside or forbidden == () or any(within(target, f) for f in forbidden or ()):
                bad.append(f"{name} imports {target}")
    assert not bad, f"{why}: " + "; ".join(sorted(bad))


def test_plots_and_grading_are_imported_by_nothing_below_them():
    bad = [f"{name} imports {target}" for name, targets in import_graph().items()
           if any(within(name, low) for low in BELOW_PLOTS)
           for target in targets if within(target, "mha_lab.plots") or within(target, "mha_lab.grading")]
    assert not bad, "plots and grading use cpu, cuda and analysis, never the reverse: " + "; ".join(bad)


def test_reading_a_notebook_builds_no_grammar():
    """The grader, each Dask worker and each command import nbformat, which imports jsonschema. From 4.25 on,
    jsonschema imports rfc3987-syntax where it is installed, which builds a Lark grammar: a second per process.
    The bug this catches: requirements.txt's jsonschema pin dropped or loosened."""
    import subprocess
    import sys

    code = "import sys, nbformat, jsonschema; print(sorted(m for m in ('lark', 'rfc3987_syntax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
