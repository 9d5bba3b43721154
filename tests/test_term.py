"""A term on a small course: submission times, a due date, an extension and late penalties, the nbgrader way.

The ``demo`` assignment of ``test_grading_batch`` (3 points), due 2026-11-20 17:00 UTC, a penalty of a
tenth of the score per started day late (at most half), and a class: on time, 26 h late, late past an
extension, no timestamp, failing one cell, a notebook under another name, two notebooks under other
names, and a student with no submission. Graded with the real command; then read back through
``nbgrader export``, formgrader's API and ``nbgrader autograde`` on a hostile submission.
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from nbgrader.apps import NbGraderAPI
from nbgrader.coursedir import CourseDirectory
from test_grading_batch import HIDDEN, source_notebook
from traitlets.config.loader import PyFileConfigLoader

from mha_lab.__main__ import main as cli_main
from mha_lab.grading import course as courses
from mha_lab.grading.judge import HIDDEN_DIR_ENV
from mha_lab.instructor import grade as cli
from mha_lab.instructor import lms, term

REPO = Path(__file__).resolve().parents[1]
DUE = "2026-11-20 17:00:00 UTC"
GOOD = "def double(x):\n    return 2 * x"
HALF = "def double(x):\n    return 2 * x if np.ndim(x) else 0"  # loses double_int only
VISIBLE = "def double(x):\n    return 3 if np.ndim(x) == 0 and x == 1 else 2 * x"  # fails a visible assert only
CLASS = {  # student -> (answer, timestamp.txt as nbgrader collect writes it, or None)
    "ontime": (GOOD, "2026-11-20 16:00:00.000000 UTC"),
    "late": (GOOD, "2026-11-21 19:00:00.000000 UTC"),  # 26 h late, 2 started days: -0.6
    "extended": (GOOD, "2026-11-21 23:00:00.000000 UTC"),  # due 2026-11-21 17:00 for them: 6 h late, -0.3
    "notime": (GOOD, None),
    "half": (HALF, "2026-11-20 12:00:00.000000 UTC"),
    "renamed": (GOOD, "2026-11-20 12:00:00.000000 UTC"),  # as demo (1).ipynb
    "twofiles": (GOOD, "2026-11-20 12:00:00.000000 UTC"),  # as a.ipynb and b.ipynb: not graded
    "visible": (VISIBLE, "2026-11-20 12:00:00.000000 UTC"),
    "raises": ("def double(x):\n    return x.reshape(5)", "2026-11-20 12:00:00.000000 UTC"),
}
PENALTY = """
c.AssignLatePenalties.plugin_class = "mha_lab.instructor.term.PerDayPenalty"
c.PerDayPenalty.per_day = 0.1
"""


def _submit(root: Path, release: nbformat.NotebookNode, student: str, answer: str, names=("demo.ipynb",)) -> Path:
    nb = nbformat.from_dict(release)
    next(c for c in nb.cells if c.get("id") == "ans_double").source = answer
    folder = root / "submitted" / student / "demo"
    folder.mkdir(parents=True)
    for name in names:
        nbformat.write(nb, folder / name)
    return folder


@pytest.fixture(scope="module")
def term_course(tmp_path_factory: pytest.TempPathFactory, grading_cluster) -> tuple[Path, str]:
    """The course, graded by ``python -m mha_lab grade demo`` on the shared cluster; returns (root, printed
    summary)."""
    root = tmp_path_factory.mktemp("term_course")
    (root / "hidden").mkdir()
    (root / "hidden" / "test_demo.py").write_text(HIDDEN)
    (root / "nbgrader_config.py").write_text((REPO / "nbgrader_config.py").read_text() + PENALTY)
    (root / "solutions" / "demo").mkdir(parents=True)
    nbformat.write(source_notebook(), root / "solutions" / "demo" / "demo.ipynb")
    with courses.gradebook(root) as gb:  # what `nbgrader db assignment add demo --duedate DUE` does, in this process
        gb.update_or_create_assignment("demo", duedate=DUE)
    release = courses.register(root, "demo")["demo.ipynb"]
    names = {"renamed": ("demo (1).ipynb",), "twofiles": ("a.ipynb", "b.ipynb")}
    for student, (answer, stamp) in CLASS.items():
        folder = _submit(root, release, student, answer, names.get(student, ("demo.ipynb",)))
        if stamp:
            (folder / "timestamp.txt").write_text(stamp + "\n")
    (root / "submitted" / "absent" / "other").mkdir(parents=True)  # never submitted demo
    (root / term.EXTENSIONS).write_text("student,assignment,due\nextended,demo,2026-11-21 17:00:00 UTC\n")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv(HIDDEN_DIR_ENV, str(root / "hidden"))
        assert cli.main(["demo", "--course", str(root), "--scheduler", grading_cluster.scheduler.address,
                         "--timeout", "30"]) == 0
    return root, out.getvalue()


def _formgrader(root: Path) -> NbGraderAPI:
    """The API formgrader serves, configured as formgrader started in the course root is (nbgrader_config.py)."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    return NbGraderAPI(CourseDirectory(root=str(root), config=config), config=config)


def _rows(path: Path, key: str) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {row[key]: row for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def exported(term_course) -> Path:
    """The course's ``nbgrader export`` of the graded term, run once for the tests that read it."""
    root, _ = term_course
    export = root / "export.csv"
    proc = courses.nbgrader(root, "export", "--to", str(export))
    assert proc.returncode == 0, proc.stderr
    return export


@pytest.mark.slow
def test_scores_penalties_and_the_nbgrader_export_are_exact(term_course, exported):
    root, summary = term_course
    export = exported
    columns = ("duedate", "timestamp", "raw_score", "late_submission_penalty", "score", "max_score", "status")
    got = {s: tuple(row[c] for c in columns) for s, row in _rows(export, "student_id").items()}
    due = "2026-11-20 17:00:00"  # the registration kept the due date
    assert got == {
        "ontime": (due, "2026-11-20 16:00:00", "3.0", "0.0", "3.0", "3.0", "graded"),
        "late": (due, "2026-11-21 19:00:00", "3.0", "0.6", "2.4", "3.0", "graded"),
        "extended": (due, "2026-11-21 23:00:00", "3.0", "0.3", "2.7", "3.0", "graded"),
        "notime": (due, "", "3.0", "0.0", "3.0", "3.0", "graded"),
        "half": (due, "2026-11-20 12:00:00", "2.0", "0.0", "2.0", "3.0", "graded"),
        "renamed": (due, "2026-11-20 12:00:00", "3.0", "0.0", "3.0", "3.0", "graded"),
        "twofiles": (due, "2026-11-20 12:00:00", "", "", "", "3.0", "not graded"),
        "visible": (due, "2026-11-20 12:00:00", "3.0", "0.0", "3.0", "3.0", "graded"),
        "raises": (due, "2026-11-20 12:00:00", "0.0", "0.0", "0.0", "3.0", "graded"),
        "absent": (due, "", "", "", "", "3.0", "not submitted"),
    }, export.read_text()
    rows = _rows(root / "grades_demo.csv", "student")
    assert {s: (r["status"], r["seconds_late"], r["penalty"], r["final_score"]) for s, r in rows.items()} == {
        "absent": ("not submitted", "", "", ""), "ontime": ("graded", "0.0", "0", "3"),
        "late": ("graded", "93600.0", "0.6", "2.4"), "extended": ("graded", "21600.0", "0.3", "2.7"),
        "notime": ("graded", "0.0", "0", "3"), "half": ("graded", "0.0", "0", "2"),
        "renamed": ("graded", "0.0", "0", "3"), "twofiles": ("not graded", "", "", ""),
        "visible": ("graded", "0.0", "0", "3"), "raises": ("graded", "0.0", "0", "0"),
    }
    assert rows["renamed"]["note"] == "graded demo (1).ipynb as demo.ipynb: hand in the notebook under its own name"
    assert rows["twofiles"]["error"] == "missing notebook demo.ipynb (found: a.ipynb, b.ipynb)"
    lines = {line.split()[0]: line for line in summary.splitlines() if line.strip()}
    assert lines["late"].split()[1:4] == ["2.4", "3", "3"] and lines["extended"].split()[1:4] == ["2.7", "3", "3"]
    assert "late 26.0 h (-0.6)" in lines["late"] and "late 6.0 h (-0.3)" in lines["extended"]
    assert lines["half"].split()[-1] == "double_int" and "[note: graded " in lines["renamed"]
    assert "NOT GRADED: missing notebook demo.ipynb (found: a" in lines["twofiles"]  # cut to fit; whole in the CSV
    assert "every cell and message is in grades_demo.csv" in summary
    assert "9 submissions: 8 graded, 1 not graded, 2 late" in summary and lines["raises"].split()[-1] == "all"
    assert "mean final score of the graded 2.39 / 3" in summary  # (3 + 2.4 + 2.7 + 3 + 2 + 3 + 3 + 0) / 8
    assert max(len(line) for line in summary.split("\nwrote ")[0].splitlines()) <= 100, summary


def _unnamed(line: str) -> str:
    """A line of stock nbgrader's export without the student id it writes as the last name of a student with
    none (as the term stores it for formgrader)."""
    fields = line.split(",")
    if fields[4] == fields[3] and not fields[5]:
        fields[4] = ""
    return ",".join(fields)


@pytest.mark.slow
def test_nbgrader_export_is_the_stock_export_with_no_score_where_nothing_was_graded(term_course, exported):
    """The course's ``nbgrader export`` against nbgrader's own plugin on the same gradebook: a graded student's
    line is the stock line plus its status, with no id where a name goes; stock writes 0 for the student it
    could not grade."""
    root, _ = term_course
    ours, stock = exported, root / "export_stock.csv"
    proc = courses.nbgrader(root, "export", "--to", str(stock),
                            "--ExportApp.plugin_class=nbgrader.plugins.export.CsvExportPlugin")
    assert proc.returncode == 0, proc.stderr
    stock_lines = stock.read_text().splitlines()
    lines = {line.split(",")[3]: line for line in ours.read_text().splitlines()[1:]}
    assert ours.read_text().splitlines()[0] == stock_lines[0] + ",status"
    graded = {s for s, line in lines.items() if line.endswith(",graded")}
    assert graded == set(CLASS) - {"twofiles"}
    assert sorted(lines[s] for s in graded) == sorted(_unnamed(line) + ",graded" for line in stock_lines[1:]
                                                      if line.split(",")[3] in graded)
    stock_rows, rows = _rows(stock, "student_id"), _rows(ours, "student_id")
    assert stock_rows["late"]["last_name"] == "late" and rows["late"]["last_name"] == ""  # an id is no last name
    assert stock_rows["twofiles"]["score"] == "0.0" and "absent" not in stock_rows  # what stock nbgrader writes
    assert {s: (rows[s]["raw_score"], rows[s]["score"], rows[s]["status"]) for s in ("twofiles", "absent")} == \
        {"twofiles": ("", "", "not graded"), "absent": ("", "", "not submitted")}
    some = root / "export_some.csv"
    proc = courses.nbgrader(root, "export", "--to", str(some), "--student", "absent", "--student", "late",
                            "--assignment", "demo")
    assert proc.returncode == 0, proc.stderr
    assert {s: r["score"] for s, r in _rows(some, "student_id").items()} == {"absent": "", "late": "2.4"}


@pytest.mark.slow
def test_the_feedback_reads(term_course):
    root, _ = term_course
    page = {s: (root / "feedback" / s / "demo" / "demo.html").read_text() for s in ("renamed", "visible", "raises",
                                                                                     "late")}
    assert "graded demo (1).ipynb as demo.ipynb" in page["renamed"]
    assert "white-space: pre-wrap" in page["raises"] and "Test cell" not in page["raises"]
    assert re.search(r"<code>double_values</code></a>\s*\(tests, Score: 0.0 / 2.0 points\)", page["raises"])
    assert "Late submission penalty: 26.0 h late, 10% per started day, capped at 50%: \u22120.6" in \
        html.unescape(page["late"])  # how late, the rule, the points
    assert "raised ValueError: cannot reshape array of size 12 into shape (5,) (called with array (3, 4) float64)" \
        in html.unescape(page["raises"])
    assert page["visible"].count("Not counted: a visible assert") == 1 and "Not counted" not in page["raises"]


@pytest.mark.slow
def test_formgrader_reads_what_make_grade_wrote(term_course):
    root, _ = term_course
    api = _formgrader(root)
    submissions = {s["student"]: s for s in api.get_submissions("demo")}
    assert not any(s["needs_manual_grade"] for s in submissions.values() if s["autograded"])
    assert submissions["late"]["timestamp"] == "2026-11-21T19:00:00"
    assert (submissions["ontime"]["last_name"], submissions["ontime"]["first_name"]) == ("ontime", "")
    notebooks = {s["student"]: s for s in api.get_notebook_submissions("demo", "demo")}
    assert notebooks["half"]["failed_tests"] and not notebooks["ontime"]["failed_tests"]


CANVAS = """Student,ID,SIS User ID,SIS Login ID,Section,demo (1234),ps9 (77),Current Score
    Points Possible,,,,,3,10,(read only)
"Time, On",101,u101,ontime,S1,,7,50
"Late, A.",102,u102,late,S1,1,8,60
"Two, Files",103,u103,twofiles,S1,,9,70
"Body, No",104,u104,nobody,S2,,,
"""


@pytest.mark.slow
def test_the_canvas_export_round_trip(term_course, tmp_path, capsys):
    root, _ = term_course
    (tmp_path / "canvas.csv").write_text(CANVAS)
    out, long = tmp_path / "import.csv", tmp_path / "long.csv"
    assert cli_main(["export", "--course", str(root), "--canvas", str(tmp_path / "canvas.csv"), "--out", str(out),
                     "--long", str(long)]) == 0
    assert "not on the Canvas roster (by SIS Login ID): extended, half, notime, raises, renamed, visible" in \
        capsys.readouterr().out
    sent = list(csv.reader(io.StringIO(CANVAS)))
    back = list(csv.reader(open(out, newline="")))
    assert back[:2] == sent[:2] and [r[:5] + r[6:] for r in back] == [r[:5] + r[6:] for r in sent]
    assert {r[3]: r[5] for r in back[2:]} == {"ontime": "3", "late": "2.4", "twofiles": "", "nobody": ""}
    rows = {(r["student"], r["assignment"]): r for r in csv.DictReader(open(long, newline=""))}
    assert (rows["late", "demo"]["status"], rows["late", "demo"]["score"], rows["late", "demo"]["late_penalty"]) == \
        ("graded", "2.4", "0.6")
    sheet = _rows(root / "grades_demo.csv", "student")  # the grade sheet and the long export: one unit, one value
    assert {s for s, _ in rows} - {"nobody"} <= set(sheet)
    assert all(float(r["seconds_late"] or "nan") == float(sheet[s]["seconds_late"] or "nan") or
               r["seconds_late"] == sheet[s]["seconds_late"] == "" for (s, _), r in rows.items() if s in sheet), \
        {s: (r["seconds_late"], sheet[s]["seconds_late"]) for (s, _), r in rows.items() if s in sheet}
    assert (rows["twofiles", "demo"]["status"], rows["twofiles", "demo"]["score"]) == ("not graded", "")
    assert (rows["absent", "demo"]["status"], rows["absent", "demo"]["score"]) == ("not submitted", "")
    with pytest.raises(SystemExit):
        cli_main(["export", "--course", str(root), "--canvas", str(tmp_path / "canvas.csv")])  # no --out
    assert cli_main(["export", "--course", str(root), "--canvas", str(tmp_path / "canvas.csv"), "--out",
                     str(out), "--id-column", "Login"]) == 1
    assert "no column 'Login'" in capsys.readouterr().err


@pytest.mark.slow
def test_nbgrader_autograde_grades_in_the_sandbox(term_course, monkeypatch):
    """A blank release plus an input transformer: stock nbgrader gives it every point, here it gets none, from
    the command line and from formgrader's button; an honest submission graded the same way gets its points."""
    root, _ = term_course
    release = nbformat.read(root / "autograded" / "ontime" / "demo" / "demo.ipynb", as_version=4)
    outside = root / "written_outside_the_sandbox"
    evil = ("get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])\n"
            f"open({str(outside)!r}, 'w').close()\n"
            "raise NotImplementedError('write your solution here')")
    _submit(root, release, "ontime_hostile", evil)
    shutil.rmtree(root / "autograded" / "ontime")  # graded again through nbgrader autograde, below
    monkeypatch.setenv(HIDDEN_DIR_ENV, str(root / "hidden"))
    proc = courses.nbgrader(root, "autograde", "demo", "--student", "ontime*", "--force")  # the two of them
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has changed" not in proc.stderr, proc.stderr[-3000:]  # tests cells handed in as released: no warning
    export = root / "export_autograde.csv"
    assert courses.nbgrader(root, "export", "--to", str(export)).returncode == 0
    rows = _rows(export, "student_id")
    assert (rows["ontime_hostile"]["score"], rows["ontime"]["score"], rows["ontime"]["timestamp"]) == \
        ("0.0", "3.0", "2026-11-20 16:00:00")
    assert (root / "autograded" / "ontime_hostile" / "demo" / "demo.ipynb").is_file()
    api = _formgrader(root)  # its Autograde button calls this
    assert api.autograde("demo", "ontime_hostile")["success"]
    assert {s["student"]: s["score"] for s in api.get_submissions("demo")}["ontime_hostile"] == 0
    assert not outside.exists(), "student code ran outside the sandbox"


def test_penalty_policies_follow_nbgrader_config(tmp_path):
    config = tmp_path / "nbgrader_config.py"
    config.write_text("c = get_config()\nc.LateSubmissionPlugin.penalty_method = 'zero'\n")
    assert term.late_plugin(tmp_path).late_submission_penalty("s", 7.5, 60) == 7.5  # nbgrader's own 'zero'
    config.write_text("c = get_config()\n")
    assert term.late_plugin(tmp_path).late_submission_penalty("s", 7.5, 60) is None  # 'none', the default
    config.write_text("c = get_config()\n" + PENALTY + "c.PerDayPenalty.cap = 0.25\n")
    plugin = term.late_plugin(tmp_path)
    assert [plugin.late_submission_penalty("s", 10, h * 3600) for h in (1, 24, 25, 100)] == [1, 1, 2, 2.5]
    config.write_text("c = get_config()\nc.AssignLatePenalties.plugin_class = 'mha_lab.instructor.term.Late'\n")
    with pytest.raises(ValueError, match="is not an nbgrader plugin class"):
        term.late_plugin(tmp_path)


def test_extensions_csv_errors_name_the_line(tmp_path):
    assert term.read_extensions(tmp_path) == {}
    (tmp_path / term.EXTENSIONS).write_text("student,due\nalice,2026-11-21 17:00:00 UTC\n")
    with pytest.raises(ValueError, match="missing assignment"):
        term.read_extensions(tmp_path)
    (tmp_path / term.EXTENSIONS).write_text("student,assignment,due\nalice,ps1,2026-11-21 17:00:00 UTC\n"
                                            "bob,ps1,next tuesday\n")
    with pytest.raises(ValueError, match="line 3: due 'next tuesday' is not a date"):
        term.read_extensions(tmp_path)


def test_an_extension_without_a_due_date_is_refused_before_grading(tmp_path):
    (tmp_path / "nbgrader_config.py").write_text("c = get_config()\n")
    (tmp_path / term.EXTENSIONS).write_text("student,assignment,due\nalice,ps1,2026-11-25 17:00:00 UTC\n")
    term.check(tmp_path, ["ps2"])  # nothing extends ps2
    with pytest.raises(ValueError, match="extends ps1, which has no due date in the gradebook"):
        term.check(tmp_path, ["ps1"])  # no gradebook yet
    with courses.gradebook(tmp_path) as gb:
        gb.add_assignment("ps1")
    with pytest.raises(ValueError, match="no due date"):
        term.check(tmp_path, ["ps1"])
    with courses.gradebook(tmp_path) as gb:
        gb.update_or_create_assignment("ps1", duedate="2026-11-23 17:00:00 UTC")
    term.check(tmp_path, ["ps1"])


def test_an_export_of_an_unknown_assignment_or_student_is_refused(tmp_path):
    """A misspelt ``--assignment`` or ``--student`` fails with the names, instead of a CSV with no rows."""
    from nbgrader.apps import ExportApp

    with courses.gradebook(tmp_path) as gb:
        gb.add_assignment("ps1")
        gb.update_or_create_student("amy")
    (tmp_path / "submitted" / "bob" / "ps1").mkdir(parents=True)  # handed in, not in the gradebook
    app = ExportApp()
    app.coursedir = CourseDirectory(root=str(tmp_path))
    out = tmp_path / "grades.csv"

    def export(**only) -> list[dict[str, str]]:
        with courses.gradebook(tmp_path) as gb:
            lms.CsvExport(parent=app, to=str(out), **only).export(gb)
        return list(csv.DictReader(out.open()))

    assert [(r["student_id"], r["status"]) for r in export(assignment=["ps1"], student=["bob"])] == \
        [("bob", "not submitted")]
    with pytest.raises(ValueError, match="no assignment ps2 in the course; its assignments: ps1"):
        export(assignment=["ps1", "ps2"])
    with pytest.raises(ValueError, match="no student zed in the course; its students: amy, bob"):
        export(student=["amy", "zed"])


def test_timestamp_txt_is_read_as_nbgrader_writes_it_and_never_followed(tmp_path):
    stamp = tmp_path / "timestamp.txt"
    assert term.read_timestamp(tmp_path) is None
    stamp.write_text("2026-11-23 17:02:11.123456 UTC\n")
    assert term.read_timestamp(tmp_path) == datetime(2026, 11, 23, 17, 2, 11, 123456)
    stamp.write_text("")
    assert term.read_timestamp(tmp_path) is None
    for make, reason in [(lambda: stamp.write_text("9" * 500), "longer than"),
                         (lambda: stamp.write_text("yesterday-ish"), "is not a time"),
                         (lambda: stamp.symlink_to("/etc/hostname"), "cannot be read"),
                         (lambda: os.mkfifo(stamp), "not a plain file"),  # a FIFO would block a plain read
                         (lambda: stamp.mkdir(), "not a plain file"),
                         (lambda: stamp.write_bytes(b"\xff\xfe\x00 2026-11-20"), "is not a time")]:
        if stamp.is_dir() and not stamp.is_symlink():
            stamp.rmdir()
        stamp.unlink(missing_ok=True)
        make()
        with pytest.raises(ValueError, match=reason):
            term.read_timestamp(tmp_path)
    notebook = tmp_path / "demo.ipynb"  # when it cannot be read, the notebook's arrival stands in
    notebook.write_text("{}")
    os.utime(notebook, (0, 86400.5))
    assert term.arrival(tmp_path) == datetime(1970, 1, 2, 0, 0, 0, 500000)
