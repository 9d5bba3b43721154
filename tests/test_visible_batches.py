"""The visible tests catch what the hidden ones catch at a batch above 1.

Each graded function with a batch axis has a mutant wrong only for B > 1 (``BATCH_MUTANTS`` in
``tests/mutants/<assignment>.py``). The release, filled with the solution and that one mutant, runs top
to bottom in a Jupyter kernel, as a student runs it, from its own folder (its ``expected.npz``): the
tests cells the mutant names must fail there, and the same notebook without the mutant fails none. The
kernel's Matplotlib backend is Agg, which renders a figure only when it is saved: no tests cell reads a
figure, and rendering ps1's and ps2's cost about half a second a run.
The cases of one assignment share its kernel (a kernel's start costs about a second); each case begins
with ``%reset -f``, which leaves no name of the case before, as a restart would.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager

from mha_lab.instructor.classroom import answer_cell, mutants, run_release

REPO = Path(__file__).resolve().parents[1]
# graded functions with no batch axis: they take a function, or a single array, not a batch of sequences
NO_BATCH = {"measure_peak", "numerical_gradient", "gradient_check", "ans_zigzag_chunks", "ans_ring_source"}
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


def batch_mutants(assignment: str) -> list:
    mutants(assignment)  # puts this clone's ``tests`` package on the path
    return getattr(importlib.import_module(f"tests.mutants.{assignment}"), "BATCH_MUTANTS", [])


@pytest.fixture(scope="module")
def kernels():
    """``kernel(assignment)``: that assignment's Jupyter kernel, started in its release folder on first use."""
    started: dict[str, KernelManager] = {}

    def kernel(assignment: str) -> KernelManager:
        if assignment not in started:
            started[assignment] = KernelManager(kernel_name="python3")
            started[assignment].start_kernel(cwd=str(REPO / "assignments" / assignment),
                                             env={**os.environ, "MPLBACKEND": "agg"})
        return started[assignment]

    yield kernel
    for km in started.values():
        km.shutdown_kernel(now=True)


def failing_cells(assignment: str, edits: dict[str, str], kernel: KernelManager) -> set[str]:
    """The grade_ids of the tests cells that raise when the filled release runs in ``kernel``."""
    nb = run_release(assignment, edits, kernel)
    return {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")
            and any(o.output_type == "error" for o in c.outputs)}


CASES = [(a, m) for a in ASSIGNMENTS for m in batch_mutants(a)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_every_graded_function_with_a_batch_has_a_batch_mutant(assignment, kernels):
    """The solution passes its visible tests; its batch mutants cover each graded function that has a batch."""
    failed = failing_cells(assignment, {}, kernels(assignment))
    assert failed == set(), f"{assignment}: the solution fails its own visible tests {sorted(failed)}"
    solution = nbformat.read(REPO / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    answers = {c.metadata["nbgrader"]["grade_id"] for c in solution.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    assert {m.grade_id for m in batch_mutants(assignment)} == answers - NO_BATCH


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("assignment", "mutant"), CASES, ids=[f"{a}-{m.name}" for a, m in CASES])
def test_a_bug_only_for_a_batch_fails_a_visible_test(assignment, mutant, kernels):
    solution = nbformat.read(REPO / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)
    failed = failing_cells(assignment, {mutant.grade_id: mutant.apply(answer_cell(solution, mutant.grade_id))},
                           kernels(assignment))
    assert failed == mutant.breaks, f"{mutant.name}: expected the visible tests {sorted(mutant.breaks)} to fail, " \
                                    f"{sorted(failed)} failed"
