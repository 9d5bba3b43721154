"""What a student wrote cannot attack the instructor who opens the feedback or the exports.

- The feedback page (``nbgrader generate_feedback`` through ``mha_lab.grading.course.feedback``) of a student whose
  markdown, printed text, displayed HTML, JavaScript output and exception carry scripts, event handlers, frames
  and ``javascript:`` links is opened in headless Chromium: none of them runs, the page logs no error, and the
  rest (headings, math, bold, code, printed text, the messages as text) is still there to read.
- Every CSV the project writes (``grades_<a>.csv``, the long export, the Canvas import, nbgrader's export and the
  report's ``similarity.csv``) holds no cell a spreadsheet would run as a formula, keeps numbers numeric, and reads
  back (``spreadsheet.DictReader``) as it was written.
"""

from __future__ import annotations

import csv
import shutil
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from test_site import CHROMIUM, CHROMIUM_ARGS, needs_chromium

from mha_lab.grading import course
from mha_lab.grading.batch import CellResult, StudentResult
from mha_lab.grading.safe_html import clean_html
from mha_lab.instructor import gradesheet, lms, report, spreadsheet
from mha_lab.instructor.classroom import REPO
from mha_lab.instructor.term import Late

RUN = "(window.pwned = window.pwned || []).push('{}'); document.title = 'pwned'"
MARKDOWN = f"""# Notes on the loop

Here $x^2 < y$ and `split_heads` and **bold**.

<script>{RUN.format('script')}</script>

<img src=x onerror="{RUN.format('img-onerror')}">

<iframe srcdoc="<script>parent.pwned = ['iframe']; parent.document.title = 'pwned'</script>"></iframe>

<a href="javascript:{RUN.format('link')}" id="js-link">a link</a>
"""
OWN_CELL = (f'<svg onload="{RUN.format("svg")}"></svg> my own cell '
            f'<details open ontoggle="{RUN.format("details")}">more</details><style>body {{display: none}}</style>')


def _hostile_notebook() -> nbformat.NotebookNode:
    """An autograded notebook: a markdown answer, a cell of the student's own, a code answer and a tests cell
    whose outputs carry HTML the student's code printed, displayed and raised."""
    answer_md = nbformat.v4.new_markdown_cell(MARKDOWN)
    answer_md.metadata["nbgrader"] = {"grade_id": "ans_md", "solution": True, "grade": False, "locked": False}
    answer = nbformat.v4.new_code_cell("def f(x):\n    return x + 1")
    answer.metadata["nbgrader"] = {"grade_id": "ans_f", "solution": True, "grade": False, "locked": False}
    tests = nbformat.v4.new_code_cell("assert f(1) == 2")
    tests.metadata["nbgrader"] = {"grade_id": "t_f", "grade": True, "solution": False, "points": 1.0, "locked": True}
    tests.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"<script>{RUN.format('stdout')}</script> printed"),
        nbformat.v4.new_output("display_data", data={"text/plain": "x", "text/html": (
            f"<b>shown in bold</b><img src=x onerror=\"{RUN.format('html-output')}\">")}),
        nbformat.v4.new_output("display_data", data={"text/plain": "x", "application/javascript": RUN.format("js")}),
        nbformat.v4.new_output("display_data", data={"text/plain": "x", "text/markdown": (
            f"<img src=x onerror=\"{RUN.format('markdown-output')}\">")}),
        nbformat.v4.new_output("error", ename=f"<img src=x onerror=\"{RUN.format('ename')}\">",
                               evalue=f"<script>{RUN.format('evalue')}</script>",
                               traceback=[f"<img src=x onerror=\"{RUN.format('traceback')}\">"])]
    nb = nbformat.v4.new_notebook()
    nb.cells = [answer_md, nbformat.v4.new_markdown_cell(OWN_CELL), answer, tests]
    return nb


@pytest.fixture(scope="module")
def hostile_feedback(tmp_path_factory) -> Path:
    """The feedback page of one hostile student, generated the way ``make grade`` does."""
    root = tmp_path_factory.mktemp("course")
    shutil.copy(REPO / "nbgrader_config.py", root)
    nb = _hostile_notebook()
    with course.gradebook(root) as gb:
        gb.update_or_create_assignment("hw")
        gb.add_notebook("hw", "hw")
        gb.add_grade_cell("t_f", "hw", "hw", max_score=1.0, cell_type="code")
        gb.add_source_cell("t_f", "hw", "hw", cell_type="code", source=nb.cells[3].source, locked=True)
        for cell in (nb.cells[0], nb.cells[2]):
            gb.add_solution_cell(cell.metadata.nbgrader["grade_id"], "hw", "hw")
            gb.add_source_cell(cell.metadata.nbgrader["grade_id"], "hw", "hw", cell_type=cell.cell_type, source="")
        gb.update_or_create_student("eve")
        gb.add_submission("hw", "eve")
        gb.find_grade("t_f", "hw", "hw", "eve").auto_score = 1.0
        gb.db.commit()
    folder = root / "autograded" / "eve" / "hw"
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "hw.ipynb")
    assert course.feedback(root, "hw", ["eve"]) == ""
    return root / "feedback" / "eve" / "hw" / "hw.html"


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for this module's pages: each page opens in a context of its own (its start costs
    seconds of CPU)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def _open(browser, page_path: Path, click: str = "") -> dict:
    """Open a page in headless Chromium, offline, clicking ``click`` if given: what the student's scripts set, the
    console's errors, the requests that left the disk, frames, text, typeset formulas."""
    errors, external = [], []
    page = browser.new_page()  # a new context: no state of another page
    try:
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        def offline(route):
            url = route.request.url
            if not url.startswith(("file://", "data:")):
                external.append(url)
                return route.abort()
            return route.continue_()

        page.route("**/*", offline)
        page.goto(page_path.as_uri(), wait_until="load")
        if click:
            page.locator(click).click()
        page.wait_for_timeout(300)
        return {"ran": page.evaluate("window.pwned"), "title": page.title(), "errors": errors,
                "external": external, "frames": len(page.frames), "text": page.locator("body").inner_text(),
                "math": page.locator("math").count(),
                "h1": page.locator("h1").first.inner_text() if page.locator("h1").count() else ""}
    finally:
        page.context.close()


@pytest.mark.slow
@needs_chromium
def test_no_script_of_the_student_runs_in_the_feedback(hostile_feedback, browser):
    seen = _open(browser, hostile_feedback, click="#js-link")  # a link the student wrote goes nowhere
    assert seen["ran"] is None and seen["title"] == "hw", (seen["ran"], seen["title"])
    assert not seen["errors"], seen["errors"]
    assert not seen["external"], seen["external"]  # no image or frame of the student's was fetched
    assert seen["frames"] == 1  # no iframe survived
    assert seen["h1"].startswith("Notes on the loop")
    assert seen["math"] == 1 and "x^2" not in seen["text"], "the student's formula is typeset, offline"
    for kept in ("split_heads", "bold", "my own cell", "a link", "printed", "shown in bold",
                 "def f(x):", "window.pwned"):  # the printed text and the messages are shown as text
        assert kept in seen["text"], kept


class _Markup(HTMLParser):
    """The elements of a page and the attributes that could run or load something."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.risky: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name.startswith("on") or name == "srcdoc" or (value or "").strip().lower().startswith("javascript:"):
                self.risky.append((tag, name, value or ""))


@pytest.mark.slow
def test_the_feedback_html_holds_no_markup_of_the_student(hostile_feedback):
    page = hostile_feedback.read_text()
    markup = _Markup()
    markup.feed(page)
    assert markup.risky == []
    body = markup.tags[markup.tags.index("body"):]  # the head holds the page's own MathJax and its config
    assert not {"script", "iframe", "svg", "object", "embed"} & set(body), body
    assert "display: none" not in page  # the student's <style> went with its content
    assert "&lt;img src=x onerror=" in page  # the exception's name, as text, in the "Not counted" note


@pytest.mark.slow
def test_stock_generate_feedback_sanitises_too(hostile_feedback):
    """``nbgrader generate_feedback`` typed by the instructor (or formgrader's button) reads ``nbgrader_config.py``,
    which gives it the same exporter as ``make grade``: the student's markup is gone there too."""
    root = hostile_feedback.parents[3]
    hostile_feedback.unlink()
    assert course.nbgrader(root, "generate_feedback", "hw", "--force").returncode == 0
    markup = _Markup()
    markup.feed(hostile_feedback.read_text())
    assert markup.risky == []
    assert not {"script", "iframe"} & set(markup.tags[markup.tags.index("body"):])


def test_the_sanitiser_keeps_what_feedback_needs():
    kept = clean_html('<h2 id="a">T<a class="anchor-link" href="#a">#</a></h2><p>$a &lt; b$ <code>x</code></p>'
                      '<div class="highlight"><pre><span class="k">def</span></pre></div><table><tr><td>1</td></tr>'
                      '</table><img src="data:image/png;base64,iVBORw0KGgo=" alt="plot">')
    for part in ('<h2 id="a">', 'class="anchor-link" href="#a"', "$a &lt; b$", "<code>x</code>",
                 '<span class="k">def</span>', "<td>1</td>", 'src="data:image/png;base64,iVBORw0KGgo="'):
        assert part in kept, (part, kept)
    gone = clean_html('<img src="https://tracker.example/p.png"><a href="data:text/html,hi">d</a>'
                      '<form action="/x"><input name="q"></form><object data="x.swf"></object>')
    assert "tracker" not in gone and "data:" not in gone and "<form" not in gone and "<object" not in gone


# --- CSV exports ---------------------------------------------------------------------------------------------

HOSTILE_IDS = ["=2+5", "@SUM(1+1)", "+cmd|' /C calc'!A0", "-2+3", "\tfoo", "'=already"]


def _formulas(path: Path) -> list[str]:
    """The cells of ``path`` a spreadsheet would read as a formula: a formula start that is not a plain number."""
    with open(path, newline="", encoding="utf-8") as f:
        cells = [c for row in csv.reader(f) for c in row]
    return [c for c in cells if c.startswith(spreadsheet.FORMULA_START) and not _number(c)]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.strip() == text and text.lower().lstrip("+-") not in ("inf", "nan", "infinity")


def test_a_cell_is_neutralised_only_when_a_spreadsheet_would_run_it():
    for text in [*HOSTILE_IDS, "\rx", "'", "''"]:
        assert spreadsheet.neutral(text).startswith("'") and spreadsheet.restore(spreadsheet.neutral(text)) == text
    for value in ["-2.2", "-1", "+3", "1e-3", "-.5", "ann", "", "2026-11-20 17:00:00", -2.5, 0, None]:
        assert spreadsheet.neutral(value) == value
    assert spreadsheet.neutral("-inf") == "'-inf" and spreadsheet.neutral("-1e") == "'-1e"  # not numbers


def test_grades_csv_neutralises_ids_and_messages_and_keeps_numbers(tmp_path):
    out = tmp_path / "grades_hw.csv"
    results = [StudentResult(s, 1.0, 3.0, [CellResult("t_a", 1.0, 1.0), CellResult("t_b", 0.0, 2.0, "-boom")],
                             notebooks={"hw.ipynb": {}}, error="=HYPERLINK(\"x\")" if i == 0 else "")
               for i, s in enumerate(HOSTILE_IDS)]
    late = {HOSTILE_IDS[0]: Late(seconds_late=30 * 3600, penalty=2.0)}  # a penalty above the score: final -1
    gradesheet.write_csv(results, out, everyone=[*HOSTILE_IDS, "@absent"], late=late)
    assert _formulas(out) == []
    gradesheet.write_csv(results[:1], out, late=late)  # grading one again merges with the rows read back
    with open(out, newline="") as f:
        rows = {r["student"]: r for r in spreadsheet.DictReader(f)}
    assert sorted(rows) == sorted([*HOSTILE_IDS, "@absent"])
    assert rows["=2+5"]["error"] == '=HYPERLINK("x")' and rows["=2+5"]["failed"] == "t_b (boom)"
    with open(out, newline="") as f:
        raw = {r["status"] + r["final_score"] for r in csv.DictReader(f) if r["penalty"] == "2"}
    assert raw == {"graded-1"}  # the negative final score is written as a number, unquoted
    assert _formulas(out) == []


def test_long_canvas_and_nbgrader_exports_neutralise_ids(tmp_path):
    grades = {(s, "hw"): lms.Grade(s, "hw", "graded", 2.5, 3.0, 0.5, 3.0, "2026-11-20 12:00:00", -3600.0)
              for s in HOSTILE_IDS}
    long = tmp_path / "long.csv"
    lms.write_long(grades, long)
    assert _formulas(long) == []
    with open(long, newline="") as f:
        rows = list(spreadsheet.DictReader(f))
    assert sorted(r["student"] for r in rows) == sorted(HOSTILE_IDS)
    assert {(r["score"], r["seconds_late"]) for r in rows} == {("2.5", "-3600.0")}  # numbers stay numbers
    export, roster = tmp_path / "canvas.csv", [s for s in HOSTILE_IDS if s.strip() == s]  # Canvas ids are trimmed
    grades = {k: g for k, g in grades.items() if k[0] in roster}
    with open(export, "w", newline="") as f:
        csv.writer(f).writerows([["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "hw (12)"],
                                 ["    Points Possible", "", "", "", "", "3"],
                                 *[[f"=Name{i}", str(100 + i), f"u{i}", s, "@S1", ""]
                                   for i, s in enumerate(roster)]])
    out = tmp_path / "import.csv"
    assert lms.canvas(export, grades, out) == []
    assert _formulas(out) == []
    back = list(csv.reader(open(out, newline="")))
    assert back[1] == ["    Points Possible", "", "", "", "", "3"]
    assert {spreadsheet.restore(r[3]): r[5] for r in back[2:]} == {s: "2.5" for s in roster}


@pytest.mark.slow
def test_nbgrader_export_and_similarity_csv_neutralise_ids(tmp_path):
    from nbgrader.apps import ExportApp
    from nbgrader.coursedir import CourseDirectory

    with course.gradebook(tmp_path) as gb:
        gb.add_assignment("hw")
        for s in HOSTILE_IDS:
            gb.update_or_create_student(s, last_name="=cmd()", first_name="-x")
    app = ExportApp()
    app.coursedir = CourseDirectory(root=str(tmp_path))
    out = tmp_path / "grades.csv"
    with course.gradebook(tmp_path) as gb:
        lms.CsvExport(parent=app, to=str(out)).export(gb)
    assert _formulas(out) == []
    with open(out, newline="") as f:
        assert sorted(r["student_id"] for r in spreadsheet.DictReader(f)) == sorted(HOSTILE_IDS)
    sim = tmp_path / "similarity.csv"
    report.write_similarity_csv([], sim)  # the header alone: no pairs
    pairs = [report.similarity.Pair(a, b, 0.5, True) for a, b in zip(HOSTILE_IDS, HOSTILE_IDS[1:], strict=False)]
    report.write_similarity_csv(pairs, sim)
    assert _formulas(sim) == []


# --- the whole way: graded by the real command, exported, opened ------------------------------------------------


@pytest.mark.slow
@needs_chromium
def test_a_hostile_class_graded_for_real_attacks_nobody(tmp_path, monkeypatch, grading_cluster, browser):
    """Students ``=2+5`` and ``@SUM(1+1)`` hand in the ``demo`` assignment of test_term, one with a markdown cell
    of scripts and a print of HTML: ``python -m mha_lab grade`` grades both; the grade sheet, the long and
    Canvas exports and similarity.csv hold no formula, and the feedback page runs no script."""
    from test_grading_batch import HIDDEN, source_notebook
    from test_term import DUE, GOOD, _submit

    from mha_lab.grading.judge import HIDDEN_DIR_ENV
    from mha_lab.instructor import grade as grading_cli

    monkeypatch.setenv(HIDDEN_DIR_ENV, str(tmp_path / "hidden"))
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_demo.py").write_text(HIDDEN)
    shutil.copy(REPO / "nbgrader_config.py", tmp_path)
    (tmp_path / "solutions" / "demo").mkdir(parents=True)
    nbformat.write(source_notebook(), tmp_path / "solutions" / "demo" / "demo.ipynb")
    with course.gradebook(tmp_path) as gb:  # what `nbgrader db assignment add demo --duedate DUE` does
        gb.update_or_create_assignment("demo", duedate=DUE)
    release = course.register(tmp_path, "demo")["demo.ipynb"]
    for student in ("=2+5", "@SUM(1+1)"):
        _submit(tmp_path, release, student, GOOD)
    hostile = tmp_path / "submitted" / "=2+5" / "demo" / "demo.ipynb"
    nb = nbformat.read(hostile, as_version=4)
    nb.cells[1:1] = [nbformat.v4.new_markdown_cell(MARKDOWN),
                     nbformat.v4.new_code_cell(f"print('<img src=x onerror=\"{RUN.format('print')}\">')")]
    nbformat.write(nb, hostile)
    assert grading_cli.main(["demo", "--course", str(tmp_path), "--scheduler", grading_cluster.scheduler.address,
                             "--timeout", "60"]) == 0
    grades = tmp_path / "grades_demo.csv"
    assert _formulas(grades) == []
    with open(grades, newline="") as f:
        assert {r["student"]: r["final_score"] for r in spreadsheet.DictReader(f)} == {"=2+5": "3", "@SUM(1+1)": "3"}
    long, canvas_in, canvas_out = tmp_path / "long.csv", tmp_path / "canvas.csv", tmp_path / "import.csv"
    canvas_in.write_text("Student,ID,SIS User ID,SIS Login ID,Section,demo (1)\n"
                         "A,1,u1,=2+5,S,\nB,2,u2,@SUM(1+1),S,\n")
    from mha_lab.__main__ import main as cli_main

    assert cli_main(["export", "--course", str(tmp_path), "--canvas", str(canvas_in), "--out", str(canvas_out),
                     "--long", str(long)]) == 0
    for written in (long, canvas_out, tmp_path / "reports" / "demo" / "similarity.csv"):
        assert _formulas(written) == [], written
    assert [r[5] for r in csv.reader(open(canvas_out, newline=""))][1:] == ["3", "3"]
    page = tmp_path / "feedback" / "=2+5" / "demo" / "demo.html"
    seen = _open(browser, page)
    assert seen["ran"] is None and seen["title"] == "demo", (seen["ran"], seen["title"])
    assert not seen["errors"] and not seen["external"], (seen["errors"], seen["external"])
    assert "Notes on the loop" in seen["text"] and "onerror=" in seen["text"]  # the print, shown as text
