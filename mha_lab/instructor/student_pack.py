"""The students' download: the releases, what they need installed, and how to start; nothing else.

``python -m mha_lab student-pack`` (``make student-pack``) writes ``_build/student/mha_lab_student.zip`` of the
course it runs in (a course folder, or the project):

- ``assignments/<name>/``: the release notebooks (stubs, visible tests) and the ``expected.npz``
  their visible tests compare with;
- ``assignments/requirements.txt``: NumPy, matplotlib, Jupyter, the whole environment a release
  needs and the one it is graded in;
- a ``README.txt`` that says how to install and open them.

No package: ``mha_lab`` is the book's, not the assignments'. Solutions, hidden checks and everything
else of the repository stay out; the build refuses to write a pack in which a solution or hidden-test
marker appears.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["MARKERS", "members", "build", "main"]

REPO = Path(__file__).resolve().parents[2]
MARKERS = ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "run_hidden_checks")

README = """MHA Lab: the problem sets

1. Install what the notebooks need, once:  pip install -r assignments/requirements.txt
   (NumPy, matplotlib and Jupyter; Python 3.10 or newer). Nothing else: the grader runs your
   notebook with exactly these packages. The course's own package, mha_lab, belongs to the book
   and is not available when your work is graded.
2. Open a notebook of assignments/ in Jupyter, JupyterLab or Colab (upload its expected.npz next
   to it), and read the chapters it links first: they are on the course website.
3. Fill in every cell that raises NotImplementedError, run the whole notebook (Restart & Run
   All), and hand in the notebook file under its own name, as your instructor asks.

The visible tests under each answer are quick checks for you. The points come from more
checks, on other shapes, that run when your notebook is graded.
"""


def members(repo: Path = REPO) -> Iterator[tuple[str, Path]]:
    """(name in the zip, file) for every file of the pack, in a stable order."""
    for path in sorted([*(repo / "assignments").glob("*/*.ipynb"), *(repo / "assignments").glob("*/*.npz")]):
        yield path.relative_to(repo).as_posix(), path
    yield "assignments/requirements.txt", repo / "assignments" / "requirements.txt"


def build(out: Path, repo: Path = REPO) -> Path:
    """Write the zip at ``out``; ValueError when a release is missing or a file carries a marker."""
    files = list(members(repo))
    if not any(name.endswith(".ipynb") for name, _ in files):
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
    here = Path.cwd()
    parser = argparse.ArgumentParser(prog="python -m mha_lab student-pack", description=__doc__.splitlines()[0])
    parser.add_argument("--course", type=Path, default=here if (here / "nbgrader_config.py").is_file() else REPO,
                        help="the course whose releases (assignments/) go in (default: here if it is a course, "
                        "else the project)")
    parser.add_argument("--out", type=Path, help="where to write the zip (default: "
                        "<course>/_build/student/mha_lab_student.zip)")
    args = parser.parse_args(argv)
    try:
        out = build(args.out or args.course / "_build" / "student" / "mha_lab_student.zip", args.course)
    except ValueError as err:
        print(f"student-pack: {err}", file=sys.stderr)
        return 1
    with zipfile.ZipFile(out) as zf:
        print(f"wrote {out}: {len(zf.namelist())} files, {out.stat().st_size / 2**10:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
