"""The README's term in ten commands, run as written: its lines, parsed from README.md, run by bash in order on a
copy of the project with no virtual environment on PATH, then every other command of the README in the shell they
leave (``as_run``); then the copy's ``git status`` must be empty.

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
import shlex
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


# Every command the README shows: the lines of its ```bash blocks and the `spans` of its text that start with a program.
PROGRAMS = r"(?:\$py|\$nbgrader|make|python3?|nbgrader|pytest|dask|torchrun|pip|apt-get|systemd-run|cp|cd|jupyter\S*)"
SPAN = re.compile(rf"`({PROGRAMS} [^`]*|\$nbgrader)`")
# The programs a command may start with in the quick start's shell: its two names, make in the clone, and what
# the reader installs or has (pip in a reader's or student's own environment; a Debian host's tools)
TYPED = re.compile(r"^(\$py -m |\$nbgrader( |$)|make [a-z-]+( |$)|(py|nbgrader)=\$PWD/\.venv/bin/|python3 -m venv |"
                   r"cp |pip install |apt-get install |systemd-run )")
REAL = ("$py -m mha_lab due ", "$py -m mha_lab report ", "$py -m mha_lab export --canvas ", "$nbgrader export")
PLACEHOLDERS = {"<A>": "ps2_mqa", "<assignment>": "ps2_mqa", "<export>.csv": "~/canvas_export.csv",
                "<file>": "readme_out.csv", " A...": " ps2_mqa"}


def readme_commands(readme: str) -> list[str]:
    """Every command of the README, as typed: lines of its bash blocks (comments cut) and command spans."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        found += [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()[:1] not in ("", "#")]
    return found + [m.group(1) for m in SPAN.finditer(readme)]


def shape(command: str) -> tuple[str, ...]:
    """A command's program and subcommand and the names of its options: all that running it checks where its values
    are this test's placeholders."""
    words = command.split()
    return (*words[:4], *sorted(w for w in words[4:] if w.startswith("--")))


def as_run(command: str) -> str | None:
    """The shell line that runs a README command after the quick start, in its shell (None: checked in this
    process instead, by name): placeholders filled; ``make`` dry-run in the clone; the course's cheap commands for
    real; a module other than mha_lab reached through ``$py`` (Dask's CLI, torchrun) with ``--help``, as running
    it for real needs a cluster or GPUs."""
    for key, value in PLACEHOLDERS.items():
        command = command.replace(key, value)
    if command.startswith("make "):
        return f"(cd \"$CLONE\" && make -n {command[5:]} > /dev/null)"
    if "..." not in command.split() and command.startswith(REAL):
        return command
    words = command.split()
    if words[:2] == ["$py", "-m"] and words[2] != "mha_lab":
        module = words[2] if words[2].startswith("torch") else " ".join(words[2:4])
        return f"$py -m {module} --help > /dev/null"
    return None


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


NUMBERS = {"eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def test_the_term_has_as_many_commands_as_its_heading_says():
    readme = (REPO / "README.md").read_text()
    said = re.search(r"^### A term in (\w+) commands", readme, re.MULTILINE).group(1)
    assert len(quick_start(readme)) == NUMBERS[said], quick_start(readme)


def test_every_readme_command_is_typed_for_the_quick_start_shell():
    """No `python` or `nbgrader` that the quick start's shell (no environment activated) does not have: the
    project's commands through `$py`, nbgrader's through `$nbgrader`, make's targets in the Makefile; each names a
    command its program has (mha_lab's --help are checked in test_package.py)."""
    from nbgrader.apps import NbGraderApp

    from mha_lab.__main__ import COMMANDS

    readme = (REPO / "README.md").read_text()
    commands = readme_commands(readme)
    assert len(commands) > 40, commands
    untyped = [c for c in commands if not TYPED.match(c)]
    assert not untyped, f"README commands the quick start's shell cannot run as typed: {untyped}"
    phony = set(re.search(r"^\.PHONY: (.*)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1).split())
    for words in (c.split() for c in commands):
        if words[:3] == ["$py", "-m", "mha_lab"]:
            assert words[3] in COMMANDS, words
        elif words[0] == "$nbgrader" and len(words) > 1:
            assert words[1] in NbGraderApp.subcommands, words
        elif words[0] == "make":
            assert words[1] in phony, words
    table = set(re.findall(r"^\| `make ([a-z-]+)", readme, re.MULTILINE))
    assert phony - {"help", "clean", "book", "test"} <= table, f"targets missing from the table: {phony - table}"


def test_the_readme_says_the_course_settings_are_in_effect(tmp_path):
    from mha_lab.instructor import course_folder

    readme = (REPO / "README.md").read_text()
    said = readme.split("The course folder (`course init`) holds its own `nbgrader_config.py`", 1)[1].split(")", 1)[0]
    assert "in effect" in said and "commented" not in said.split("comment on")[0], said
    config = (course_folder.init(tmp_path / "c") / "nbgrader_config.py").read_text().splitlines()
    for setting in ("c.AssignLatePenalties.plugin_class", "c.PerDayPenalty.per_day", "c.PerDayPenalty.cap",
                    "c.Execute.timeout"):
        assert any(line.startswith(setting + " = ") for line in config), setting


@pytest.mark.slow
def test_the_readme_quick_start_runs_a_term_and_leaves_the_clone_clean(tmp_path):
    """The quick start's lines, then, in the shell they leave, every other command of the README (``as_run``) but
    one with placeholders whose ``shape`` a quick start line has run already (seconds of CPU each)."""
    readme = (REPO / "README.md").read_text()
    lines = quick_start(readme)
    typed = {line.split("  #", 1)[0].strip() for line in lines}
    found = {c: run for c in readme_commands(readme) if c not in typed and (run := as_run(c))}
    assert len(set(found.values())) > 20, found
    ran = {shape(line) for line in typed}
    others = list(dict.fromkeys(run for c, run in found.items()
                                if not (any(key in c for key in PLACEHOLDERS) and shape(c) in ran)))
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
    script = ["CLONE=$PWD", *lines[1:], "cp ~/canvas_export.csv .  # the instructor's export, here as the README types",
              *(f"echo {shlex.quote('README: ' + run)} >&2; {run}" for run in others)]
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=clone, env=env,
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
