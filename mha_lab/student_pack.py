"""The students' download: the release notebooks and the package they import, nothing else.

``python -m mha_lab student-pack`` (``make student-pack``) writes ``_build/student/mha_lab_student.zip``:

- ``assignments/<name>/<name>.ipynb``: the release notebooks (stubs, visible tests);
- ``mha_lab/``: the package, without the instructor's tools (the grader, ``classroom``, ``grade_bench``,
  this module);
- ``pyproject.toml`` and a ``README.txt`` that says how to install and open them.

Solutions, hidden checks and everything else of the repository stay out; the build refuses to
write a pack in which a solution or hidden-test marker appears.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["INSTRUCTOR_ONLY", "MARKERS", "members", "build", "main"]

REPO = Path(__file__).resolve().parents[1]
# Parts of mha_lab that only instructors use: they hold no answers, but a student has no use for them.
INSTRUCTOR_ONLY = ("mha_lab/grading/", "mha_lab/instructor/", "mha_lab/classroom.py", "mha_lab/grade_bench.py",
                   "mha_lab/student_pack.py")
MARKERS = ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "run_hidden_checks")

README = """MHA Lab: the problem sets

1. Install the companion package once, from this folder:  pip install -e .
   (it needs Python 3.10 or newer; NumPy, matplotlib and tqdm come with it)
2. Open a notebook of assignments/ in Jupyter, JupyterLab or Colab, and read the chapters it
   links first: they are on the course website.
3. Fill in every cell that raises NotImplementedError, run the whole notebook (Restart & Run
   All), and hand in the notebook file under its own name, as your instructor asks.

The visible tests under each answer are quick checks for you. The points come from more
checks, on other shapes, that run when your notebook is graded.
"""


def members(repo: Path = REPO) -> Iterator[tuple[str, Path]]:
    """(name in the zip, file) for every file of the pack, in a stable order."""
    for nb in sorted((repo / "assignments").glob("*/*.ipynb")):
        yield nb.relative_to(repo).as_posix(), nb
    for path in sorted((repo / "mha_lab").rglob("*")):
        name = path.relative_to(repo).as_posix()
        if path.is_file() and "__pycache__" not in path.parts and not name.startswith(INSTRUCTOR_ONLY):
            yield name, path
    yield "pyproject.toml", repo / "pyproject.toml"


def build(out: Path, repo: Path = REPO) -> Path:
    """Write the zip at ``out``; ValueError when a release is missing or a file carries a marker."""
    files = list(members(repo))
    if not any(name.startswith("assignments/") for name, _ in files):
        raise ValueError(f"no release notebooks in {repo / 'assignments'}: run `make assignments` first")
    for name, path in files:
        text = path.read_text(errors="ignore")
        leaked = [m for m in MARKERS if m in text]
        if leaked:
            raise ValueError(f"{name} contains {leaked[0]!r}: a student pack holds no solutions or hidden checks")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("README.txt", README)
        for name, path in files:
            zf.write(path, name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab student-pack", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "_build" / "student" / "mha_lab_student.zip",
                        help="where to write the zip (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        out = build(args.out)
    except ValueError as err:
        print(f"student-pack: {err}", file=sys.stderr)
        return 1
    with zipfile.ZipFile(out) as zf:
        print(f"wrote {out}: {len(zf.namelist())} files, {out.stat().st_size / 2**10:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
