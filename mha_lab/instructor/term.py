"""Due dates, extensions and late work, nbgrader's way, recorded in the gradebook after a grading run.

- The submission time is ``submitted/<student>/<a>/timestamp.txt`` as ``nbgrader collect`` writes it
  (``2026-11-23 17:02:11.123456 UTC``), read with nbgrader's own parser; no file, no time (as nbgrader).
  A file that is there but cannot be read as a time (a folder, a link, garbage) never counts as on time:
  the time the notebook arrived (its file time, as collected) stands for it, and the summary flags it.
- The due date is the gradebook's: ``python -m mha_lab due <a> "2026-11-23 17:00:00 UTC"`` (``set_due``) sets or
  moves it, as ``nbgrader db assignment add <a> --duedate ...`` does.
- ``extensions.csv`` at the course root (``student,assignment,due``, the due date in the same format)
  moves one student's due date. It lands in the gradebook as nbgrader's ``extension``, so the
  lateness nbgrader computes (``total_seconds_late``) and ``nbgrader export`` follow it.
- The penalty is the ``LateSubmissionPlugin`` that ``nbgrader_config.py`` configures
  (``c.LateSubmissionPlugin.penalty_method = "none" | "zero"``, or ``c.AssignLatePenalties.plugin_class``),
  per notebook and clamped to [0, score] as nbgrader does. ``PerDayPenalty`` is the policy nbgrader lacks:
  a fraction of the score per started day late, up to a cap.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbgrader.plugins import BasePlugin, LateSubmissionPlugin
from traitlets import Float
from traitlets.config.loader import PyFileConfigLoader
from traitlets.utils.importstring import import_item

from mha_lab.grading import course as courses

__all__ = ["EXTENSIONS", "NOTE_KEY", "Late", "PerDayPenalty", "read_timestamp", "arrival", "read_extensions",
           "describe_policy", "late_line", "late_plugin", "set_due", "check", "apply", "main"]

EXTENSIONS = "extensions.csv"
DAY = 86400.0
TIMESTAMP_BYTES = 100


@dataclass(frozen=True)
class Late:
    """A submission's time against its due date, and the points its lateness cost."""

    timestamp: datetime | None = None
    due: datetime | None = None
    seconds_late: float = 0.0
    penalty: float = 0.0
    extended: bool = False
    problem: str = ""  # why timestamp.txt could not be read (then ``timestamp`` is the notebook's file time)

    @property
    def hours_late(self) -> float:
        return self.seconds_late / 3600

    def describe(self) -> str:
        """'' when on time; else e.g. 'late 26.5 h (-2)'; 'no timestamp' when a due date exists but no time; then
        'file time' when timestamp.txt could not be read and the notebook's file time stood for it."""
        if self.seconds_late > 0:
            when = f"late {self.hours_late:.1f} h (-{self.penalty:g})"
        else:
            when = "no timestamp" if self.timestamp is None and self.due is not None else ""
        return " ".join(filter(None, [when, "[file time: timestamp.txt unreadable]" if self.problem else ""]))


class PerDayPenalty(LateSubmissionPlugin):
    """``per_day`` of the notebook's score per started day late, at most ``cap`` of it.

    ``penalty = score * min(cap, per_day * ceil(seconds_late / 86400))``. In nbgrader_config.py:
    ``c.AssignLatePenalties.plugin_class = "mha_lab.instructor.term.PerDayPenalty"``,
    ``c.PerDayPenalty.per_day = 0.1``, ``c.PerDayPenalty.cap = 0.5``.
    """

    per_day = Float(0.1, help="fraction of the score taken per started day late").tag(config=True)
    cap = Float(0.5, help="the largest fraction of the score taken").tag(config=True)

    def late_submission_penalty(self, student_id: str, score: float, total_seconds_late: float) -> float:
        if not (0 <= self.per_day <= 1 and 0 <= self.cap <= 1):
            raise ValueError(f"PerDayPenalty needs per_day and cap in [0, 1], got {self.per_day} and {self.cap}")
        return round(score * min(self.cap, self.per_day * math.ceil(total_seconds_late / DAY)), 6)


def read_timestamp(folder: Path) -> datetime | None:
    """The UTC time in ``folder/timestamp.txt`` (naive, as the gradebook keeps it); None when absent or empty.

    The file comes with the submission: ValueError when it is a link, not a plain file, too long or no time.
    """
    from nbgrader.utils import parse_utc

    path = Path(folder) / "timestamp.txt"
    if not os.path.lexists(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"timestamp.txt cannot be read ({exc.strerror}: a link?)") from None
    try:  # a folder opens too: the file object Python would wrap it in would refuse it, IsADirectoryError
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("timestamp.txt is not a plain file")
        text = os.read(fd, TIMESTAMP_BYTES + 1).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise ValueError(f"timestamp.txt cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(text) > TIMESTAMP_BYTES:
        raise ValueError(f"timestamp.txt is longer than {TIMESTAMP_BYTES} bytes")
    if not text:
        return None
    try:
        return parse_utc(text)
    except Exception:  # noqa: BLE001 - whatever the parser makes of text that is not a time
        raise ValueError(f"timestamp.txt: {text[:60]!r} is not a time as nbgrader collect writes it") from None


def arrival(folder: Path) -> datetime:
    """When the submission in ``folder`` arrived, as its files say: the newest notebook's modification time as
    collected (the folder's own when it holds none), in UTC, naive as the gradebook keeps times. Links are not
    followed."""
    times = [p.lstat().st_mtime for p in Path(folder).glob("*.ipynb")] or [Path(folder).lstat().st_mtime]
    return datetime.fromtimestamp(max(times), timezone.utc).replace(tzinfo=None)


def read_extensions(course: Path) -> dict[tuple[str, str], datetime]:
    """(student, assignment) -> the extended due date (UTC), from ``extensions.csv``; {} when there is none."""
    from nbgrader.utils import parse_utc

    path = Path(course) / EXTENSIONS
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"student", "assignment", "due"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: needs the columns student,assignment,due; missing {', '.join(sorted(missing))}")
        found = {}
        for line, row in enumerate(reader, start=2):
            try:
                found[row["student"].strip(), row["assignment"].strip()] = parse_utc(row["due"].strip())
            except (ValueError, OverflowError, AttributeError):
                raise ValueError(f"{path}, line {line}: due {row['due']!r} is not a date such as "
                                 "'2026-11-23 17:00:00 UTC'") from None
    return found


def describe_policy(plugin: BasePlugin) -> str:
    """The late policy in words, for the feedback: '10% per started day, capped at 50%'."""
    if isinstance(plugin, PerDayPenalty):
        return f"{plugin.per_day:.0%} per started day, capped at {plugin.cap:.0%}"
    if type(plugin) is LateSubmissionPlugin:  # nbgrader's own, not a subclass with a rule of its own
        return {"zero": "late work scores 0", "none": "no penalty"}.get(plugin.penalty_method, plugin.penalty_method)
    return f"the course's late policy ({type(plugin).__name__})"


NOTE_KEY = "mha_lab_late"  # in an autograded notebook's metadata: the feedback's late line


def late_line(late: Late, policy: str) -> str:
    """'24.0 h late, 10% per started day, capped at 50%' ('' when on time): how late, and the rule."""
    return f"{late.hours_late:.1f} h late, {policy}" if late.seconds_late > 0 else ""


def _note_lateness(course: Path, assignment: str, student: str, line: str) -> None:
    """Put the late line into the student's autograded notebooks, where the feedback page reads it."""
    for path in sorted((Path(course) / "autograded" / student / assignment).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if nb.metadata.get(NOTE_KEY, "") != line:
            nb.metadata[NOTE_KEY] = line
            nbformat.write(nb, path)


def late_plugin(course: Path) -> BasePlugin:
    """The late-penalty plugin nbgrader_config.py configures (nbgrader's ``LateSubmissionPlugin`` by default)."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    cls = config.AssignLatePenalties.get("plugin_class", LateSubmissionPlugin)
    cls = import_item(cls) if isinstance(cls, str) else cls
    if not (isinstance(cls, type) and issubclass(cls, BasePlugin)):
        raise ValueError(f"AssignLatePenalties.plugin_class {cls!r} is not an nbgrader plugin class")
    return cls(config=config)


def set_due(course: Path, assignment: str, due: str) -> tuple[datetime, datetime | None]:
    """Set or move the assignment's due date in the gradebook (made when missing); returns (new, old) in UTC.

    ``due`` as nbgrader reads it (``2026-11-23 17:00:00 UTC``); ValueError when it is not a date or the course has
    no source of that assignment."""
    from nbgrader.api import MissingEntry
    from nbgrader.utils import parse_utc

    if not (Path(course) / "solutions" / assignment).is_dir():
        raise ValueError(f"no assignment {assignment!r} in {Path(course) / 'solutions'}")
    try:
        when = parse_utc(due)
    except (ValueError, OverflowError):
        raise ValueError(f"{due!r} is not a date such as '2026-11-23 17:00:00 UTC'") from None
    with courses.gradebook(course) as gb:
        try:
            old = gb.find_assignment(assignment).duedate
        except MissingEntry:
            old = None
        gb.update_or_create_assignment(assignment, duedate=when)
    return when, old


def check(course: Path, assignments: Iterable[str]) -> None:
    """Before grading: ``extensions.csv`` and the penalty's configuration can be read, and every assignment it
    extends has a due date in the gradebook; ValueError (ImportError for a plugin) names what to fix."""
    from nbgrader.api import MissingEntry

    extended, _ = read_extensions(course), late_plugin(course)
    for assignment in sorted({a for _, a in extended} & set(assignments)):
        due = None
        if (Path(course) / "gradebook.db").is_file():
            with courses.gradebook(course) as gb, contextlib.suppress(MissingEntry):
                due = gb.find_assignment(assignment).duedate
        if due is None:
            raise ValueError(f"{EXTENSIONS} extends {assignment}, which has no due date in the gradebook: set it "
                             f"first: python -m mha_lab due {assignment} '2026-11-23 17:00:00 UTC'")


def apply(course: Path, assignment: str, students: Iterable[str]) -> dict[str, Late]:
    """Record each graded student's submission time, extension and late penalty in the gradebook.

    A student with no name gets their id as last name (formgrader would print "None, None").
    Returns student -> ``Late``.
    """
    from nbgrader.api import MissingEntry

    course = Path(course)
    extensions, plugin = read_extensions(course), late_plugin(course)
    found = {}
    with courses.gradebook(course) as gb:
        due = gb.find_assignment(assignment).duedate
        for student in students:
            try:
                submission = gb.find_submission(assignment, student)
            except MissingEntry:
                continue
            if submission.student.first_name is None and submission.student.last_name is None:
                submission.student.last_name, submission.student.first_name = student, ""
            folder = courses.submission(course, student, assignment)
            try:
                submission.timestamp, problem = read_timestamp(folder), ""
            except ValueError as exc:  # never on time by default: when it arrived stands in; the summary says so
                submission.timestamp = arrival(folder)
                problem = f"{exc}; the notebook's file time {submission.timestamp:%Y-%m-%d %H:%M:%S} UTC is used"
            extended = extensions.get((student, assignment)) if due is not None else None  # see check()
            submission.extension = None if extended is None else extended - due
            late = submission.total_seconds_late
            penalty = 0.0
            for notebook in submission.notebooks:
                notebook.late_submission_penalty = None
                if late > 0:
                    cost = plugin.late_submission_penalty(student, notebook.score, late)
                    notebook.late_submission_penalty = None if cost is None else min(max(cost, 0.0), notebook.score)
                penalty += notebook.late_submission_penalty or 0.0
            found[student] = Late(submission.timestamp, submission.duedate, late, penalty, extended is not None,
                                  problem)
        gb.db.commit()
    policy = describe_policy(plugin)
    for student, late in found.items():
        _note_lateness(course, assignment, student, late_line(late, policy))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mha_lab due <assignment> DATE [--course DIR]``: set or move a due date."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab due", description="Set or move an assignment's due "
                                     "date in the course's gradebook (late penalties count from it).")
    parser.add_argument("assignment", help="e.g. ps2_mqa")
    parser.add_argument("due", help="the due date in UTC, e.g. '2026-12-01 17:00:00 UTC'")
    parser.add_argument("--course", type=Path, default=Path.cwd(), help="course root (default: here)")
    args = parser.parse_args(argv)
    if not (args.course / "nbgrader_config.py").is_file():
        parser.error(f"{args.course.resolve()} is not a course folder (no nbgrader_config.py); pass --course DIR")
    try:
        when, old = set_due(args.course, args.assignment, args.due)
    except ValueError as exc:
        parser.exit(1, f"due: {exc}\n")
    moved = f" (was {old:%Y-%m-%d %H:%M:%S} UTC)" if old is not None and old != when else ""
    print(f"{args.assignment} is due {when:%Y-%m-%d %H:%M:%S} UTC{moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
