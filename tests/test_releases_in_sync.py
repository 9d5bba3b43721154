"""Every committed release in ``assignments/`` is what ``make assignments`` makes of its source now."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from mha_lab.grading import course as courses

REPO = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


def cells(path: Path) -> list[tuple[str, str, dict]]:
    """What a student sees and nbgrader checks: each cell's type, source and nbgrader metadata."""
    nb = nbformat.read(path, as_version=4)
    return [(c.cell_type, c.source, dict(c.metadata.get("nbgrader", {}))) for c in nb.cells]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    course = tmp_path_factory.mktemp("regenerate")
    shutil.copy(REPO / "nbgrader_config.py", course)
    shutil.copytree(REPO / "solutions", course / "solutions")
    for a in ASSIGNMENTS:
        proc = courses.nbgrader(course, "generate_assignment", a, "--force", timeout=300)
        assert proc.returncode == 0, f"generate_assignment {a} failed:\n{proc.stderr[-2000:]}"
    return course


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_matches_its_source(regenerated, assignment):
    fresh = sorted((regenerated / "assignments" / assignment).glob("*.ipynb"))
    committed = sorted((REPO / "assignments" / assignment).glob("*.ipynb"))
    assert [p.name for p in committed] == [p.name for p in fresh], (
        f"assignments/{assignment} does not hold the notebooks its source makes: run `make assignments A={assignment}`")
    for new, old in zip(fresh, committed, strict=True):
        assert cells(old) == cells(new), (
            f"assignments/{assignment}/{old.name} is out of date with its source: "
            f"run `make assignments A={assignment}`")


def test_every_release_stubs_name_their_task():
    for a in ASSIGNMENTS:
        text = "".join(p.read_text() for p in (REPO / "assignments" / a).glob("*.ipynb"))
        assert f'raise NotImplementedError(\\"{a} task 1: ' in text, f"{a}: stubs do not name their task"
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, f"{a}: the release leaks answers"
