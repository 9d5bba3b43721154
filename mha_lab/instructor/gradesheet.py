"""The grade sheet of a grading run: the summary on stdout and ``grades_<assignment>.csv``.

The summary has one line per student, at most 100 columns (final score after the late penalty, raw score,
lateness, the tests cells that lost points, or why it was not graded) and the totals; the messages and whatever
is cut to fit stay in the CSV and the feedback. The CSV has
one row per student of the course; grading some students again replaces their rows and keeps the
others. A student with no submission reads "not submitted", one that could not be graded "not graded":
neither is a 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from mha_lab.grading.batch import StudentResult, memory_reading
from mha_lab.instructor import spreadsheet
from mha_lab.instructor.term import Late

__all__ = ["FIELDS", "summary_table", "write_csv"]

# seconds_late: the unit of nbgrader's total_seconds_late and of grades_long.csv (export --long), written as it is
FIELDS = ["student", "status", "score", "max_score", "timestamp", "seconds_late", "penalty", "final_score", "error",
          "note", "failed", "memory", "memory_peak", "queue_s", "run_s", "judge_s"]
REASON_CHARS = 90  # of a reason in the summary; the whole message is in the CSV
WIDTH = 100  # columns of the summary: no line wraps on a terminal
STUDENT_CHARS = 24  # of a student's id in the summary


def _status(r: StudentResult) -> str:
    return "graded" if r.notebooks else "not graded"


def _failures(r: StudentResult) -> str:
    return "; ".join(f"{c.grade_id} ({c.message.splitlines()[-1].lstrip('- ')})" if c.message else c.grade_id
                     for c in r.cells if c.score < c.max_score)


def _short(text: str) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def _lost(r: StudentResult) -> str:
    """The ids of the tests cells that lost points, 'all' when every one did, or why it was not graded."""
    if not r.notebooks:
        return f"NOT GRADED: {_short(r.error)}"
    lost = [c.grade_id for c in r.cells if c.score < c.max_score]
    text = "all" if lost and len(lost) == len(r.cells) else " ".join(lost)
    extra = [f"[{_short(r.error)}]"] if r.error else []
    return " ".join([text, *extra, *([f"[note: {_short(r.note)}]"] if r.note else [])]).strip()


def _shown(student: str) -> str:
    """A student id as a table shows it: as it is, or quoted when it holds a character that is not printable."""
    return student if student.isprintable() else repr(student)


def _attention(r: StudentResult, when: Late | None) -> str:
    """What the instructor should look at for this student: why it was not graded, what went wrong while it was,
    a submission time that could not be read; '' when nothing."""
    return _short("; ".join(text for text in (r.error, when.problem if when else "") if text))


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(width - 1, 0)] + "…"


def _final(r: StudentResult, late: Mapping[str, Late]) -> float:
    return r.score - (late[r.student].penalty if r.student in late else 0.0)


def summary_table(results: Sequence[StudentResult], *, late: Mapping[str, Late] | None = None,
                  unsafe: bool = False, details: str = "") -> str:
    """One line per student (student, final score, raw score, max, late, lost cells or reason), the totals, then
    each student that needs attention (not graded, graded with an error, or with a submission time that could not
    be read) and why; every line fits ``WIDTH`` columns, and a list cut to fit says that ``details`` (the CSV) has
    it whole."""
    late = late or {}
    rows = [("student", "final", "raw", "max", "late", "lost points in / not graded because")]
    rows += [(_shown(r.student), f"{_final(r, late):g}" if r.notebooks else "-", f"{r.score:g}" if r.notebooks else "-",
              f"{r.max_score:g}", late[r.student].describe() if r.student in late else "", _lost(r))
             for r in results]
    rows = [(_cut(row[0], STUDENT_CHARS), *row[1:]) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(5)) + "  " + row[5] for row in rows]
    cut = any(len(line.rstrip()) > WIDTH for line in lines)
    lines = [_cut(line.rstrip(), WIDTH) for line in lines]
    lines.insert(1, "-" * min(max(len(line) for line in lines), WIDTH))
    graded = [r for r in results if r.notebooks]
    n_late = sum(1 for r in graded if r.student in late and late[r.student].hours_late > 0)
    mean = sum(_final(r, late) for r in graded) / max(len(graded), 1)
    top = max((r.max_score for r in results), default=0)
    lines.append(f"{len(results)} submissions: {len(graded)} graded, {len(results) - len(graded)} not graded, "
                 f"{n_late} late; mean final score of the graded {mean:.2f} / {top:g}")
    modes = sorted({r.memory for r in graded if r.memory})
    memory = f"memory measured by: {'; '.join(modes) or 'nothing (no graded submission)'}"
    lines.append(_cut(memory, WIDTH))
    attention = [(r.student, why) for r in results if (why := _attention(r, late.get(r.student)))]
    lines += ["needs attention:", *(_cut(f"  {s!r}: {why}", WIDTH) for s, why in attention)] if attention else []
    cut = cut or len(memory) > WIDTH or any(len(f"  {s!r}: {why}") > WIDTH for s, why in attention)
    if cut:
        lines.append(f"lines cut to {WIDTH} columns: every cell and message is in {details or 'the grades CSV'}")
    if unsafe:
        lines.append("WARNING: graded with --unsafe-no-sandbox: student code ran unconfined, as this user")
    return "\n".join(lines)


def write_csv(results: Sequence[StudentResult], path: Path, everyone: Iterable[str] = (),
              late: Mapping[str, Late] | None = None) -> None:
    """Merge ``results`` into the CSV at ``path``; students in ``everyone`` with no row are 'not submitted'."""
    late = late or {}
    rows = {}
    if Path(path).is_file():
        with open(path, newline="", encoding="utf-8") as f:
            rows = {row["student"]: row for row in spreadsheet.DictReader(f)}
    for s in everyone:
        rows.setdefault(s, {"student": s, "status": "not submitted", "error": "not submitted"})
    for r in results:
        when = late.get(r.student) if r.notebooks else None
        penalty = when.penalty if when else 0.0
        graded = {"penalty": f"{penalty:g}", "final_score": f"{r.score - penalty:g}"} if r.notebooks else {}
        rows[r.student] = {"student": r.student, "status": _status(r), "score": r.score, "max_score": r.max_score,
                           "timestamp": when.timestamp.isoformat(sep=" ") if when and when.timestamp else "",
                           "seconds_late": str(float(when.seconds_late)) if when else "", **graded, "error": r.error,
                           "note": "; ".join(filter(None, [r.note, when.problem if when else ""])),
                           "failed": _failures(r), "memory": r.memory,
                           "memory_peak": "; ".join(f"{c.grade_id}: {memory_reading(c.memory)}" for c in r.cells
                                                    if c.memory),
                           **{f"{k}_s": f"{v:.2f}" for k, v in r.timings.items()}}
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = spreadsheet.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows[s] for s in sorted(rows))
