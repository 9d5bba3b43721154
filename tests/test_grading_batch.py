"""The batch grader (``make grade``) on a small course: broken submissions do not stop the batch.

One tiny assignment, ``demo`` (3 points), graded with the real nbgrader and the real sandbox: a
good submission, a corrupt notebook, a missing notebook, a function that hangs, a process that
exits, a notebook that rigs its own kernel (nothing it does there reaches the judge), and two
whose grading process dies, once and always.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from mha_lab.grading import batch, sandbox
from mha_lab.grading import course as courses
from mha_lab.grading.judge import HIDDEN_DIR_ENV
from mha_lab.instructor import grade as cli
from mha_lab.instructor import gradesheet, term

REPO = Path(__file__).resolve().parents[1]

HIDDEN = '''
import os
import signal
from pathlib import Path

import numpy as np
from mha_lab.grading import checks


def _defines(student, name):
    try:
        return checks.call(student, name) is True
    except AssertionError:
        return False


def _grader_dies(student):
    """This course's stand-in for a Dask worker that dies while it grades (the OOM killer, a lost node). Only a
    student who asks for it needs MHA_LAB_HIDDEN_DIR on the worker: a class with no such student can be graded
    on a cluster started for other courses (the tests' shared grading_cluster)."""
    always, once = _defines(student, "grader_dies_always"), _defines(student, "grader_dies_once")
    if not (always or once):
        return
    first = Path(os.environ["MHA_LAB_HIDDEN_DIR"], "died_once")  # the checks travel to each worker as text
    if always or not first.exists():
        first.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def test_double_values(student):
    x = np.random.default_rng(0).normal(size=(3, 4))

    out = checks.call(student, "double", x)

    checks.expect_array(out, what="double(x)", shape=(3, 4))
    checks.expect_close(out, 2 * x, what="double(x)", hint="multiply by 2")


def test_double_int(student):
    _grader_dies(student)
    out = checks.call(student, "double", 21)

    checks.expect_true(out == 42, what=f"double(21) gave {out!r}", hint="multiply by 2")
'''

ANSWER = "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"


def _cell(source: str, grade_id: str, **meta) -> nbformat.NotebookNode:
    cell = new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": False, "solution": False, "locked": False, "grade_id": grade_id,
                                 "schema_version": 3, **meta}
    cell["id"] = grade_id
    return cell


def _tests(grade_id: str, points: int, visible: str) -> nbformat.NotebookNode:
    hidden = f'### BEGIN HIDDEN TESTS\nfrom mha_lab.grading import run_hidden_checks\n' \
             f'run_hidden_checks("demo", "{grade_id}", globals())\n### END HIDDEN TESTS'
    return _cell(f"{visible}\n{hidden}", grade_id, grade=True, locked=True, points=points)


def source_notebook() -> nbformat.NotebookNode:
    nb = new_notebook(cells=[
        _cell("import numpy as np", "imports", locked=True),
        _cell(ANSWER, "ans_double", solution=True),
        _tests("double_values", 2, "assert double(1) == 2"),
        _tests("double_int", 1, "assert double(0) == 0"),
    ])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return nb


SUBMISSIONS = {
    "good": "def double(x):\n    return 2 * x",
    "hangs": "import time\ndef double(x):\n    while True:\n        time.sleep(1)",  # idle: the deadline is wall time
    "crashes": "import os\nos._exit(1)",
    "grader_dies_once": "def double(x):\n    return 2 * x\ndef grader_dies_once():\n    return True",
    "grader_dies_always": "def double(x):\n    return 2 * x\ndef grader_dies_always():\n    return True",
    "cheats": textwrap.dedent("""
        np.allclose = np.array_equal = lambda *args, **kwargs: True  # in the sandbox only
        np.testing.assert_allclose = lambda *args, **kwargs: None

        def double(x):
            return 2 * x if np.ndim(x) == 0 and x in (0, 1) else x  # right on the visible asserts only
    """).strip(),
}


SECONDS = 8  # per submission: the answers take milliseconds, a sandbox's start a second or more when loaded


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo_course")
    hidden = root / "hidden"
    hidden.mkdir()
    (hidden / "test_demo.py").write_text(HIDDEN)
    shutil.copy(REPO / "nbgrader_config.py", root)
    (root / "solutions" / "demo").mkdir(parents=True)
    nbformat.write(source_notebook(), root / "solutions" / "demo" / "demo.ipynb")
    release = courses.register(root, "demo")["demo.ipynb"]
    for student, answer in SUBMISSIONS.items():
        nb = nbformat.from_dict(release)
        next(c for c in nb.cells if c.get("id") == "ans_double").source = answer
        folder = root / "submitted" / student / "demo"
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "demo.ipynb")
    (root / "submitted" / "corrupt" / "demo").mkdir(parents=True)
    (root / "submitted" / "corrupt" / "demo" / "demo.ipynb").write_text('{"cells": [ this is not JSON')
    (root / "submitted" / "missing" / "demo").mkdir(parents=True)
    (root / "submitted" / "absent" / "another").mkdir(parents=True)  # a student who never submitted demo
    return root


@pytest.fixture(scope="module")
def graded(course: Path) -> dict[str, batch.StudentResult]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HIDDEN_DIR_ENV, str(course / "hidden"))
        results = batch.grade_class(course, "demo", students=sorted(set(SUBMISSIONS) | {"corrupt", "missing"}),
                                    jobs=2, limits=sandbox.Limits(seconds=SECONDS), progress=False)
    return {r.student: r for r in results}


@pytest.mark.slow
def test_good_submission_gets_full_marks(graded):
    good = graded["good"]
    assert (good.score, good.max_score, good.error) == (3, 3, "")
    assert set(good.timings) == {"queue", "run", "judge"} and all(t >= 0 for t in good.timings.values())


@pytest.mark.slow
def test_corrupt_and_missing_notebooks_are_recorded_not_fatal(graded):
    assert graded["corrupt"].score == 0 and "not a valid notebook" in graded["corrupt"].error
    missing = graded["missing"]
    assert missing.score == 0 and missing.error == "missing notebook demo.ipynb (found: no .ipynb file)"


@pytest.mark.slow
def test_hanging_function_runs_out_of_time_and_scores_nothing(graded):
    hangs = graded["hangs"]
    assert hangs.score == 0 and hangs.max_score == 3 and f"ran out of its {SECONDS} s" in hangs.error, hangs


@pytest.mark.slow
def test_exiting_process_is_recorded(graded):
    crashed = graded["crashes"]
    assert crashed.score == 0 and "exit code 1" in crashed.error, crashed


@pytest.mark.slow
def test_a_grading_process_that_dies_is_retried_once_then_recorded(graded):
    assert (graded["grader_dies_once"].score, graded["grader_dies_once"].error) == (3, "")
    lost = graded["grader_dies_always"]
    assert lost.score == 0 and "grading failed twice: KilledWorker" in lost.error, lost


@pytest.mark.slow
def test_a_rigged_kernel_does_not_reach_the_judge(graded):
    cheats = graded["cheats"]
    assert cheats.score == 0, gradesheet.summary_table([cheats])
    assert "double(x): values differ" in " ".join(c.message for c in cheats.cells)


@pytest.mark.slow
def test_summary_table_feedback_and_a_merged_csv(graded, course):
    results = [graded[s] for s in sorted(graded)]
    table = gradesheet.summary_table(results)
    assert "NOT GRADED: missing notebook demo.ipynb" in table
    assert table.split("cheats", 1)[1].splitlines()[0].split()[-1] == "all"  # every tests cell lost points
    out = course / "grades_demo.csv"
    gradesheet.write_csv(results, out, everyone=["absent", *graded])
    gradesheet.write_csv([graded["good"]], out)  # grading one student again keeps the others
    rows = {row["student"]: row for row in csv.DictReader(open(out))}
    assert float(rows["good"]["score"]) == 3 and rows["corrupt"]["error"].startswith("demo.ipynb is not a valid")
    assert rows["absent"]["error"] == "not submitted" and rows["absent"]["score"] == ""
    assert set(rows) == {"absent", *graded} and float(rows["good"]["run_s"]) > 0
    assert (course / "feedback" / "good" / "demo" / "demo.html").is_file()
    assert "values differ" in (course / "feedback" / "cheats" / "demo" / "demo.html").read_text()


def test_cli_refuses_without_a_sandbox_and_names_the_fix(course, monkeypatch, capsys):
    def no_sandbox():
        raise sandbox.SandboxError(f"no sandbox: bwrap was not found; {sandbox.FIX}")

    monkeypatch.setattr(sandbox, "check", no_sandbox)
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--course", str(course)])
    assert info.value.code == 1 and "apt-get install bubblewrap" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["nothing", "--course", str(course)])
    assert info.value.code == 2 and "no assignment 'nothing'" in capsys.readouterr().err


@pytest.mark.slow
def test_unsafe_mode_grades_unconfined_and_the_summary_says_so(course, monkeypatch, capsys, grading_cluster):
    monkeypatch.setenv(HIDDEN_DIR_ENV, str(course / "hidden"))
    args = ["demo", "--course", str(course), "--student", "good", "--unsafe-no-sandbox",
            "--scheduler", grading_cluster.scheduler.address]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^good\s+3\s+3\s+3\s*$", out, re.MULTILINE), out  # final, raw, max
    assert "WARNING: graded with --unsafe-no-sandbox" in out


def test_summary_fits_100_columns_and_says_where_the_whole_lists_are():
    """A long id and a long list of failed cells are cut to fit; the final score (after the penalty) leads."""
    cells = [batch.CellResult(f"a_rather_long_tests_cell_name_{i:02d}", float(i == 0), 1.0) for i in range(12)]
    long = batch.StudentResult("s" * 60, score=1.0, max_score=12.0, cells=cells, notebooks={"x.ipynb": {}})
    late = batch.StudentResult("late", score=10.0, max_score=12.0, cells=cells[:2], notebooks={"x.ipynb": {}})
    table = gradesheet.summary_table([long, late], late={"late": term.Late(seconds_late=86400.0, penalty=1.0)},
                                     details="grades_x.csv")
    assert max(len(line) for line in table.splitlines()) <= 100, table
    assert "every cell and message is in grades_x.csv" in table
    assert next(ln for ln in table.splitlines() if ln.startswith("late ")).split()[1:4] == ["9", "10", "12"]
    assert "mean final score of the graded 5.00 / 12" in table


def test_a_new_gradebook_is_stamped_with_nbgraders_revision_without_running_alembic(tmp_path, monkeypatch):
    """nbgrader stamps a gradebook it makes with the head of its migrations, which it asks its ``alembic`` script
    for; ``course.gradebook`` reads that head in this process. Bugs this catches: a stamp that is not nbgrader's
    head (a constant gone stale with an upgrade: nbgrader would then try to migrate the gradebook), and a
    gradebook still stamped by running ``alembic`` (1.2 s per new gradebook, and a failure where that script is
    not on PATH)."""
    asked = subprocess.run([sys.executable, "-c", "import nbgrader.api; print(nbgrader.api.get_alembic_version())"],
                           env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                           capture_output=True, text=True, check=True).stdout.strip()
    def run(args, *_, **__):
        raise AssertionError(f"the gradebook was stamped by running {args}")

    monkeypatch.setattr(subprocess, "check_output", run)  # what nbgrader.api calls
    with courses.gradebook(tmp_path) as gb:
        gb.add_assignment("hw")
    with sqlite3.connect(tmp_path / "gradebook.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(asked,)]
    assert re.fullmatch(r"[0-9a-f]{12}", asked), asked


def _environment_variable(name: str) -> str | None:
    return os.environ.get(name)  # run on a grading worker


@pytest.mark.timeout(120)
def test_workers_see_the_grading_processs_environment_as_it_is_when_they_start(monkeypatch, grading_cluster):
    """Grading workers are forked from a server started with the first class graded, which keeps the environment
    it had then. The bug this catches: a variable set afterwards (a course's hidden-checks folder, named by
    ``MHA_LAB_HIDDEN_DIR`` before the next class is graded) unseen by the next class's workers. The shared
    cluster's workers stand for the first class's: this process's server has run since it started."""
    grading_cluster.submit(_environment_variable, "PATH").result()
    monkeypatch.setenv("MHA_LAB_TEST_PROBE", "set after the first class")
    with batch.dask_client(1) as client:
        assert client.submit(_environment_variable, "MHA_LAB_TEST_PROBE").result() == "set after the first class"
