"""The README's term in ten commands, run as written: its lines, parsed from README.md, run by bash in order on a
copy of the project with no virtual environment on PATH; then the copy's ``git status`` must be empty.

The first line, the set-up, makes ``.venv`` from requirements.txt over the network: it is checked to be that
set-up and not run; the copy gets this test's own environment as its ``.venv`` instead (and its own ``mha_lab``
first on PYTHONPATH, as its editable install would). HOME is a temporary folder holding what an instructor
brings: two hand-ins of ps2_mqa (correct notebooks alone, one of them a day late) and Canvas's gradebook export.
"""

from __future__ import annotations

import csv
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mha_lab.instructor.classroom import fill_release

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- quick start:"
CANVAS = """Student,ID,SIS User ID,SIS Login ID,Section,ps2_mqa (1234)
    Points Possible,,,,,22
"Ontime, Alice",101,u101,alice,S1,
"Late, Bob",102,u102,bob,S1,
"""
HANDINS = {"alice": "2026-12-01 16:00:00.000000 UTC", "bob": "2026-12-02 17:00:00.000000 UTC"}  # bob: 24 h late


def quick_start(readme: str) -> list[str]:
    """The command lines of the README's quick start: the fenced block after the marker, as typed."""
    block = readme.split(MARKER, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _copy_project(to: Path) -> Path:
    """The project's files (tracked and untracked, not ignored) in a fresh git repository, committed."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, to / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "clone"]):
        subprocess.run([*git, *args], cwd=to, check=True, capture_output=True)
    (to / ".venv").symlink_to(sys.prefix)  # the set-up line's result: this environment
    with open(to / ".git" / "info" / "exclude", "a") as f:
        f.write(".venv\n")  # a link, which .gitignore's ".venv/" (a folder) does not match
    return to


def test_quick_start_has_at_most_ten_commands_and_starts_with_the_set_up():
    lines = quick_start((REPO / "README.md").read_text())
    assert 3 <= len(lines) <= 10, lines
    assert "venv" in lines[0] and "requirements.txt" in lines[0], lines[0]


@pytest.mark.slow
def test_the_readme_quick_start_runs_a_term_and_leaves_the_clone_clean(tmp_path):
    lines = quick_start((REPO / "README.md").read_text())
    clone, home = _copy_project(tmp_path / "clone"), tmp_path / "home"
    solution = nbformat.read(clone / "solutions" / "ps2_mqa" / "ps2_mqa.ipynb", as_version=4)
    release = nbformat.read(clone / "assignments" / "ps2_mqa" / "ps2_mqa.ipynb", as_version=4)
    for student, stamp in HANDINS.items():
        folder = home / "handins" / student / "ps2_mqa"
        folder.mkdir(parents=True)
        nbformat.write(fill_release(release, solution), folder / "ps2_mqa.ipynb")  # the notebook alone
        (folder / "timestamp.txt").write_text(stamp + "\n")
    (home / "canvas_export.csv").write_text(CANVAS)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(clone), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines[1:])], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    course = home / "mha_term"
    summary = proc.stdout.split("student ", 1)[1].split("\nwrote in", 1)[0]
    assert max(map(len, summary.splitlines())) <= 100, summary
    assert re.search(r"^bob\s+19\.8\s+22\s+22\s+late 24\.0 h \(-2\.2\)", summary, re.MULTILINE), summary
    with open(course / "canvas_import.csv", newline="") as f:
        scores = {row["SIS Login ID"]: row["ps2_mqa (1234)"] for row in csv.DictReader(f)}
    assert (scores["alice"], scores["bob"]) == ("22", "19.8"), scores
    feedback = {s: html.unescape((course / "feedback" / s / "ps2_mqa" / "ps2_mqa.html").read_text()) for s in HANDINS}
    graded = nbformat.read(course / "autograded" / "alice" / "ps2_mqa" / "ps2_mqa.ipynb", as_version=4)
    errors = [o.ename for c in graded.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors  # the notebook alone, and not an error in its feedback
    assert not re.search(r"FileNotFoundError|NameError|Traceback \(most recent", feedback["alice"])
    assert "24.0 h late, 10% per started day, capped at 50%: \u22122.2" in feedback["bob"]
    assert "all visible tests passed (the hidden checks run when graded)" in feedback["alice"]
    assert (course / "reports" / "ps2_mqa" / "index.html").is_file()
    assert (course / "_build" / "student" / "mha_lab_student.zip").is_file()

    nbgrader = subprocess.run([str(clone / ".venv" / "bin" / "nbgrader"), "db", "assignment", "list"], cwd=course,
                              env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "ps2_mqa (due: 2026-12-01 17:00:00)" in nbgrader.stdout, nbgrader.stderr[-2000:]

    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"the term changed the project's checkout:\n{status}"
    assert not (set(os.listdir(clone)) & {"submitted", "gradebook.db", "feedback", "reports", "canvas_import.csv"})


def test_course_init_refuses_the_checkout_and_a_second_init_and_due_moves_a_date(tmp_path, capsys):
    from mha_lab.__main__ import main
    from mha_lab.instructor import course_folder

    with pytest.raises(ValueError, match="inside the project's checkout"):
        course_folder.init(REPO / "my_course")
    course = course_folder.init(tmp_path / "c")
    with pytest.raises(ValueError, match="a course folder already"):
        course_folder.init(course)
    ignored = (course / ".gitignore").read_text().split()
    assert {"submitted/", "gradebook.db", "feedback/", "reports/", "grades_*.csv", "canvas_*.csv"} <= set(ignored)
    assert 'c.PerDayPenalty.per_day = 0.1' in (course / "nbgrader_config.py").read_text()
    released = sorted(p.parent.name for p in (REPO / "assignments").glob("*/expected.npz"))
    assert sorted(p.parent.name for p in (course / "assignments").glob("*/expected.npz")) == released
    assert main(["due", "ps2_mqa", "2026-12-01 17:00:00 UTC", "--course", str(course)]) == 0
    assert main(["due", "ps2_mqa", "2026-12-03 09:30:00 UTC", "--course", str(course)]) == 0
    assert "due 2026-12-03 09:30:00 UTC (was 2026-12-01 17:00:00 UTC)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["due", "ps2_mqa", "next Friday", "--course", str(course)])
    assert "not a date" in capsys.readouterr().err
