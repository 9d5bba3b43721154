"""What a student of ps5_decoding sees: the task states what is graded, and the visible tests name each fault in the
task it belongs to. Every release's tests cells end with the line that says they passed."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager

from mha_lab.instructor.classroom import answer_cell, mutants, run_release

REPO = Path(__file__).resolve().parents[1]
A = "ps5_decoding"
PASSED = 'print("all visible tests passed (the hidden checks run when graded)")'
PAGED = ("paged_decode_cache", "paged_decode_values", "paged_decode_sequence")


def visible_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")
            and not c.metadata["nbgrader"].get("solution")]


@pytest.mark.parametrize("assignment", sorted(p.name for p in (REPO / "assignments").iterdir() if p.is_dir()))
def test_every_visible_tests_cell_says_when_it_passed(assignment):
    nb = nbformat.read(REPO / "assignments" / assignment / f"{assignment}.ipynb", as_version=4)
    silent = [c.metadata["nbgrader"]["grade_id"] for c in visible_cells(nb)
              if c.source.rstrip().splitlines()[-1] != PASSED]
    assert not silent, f"{assignment}: tests cells that print nothing when they pass: {silent}"


def test_the_task_states_the_scale_the_reference_rope_and_what_positions_may_be():
    nb = nbformat.read(REPO / "assignments" / A / f"{A}.ipynb", as_version=4)
    text = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}
    assert "1/sqrt(d_k)" in text["task2"] and "reference `rope` in\nplace of yours" in text["task2"]
    assert "a list or a 1-D array" in text["task1"] and "p = positions[n]" in text["task1"]
    assert "positions[p]" not in text["ans_rope"], "the docstring's p must be a position, as in the task"


def run(edits: dict[str, str], km: KernelManager) -> dict[str, str]:
    """grade_id -> what each tests cell showed (its error, else its printed text) when the release, filled with the
    solution and ``edits``, runs in ``km`` from its own folder."""
    nb = run_release(A, edits, km)
    return {c.metadata["nbgrader"]["grade_id"]: "".join(o.get("evalue", "") or o.get("text", "") for o in c.outputs)
            for c in visible_cells(nb)}


@pytest.fixture(scope="module")
def kernel():
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(REPO / "assignments" / A))
    yield km
    km.shutdown_kernel(now=True)


def mutant(name: str) -> dict[str, str]:
    m = next(m for m in mutants(A) if m.name == name)
    solution = nbformat.read(REPO / "solutions" / A / f"{A}.ipynb", as_version=4)
    return {m.grade_id: m.apply(answer_cell(solution, m.grade_id))}


@pytest.mark.timeout(120)
def test_visible_tests_tell_a_rope_fault_from_a_paged_one_and_name_the_scale(kernel):
    shown = run({}, kernel)
    assert all(s.strip() == "all visible tests passed (the hidden checks run when graded)" for s in shown.values()), \
        shown
    rope_sign = run(mutant("rope: turns the wrong way"), kernel)
    assert "fix task 1 first" not in rope_sign["rope_values"] and "differs" in rope_sign["rope_values"]
    for cell in PAGED:
        assert rope_sign[cell].startswith("fix task 1 first"), (cell, rope_sign[cell])
    as_list = run(mutant("rope: positions indexed as an array"), kernel)
    for cell in PAGED:
        assert re.match(r"fix task 1 first: rope raised \w+ for positions as a list", as_list[cell]), as_list[cell]
    unscaled = run(mutant("paged: scores not scaled by 1/sqrt(d_k)"), kernel)
    for cell in PAGED[1:]:
        assert "not scaled" in unscaled[cell] and "sqrt(d_k)" in unscaled[cell], (cell, unscaled[cell])
    assert "passed" in unscaled["paged_decode_cache"], "the cache holds no scores: its test must pass"
