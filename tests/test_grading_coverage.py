"""Every graded tests cell is judged by hidden checks that cover its visible asserts.

The grader gives a tests cell its points only from the hidden checks of its group (the cell's
grade_id), so each group must exist, and must call every student function the cell's visible
asserts call: otherwise a property the student sees tested would go ungraded.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())
HIDDEN_CALL = re.compile(r'run_hidden_checks\("(\w+)", "(\w+)", globals\(\)\)')
CALLS = {"call": 1, "call_with_peak": 1, "call_replacing": 2}  # checks.<helper>: where the function's name is


def graded_cells(assignment: str) -> list[tuple[str, str, str]]:
    """(grade_id, visible source, hidden block) of each graded tests cell of the source notebook."""
    nb = nbformat.read(REPO / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    return [(c.metadata.nbgrader.grade_id, *c.source.partition("### BEGIN HIDDEN TESTS")[::2])
            for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]


def student_functions(assignment: str) -> set[str]:
    nb = nbformat.read(REPO / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    return {n.name for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")
            for n in ast.walk(ast.parse(c.source)) if isinstance(n, ast.FunctionDef)}


def functions_called(tree: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def judged_functions(assignment: str, group: str) -> set[str]:
    """The student functions the group's checks call (through ``checks.call...``), helpers followed."""
    tree = ast.parse((REPO / "tests" / "hidden" / f"test_{assignment}.py").read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    todo = [f for name, f in defs.items() if name == f"test_{group}" or name.startswith(f"test_{group}__")]
    assert todo, f"{assignment}: no hidden checks test_{group} or test_{group}__* in tests/hidden"
    judged, seen = set(), set()
    while todo:
        fn = todo.pop()
        seen.add(fn.name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS:
                arg = node.args[CALLS[node.func.attr]]
                judged |= {arg.value} if isinstance(arg, ast.Constant) else set()
        todo += [defs[n] for n in functions_called(fn) if n in defs and n not in seen]
    return judged


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_graded_cell_has_hidden_checks_covering_its_visible_asserts(assignment):
    answers = student_functions(assignment)
    for grade_id, visible, hidden in graded_cells(assignment):
        named = HIDDEN_CALL.findall(hidden)
        assert named == [(assignment, grade_id)], (
            f"{assignment}/{grade_id}: its hidden block must read run_hidden_checks({assignment!r}, {grade_id!r}, "
            f"globals()), found {named}")
        asserted = functions_called(ast.parse(visible)) & answers
        missing = asserted - judged_functions(assignment, grade_id)
        assert not missing, (f"{assignment}/{grade_id}: the visible asserts test {sorted(missing)}, which no "
                             f"hidden check of the group calls")
