"""Grade a whole class: ``python -m mha_lab.grading.batch <assignment>`` (``make grade A=...``).

For every student in ``submitted/``: ``nbgrader autograde`` (``--jobs`` runs side by side; a
broken submission stops nobody else), then ``nbgrader generate_feedback`` and ``nbgrader export``.
Prints a summary table (student, score, max, failed properties with the first line of each
failure) and writes it as ``grades_<assignment>.csv``. A submission that cannot be graded (invalid
JSON, a missing notebook, a crashed kernel, nbgrader's own error) gets 0 and its reason.

``--trusted`` re-judges every submission outside the student's kernel (``mha_lab.grading.remote``):
the student's functions run in a separate process, the hidden checks run here, and a tests
cell keeps its points only if both verdicts pass.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from tqdm import tqdm

__all__ = ["CellResult", "StudentResult", "grade_assignment", "summary_table", "write_csv", "main"]

COURSE_ID = "mha_lab"  # as in nbgrader_config.py


@dataclass
class CellResult:
    """One autograder tests cell of one student: its points and, when it failed, why."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""


@dataclass
class StudentResult:
    """A student's grade for one assignment; ``error`` says why it could not be graded at all."""

    student: str
    score: float = 0.0
    max_score: float = 0.0
    cells: list[CellResult] = field(default_factory=list)
    error: str = ""

    @property
    def failed(self) -> list[CellResult]:
        return [c for c in self.cells if c.score < c.max_score]


# --- running nbgrader ----------------------------------------------------------------------------


def nbgrader(course: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``nbgrader <args>`` in the course folder (its nbgrader_config.py applies)."""
    bin_dir = str(Path(sys.executable).parent)  # nbgrader calls the ``alembic`` script of its environment
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _nbgrader_error(proc: subprocess.CompletedProcess) -> str:
    """The most telling line of a failed nbgrader run."""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    for marker in ("DeadKernelError", "Kernel died", "CellTimeoutError", "Error:", "ERROR"):
        hits = [ln for ln in lines if marker in ln]
        if hits:
            return hits[0][:300]
    return lines[-1][:300] if lines else f"nbgrader exited with code {proc.returncode}"


def release_notebooks(course: Path, assignment: str) -> list[str]:
    """Names of the assignment's notebooks (from the release folder, else the source folder)."""
    for folder in ("assignments", "solutions"):
        found = sorted(p.name for p in (course / folder / assignment).glob("*.ipynb"))
        if found:
            return found
    raise FileNotFoundError(f"assignment {assignment!r} has no notebooks in {course}/assignments or solutions")


def submission_problem(course: Path, assignment: str, student: str) -> str:
    """Why a submission cannot be graded ('' when it looks gradable): missing or unreadable notebook."""
    folder = course / "submitted" / student / assignment
    for name in release_notebooks(course, assignment):
        path = folder / name
        if not path.is_file():
            return f"missing notebook {name}"
        try:
            nbformat.validate(nbformat.read(path, as_version=4))
        except Exception as exc:  # noqa: BLE001 - invalid JSON, wrong schema...: the reason is the message
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{name} is not a valid notebook ({type(exc).__name__}: {first[:200]})"
    return ""


def students(course: Path, assignment: str) -> list[str]:
    """Every student with a folder ``submitted/<student>/<assignment>/``."""
    return sorted(p.parent.name for p in (course / "submitted").glob(f"*/{assignment}") if p.is_dir())


# --- reading the results -------------------------------------------------------------------------


def _first_line(evalue: str) -> str:
    """The informative line of a failure: the first failing hidden check, or the assert's own text."""
    lines = [ln.strip() for ln in evalue.splitlines() if ln.strip()]
    if len(lines) > 1 and "hidden check(s) failed" in lines[0]:
        return lines[1].lstrip("- ")
    return lines[0] if lines else ""


def failure_messages(course: Path, assignment: str, student: str) -> dict[str, str]:
    """grade_id -> first line of the error of each tests cell that raised, from the autograded notebooks."""
    messages = {}
    for path in sorted((course / "autograded" / student / assignment).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            for out in cell.get("outputs", []):
                if grade_id and out.get("output_type") == "error":
                    text = _first_line(out.get("evalue", ""))
                    messages[grade_id] = f"{out.get('ename', 'Error')}: {text}" if text else out.get("ename", "")
    return messages


def read_grades(course: Path, assignment: str, student: str) -> list[CellResult]:
    """Per-cell points from the gradebook, with the failure message of each cell that lost points."""
    from nbgrader.api import Gradebook, MissingEntry

    messages = failure_messages(course, assignment, student)
    cells = []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        try:
            submission = gb.find_submission(assignment, student)
        except MissingEntry:
            return []
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                score = grade.score or 0.0
                message = messages.get(grade.name, "") if score < grade.max_score else ""
                cells.append(CellResult(grade.name, float(score), float(grade.max_score), message))
    return cells


# --- grading -------------------------------------------------------------------------------------


def grade_student(course: Path, assignment: str, student: str, timeout: float,
                  extra: Sequence[str] = ()) -> StudentResult:
    """Autograde one submission; never raises: a failure is recorded in ``error``."""
    result = StudentResult(student)
    problem = submission_problem(course, assignment, student)
    if problem:
        result.error = problem
        return result
    try:
        proc = nbgrader(course, "autograde", assignment, "--student", student, "--force", *extra, timeout=timeout)
    except subprocess.TimeoutExpired:
        result.error = f"autograde took longer than {timeout:.0f} s"
        return result
    result.cells = read_grades(course, assignment, student)
    result.score = sum(c.score for c in result.cells)
    result.max_score = sum(c.max_score for c in result.cells)
    if proc.returncode != 0 or "ERROR" in proc.stderr:
        result.error = _nbgrader_error(proc)
    if not result.cells and not result.error:
        result.error = "no grades recorded"
    return result


def _shard_errors(log: list[str]) -> dict[str, str]:
    """student -> why nbgrader failed on that submission, from an autograde log covering many students."""
    errors, student, segment = {}, None, []
    for line in [*log, "Converting notebook /end/of/log/"]:
        match = _CONVERTING.search(line)
        if match:
            if student and any("There was an error processing" in ln for ln in segment):
                hits = [ln.strip() for ln in segment if _EXCEPTION.match(ln.strip())]
                errors[student] = (hits[-1] if hits else "autograde failed")[:300]
            student, segment = match.group(1), []
        else:
            segment.append(line)
    return errors


_CONVERTING = re.compile(r"Converting notebook .*?submitted[\\/](?:\.[\\/])?([^\\/]+)[\\/]")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


def _autograde_shard(course: Path, assignment: str, excluded: list[str], extra: Sequence[str], timeout: float,
                     bar: tqdm) -> list[str]:
    """One ``nbgrader autograde`` run over every student not in ``excluded``; returns its log."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    cmd = [sys.executable, "-m", "nbgrader", "autograde", assignment, "--force", *extra]
    if excluded:
        cmd.append(f"--CourseDirectory.student_id_exclude={','.join(excluded)}")
    proc = subprocess.Popen(cmd, cwd=course, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    log, executing = [], False
    try:
        for line in proc.stdout:
            log.append(line)
            if "Converting notebook" in line:  # first a copy from submitted/, then the run in autograded/
                executing = f"autograded{os.sep}" in line
            elif executing and "Writing" in line:
                bar.update(1)  # one notebook of one student is done
                executing = False
        proc.wait()
    finally:
        timer.cancel()
    return log


def grade_assignment(course: Path, assignment: str, *, jobs: int = 1, only: Iterable[str] | None = None,
                     timeout: float = 900, extra: Sequence[str] = (), progress: bool = True,
                     trusted: bool = False) -> list[StudentResult]:
    """Autograde every submission, then generate feedback and export the grades; never stops early.

    Submissions are split into ``jobs`` groups autograded side by side (one nbgrader run each);
    a submission whose group run gave it no grades is retried alone, and its reason recorded.
    ``timeout`` is in seconds per submission.
    """
    course = Path(course).resolve()
    names = sorted(only) if only is not None else students(course, assignment)
    results = {s: StudentResult(s) for s in names}
    for s in names:
        results[s].error = submission_problem(course, assignment, s)
    gradable = [s for s in names if not results[s].error]
    everyone = students(course, assignment)
    shards = [gradable[i::max(1, jobs)] for i in range(max(1, jobs))]
    n_notebooks = len(release_notebooks(course, assignment)) * len(gradable)
    with tqdm(total=n_notebooks, desc=f"autograde {assignment}", unit="notebook", disable=not progress) as bar:
        with ThreadPoolExecutor(max_workers=len(shards)) as pool:
            logs = list(pool.map(lambda shard: _autograde_shard(
                course, assignment, [s for s in everyone if s not in shard], extra, timeout * max(1, len(shard)),
                bar) if shard else [], shards))
    errors = {k: v for log in logs for k, v in _shard_errors(log).items()}
    for s in gradable:
        r = results[s]
        r.cells = read_grades(course, assignment, s)
        if not r.cells and s not in errors:  # the group run stopped early: grade this one alone
            r = results[s] = grade_student(course, assignment, s, timeout, extra)
        r.error = r.error or errors.get(s, "")
        r.score = sum(c.score for c in r.cells)
        r.max_score = sum(c.max_score for c in r.cells)
    if trusted:
        from mha_lab.grading.remote import rejudge

        for name in tqdm(gradable, desc="trusted re-judging", unit="student", disable=not progress):
            r = results[name]
            if r.cells:
                try:
                    rejudge(course, assignment, r)
                except Exception as exc:  # noqa: BLE001 - unverified points are not given
                    r.error = f"trusted re-judging failed: {type(exc).__name__}: {exc}"
                    for cell in r.cells:
                        cell.score = 0.0
                    r.score = 0.0
    if any(results[s].cells for s in names):
        nbgrader(course, "generate_feedback", assignment, "--force", timeout=timeout * max(1, len(names)))
        nbgrader(course, "export", timeout=timeout)
    return [results[s] for s in names]


# --- reporting -----------------------------------------------------------------------------------


def _failures(r: StudentResult) -> str:
    parts = [f"{c.grade_id} ({c.message})" if c.message else c.grade_id for c in r.failed]
    return "; ".join(parts)


def summary_table(results: Sequence[StudentResult]) -> str:
    """A plain-text table: student, score, max, and the failed properties (or why grading failed)."""
    rows = [("student", "score", "max", "failed properties / error")]
    for r in results:
        detail = f"NOT GRADED: {r.error}" if r.error and not r.cells else _failures(r)
        if r.error and r.cells:
            detail = f"{detail} [{r.error}]".strip()
        rows.append((r.student, f"{r.score:g}", f"{r.max_score:g}", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
    lines.insert(1, "-" * max(len(line) for line in lines[:1]))
    return "\n".join(lines)


def write_csv(results: Sequence[StudentResult], path: Path) -> None:
    """One row per student: score, max, error, and the failed grade_ids with their messages."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "score", "max_score", "error", "failed"])
        for r in results:
            writer.writerow([r.student, r.score, r.max_score, r.error, _failures(r)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab.grading.batch", description=__doc__.splitlines()[0])
    parser.add_argument("assignment")
    parser.add_argument("--course", type=Path, default=Path.cwd(), help="course root (default: here)")
    parser.add_argument("--student", action="append", help="grade only this student (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="submissions autograded at the same time")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per submission, all cells together")
    parser.add_argument("--trusted", action="store_true", help="re-judge outside the students' kernels")
    args, extra = parser.parse_known_args(argv)  # anything else goes to nbgrader, e.g. --Execute.timeout=10
    results = grade_assignment(args.course, args.assignment, jobs=args.jobs, only=args.student,
                               timeout=args.timeout, extra=extra, trusted=args.trusted)
    if not results:
        print(f"no submissions for {args.assignment} in {args.course / 'submitted'}", file=sys.stderr)
        return 1
    print(summary_table(results))
    out = args.course / f"grades_{args.assignment}.csv"
    write_csv(results, out)
    print(f"\nwrote {out} (nbgrader's own export: {args.course / 'grades.csv'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
