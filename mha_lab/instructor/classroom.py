"""A class of submissions built from the course's own notebooks, each knowing the score it deserves.

An honest student fills the release with the solution's answers; a buggy one carries one
mutant of ``tests/mutants/`` (it loses exactly the points of the cells the mutant breaks); a
blank one hands in the release; a hostile one carries an attack of ``tests/adversarial/``
(it deserves no more than the same notebook without the attack: mostly the blank release).
The grader's test suite and ``grade-bench`` build their classes here and run the real grading
command on them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient

from mha_lab.instructor import spreadsheet

__all__ = ["REPO", "Target", "Attack", "Student", "new_course", "read_notebook", "points", "fill_release",
           "run_release", "answer_cell", "submit", "mutants", "attacks", "honest", "blank", "buggy", "hostile",
           "remove_tree", "run_grader", "read_grades"]

REPO = Path(__file__).resolve().parents[2]  # a clone: solutions/, assignments/, tests/mutants, tests/adversarial
SOLUTION_LINE = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")
GRADER = ("-m", "mha_lab", "grade")  # <assignment> --course DIR --jobs N --timeout S


# --- the course ---------------------------------------------------------------------------------


def new_course(root: Path, assignments: Sequence[str]) -> Path:
    """A course folder as an instructor has it: nbgrader_config.py, the sources and the releases (no gradebook)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "nbgrader_config.py", root)
    for a in assignments:
        for folder in ("solutions", "assignments"):
            shutil.copytree(REPO / folder / a, root / folder / a, dirs_exist_ok=True)
    return root


def read_notebook(course: Path, folder: str, assignment: str) -> nbformat.NotebookNode:
    """``<course>/<folder>/<assignment>/<assignment>.ipynb``; folder is "solutions" or "assignments"."""
    return nbformat.read(course / folder / assignment / f"{assignment}.ipynb", as_version=4)


def points(nb: nbformat.NotebookNode) -> dict[str, float]:
    """grade_id -> points of every graded cell of a notebook."""
    return {c.metadata["nbgrader"]["grade_id"]: float(c.metadata["nbgrader"].get("points", 0))
            for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}


def answer_cell(solution: nbformat.NotebookNode, grade_id: str) -> str:
    """The source of the solution's cell ``grade_id``."""
    for cell in solution.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            return cell.source
    raise KeyError(f"no cell {grade_id!r} in the solution")


def fill_release(release: nbformat.NotebookNode, solution: nbformat.NotebookNode,
                 edits: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """A student's notebook: the release with every answer cell written as in the solution (or ``edits``)."""
    answers = {}
    for cell in solution.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and not meta.get("grade"):
            source = (edits or {}).get(meta["grade_id"], cell.source)
            answers[meta["grade_id"]] = "\n".join(ln for ln in source.split("\n") if not SOLUTION_LINE.match(ln))
    filled = nbformat.from_dict(release)
    for cell in filled.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
    return filled


def run_release(assignment: str, edits: dict[str, str], km: KernelManager) -> nbformat.NotebookNode:
    """The release filled with the solution and ``edits``, run top to bottom in ``km`` as a student runs it.

    The run begins with ``%reset -f`` (no name of the run before survives, as after a restart); a cell
    that raises keeps its error in its outputs and the cells after it still run.
    """
    nb = fill_release(read_notebook(REPO, "assignments", assignment), read_notebook(REPO, "solutions", assignment),
                      edits)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    client = NotebookClient(nb, km=km, timeout=120, allow_errors=True)
    try:
        client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
    return nb


def submit(course: Path, student: str, assignment: str, nb: nbformat.NotebookNode) -> Path:
    """Write ``submitted/<student>/<assignment>/<assignment>.ipynb``; returns the submission folder."""
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / f"{assignment}.ipynb")
    return folder


def _import_from_repo(name: str) -> ModuleType:
    if str(REPO) not in sys.path:  # ``tests`` is a namespace package of the clone
        sys.path.insert(0, str(REPO))
    return importlib.import_module(name)


def mutants(assignment: str) -> list:
    """The one-bug variants of ``tests/mutants/<assignment>.py`` (empty when there is none)."""
    if not (REPO / "tests" / "mutants" / f"{assignment}.py").is_file():
        return []
    return _import_from_repo(f"tests.mutants.{assignment}").MUTANTS


# --- attacks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What an attack is told: its marker, the loopback port to leak to, the course, the repo, a pid to spare.

    Every process an attack starts carries ``marker`` in its environment (``MHA_LAB_ATTACK``) or argv.
    ``protect`` is the process that runs the grader (a test or the benchmark): killing it would stop the
    measurement, not the grader.
    """

    marker: str
    port: int
    course: str
    repo: str
    protect: int


@dataclass(frozen=True)
class Attack:
    """A hostile submission from ``tests/adversarial/<name>.py``.

    The module's docstring says what it does and what stops it. Its function ``cell(marker, port,
    course, repo, protect)`` is not called: its body becomes code in the notebook, in the first
    answer cell (``EVERY_ANSWER_CELL = True``: in place of every answer cell's stub). An optional
    ``prepare(folder, nb, target)`` edits the notebook or adds files to the submission folder.
    ``DESERVES`` names the tests cells its honest part earns (none by default: a blank release).
    """

    name: str
    assignment: str
    summary: str
    code: str
    every_answer_cell: bool
    prepare: Callable | None
    deserves: tuple[str, ...] = ()

    def notebook(self, release: nbformat.NotebookNode, target: Target) -> nbformat.NotebookNode:
        """The release with the attack's code in, told its target, with a child process that must not outlive it."""
        header = textwrap.dedent(f"""\
            import os as _os
            import subprocess as _subprocess
            _os.environ["MHA_LAB_ATTACK"] = {target.marker!r}  # every process it starts carries the marker
            try:  # a plain child process: it must die with the submission
                _subprocess.Popen(["sleep", "3600"], stdin=_subprocess.DEVNULL, stdout=_subprocess.DEVNULL,
                                  stderr=_subprocess.DEVNULL)
            except OSError:
                pass
            marker, port, course, repo, protect = {target.marker!r}, {target.port}, {target.course!r}, \\
                {target.repo!r}, {target.protect}
            """)
        nb = nbformat.from_dict(release)
        answers = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")
                   and not c.metadata["nbgrader"].get("grade")]
        if self.every_answer_cell:
            for cell in answers:
                cell.source = self.code
            answers[0].source = header + self.code
        else:
            answers[0].source = header + self.code + "\n\n" + answers[0].source
        return nb


def _body(path: Path) -> str:
    """The source of the body of ``cell`` in the module at ``path``, dedented (string literals kept as written)."""
    text = path.read_text()
    fn = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "cell"), None)
    if fn is None:
        raise ValueError(f"{path} defines no function cell(marker, port, course, repo, protect)")
    inside_strings = {line for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                      if tok.type == tokenize.STRING for line in range(tok.start[0] + 1, tok.end[0] + 1)}
    indent = " " * fn.body[0].col_offset
    lines = text.splitlines()
    return "\n".join(lines[i - 1] if i in inside_strings else lines[i - 1].removeprefix(indent)
                     for i in range(fn.body[0].lineno, fn.body[-1].end_lineno + 1)) + "\n"


def attacks(folder: Path = REPO / "tests" / "adversarial") -> list[Attack]:
    """Every attack of ``tests/adversarial/``, in name order."""
    found = []
    for path in sorted(folder.glob("[!_]*.py")):
        spec = importlib.util.spec_from_file_location(f"_attack_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # the module only defines functions: nothing hostile runs here
        doc = (module.__doc__ or "").strip()
        if not doc:
            raise ValueError(f"{path} needs a docstring: what the attack does, and what stops it")
        found.append(Attack(path.stem, getattr(module, "ASSIGNMENT", "ps1_per_head_loop"), doc.splitlines()[0],
                            _body(path), getattr(module, "EVERY_ANSWER_CELL", False),
                            getattr(module, "prepare", None), tuple(getattr(module, "DESERVES", ()))))
    return found


# --- a class ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Student:
    """A submission and the score it deserves (``at_most``: a hostile one may get less, never more)."""

    name: str
    kind: str  # honest | buggy | blank | hostile
    expected: float
    at_most: bool = False


def honest(course: Path, name: str, assignment: str, secret: str = "") -> Student:
    """The solution's answers; ``secret`` is a comment line in the first answer, which no one else may see."""
    solution, release = read_notebook(course, "solutions", assignment), read_notebook(course, "assignments", assignment)
    nb = fill_release(release, solution)
    if secret:
        first = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution"))
        first.source = f"# {secret}\n{first.source}"
    submit(course, name, assignment, nb)
    return Student(name, "honest", sum(points(solution).values()))


def blank(course: Path, name: str, assignment: str) -> Student:
    """The release as handed out."""
    submit(course, name, assignment, read_notebook(course, "assignments", assignment))
    return Student(name, "blank", 0.0)


def buggy(course: Path, name: str, assignment: str, index: int) -> Student:
    """The solution with mutant ``index`` of ``tests/mutants/<assignment>.py`` in."""
    found = mutants(assignment)
    if not found:
        raise ValueError(f"no mutants for {assignment} in tests/mutants/")
    m = found[index % len(found)]
    solution, release = read_notebook(course, "solutions", assignment), read_notebook(course, "assignments", assignment)
    submit(course, name, assignment, fill_release(release, solution, {m.grade_id: m.apply(answer_cell(solution,
                                                                                                     m.grade_id))}))
    scores = points(solution)
    return Student(name, "buggy", sum(scores.values()) - sum(scores[g] for g in m.breaks))


def hostile(course: Path, name: str, attack: Attack, target: Target) -> Student:
    """The release with ``attack`` in; it deserves no more than its honest part (``attack.deserves``)."""
    folder = submit(course, name, attack.assignment,
                    attack.notebook(read_notebook(course, "assignments", attack.assignment), target))
    if attack.prepare is not None:
        nb = nbformat.read(folder / f"{attack.assignment}.ipynb", as_version=4)
        attack.prepare(folder, nb, target)
    scores = points(read_notebook(course, "solutions", attack.assignment))
    return Student(name, "hostile", sum(scores[g] for g in attack.deserves), at_most=True)


def remove_tree(root: Path) -> None:
    """Remove the folder ``root`` and everything in it, however deep: one folder open at a time, by file
    descriptor (a hostile folder's paths outgrow PATH_MAX, and shutil.rmtree recurses past Python's limit)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd, below = os.open(root, flags), []  # below: the names from root down to the open folder
    while True:
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                os.unlink(e.name, dir_fd=fd)
        inner = next((e.name for e in entries if e.is_dir(follow_symlinks=False)), None)
        if inner is not None:
            below.append(inner)
            fd, outer = os.open(inner, flags, dir_fd=fd), fd
            os.close(outer)
            continue
        if not below:
            os.close(fd)
            os.rmdir(root)
            return
        fd, inner_fd = os.open("..", flags, dir_fd=fd), fd
        os.close(inner_fd)
        os.rmdir(below.pop(), dir_fd=fd)


# --- grading ------------------------------------------------------------------------------------


def run_grader(course: Path, assignment: str, *, jobs: int = 2, timeout: float = 60, limit: float = 900,
               extra: Sequence[str] = (), uid: int | None = None) -> tuple[subprocess.CompletedProcess | None, float]:
    """Run the grading command on the course as an instructor would, as user ``uid`` when given (``setpriv``:
    the course must be theirs); returns (process, wall seconds).

    The process is None when it ran past ``limit`` seconds: then its whole process group is killed.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    python = sys.executable
    if uid is not None:  # the system's interpreter on this environment's packages: a venv's may be in root's home
        python = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/bin:/bin") or python
        env |= {"HOME": str(course), "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin",
                "JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter"),
                "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], sysconfig.get_paths()["purelib"]])}
    user = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    cmd = [*user, python, *GRADER, assignment, "--course", str(course), "--jobs", str(jobs),
           "--timeout", str(timeout), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=course, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, time.perf_counter() - start
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.perf_counter() - start


def read_grades(course: Path, assignment: str) -> list[dict[str, str]]:
    """The rows of ``grades_<assignment>.csv`` (every column as text); [] when the file is missing."""
    path = course / f"grades_{assignment}.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(spreadsheet.DictReader(f))
