"""The grader graded: every assignment submitted and graded through the sandbox, with the real nbgrader.

For each assignment in ``solutions/``: the reference solution (two students) must get full
marks, the untouched release 0, and each mutant in ``tests/mutants/<assignment>.py`` must lose
exactly the points of the tests cells it breaks, keep the rest, and get feedback naming its bug.
Each correct variant in the same module (``VARIANTS``) is graded in the same batch and must get
full marks. No feedback page may show a line of the hidden checks.

A student is a sandbox and a Python of its own, so mutants and variants that answer different tasks
share students (``packed``): each task of a student's notebook carries at most one of them, and every
test still names its mutant or variant and judges only the cells of its own tasks.

Each assignment's checks are a class (``Class`` with its ``ASSIGNMENT``): pytest-xdist runs a class whole in
one worker (``--dist loadscope``), which grades that assignment's class once.
"""

from __future__ import annotations

import csv
import functools
import html
import importlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from mha_lab.grading import batch
from mha_lab.instructor import gradesheet, report
from mha_lab.instructor.classroom import answer_cell, fill_release, mutants, read_notebook, submit
from mha_lab.instructor.report import blank_answers, misconceptions, read_class
from mha_lab.instructor.report import build as build_report

REPO = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())
REFERENCE_STUDENTS = ("reference-1", "reference-2")
RELEASE_STUDENT = "release"


def variants(assignment: str) -> list:
    """The correct solutions written differently, ``VARIANTS`` next to ``MUTANTS`` (empty when there is none)."""
    if not mutants(assignment):  # also puts this clone's ``tests`` package on the path
        return []
    return getattr(importlib.import_module(f"tests.mutants.{assignment}"), "VARIANTS", [])


@dataclass(frozen=True)
class Packed:
    """One student of the class: the mutants and correct variants it hands in, no two answering the same task."""

    name: str
    mutants: tuple
    variants: tuple

    def edits(self, solution: nbformat.NotebookNode) -> dict[str, str]:
        """Answer cell -> its source: each mutant applied to the solution's cell, each variant's cells whole."""
        out = {m.grade_id: m.apply(answer_cell(solution, m.grade_id)) for m in self.mutants}
        for v in self.variants:
            out |= dict(v.answers)
        return out


@functools.cache
def task_of(assignment: str) -> dict[str, str]:
    """Tests cell -> its task (the answer cell it follows, without ``ans_``), as the class report reads them."""
    return report._tasks(read_notebook(REPO, "solutions", assignment))[0]


def claims(assignment: str, item) -> tuple[frozenset[str], frozenset[str]]:
    """(the tasks a mutant or a correct variant answers for, the tests cells it breaks): a variant's answer cells';
    a mutant's answer cell's and those of every cell it breaks."""
    if hasattr(item, "answers"):
        return frozenset(g.removeprefix("ans_") for g in item.answers), frozenset()
    owner = task_of(assignment)
    return frozenset({item.grade_id.removeprefix("ans_"), *(owner.get(g, g) for g in item.breaks)}), item.breaks


def cells_of(assignment: str, items) -> set[str]:
    """The tests cells of every task the mutants and variants ``items`` answer for."""
    tasks = frozenset().union(*(claims(assignment, x)[0] for x in items))
    return {g for g, t in task_of(assignment).items() if t in tasks}


@functools.cache
def packed(assignment: str) -> tuple[Packed, ...]:
    """The class's mutants, then its correct variants, each put into the first student (in order) none of whose
    tasks it answers and whose broken cells it does not break. Packed so, no mutant changes another's points or
    words (``test_mutant_loses_exactly_its_points`` fails on a cell lost outside its student's tasks)."""
    students: list[dict] = []  # {"items": its mutants and variants, "tasks": they answer, "breaks": they break}
    for item in [*mutants(assignment), *variants(assignment)]:
        tasks, breaks = claims(assignment, item)
        s = next((s for s in students if not (tasks & s["tasks"] or breaks & s["breaks"])), None)
        if s is None:
            students.append(s := {"items": [], "tasks": set(), "breaks": set()})
        s["items"].append(item)
        s["tasks"] |= tasks
        s["breaks"] |= breaks
    return tuple(Packed(f"student-{i:02d}", tuple(x for x in s["items"] if not hasattr(x, "answers")),
                        tuple(x for x in s["items"] if hasattr(x, "answers"))) for i, s in enumerate(students))


def carrier(assignment: str, item) -> Packed:
    """The student who hands in ``item`` (a mutant or a correct variant)."""
    return next(s for s in packed(assignment) if item in s.mutants or item in s.variants)


def failed_by_cell(failed: str, ids: set[str]) -> dict[str, str]:
    """The grade sheet's ``failed`` column ("cell (last line); cell ...") cut at the tests cells ``ids``."""
    starts = sorted((m.start(), g) for g in ids
                    for m in re.finditer(rf"(?:^|(?<=; )){re.escape(g)}(?= \(|;|$)", failed))
    ends = [start for start, _ in starts[1:]] + [len(failed)]
    return {g: failed[start:end] for (start, g), end in zip(starts, ends, strict=True)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A class's mutants (``mutant``) and correct variants (``variant``): its assignment's, one test each."""
    a = getattr(metafunc.cls, "ASSIGNMENT", None)
    for name, found in (("mutant", mutants(a) if a else []), ("variant", variants(a) if a else [])):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, found, ids=[x.name for x in found])


class Graded(dict):
    """student -> result of one assignment's class, submitted to ``course`` and graded in sandboxes, with feedback."""

    def __init__(self, course: Path, results: list[batch.StudentResult]) -> None:
        super().__init__((r.student, r) for r in results)
        self.course = course


@pytest.fixture(scope="class")
def graded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, grading_cluster) -> Graded:
    """A temporary course with no gradebook yet: the class's assignment submitted, graded in sandboxes."""
    a = request.cls.ASSIGNMENT
    course = tmp_path_factory.mktemp(a)
    shutil.copy(REPO / "nbgrader_config.py", course)
    shutil.copytree(REPO / "solutions" / a, course / "solutions" / a)
    solution = nbformat.read(course / "solutions" / a / f"{a}.ipynb", as_version=4)
    release = nbformat.read(REPO / "assignments" / a / f"{a}.ipynb", as_version=4)
    for student in REFERENCE_STUDENTS:  # notebooks alone, as students hand them in
        submit(course, student, a, fill_release(release, solution))
    (course / "submitted" / REFERENCE_STUDENTS[1] / a / "expected.npz").write_bytes(b"not the release's")
    submit(course, RELEASE_STUDENT, a, release)
    for student in packed(a):
        submit(course, student.name, a, fill_release(release, solution, student.edits(solution)))
    return Graded(course, batch.grade_class(course, a, client=grading_cluster, progress=False))


def feedback_text(course: Path, student: str, assignment: str) -> str:
    pages = sorted((course / "feedback" / student / assignment).glob("*.html"))
    assert pages, f"no feedback for {student}/{assignment}"
    text = "".join(p.read_text() for p in pages)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


# Mutants the checks cannot tell apart: they fail the same check with the same words (one keeps every head's
# weights, the other builds the full score tensor: the same peak, the same output), so the class report puts
# their students into one group.
SAME_DIAGNOSIS = [{"every_head_kept_alive", "full_score_tensor_built"}]


def hidden_lines() -> set[str]:
    """Lines of tests/hidden that a student could not have written: not in any notebook of the course."""
    notebooks = "".join(p.read_text() for p in [*REPO.glob("solutions/*/*.ipynb"), *REPO.glob("assignments/*/*.ipynb")])
    lines = {ln.strip() for p in (REPO / "tests" / "hidden").glob("*.py") for ln in p.read_text().splitlines()}
    return {ln for ln in lines if len(ln) >= 20 and ln not in notebooks}


class Class:
    """The checks of one assignment's graded class; a subclass per assignment names it (``ASSIGNMENT``)."""

    ASSIGNMENT = ""

    @pytest.mark.slow
    def test_reference_gets_full_marks(self, graded):
        for student in REFERENCE_STUDENTS:
            r = graded[student]
            assert not r.error, f"{student}: {r.error}"
            assert 10 <= r.max_score <= 25, f"{self.ASSIGNMENT} is worth {r.max_score} points; 10 to 25 expected"
            assert r.score == r.max_score, f"{student} lost points: {gradesheet.summary_table([r])}"

    @pytest.mark.slow
    def test_correct_notebook_alone_gets_feedback_without_an_error(self, graded):
        """The release's expected.npz is the grader's to give: one student handed in the notebook alone, the other
        a broken copy of it; neither feedback shows an error (every visible test ran against the release's
        values)."""
        for student in REFERENCE_STUDENTS:
            r = graded[student]
            errors = [f"{c.metadata.get('nbgrader', {}).get('grade_id')}: {o.ename}: {o.evalue[:200]}"
                      for nb in r.notebooks.values() for c in nb.cells for o in c.get("outputs", [])
                      if o.output_type == "error"]
            assert r.notebooks and not errors, f"{student}'s notebook shows errors it did not cause: {errors}"
            text = feedback_text(graded.course, student, self.ASSIGNMENT)
            assert not re.search(r"FileNotFoundError|NameError|Traceback \(most recent|Not counted", text), \
                f"{student}'s feedback shows an error"

    @pytest.mark.slow
    def test_cells_are_numbered_as_they_ran(self, graded):
        student = REFERENCE_STUDENTS[0]
        for nb in graded[student].notebooks.values():
            counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code"]
            assert counts == list(range(1, len(counts) + 1)), counts
        text = feedback_text(graded.course, student, self.ASSIGNMENT)
        assert "In\xa0[1]:" in text and not re.search(r"In\s\[\s\]:", text), "the feedback shows cells that never ran"

    @pytest.mark.slow
    def test_release_gets_zero(self, graded):
        r = graded[RELEASE_STUDENT]
        assert r.cells and r.max_score > 0, f"release was not graded: {r.error}"
        assert r.score == 0, f"the untouched release scored: {gradesheet.summary_table([r])}"

    def test_has_six_mutants(self):
        found = mutants(self.ASSIGNMENT)
        assert len(found) >= 6, f"{self.ASSIGNMENT} has {len(found)} mutants in tests/mutants/{self.ASSIGNMENT}.py; " \
                                "6 needed"

    @pytest.mark.slow
    def test_mutant_loses_exactly_its_points(self, graded, mutant):
        """Of its own tasks' cells the mutant's student loses exactly ``breaks``, with no points, and the feedback
        says the bug in one of them; a cell of no task its mutants answer for keeps every point."""
        a = self.ASSIGNMENT
        student = carrier(a, mutant)
        r = graded[student.name]
        who = f"mutant {mutant.name!r} (in {student.name} with {[m.name for m in student.mutants]})"
        assert r.cells, f"{who} was not graded: {r.error}"
        cells = {c.grade_id: c for c in r.cells}
        unknown = mutant.breaks - cells.keys()
        assert not unknown, f"mutant {mutant.name!r} names tests cells that do not exist: {sorted(unknown)}"
        lost = {g for g, c in cells.items() if c.score < c.max_score}
        mine = lost & cells_of(a, [mutant])
        assert mine == mutant.breaks, (f"{who}: expected to lose {sorted(mutant.breaks)}, lost {sorted(mine)} of its "
                                       f"tasks' cells\n{gradesheet.summary_table([r])}")
        stray = lost - cells_of(a, student.mutants + student.variants)  # a variant's cells: its own test's
        assert not stray, f"{who}: lost {sorted(stray)}, cells of no task its student's mutants answer for: they " \
                          "interfere"
        assert all(cells[g].score == 0 for g in mutant.breaks), f"partial points for a broken property: {r.cells}"
        text = feedback_text(graded.course, student.name, a)
        assert mutant.feedback in text, f"{who}: feedback does not say {mutant.feedback!r}"
        assert any(mutant.feedback in cells[g].message for g in mutant.breaks), \
            f"{who}: no cell it breaks says {mutant.feedback!r}: {[cells[g].message for g in mutant.breaks]}"

    @pytest.mark.slow
    def test_class_report_groups_each_mutant_with_exactly_its_students(self, graded):
        a, course = self.ASSIGNMENT, graded.course
        out = build_report(course, a)
        groups = misconceptions(read_class(course, a))
        found = {(g["task"], frozenset(g["students"])): g for g in groups}
        by_name = {m.name: m for m in mutants(a)}
        for m in mutants(a):
            twins = next((same for same in SAME_DIAGNOSIS if m.name in same), {m.name})
            who = frozenset(carrier(a, by_name[n]).name for n in twins)
            group = found.get((m.grade_id.removeprefix("ans_"), who))
            assert group, (f"mutant {m.name!r}: no misconception group of exactly {sorted(who)}; groups with it: "
                           f"{[g for g in groups if carrier(a, m).name in g['students']]}")
            assert any(m.feedback in said for said in group["says"].values()), (m.feedback, group)
            assert not m.bug or group["bugs"] == [m.bug], f"mutant {m.name!r} grouped as {group['bugs']}, not {m.bug}"
        assert not [g for g in groups if RELEASE_STUDENT in g["students"]], "a blank answer is no misconception"
        blanks = blank_answers(read_class(course, a))
        assert blanks and {b["task"] for b in blanks} >= {g["task"] for g in groups}, blanks
        assert all(b["students"] == [RELEASE_STUDENT] for b in blanks), blanks
        md = (out / "report.md").read_text()
        assert "## Misconceptions" in md and "## Blank answers" in md
        sheet = course / f"grades_{a}.csv"  # the grade sheet names each bug too
        gradesheet.write_csv(list(graded.values()), sheet)
        rows = {r["student"]: r for r in csv.DictReader(open(sheet, newline=""))}
        for m in mutants(a):  # in the entry of a cell it breaks: another mutant of its student may share the bug
            entries = failed_by_cell(rows[carrier(a, m).name]["failed"], set(task_of(a)))
            assert not m.bug or any(f"[bug: {m.bug}]" in entries.get(g, "") for g in m.breaks), (m.name, entries)

    def test_has_three_correct_variants(self):
        found = variants(self.ASSIGNMENT)
        assert len(found) >= 3, f"{self.ASSIGNMENT} has {len(found)} correct variants in " \
                                f"tests/mutants/{self.ASSIGNMENT}.py; 3 needed"

    @pytest.mark.slow
    def test_correct_variant_gets_full_marks(self, graded, variant):
        """Every point outside the tasks of the mutants it shares a student with (all of them, when it has none):
        its own cells, and the cells the solution answers."""
        student = carrier(self.ASSIGNMENT, variant)
        r = graded[student.name]
        assert r.cells, f"variant {variant.name!r} was not graded: {r.error}"
        lost = {c.grade_id for c in r.cells if c.score < c.max_score} - cells_of(self.ASSIGNMENT, student.mutants)
        assert not lost, (f"correct variant {variant.name!r} (in {student.name} with mutants "
                          f"{[m.name for m in student.mutants]}) lost {sorted(lost)}:\n{gradesheet.summary_table([r])}")

    @pytest.mark.slow
    def test_feedback_never_shows_the_hidden_checks(self, graded):
        secret = hidden_lines()
        assert len(secret) > 100, "the hidden checks should have plenty of lines to hide"
        pages = sorted((graded.course / "feedback").glob(f"*/{self.ASSIGNMENT}/*.html"))
        assert len(pages) >= 3
        for page in pages:
            text = html.unescape(page.read_text())
            shown = [ln for ln in secret if ln in text]
            assert not shown, f"{page} shows lines of tests/hidden: {shown[:3]}"


class TestPs1PerHeadLoop(Class):
    ASSIGNMENT = "ps1_per_head_loop"


class TestPs2Mqa(Class):
    ASSIGNMENT = "ps2_mqa"


class TestPs3MemoryEfficient(Class):
    ASSIGNMENT = "ps3_memory_efficient"

    @pytest.mark.slow
    def test_the_graders_memory_readings_are_on_record(self, graded):
        """Each memory cell's reading, passed or not: in the grade sheet, in the feedback beside the student's
        own, and as a distribution in the class report."""
        cells = {"head_by_head_forward_memory", "chunked_attention_memory"}
        for student in REFERENCE_STUDENTS:  # (a result that is wrong is not measured: no memory points)
            assert {c.grade_id for c in graded[student].cells if c.memory} == cells, graded[student].cells
        sheet = graded.course / f"grades_{self.ASSIGNMENT}.csv"
        gradesheet.write_csv(list(graded.values()), sheet)
        row = {r["student"]: r for r in csv.DictReader(open(sheet, newline=""))}[REFERENCE_STUDENTS[0]]
        assert all(f"{c}: " in row["memory_peak"] for c in cells), row["memory_peak"]
        text = feedback_text(graded.course, REFERENCE_STUDENTS[0], self.ASSIGNMENT)
        assert text.count("The grader measured, from outside your process: ") == len(cells), text[-2000:]
        md = (build_report(graded.course, self.ASSIGNMENT) / "report.md").read_text()
        assert "## Measured memory" in md and all(c.replace("_", "\\_") in md for c in cells), md


class TestPs4Backward(Class):
    ASSIGNMENT = "ps4_backward"


class TestPs5Decoding(Class):
    ASSIGNMENT = "ps5_decoding"


class TestPs6RingSpeculative(Class):
    ASSIGNMENT = "ps6_ring_speculative"


def test_every_assignment_has_its_class():
    assert sorted(c.ASSIGNMENT for c in Class.__subclasses__()) == ASSIGNMENTS
