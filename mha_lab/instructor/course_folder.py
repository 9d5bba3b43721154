"""A course of its own: ``python -m mha_lab course init DIR`` makes the folder a term is run in, outside the
package's checkout, so that no student's work, grade or export ever lands in the project.

``DIR`` gets what nbgrader expects of a course root, with the project's folder names:

- ``nbgrader_config.py``: the project's configuration, then the term's own settings (the late penalty and the
  time a cell may take), each with a comment: they are set here, never in the project;
- ``solutions/<a>/``: the sources (nbgrader's ``source_directory``) and ``assignments/<a>/``: the releases
  (``release_directory``), copies of the project's, so that ``nbgrader generate_assignment`` run here writes here;
- ``.gitignore``: every file that holds students' data (submissions, gradebook, feedback, grades, reports, LMS
  files), should the folder be kept in git.

The hidden checks stay in the project (``tests/hidden/``, found beside ``mha_lab``); a ``tests/hidden/`` folder in
``DIR`` takes their place. Every instructor command runs in ``DIR`` with the project's interpreter, no activated
virtual environment needed: ``<project>/.venv/bin/python -m mha_lab grade <a>`` (``report``, ``due``, ``export``,
``student-pack``) and ``<project>/.venv/bin/nbgrader ...``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PROJECT", "STUDENT_DATA", "TERM_SETTINGS", "init", "main"]

PROJECT = Path(__file__).resolve().parents[2]  # the checkout: nbgrader_config.py, solutions/, assignments/

# Everything a term writes that holds students' data, as .gitignore patterns.
STUDENT_DATA = ["submitted/", "autograded/", "feedback/", "downloaded/", "gradebook.db", "*.db-journal",
                "reports/", "grades_*.csv", "grades.csv", "grades_long.csv", "canvas_*.csv", "extensions.csv",
                ".nbgrader.log", "_build/"]

TERM_SETTINGS = '''
# --- This term's settings: change them here (the project's own nbgrader_config.py stays as it is) -------------

# Late work, per notebook: a fraction of the score per started day late, at most a cap. The due date is the
# gradebook's (python -m mha_lab due <assignment> "2026-12-01 17:00:00 UTC"); extensions.csv moves one student's.
c.AssignLatePenalties.plugin_class = "mha_lab.instructor.term.PerDayPenalty"
c.PerDayPenalty.per_day = 0.1  # 10% of the score per started day late
c.PerDayPenalty.cap = 0.5  # never more than half of it
# No penalty instead: delete the three lines above. Late work scores 0: delete them and write
# c.LateSubmissionPlugin.penalty_method = "zero"

# Seconds a cell of a submission may run before it is stopped (the solutions need well under a second).
c.Execute.timeout = 60
'''


def init(folder: Path, project: Path = PROJECT) -> Path:
    """Make the course folder ``folder`` from the project at ``project``; returns it, resolved.

    ValueError when it already holds a course, or lies inside the project's checkout.
    """
    folder = Path(folder).expanduser().resolve()
    project = Path(project).resolve()
    if folder == project or project in folder.parents:
        raise ValueError(f"{folder} is inside the project's checkout {project}: a course keeps students' data, "
                         "so it lives in a folder of its own (e.g. ~/mha_course)")
    if (folder / "nbgrader_config.py").exists():
        raise ValueError(f"{folder} is a course folder already (it has nbgrader_config.py)")
    folder.mkdir(parents=True, exist_ok=True)
    config = (project / "nbgrader_config.py").read_text()
    (folder / "nbgrader_config.py").write_text(config.rstrip("\n") + "\n" + TERM_SETTINGS)
    for name in ("solutions", "assignments"):
        shutil.copytree(project / name, folder / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    (folder / ".gitignore").write_text("# students' data: never committed\n" + "\n".join(STUDENT_DATA) + "\n")
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab course", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    made = actions.add_parser("init", help="make a course folder DIR outside the project")
    made.add_argument("folder", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    try:
        folder = init(args.folder)
    except (ValueError, OSError) as exc:
        parser.exit(1, f"course init: {exc}\n")
    python = Path(sys.executable)
    print(f"made the course {folder}: nbgrader_config.py (this term's settings at its end), solutions/, "
          f"assignments/, .gitignore\nrun every command there, e.g.\n  cd {folder}\n"
          f"  {python} -m mha_lab due <assignment> '2026-12-01 17:00:00 UTC'\n"
          f"  {python} -m mha_lab grade <assignment>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
