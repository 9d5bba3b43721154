"""Every committed release in ``assignments/`` is what ``make assignments`` makes of its source now, and needs
only the student's environment."""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest

from mha_lab.grading import course as courses
from mha_lab.instructor import release_values

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
    for a in ASSIGNMENTS:  # nbgrader's GenerateAssignment, as `nbgrader generate_assignment a --force` runs it
        failed = courses.convert(course, "GenerateAssignment", a)
        assert not failed, f"generate_assignment {a} failed:\n{failed[-2000:]}"
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


def test_read_first_links_point_to_the_published_book():
    """Links that work in a downloaded or Colab notebook: the site's address, a real page, a real label."""
    base = re.search(r"^  baseurl: (\S+)$", (REPO / "_config.yml").read_text(), re.M)
    assert base, "_config.yml has no html.baseurl: the notebooks' links need the published site's address"
    checked = 0
    for a in ASSIGNMENTS:
        text = "\n".join(src for kind, src, _ in cells(REPO / "assignments" / a / f"{a}.ipynb") if kind == "markdown")
        assert "_build/" not in text, f"{a} links the book in a local _build/, which a student does not have"
        for url in re.findall(r"\]\((https?://[^)\s]+)\)", text):
            if "nbgrader.readthedocs.io" in url:
                continue
            assert url.startswith(base[1]), f"{a} links {url}, not the published book at {base[1]}"
            page, _, label = url.removeprefix(base[1]).partition("#")
            source = REPO / page.replace(".html", ".md")
            assert source.is_file(), f"{a} links {url}: no chapter {source.relative_to(REPO)}"
            assert not label or f"({label})=" in source.read_text(), f"{a} links {url}: no label {label}"
            checked += 1
    assert checked >= len(ASSIGNMENTS), "every assignment links the chapters to read first"


STUDENT_ENVIRONMENT = {"numpy", "matplotlib"}  # assignments/requirements.txt, with the standard library


def test_releases_need_only_the_students_environment():
    """Every import of a release is the standard library's, NumPy's or matplotlib's."""
    for a in ASSIGNMENTS:
        for kind, source, _ in cells(REPO / "assignments" / a / f"{a}.ipynb"):
            if kind != "code":
                continue
            for node in ast.walk(ast.parse(source)):
                names = [n.name for n in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for top in (n.split(".")[0] for n in names):
                    assert top in sys.stdlib_module_names or top in STUDENT_ENVIRONMENT, f"{a} imports {top}"


def test_the_given_cells_compute_no_graded_piece():
    """What a release gives (its locked code cells) defines none of the functions the student writes."""
    for a in ASSIGNMENTS:
        release = cells(REPO / "assignments" / a / f"{a}.ipynb")
        answers = {m.group(1) for _, src, meta in release if meta.get("solution")
                   for m in re.finditer(r"^def (\w+)", src, re.M)}
        given = {node.name for kind, src, meta in release if kind == "code" and not meta.get("solution")
                 for node in ast.walk(ast.parse(src)) if isinstance(node, ast.FunctionDef)}
        assert answers and not answers & given, f"{a} gives {answers & given}"


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_expected_values_are_what_the_reference_computes_now(assignment):
    fresh = release_values.VALUES[assignment]()
    for folder in ("solutions", "assignments"):
        with np.load(REPO / folder / assignment / release_values.FILENAME, allow_pickle=False) as stored:
            assert sorted(stored) == sorted(fresh), f"{folder}/{assignment}: run `make assignments A={assignment}`"
            for name, value in fresh.items():  # a peak too: whole 64 KiB blocks of its arrays
                np.testing.assert_allclose(stored[name], value, rtol=1e-12, atol=1e-14,  # another BLAS's rounding
                                           err_msg=f"{folder}/{assignment}: {name}")


def test_release_values_write_the_same_bytes_every_time(tmp_path):
    """``make assignments`` leaves ``git status`` clean when nothing changed."""
    (tmp_path / "solutions" / "ps3_memory_efficient").mkdir(parents=True)
    written = []
    for _ in range(2):
        release_values.main(["ps3_memory_efficient", "--course", str(tmp_path)])
        written.append((tmp_path / "solutions" / "ps3_memory_efficient" / release_values.FILENAME).read_bytes())
    assert written[0] == written[1]
