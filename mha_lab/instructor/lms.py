"""Grades into the LMS: a Canvas gradebook import, and a long CSV any other LMS can map.

``python -m mha_lab export --canvas <canvas export>.csv --out canvas_import.csv [--long grades_long.csv]``
(the command: ``mha_lab.instructor.export``).

- The Canvas file is the gradebook Canvas exports (``Student, ID, SIS User ID, SIS Login ID, Section``,
  then one column per assignment titled ``Name (id)``). It is the roster: students are matched on
  ``SIS Login ID`` = the nbgrader student id (``--id-column`` names another column).
- An assignment's column is the one whose title is the nbgrader assignment name, with or without
  Canvas's ``(id)``. The file written keeps every column and row of the export (the ``Points
  Possible`` row too) and fills those columns with the final score: after the late penalty, as
  ``nbgrader export`` computes it. A student with no submission, or one that could not be graded,
  is left empty, never 0.
- The long CSV has one row per student and assignment: ``student, assignment, status, score,
  raw_score, late_penalty, max_score, timestamp, seconds_late``.

``nbgrader export`` in the course writes its stock CSV through ``CsvExport`` (set in ``nbgrader_config.py``):
the same columns and, for a graded student, the same row, plus a last column ``status``; a student with no
submission, or one that could not be graded, gets empty scores where stock nbgrader writes 0.
"""

from __future__ import annotations

import csv
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.plugins import ExportPlugin

from mha_lab.grading import course as courses
from mha_lab.instructor import spreadsheet

__all__ = ["Grade", "read_grades", "canvas", "write_long", "CsvExport"]

LONG_FIELDS = ["student", "assignment", "status", "score", "raw_score", "late_penalty", "max_score", "timestamp",
               "seconds_late"]
# nbgrader 0.9.6's CsvExportPlugin columns, in its order, then ours
EXPORT_FIELDS = ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email", "raw_score",
                 "late_submission_penalty", "score", "max_score", "status"]


@dataclass(frozen=True)
class Grade:
    """One student's grade for one assignment; ``score`` is None unless it was graded."""

    student: str
    assignment: str
    status: str  # graded | not graded | not submitted
    score: float | None = None
    raw_score: float | None = None
    late_penalty: float | None = None
    max_score: float = 0.0
    timestamp: str = ""
    seconds_late: float | None = None


def _not_graded(course: Path, assignment: str) -> set[str]:
    """Students whose last grading of ``assignment`` could not grade them (``grades_<a>.csv``'s status)."""
    path = Path(course) / f"grades_{assignment}.csv"
    if not path.is_file():
        return set()
    with open(path, newline="") as f:
        return {row["student"] for row in spreadsheet.DictReader(f) if row.get("status") == "not graded"}


def read_grades(course: Path, gradebook: Gradebook | None = None) -> dict[tuple[str, str], Grade]:
    """(student, assignment) -> Grade, for every assignment of the course's gradebook and every student of the
    gradebook or of ``submitted/``; ``gradebook`` is nbgrader's, open (default: ``<course>/gradebook.db``)."""
    if gradebook is None:
        db = Path(course) / "gradebook.db"
        if not db.is_file():
            raise FileNotFoundError(f"no gradebook at {db}: grade first (make grade)")
        with courses.gradebook(course) as gb:
            return read_grades(course, gb)
    grades = {}
    everyone = sorted({s.id for s in gradebook.students} | set(courses.students(course)))
    for assignment in gradebook.assignments:
        skipped = _not_graded(course, assignment.name)
        for student in everyone:
            key = (student, assignment.name)
            try:
                sub = gradebook.find_submission(assignment.name, student)
            except MissingEntry:
                grades[key] = Grade(*key, "not submitted", max_score=assignment.max_score)
                continue
            timestamp = sub.timestamp.isoformat(sep=" ") if sub.timestamp else ""
            if student in skipped:
                grades[key] = Grade(*key, "not graded", max_score=assignment.max_score, timestamp=timestamp)
                continue
            penalty = sub.late_submission_penalty or 0.0
            grades[key] = Grade(*key, "graded", max(0.0, sub.score - penalty), sub.score, penalty,
                                assignment.max_score, timestamp, sub.total_seconds_late)
    return grades


def write_long(grades: dict[tuple[str, str], Grade], out: Path) -> None:
    """The long CSV: one row per (student, assignment), sorted; empty cells where there is no grade."""
    with open(out, "w", newline="") as f:
        writer = spreadsheet.DictWriter(f, LONG_FIELDS)
        writer.writeheader()
        for key in sorted(grades):
            writer.writerow({k: "" if v is None else v for k, v in asdict(grades[key]).items()})


def _column(header: list[str], assignment: str) -> int | None:
    """The index of the Canvas column titled ``assignment`` or ``assignment (id)``; None when there is none."""
    pattern = re.compile(rf"{re.escape(assignment)}(\s*\(\d+\))?")
    found = [i for i, title in enumerate(header) if pattern.fullmatch(title.strip())]
    if len(found) > 1:
        raise ValueError(f"{len(found)} Canvas columns are titled {assignment!r}: {[header[i] for i in found]}")
    return found[0] if found else None


def canvas(export: Path, grades: dict[tuple[str, str], Grade], out: Path, id_column: str = "SIS Login ID") -> list[str]:
    """Write the Canvas import at ``out`` from the Canvas gradebook ``export``; returns what the instructor
    should know (assignments with no column, students graded but not on the roster)."""
    with open(export, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    if not rows or id_column not in rows[0]:
        raise ValueError(f"{export}: no column {id_column!r} in its header (is it a Canvas gradebook export?); "
                         f"columns: {', '.join(rows[0]) if rows else 'none'}")
    header, key = rows[0], rows[0].index(id_column)
    notes, columns = [], {}
    for assignment in sorted({a for _, a in grades}):
        index = _column(header, assignment)
        if index is None:
            notes.append(f"no Canvas column for {assignment}: add the assignment in Canvas, export again")
        else:
            columns[assignment] = index
    roster = set()
    for row in rows[1:]:
        student = row[key].strip() if key < len(row) else ""
        if not student:  # the Points Possible row, or a row Canvas adds that is no student
            continue
        roster.add(student)
        for assignment, index in columns.items():
            grade = grades.get((student, assignment))
            row[index] = "" if grade is None or grade.score is None else f"{grade.score:g}"
    graded = sorted({s for (s, _), g in grades.items() if g.status == "graded"} - roster)
    if graded:
        notes.append(f"graded but not on the Canvas roster (by {id_column}): {', '.join(graded)}")
    with open(out, "w", newline="", encoding="utf-8") as f:
        spreadsheet.writer(f).writerows(rows)
    return notes


def _names(person: Any, student: str) -> tuple[str | None, str | None, str | None]:
    """A student's last name, first name and email for the export. The id that the term stores as the last name
    of a student who has none (so that formgrader lists students by it) is not a name: both stay empty."""
    last, first, email = (getattr(person, name, None) for name in ("last_name", "first_name", "email"))
    return (None, None, email) if last == student and not first else (last, first, email)


class CsvExport(ExportPlugin):
    """``nbgrader export``: nbgrader's CSV (``--to``, default ``grades.csv``; ``--assignment``, ``--student``) from
    ``read_grades``, with a last column ``status``. Scores stay empty unless graded, where stock nbgrader writes 0;
    a student with a folder in ``submitted/`` but not in the gradebook gets a row too, with no name. An
    ``--assignment`` or ``--student`` the course does not know is a ValueError, not a CSV with no rows."""

    def export(self, gradebook: Gradebook) -> None:
        dest = self.to or "grades.csv"
        grades = read_grades(Path(self.parent.coursedir.root), gradebook)
        people = {s.id: s for s in gradebook.students}  # nbgrader's order: by last, then first name
        everyone = [*people, *sorted({s for s, _ in grades} - people.keys())]
        only_assignments, only_students = {str(a) for a in self.assignment}, {str(s) for s in self.student}
        for what, asked, known in (("assignment", only_assignments, {a.name for a in gradebook.assignments}),
                                   ("student", only_students, set(everyone))):
            if asked - known:
                raise ValueError(f"no {what} {', '.join(sorted(asked - known))} in the course; "
                                 f"its {what}s: {', '.join(sorted(known)) or 'none'}")
        self.log.info("Exporting grades to %s", dest)
        with open(dest, "w", newline="", encoding="utf-8") as f:
            writer = spreadsheet.writer(f, lineterminator="\n")  # as nbgrader ends its lines; None is written empty
            writer.writerow(EXPORT_FIELDS)
            for assignment in gradebook.assignments:
                if only_assignments and assignment.name not in only_assignments:
                    continue
                for student in everyone:
                    if only_students and student not in only_students:
                        continue
                    grade, person = grades[student, assignment.name], people.get(student)
                    writer.writerow([assignment.name, assignment.duedate, grade.timestamp, student,
                                     *_names(person, student), grade.raw_score, grade.late_penalty, grade.score,
                                     grade.max_score, grade.status])
