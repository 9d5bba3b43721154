"""The reports of a grading run: the summary table on stdout and ``grades_<assignment>.csv``.

The CSV has one row per student of the course; grading some students again replaces their rows
and keeps the others. A student with no submission reads "not submitted", not 0.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path

from mha_lab.grading.batch import StudentResult

__all__ = ["FIELDS", "summary_table", "write_csv"]

FIELDS = ["student", "score", "max_score", "error", "failed", "queue_s", "run_s", "judge_s"]


def _failures(r: StudentResult) -> str:
    return "; ".join(f"{c.grade_id} ({c.message.splitlines()[-1].lstrip('- ')})" if c.message else c.grade_id
                     for c in r.cells if c.score < c.max_score)


def summary_table(results: Sequence[StudentResult], *, unsafe: bool = False) -> str:
    """A plain-text table: student, score, max, and the failed tests cells (or why grading failed)."""
    rows = [("student", "score", "max", "failed tests cells / error")]
    for r in results:
        detail = _failures(r) + (f" [{r.error}]" if r.error else "") if r.notebooks else f"NOT GRADED: {r.error}"
        rows.append((r.student, f"{r.score:g}", f"{r.max_score:g}", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    if unsafe:
        lines.append("WARNING: graded with --unsafe-no-sandbox: student code ran unconfined, as this user")
    return "\n".join(lines)


def write_csv(results: Sequence[StudentResult], path: Path, everyone: Iterable[str] = ()) -> None:
    """Merge ``results`` into the CSV at ``path``; students in ``everyone`` with no row are 'not submitted'."""
    rows = {}
    if Path(path).is_file():
        with open(path, newline="") as f:
            rows = {row["student"]: row for row in csv.DictReader(f)}
    for s in everyone:
        rows.setdefault(s, {"student": s, "error": "not submitted"})
    for r in results:
        rows[r.student] = {"student": r.student, "score": r.score, "max_score": r.max_score, "error": r.error,
                           "failed": _failures(r), **{f"{k}_s": f"{v:.2f}" for k, v in r.timings.items()}}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows[s] for s in sorted(rows))
