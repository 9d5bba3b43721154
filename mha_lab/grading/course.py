"""The course folder as nbgrader lays it out (``solutions/<a>/``, ``submitted/<student>/<a>/``) and its
``gradebook.db``, which nbgrader's feedback, export and formgrader read. Only the grader writes here, after
the submission's sandbox is gone."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat

from mha_lab.grading import math_html, safe_html
from mha_lab.grading.text import writable_name

__all__ = ["COURSE_ID", "stamp_in_process", "nbgrader", "convert", "gradebook", "students", "submission", "id_problem",
           "assignments", "register", "release_files", "locate", "submitted_notebook", "merge", "FEEDBACK_EXPORTER",
           "feedback_exporter", "feedback"]

COURSE_ID = "mha_lab"  # as in nbgrader_config.py
MAX_NOTEBOOK_BYTES = 20 * 2**20


def stamp_in_process() -> None:
    """Have nbgrader stamp each gradebook it makes with its schema's revision read in this process
    (``_schema_head``). nbgrader asks its environment's ``alembic`` script for it: a second interpreter's start
    (1.2 s per new gradebook), and ``FileNotFoundError: 'alembic'`` where that script is not on PATH, as without
    an activated virtual environment. nbgrader_config.py calls it, so ``.venv/bin/nbgrader`` works as typed."""
    import nbgrader.api

    nbgrader.api.get_alembic_version = _schema_head


@functools.cache
def _schema_head() -> str:
    """The head revision of nbgrader's gradebook migrations, what ``alembic heads`` prints first."""
    import nbgrader
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(Path(nbgrader.__file__).parent / "alembic")).get_current_head()


def nbgrader(course: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``nbgrader <args>`` in the course folder (its nbgrader_config.py applies)."""
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True,
                          text=True, timeout=timeout, check=False)


def convert(course: Path, converter: str, assignment: str, settings: dict[str, Any] | None = None) -> str:
    """nbgrader's ``converter`` (``GenerateAssignment``, ``GenerateFeedback``) on ``assignment`` in this process, as
    ``nbgrader generate_... <assignment> --force`` with ``settings`` ("Class.trait" -> value) on top of the course's
    nbgrader_config.py, without another interpreter's start (seconds of imports per class graded). '' when it
    worked, else its error and log. Converters change the working directory while they run: call from one thread.
    """
    import logging

    import nbgrader.converters
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.utils import capture_log
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    stamp_in_process()
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    extra = Config()
    for name, value in {"CourseDirectory.root": str(Path(course).resolve()), **(settings or {})}.items():
        owner, trait = name.split(".")
        setattr(getattr(extra, owner), trait, value)
    config.merge(extra)
    log = logging.getLogger(f"mha_lab.nbgrader.{converter}")  # its messages go to the result, not to the terminal
    log.propagate = False
    coursedir = CourseDirectory(config=config)
    coursedir.assignment_id = assignment
    app = getattr(nbgrader.converters, converter)(coursedir=coursedir, config=config, log=log)
    app.force = True
    outcome = capture_log(app)
    return "" if outcome["success"] else f"{outcome.get('error', '')}{outcome.get('log', '')}".strip()


@contextlib.contextmanager
def gradebook(course: Path) -> Iterator[Any]:
    """nbgrader's ``Gradebook`` of ``<course>/gradebook.db`` (made when missing), SQLAlchemy's warnings silenced."""
    from nbgrader.api import Gradebook

    stamp_in_process()

    with Gradebook(f"sqlite:///{Path(course) / 'gradebook.db'}", course_id=COURSE_ID) as gb, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy's, about nbgrader's own session handling
        yield gb


def students(course: Path, assignment: str | None = None) -> list[str]:
    """Students with a folder ``submitted/<student>/<assignment>/`` (any assignment when None). A student's id is
    the folder's name as ``text.writable_name`` shows it: a byte that is not UTF-8 appears as ``\\xNN``."""
    return sorted({writable_name(p.parent.name) for p in (Path(course) / "submitted").glob(f"*/{assignment or '*'}")
                   if p.is_dir()})


def submission(course: Path, student: str, assignment: str) -> Path:
    """The folder ``submitted/<student>/<assignment>/`` of the id ``student``, found by its shown name when that
    folder's name is not UTF-8 (``students``)."""
    submitted = Path(course) / "submitted"
    if os.path.lexists(submitted / student):
        return submitted / student / assignment
    found = next((p for p in submitted.iterdir() if writable_name(p.name) == student), submitted / student)
    return found / assignment


def id_problem(student: str) -> str:
    """Why the folder name ``student`` cannot be a student id ('' when it can): a control character (a newline, a
    tab, an escape...) would break the gradebook's exports, nbgrader's command lines and every table it is in."""
    if student.isprintable() and student.strip() == student and student:
        return ""
    return f"the student id {student!r} has control characters or surrounding spaces: rename the folder"


def assignments(course: Path) -> list[str]:
    """Assignments that have a source and at least one submission."""
    return sorted({p.name for p in (Path(course) / "submitted").glob("*/*")
                   if p.is_dir() and (Path(course) / "solutions" / p.name).is_dir()})


def register(course: Path, assignment: str) -> dict[str, nbformat.NotebookNode]:
    """Enter the assignment into the gradebook and return its releases, made by ``nbgrader generate_assignment``
    on a copy of the source (the course's ``assignments/`` is left as it is)."""
    course = Path(course).resolve()
    source = course / "solutions" / assignment
    if not source.is_dir():
        raise FileNotFoundError(f"no assignment {assignment!r}: {source} does not exist")
    with tempfile.TemporaryDirectory(prefix="mha_lab_release_") as tmp:
        shutil.copy(course / "nbgrader_config.py", tmp)
        shutil.copytree(source, Path(tmp) / "solutions" / assignment)
        failed = convert(Path(tmp), "GenerateAssignment", assignment,
                         {"CourseDirectory.db_url": f"sqlite:///{course / 'gradebook.db'}"})
        if failed:
            raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{failed[-2000:]}")
        releases = sorted((Path(tmp) / "assignments" / assignment).glob("*.ipynb"))
        return {p.name: nbformat.read(p, as_version=4) for p in releases}


RELEASE_IGNORE = (".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback")  # nbgrader's CourseDirectory.ignore


def release_files(course: Path, assignment: str) -> dict[str, bytes]:
    """The files the release ships beside its notebooks (``expected.npz``), path within the folder -> bytes.

    ``nbgrader generate_assignment`` copies every file of the source folder but its notebooks into the release;
    the grader gives these to every submission's sandbox, in place of any copy the student handed in.
    """
    source = Path(course) / "solutions" / assignment
    files = {}
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if (path.is_file() and path.suffix != ".ipynb"
                and not any(fnmatch.fnmatch(part, pattern) for part in rel.parts for pattern in RELEASE_IGNORE)):
            files[rel.as_posix()] = path.read_bytes()
    return files


def locate(folder: Path, name: str, alone: bool) -> tuple[str, str]:
    """The file to grade as notebook ``name``, and a note when it has another name ('' otherwise).

    ``alone``: ``name`` is the assignment's only notebook; then a folder holding exactly one ``.ipynb``
    (``ps2_mqa (1).ipynb``, as a browser saves it) is graded as it. ValueError names the files found.
    """
    found = sorted(p.name for p in Path(folder).glob("*.ipynb"))
    if name in found or (Path(folder) / name).is_symlink():
        return name, ""
    if alone and len(found) == 1:
        return found[0], f"graded {writable_name(found[0])} as {name}: hand in the notebook under its own name"
    return name, ""  # submitted_notebook says it is missing, and names the files found


def submitted_notebook(folder: Path, name: str) -> nbformat.NotebookNode:
    """A student's notebook, read without following links; ValueError says why it cannot be graded."""
    path = Path(folder) / name
    for part in (path, *list(path.parents)[:3]):  # the notebook, assignment, student and submitted/ folders
        if part.is_symlink():
            raise ValueError(f"{part.name} is a symbolic link, not a submitted file")
    if os.path.lexists(path) and not path.is_file():
        raise ValueError(f"{name} is not a notebook file (a folder, a pipe or a device)")
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in Path(folder).glob("*.ipynb"))) or "no .ipynb file"
        raise ValueError(f"missing notebook {name} (found: {found})")
    if path.stat().st_size > MAX_NOTEBOOK_BYTES:
        raise ValueError(f"{name} is larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - invalid JSON, wrong schema...: the reason is the message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{name} is not a valid notebook ({type(exc).__name__}: {first[:200]})") from None
    return nb


def _grade_id(cell: nbformat.NotebookNode) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")


def merge(release: nbformat.NotebookNode, submitted: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook to run: the release's graded and locked cells in its order, answer cells as the
    student wrote them, the rest (given code, tests) as released; the student's other cells where they are."""
    known = {_grade_id(c): c for c in release.cells if _grade_id(c)}
    answers, extra, before = {}, [], {}
    for cell in submitted.cells:
        gid = _grade_id(cell)
        if gid in known and gid not in before:
            answers[gid], before[gid], extra = cell.source, extra, []
        elif cell.cell_type in ("code", "markdown"):  # the student's own, or unlocked cells of the release
            extra.append(getattr(nbformat.v4, f"new_{cell.cell_type}_cell")(cell.source))
    merged = nbformat.v4.new_notebook(metadata=release.metadata)
    for cell in (c for c in release.cells if _grade_id(c)):
        gid = _grade_id(cell)
        merged.cells += before.get(gid, [])
        meta = cell.metadata.get("nbgrader", {})
        answered = gid in answers and meta.get("solution") and not meta.get("locked")
        merged.cells.append(nbformat.from_dict({**cell, "source": answers[gid]} if answered else cell))
    merged.cells += extra
    return merged


FEEDBACK_TEMPLATES = Path(__file__).with_name("templates")  # mha_feedback: nbgrader's, made for reading
FEEDBACK_EXPORTER = "mha_lab.grading.feedback_page.FeedbackExporter"  # imports nbconvert: named, not imported


def feedback_exporter() -> dict[str, Any]:
    """The HTMLExporter settings of every feedback page (``make grade``, ``nbgrader generate_feedback``, formgrader's
    button; ``nbgrader_config.py`` sets them): the ``mha_feedback`` template, and what the students wrote or
    displayed sanitised (``safe_html``), and its formulas typeset as MathML (``math_html``), for reading offline."""
    nbgrader_dir = Path(importlib.util.find_spec("nbgrader").origin).parent
    return {"template_name": "mha_feedback", "template_file": "feedback.html.j2", "sanitize_html": True,
            "filters": {"clean_html": safe_html.FILTER, "typeset_math": math_html.FILTER},
            "extra_template_basedirs": [str(FEEDBACK_TEMPLATES),
                                        str(nbgrader_dir / "server_extensions" / "formgrader" / "templates")]}


def feedback(course: Path, assignment: str, who: list[str]) -> str:
    """``nbgrader generate_feedback`` for these students (in this process, ``convert``), with ``feedback_exporter``'s
    settings; '' or what went wrong."""
    if not who:
        return ""
    settings = {f"HTMLExporter.{k}": v for k, v in feedback_exporter().items()}
    settings["GenerateFeedback.exporter_class"] = FEEDBACK_EXPORTER
    settings["CourseDirectory.student_id_exclude"] = ",".join(s for s in students(course)
                                                              if s not in who and not id_problem(s))
    failed = convert(Path(course), "GenerateFeedback", assignment, settings)
    return failed and f"generate_feedback failed: {failed[-300:]}"
