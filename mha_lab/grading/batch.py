"""Grade one submission (``grade_submission``: its notebooks, merged with the release, run in a sandbox;
every tests cell is judged here), or a class on Dask ``distributed`` (``grade_class``: each submission
travels to a worker as bytes, ``grade_packed``; a task whose worker dies is tried once more). Only the client
writes the gradebook, autograded notebooks and feedback, after the sandboxes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from tqdm import tqdm

from mha_lab.grading import abilities, checks, judge, text, transport
from mha_lab.grading import course as courses
from mha_lab.grading.remote import RemoteSubmission
from mha_lab.grading.sandbox import NOT_MEASURED, Limits, private_copy
from mha_lab.grading.worker import OUTPUT_CHARS

__all__ = ["CellResult", "StudentResult", "MEMORY_READING", "memory_reading", "grade_submission", "grade_packed",
           "record", "dask_client", "grade_class"]

DEFAULT_LIMITS = Limits()
GRACE_SECONDS = 30.0  # past a submission's deadline before its grading process is stopped from outside
IN_FLIGHT = 2  # packed submissions per worker held at once: one graded, one waiting


@dataclass
class CellResult:
    """One autograder tests cell of one student: its points and, when it failed, why."""

    grade_id: str
    score: float
    max_score: float
    message: str = ""
    notebook: str = ""
    memory: list[tuple[int | None, int]] = field(default_factory=list)  # (peak, budget) bytes of its memory checks


MEMORY_READING = re.compile(r"peak (?P<peak>[\d.]+) MiB of a (?P<budget>[\d.]+) MiB budget")  # memory_reading's


def memory_reading(readings: Iterable[tuple[int | None, int]]) -> str:
    """The grader's memory readings of a tests cell, as the feedback, the grade sheet and the report give them:
    "peak 9.93 MiB of a 12.00 MiB budget" (MiB = 2**20 bytes), or "not measured"."""
    return "; ".join("not measured" if peak is None else f"peak {peak / 2**20:.2f} MiB of a {budget / 2**20:.2f} MiB "
                     "budget" for peak, budget in readings)


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
                     student: str = "", queued_at: float | None = None,
                     release_files: Mapping[str, bytes] | None = None) -> StudentResult:
    """Grade the submission in ``folder`` against the assignment's ``releases`` (name -> notebook) and its
    ``hidden`` checks: run each notebook in a sandbox, judge every tests cell here, all before the sandbox's
    deadline (``limits.seconds`` from its start): a cell still to judge past it scores nothing and says so.
    Never raises.

    ``release_files``: what the release ships beside its notebooks (``courses.release_files``), given to the sandbox in
    place of the student's copies, so that a notebook handed in alone runs as it does for the student."""
    result = StudentResult(student or Path(folder).parent.name)
    result.timings = {"queue": time.time() - queued_at if queued_at else 0.0, "run": 0.0, "judge": 0.0}
    result.cells = [CellResult(c.metadata.nbgrader.grade_id, 0.0, float(c.metadata.nbgrader.get("points", 0)),
                               notebook=Path(n).stem) for n, release in releases.items() for c in release.cells
                    if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    result.max_score = sum(c.max_score for c in result.cells)
    try:
        files = {n: courses.locate(folder, n, alone=len(releases) == 1) for n in releases}
        submitted = {n: courses.submitted_notebook(folder, f) for n, (f, _) in files.items()}
    except (ValueError, OSError) as exc:  # OSError: a file the grader may not read, or that vanished
        result.error = str(exc) if isinstance(exc, ValueError) else f"the submission cannot be read ({exc})"
        return result
    result.note = "; ".join(note for _, note in files.values() if note)
    module = judge.load(hidden)
    for name, release in releases.items():
        nb = courses.merge(nbformat.from_dict(release), submitted[name])
        if files[name][1]:
            nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"**Note:** {files[name][1]}."))
        code = [c for c in nb.cells if c.cell_type == "code"]
        t0 = time.time()
        with _with_release_files(Path(folder), release_files or {}, limits) as given, \
                closing(RemoteSubmission(given, limits)) as sandboxed:
            try:
                ran = sandboxed.run([c.source for c in code], _definitions(code))
                for count, (cell, (text, error)) in enumerate(zip(code, ran, strict=False), start=1):
                    cell.outputs, cell.execution_count = _outputs(str(text), str(error)), count  # In [count]
            except Exception as exc:  # noqa: BLE001 - the worker stopped, or answered in a shape it should not
                result.error = str(exc)
            t1 = time.time()
            by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in code}
            for cell in (c for c in result.cells if c.notebook == Path(name).stem):
                if time.monotonic() > sandboxed.deadline:  # the grader's judging counts towards it too
                    why = sandboxed.stopped or f"the submission ran past its {limits.seconds:.0f} s"
                    result.error, cell.message = result.error or why, f"{cell.grade_id}: not judged: {why}"
                else:
                    with checks.recording_memory() as readings:
                        cell.message = judge.judge_cell(module, cell.grade_id, sandboxed)
                    cell.memory = readings
                cell.score = 0.0 if cell.message else cell.max_score
                if cell.memory:  # beside the student's own reading, printed above by their visible test
                    by_id[cell.grade_id].outputs.append(nbformat.v4.new_output("stream", name="stdout", text=(
                        f"The grader measured, from outside your process: {memory_reading(cell.memory)}\n")))
                if cell.message:
                    by_id[cell.grade_id].outputs.append(nbformat.v4.new_output(
                        "error", ename="HiddenCheckFailure", evalue=cell.message, traceback=[cell.message]))
        result.timings["run"] += t1 - t0
        result.timings["judge"] += time.time() - t1
        result.error = result.error or sandboxed.stopped
        result.memory = sandboxed.memory
        result.notebooks[name] = nb
    result.score = sum(c.score for c in result.cells)
    return _writable(result)


def _writable(result: StudentResult) -> StudentResult:
    """``result`` with every string in it made writable (``text.writable``: the notebooks' sources, outputs and
    metadata, the messages), where the student's text enters everything the grader writes; a note says so to the
    student when some had to change."""
    changed = False
    for nb in result.notebooks.values():
        changed |= text.writable_tree(nb)[1]
    for cell in result.cells:
        changed |= (message := text.writable(cell.message)) is not cell.message
        cell.message = message
    error, note = text.writable(result.error), text.writable(result.note)
    changed |= error is not result.error or note is not result.note
    result.error, result.note = error, "; ".join(filter(None, [note, text.NOTE if changed else ""]))
    return result


def grade_packed(packed: transport.Packed, assignment: transport.Assignment, limits: Limits = DEFAULT_LIMITS, *,
                 student: str, queued_at: float | None = None) -> StudentResult:
    """On a grading worker: unpack the submission into a private temporary folder and grade it there against
    ``assignment`` (its release and hidden checks, sent once per worker); both folders are gone afterwards."""
    if packed.error:
        return StudentResult(student, error=packed.error)
    try:
        with transport.unpacked(packed, assignment.name) as folder, transport.hidden_checks(assignment) as hidden:
            result = grade_submission(folder, assignment.releases, hidden, limits, student=student,
                                      queued_at=queued_at, release_files=assignment.release_files)
    except ValueError as exc:
        return StudentResult(student, error=text.writable(str(exc)))
    result.note = "; ".join(filter(None, [packed.note, result.note]))
    return result


def _on_worker(assignment: transport.Assignment) -> Any:
    """A Dask worker plugin that holds ``assignment`` on every worker, those that join or restart later too."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class Held(WorkerPlugin):
        name = f"mha_lab:{assignment.name}:{hash((assignment.hidden_source, repr(assignment.releases))):x}"

        def __init__(self) -> None:
            self.assignment = assignment

    return Held()


def _grade_held(packed: transport.Packed, plugin: str, limits: Limits, **kwargs: Any) -> StudentResult:
    """``grade_packed`` with the assignment the worker holds (``_on_worker``)."""
    from distributed import get_worker

    return grade_packed(packed, get_worker().plugins[plugin].assignment, limits, **kwargs)


@contextmanager
def _with_release_files(folder: Path, files: Mapping[str, bytes], limits: Limits) -> Iterator[Path]:
    """The submission folder as its sandbox gets it: the student's files, with the release's ``files`` in place
    of any copy (or link, or folder) of the same name the student handed in."""
    if not files:
        yield folder
        return
    copy = private_copy(folder, limits)
    try:
        for name, data in files.items():
            target = copy / name
            for part in [*reversed(target.parents[:len(Path(name).parts) - 1]), target]:  # each folder, then the file
                if part.is_symlink() or (part.exists() and (part == target or not part.is_dir())):
                    shutil.rmtree(part) if part.is_dir() and not part.is_symlink() else part.unlink()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(0o644)
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)


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


def record(course: Path, assignment: str, results: Iterable[StudentResult], gradebook: Any = None) -> list[str]:
    """Write each result that graded anything (cells or notebooks): its scores to the gradebook, its notebooks to
    ``autograded/<student>/<assignment>/``. Returns their students. ``gradebook``: the course's, open (a grading
    run keeps one open: each one opened compiles its queries afresh); else one is opened for these results."""
    done = [r for r in results if r.notebooks or r.cells]
    with nullcontext(gradebook) if gradebook is not None else courses.gradebook(course) as gb:
        for r in done:
            _record(course, assignment, r, gb)
    return [r.student for r in done]


def _record(course: Path, assignment: str, r: StudentResult, gb: Any) -> None:
    """One result: its notebooks into ``autograded/``, then its scores into the open gradebook ``gb``; when either
    fails, neither is left behind (the exception goes on)."""
    folder = Path(course) / "autograded" / r.student / assignment
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True)
        for name, nb in r.notebooks.items():
            nbformat.write(nbformat.from_dict(nb), folder / name)
        gb.update_or_create_student(r.student)
        gb.update_or_create_submission(assignment, r.student)
        for c in r.cells:
            grade = gb.find_grade(c.grade_id, c.notebook, assignment, r.student)
            grade.auto_score = c.score  # as nbgrader's SaveAutoGrades; memory not measured: the instructor's
            grade.needs_manual_grade = NOT_MEASURED in c.message
        gb.db.commit()
    except BaseException:
        gb.db.rollback()
        shutil.rmtree(folder, ignore_errors=True)
        raise


@contextmanager
def dask_client(jobs: int = 2, scheduler: str | None = None, *, dashboard: bool = False) -> Iterator[Any]:
    """A Dask client: of the scheduler at ``scheduler``, else of a LocalCluster of ``jobs`` processes, with Dask's
    dashboard on :8787 (or the next free port) only when ``dashboard``: otherwise its scheduler serves no page, on a
    free port of 127.0.0.1 (Dask's default would take :8787 and warn when it is taken)."""
    import dask
    from distributed import Client

    # a task whose worker dies is tried once more, and holds no other task up (each worker holds only the
    # task it runs); workers may start sandboxes. Workers are forked from one server process per grading process,
    # which has imported distributed and NumPy once: a worker spawned afresh imported them itself (0.6 s each,
    # for every worker of every class graded, and for each one restarted because its judging hung). The server
    # keeps the environment it started with: each worker is given this process's environment as it is now.
    # Without a dashboard nobody reads the statistical profiler, which samples each worker's thread every 10 ms.
    with dask.config.set({"distributed.scheduler.allowed-failures": 1, "distributed.scheduler.worker-saturation": 1.0,
                          "distributed.worker.daemon": False,
                          "distributed.worker.multiprocessing-method": "forkserver",
                          **({} if dashboard else {"distributed.scheduler.http.routes": [],
                                                   "distributed.worker.profile.enabled": False})}):
        quiet = {"dashboard_address": ":8787"} if dashboard else {
            "dashboard_address": None, "scheduler_kwargs": {"dashboard_address": "127.0.0.1:0"}}
        with Client(scheduler) if scheduler else Client(n_workers=jobs, threads_per_worker=1, processes=True,
                                                        silence_logs=50, env=dict(os.environ), **quiet) as client:
            yield client


def grade_class(course: Path, assignment: str, *, students: Iterable[str] | None = None, client: Any = None,
                jobs: int = 2, scheduler: str | None = None, limits: Limits = DEFAULT_LIMITS,
                progress: bool = True, grace: float | None = None, require_memory: bool = False,
                before_feedback: Callable[[list[str]], Any] | None = None) -> list[StudentResult]:
    """Grade every submission of ``assignment`` (or only ``students``), record grades and feedback.

    Runs on ``client``, else on ``dask_client(jobs, scheduler)``. Each student is one boundary: whatever fails in
    packing, grading, recording or the feedback of one student is recorded for that student alone ("not graded:
    <reason>", or graded with what could not be written), and the class goes on. Students stream through: at most
    ``IN_FLIGHT`` packed submissions per worker at a time, so the client's memory does not grow with the class.
    One still grading ``grace`` seconds (default ``GRACE_SECONDS``) past its deadline is stopped and recorded as
    not graded, with why, as is a student id that cannot be one. Tasks go to workers that can make a sandbox, and
    to workers that measure memory when the checks do (``abilities.place``: ``abilities.CannotGradeError`` before
    any grading when there are none, or none measures and ``require_memory``). ``before_feedback`` is called
    with the recorded students between the gradebook and the feedback (the term's late penalties go into both).
    """
    course = Path(course).resolve()
    grace = GRACE_SECONDS if grace is None else grace
    hidden_path = judge.hidden_module(assignment, course)
    work = transport.Assignment(assignment, courses.register(course, assignment), hidden_path.read_text(),
                                courses.release_files(course, assignment))
    names = sorted(students) if students is not None else courses.students(course, assignment)
    results = {s: StudentResult(s, error=why) for s in names if (why := courses.id_problem(s))}
    recorded: list[str] = []
    with nullcontext(client) if client is not None else dask_client(jobs, scheduler) as client:
        needs = abilities.place(client, limits, measures=judge.measures_memory(hidden_path),
                                   require_memory=require_memory)
        plugin = _on_worker(work)  # the release and hidden checks go to each worker once, not with each task
        client.register_plugin(plugin)

        def start(s: str) -> Any:
            packed = transport.pack(courses.submission(course, s, assignment), limits.scratch)
            return client.submit(_grade_held, packed, plugin.name, limits, student=s, queued_at=time.time(),
                                 pure=False, retries=1, resources=needs or None)

        window = IN_FLIGHT * max(len(client.scheduler_info().get("workers", {})), 1)
        todo = iter([s for s in names if s not in results])
        with tqdm(total=len(names), initial=len(results), desc=f"grade {assignment}", unit="submission",
                  disable=not progress) as bar, courses.gradebook(course) as gb:
            for s, result in _as_graded(client, todo, start, window, limits.seconds + grace):
                results[s] = result
                try:
                    recorded += record(course, assignment, [result], gb)
                except Exception as exc:  # noqa: BLE001 - this student's alone: the class goes on
                    result.error = f"graded, but not recorded ({_reason(exc)}); {result.error}".removesuffix("; ")
                bar.update(1)
    if before_feedback is not None:
        before_feedback(recorded)
    problem = courses.feedback(course, assignment, recorded)
    for s in recorded:
        if not any((course / "feedback" / s / assignment).glob("*.html")):
            results[s].error = results[s].error or f"graded, but no feedback page was written: {problem or '?'}"
    return [results[s] for s in names]


def _reason(exc: BaseException) -> str:
    """An exception as one short line of the grade sheet."""
    return text.writable(f"{type(exc).__name__}: {exc}")[:300]


def _executing(dask_worker: Any) -> list[str]:
    """On a Dask worker: the keys of the tasks it is running now (not those waiting there for a thread)."""
    return [ts.key for ts in dask_worker.state.executing]


def _as_graded(client: Any, todo: Iterator[str], start: Callable[[str], Any], window: int,
               allowed: float) -> Iterator[tuple[str, StudentResult]]:
    """(student, result) of each student of ``todo`` as it ends. ``start(s)`` packs and submits one; at most
    ``window`` are packed and in flight at once, and one whose packing fails is not graded, with why. One that
    has run ``allowed`` seconds (its sandbox's deadline passed long ago: the grader's own work is what is stuck)
    is cancelled and its Dask worker restarted. The clock starts when a worker starts the task, not when the task
    is queued there."""
    pending, started, polled = {}, {}, 0.0
    while True:
        while len(pending) < window and (s := next(todo, None)) is not None:
            try:
                pending[start(s)] = s
            except Exception as exc:  # noqa: BLE001 - a folder that cannot be packed stops no one else
                yield s, StudentResult(s, error=f"not graded: its folder could not be packed ({_reason(exc)})")
        if not pending:
            return
        done = [f for f in pending if f.done()]
        for future in done:
            s = pending.pop(future)
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - its Dask worker died twice (KilledWorker), or it raised twice
                result = StudentResult(s, error=f"grading failed twice: {_reason(exc)}")
            future.release()  # its result is here now: a worker restarted later must not compute it again
            yield s, result
        now = time.monotonic()
        if now - polled >= 1.0:  # a round trip to every worker: once a second is enough for deadlines of minutes
            polled = now
            for worker, keys in client.run(_executing, on_error="ignore").items():
                for future in [f for f in pending if f.key in keys]:
                    if now - started.setdefault(future, now) > allowed:
                        s = pending.pop(future)
                        client.cancel(future)
                        with contextlib.suppress(Exception):  # a worker that is gone already needs no restart
                            client.restart_workers([worker], raise_for_error=False)
                        yield s, StudentResult(s, error=f"grading ran {allowed:.0f} s without finishing: stopped")
        if not done:
            time.sleep(0.2)
