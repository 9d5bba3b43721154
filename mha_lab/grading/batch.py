"""Grade one submission (``grade_submission``: its notebooks, merged with the release, run in a sandbox;
every tests cell is judged here), or a class on Dask ``distributed`` (``grade_class``: a task whose worker
dies is tried once more). The gradebook, autograded notebooks and feedback are written after the sandboxes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from tqdm import tqdm

from mha_lab.grading import course as courses
from mha_lab.grading import judge
from mha_lab.grading.remote import RemoteSubmission
from mha_lab.grading.sandbox import NOT_MEASURED, Limits
from mha_lab.grading.worker import OUTPUT_CHARS

__all__ = ["CellResult", "StudentResult", "grade_submission", "record", "dask_client", "grade_class"]

DEFAULT_LIMITS = Limits()


@dataclass
class CellResult:
    """One autograder tests cell of one student: its points and, when it failed, why."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""
    notebook: str = ""


@dataclass
class StudentResult:
    """A student's grade for one assignment; ``error`` says why it could not be graded at all."""

    student: str
    score: float = 0.0
    max_score: float = 0.0
    cells: list[CellResult] = field(default_factory=list)
    error: str = ""
    note: str = ""  # graded, with a remark: a notebook under another name
    timings: dict[str, float] = field(default_factory=dict)  # seconds: queue, run, judge
    notebooks: dict[str, dict] = field(default_factory=dict)  # name -> the executed notebook, for feedback
    memory: str = ""  # how its memory was measured (``sandbox.memory_mode``), or why it was not


def grade_submission(folder: Path, releases: dict[str, dict], hidden: Path, limits: Limits = DEFAULT_LIMITS, *,
                     student: str = "", queued_at: float | None = None) -> StudentResult:
    """Grade the submission in ``folder`` against the assignment's ``releases`` (name -> notebook) and its
    ``hidden`` checks: run it in a sandbox, judge every tests cell here. Never raises."""
    result = StudentResult(student or Path(folder).parent.name)
    result.timings = {"queue": time.time() - queued_at if queued_at else 0.0, "run": 0.0, "judge": 0.0}
    result.cells = [CellResult(c.metadata.nbgrader.grade_id, 0.0, float(c.metadata.nbgrader.get("points", 0)),
                               notebook=Path(n).stem) for n, release in releases.items() for c in release.cells
                    if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    result.max_score = sum(c.max_score for c in result.cells)
    try:
        files = {n: courses.locate(folder, n, alone=len(releases) == 1) for n in releases}
        submitted = {n: courses.submitted_notebook(folder, f) for n, (f, _) in files.items()}
    except ValueError as exc:
        result.error = str(exc)
        return result
    result.note = "; ".join(note for _, note in files.values() if note)
    module = judge.load(hidden)
    for name, release in releases.items():
        nb = courses.merge(nbformat.from_dict(release), submitted[name])
        if files[name][1]:
            nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"**Note:** {files[name][1]}."))
        code = [c for c in nb.cells if c.cell_type == "code"]
        t0 = time.time()
        with closing(RemoteSubmission(Path(folder), limits)) as sandboxed:
            try:
                for cell, (text, error) in zip(code, sandboxed.run([c.source for c in code], _definitions(code)),
                                               strict=False):
                    cell.outputs = _outputs(str(text), str(error))
            except Exception as exc:  # noqa: BLE001 - the worker stopped, or answered in a shape it should not
                result.error = str(exc)
            t1 = time.time()
            by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in code}
            for cell in (c for c in result.cells if c.notebook == Path(name).stem):
                cell.message = judge.judge_cell(module, cell.grade_id, sandboxed)
                cell.score = 0.0 if cell.message else cell.max_score
                if cell.message:
                    by_id[cell.grade_id].outputs.append(nbformat.v4.new_output(
                        "error", ename="HiddenCheckFailure", evalue=cell.message, traceback=[cell.message]))
        result.timings["run"] += t1 - t0
        result.timings["judge"] += time.time() - t1
        result.error = result.error or sandboxed.stopped
        result.memory = sandboxed.memory
        result.notebooks[name] = nb
    result.score = sum(c.score for c in result.cells)
    return result


def _definitions(code: list[nbformat.NotebookNode]) -> tuple[list[str], list[str]]:
    """The release's own cells before the first answer cell (``course.merge`` keeps nbgrader's metadata on those
    only), then the student's cells there and, up to the last answer cell, those that are not tests."""
    answers = [i for i, c in enumerate(code) if c.metadata.get("nbgrader", {}).get("solution")] or [0]
    given = [i for i in range(answers[0]) if code[i].metadata.get("nbgrader")]
    return ([code[i].source for i in given], [c.source for i, c in enumerate(code[:answers[-1] + 1])
                                              if i not in given and not c.metadata.get("nbgrader", {}).get("grade")])


def _outputs(text: str, error: str) -> list[nbformat.NotebookNode]:
    """A cell's outputs for the feedback, from the strings the sandbox sent, cut to a readable size."""
    outputs = [nbformat.v4.new_output("stream", name="stdout", text=text[:OUTPUT_CHARS])] if text else []
    if error:
        ename, _, evalue = error[:2000].partition(": ")
        outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[error[:2000]]))
    return outputs


def record(course: Path, assignment: str, results: Iterable[StudentResult]) -> list[str]:
    """Write each result that graded anything (cells or notebooks): its scores to the gradebook, its notebooks to
    ``autograded/<student>/<assignment>/``. Returns their students."""
    done = [r for r in results if r.notebooks or r.cells]
    for r in done:
        with courses.gradebook(course) as gb:
            gb.update_or_create_student(r.student)
            gb.update_or_create_submission(assignment, r.student)
            for c in r.cells:
                grade = gb.find_grade(c.grade_id, c.notebook, assignment, r.student)
                grade.auto_score = c.score  # as nbgrader's SaveAutoGrades; memory not measured: the instructor's
                grade.needs_manual_grade = NOT_MEASURED in c.message
            gb.db.commit()
        folder = Path(course) / "autograded" / r.student / assignment
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, nb in r.notebooks.items():
            nbformat.write(nbformat.from_dict(nb), folder / name)
    return [r.student for r in done]


@contextmanager
def dask_client(jobs: int = 2, scheduler: str | None = None) -> Iterator[Any]:
    """A Dask client: of the scheduler at ``scheduler``, else of a LocalCluster of ``jobs`` processes."""
    import dask
    from distributed import Client

    # a task whose worker dies is tried once more, and holds no other task up (each worker holds only the
    # task it runs); workers may start sandboxes
    with dask.config.set({"distributed.scheduler.allowed-failures": 1, "distributed.scheduler.worker-saturation": 1.0,
                          "distributed.worker.daemon": False}):
        with Client(scheduler) if scheduler else Client(n_workers=jobs, threads_per_worker=1, processes=True,
                                                        dashboard_address=None, silence_logs=50) as client:
            yield client


def grade_class(course: Path, assignment: str, *, students: Iterable[str] | None = None, client: Any = None,
                jobs: int = 2, scheduler: str | None = None, limits: Limits = DEFAULT_LIMITS,
                progress: bool = True,
                before_feedback: Callable[[list[str]], Any] | None = None) -> list[StudentResult]:
    """Grade every submission of ``assignment`` (or only ``students``), record grades and feedback.

    Runs on ``client``, else on ``dask_client(jobs, scheduler)``. ``before_feedback`` is called with the
    recorded students between the gradebook and the feedback (the term's late penalties go into both).
    """
    from distributed import as_completed

    course = Path(course).resolve()
    releases, hidden = courses.register(course, assignment), judge.hidden_module(assignment, course)
    names = sorted(students) if students is not None else courses.students(course, assignment)
    results: dict[str, StudentResult] = {}
    with nullcontext(client) if client is not None else dask_client(jobs, scheduler) as client:
        futures = {client.submit(grade_submission, course / "submitted" / s / assignment, releases, hidden, limits,
                                 student=s, queued_at=time.time(), pure=False, retries=1): s for s in names}
        with tqdm(total=len(names), desc=f"grade {assignment}", unit="submission", disable=not progress) as bar:
            for future in as_completed(futures):
                s = futures[future]
                try:
                    results[s] = future.result()
                except Exception as exc:  # noqa: BLE001 - its Dask worker died twice (KilledWorker), or it raised twice
                    results[s] = StudentResult(s, error=f"grading failed twice: {type(exc).__name__}: {exc}")
                bar.update(1)
    recorded = record(course, assignment, [results[s] for s in names])
    if before_feedback is not None:
        before_feedback(recorded)
    problem = courses.feedback(course, assignment, [s for s in names if results[s].notebooks])
    for s in names:
        results[s].error = results[s].error or problem
    return [results[s] for s in names]
