"""The grade sheet of a grading run: the summary on stdout and ``grades_<assignment>.csv``.

The summary has one short line per student (score, lateness, the tests cells that lost points, or
why it was not graded) and the totals; the messages stay in the CSV and the feedback. The CSV has
one row per student of the course; grading some students again replaces their rows and keeps the
others. A student with no submission reads "not submitted", one that could not be graded "not graded":
neither is a 0.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from mha_lab.grading.batch import StudentResult
from mha_lab.instructor.term import Late

__all__ = ["FIELDS", "summary_table", "write_csv"]

FIELDS = ["student", "status", "score", "max_score", "timestamp", "hours_late", "penalty", "final_score", "error",
          "note", "failed", "memory", "queue_s", "run_s", "judge_s"]
REASON_CHARS = 90  # of a reason in the summary; the whole message is in the CSV


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
    return " ".join([text, *extra, *(["[renamed notebook]"] if r.note else [])]).strip()


def summary_table(results: Sequence[StudentResult], *, late: Mapping[str, Late] | None = None,
                  unsafe: bool = False) -> str:
    """One line per student (student, score, max, late, lost cells or reason), then the totals."""
    late = late or {}
    rows = [("student", "score", "max", "late", "lost points in / not graded because")]
    rows += [(r.student, f"{r.score:g}", f"{r.max_score:g}", late[r.student].describe() if r.student in late else "",
              _lost(r)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(4)) + "  " + row[4] for row in rows]
    lines = [line.rstrip() for line in lines]
    lines.insert(1, "-" * len(lines[0]))
    graded = [r for r in results if r.notebooks]
    n_late = sum(1 for r in graded if r.student in late and late[r.student].hours_late > 0)
    mean = sum(r.score - (late[r.student].penalty if r.student in late else 0) for r in graded) / max(len(graded), 1)
    top = max((r.max_score for r in results), default=0)
    lines.append(f"{len(results)} submissions: {len(graded)} graded, {len(results) - len(graded)} not graded, "
                 f"{n_late} late; mean final score of the graded {mean:.2f} / {top:g}")
    modes = sorted({r.memory for r in graded if r.memory})
    lines.append(f"memory measured by: {'; '.join(modes) or 'nothing (no graded submission)'}")
    if unsafe:
        lines.append("WARNING: graded with --unsafe-no-sandbox: student code ran unconfined, as this user")
    return "\n".join(lines)


def write_csv(results: Sequence[StudentResult], path: Path, everyone: Iterable[str] = (),
              late: Mapping[str, Late] | None = None) -> None:
    """Merge ``results`` into the CSV at ``path``; students in ``everyone`` with no row are 'not submitted'."""
    late = late or {}
    rows = {}
    if Path(path).is_file():
        with open(path, newline="") as f:
            rows = {row["student"]: row for row in csv.DictReader(f)}
    for s in everyone:
        rows.setdefault(s, {"student": s, "status": "not submitted", "error": "not submitted"})
    for r in results:
        when = late.get(r.student) if r.notebooks else None
        penalty = when.penalty if when else 0.0
        graded = {"penalty": f"{penalty:g}", "final_score": f"{r.score - penalty:g}"} if r.notebooks else {}
        rows[r.student] = {"student": r.student, "status": _status(r), "score": r.score, "max_score": r.max_score,
                           "timestamp": when.timestamp.isoformat(sep=" ") if when and when.timestamp else "",
                           "hours_late": f"{when.hours_late:.2f}" if when else "", **graded, "error": r.error,
                           "note": "; ".join(filter(None, [r.note, when.problem if when else ""])),
                           "failed": _failures(r), "memory": r.memory,
                           **{f"{k}_s": f"{v:.2f}" for k, v in r.timings.items()}}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows[s] for s in sorted(rows))
