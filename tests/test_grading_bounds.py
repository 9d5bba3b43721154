"""The grader's own work per submission is bounded, and nothing in one submission folder stops the class.

- Units: messages are cut before any expression reads them, answers are bounded in size and structure before
  they are parsed, the loss object that crosses carries no answer, a reference answers only at its call's sizes.
- The hostile ps1 submissions of ``tests/adversarial/`` that aim at the grader's process (a reference asked to
  attend over L = 16,384, a forged reply of millions of empty lists, exception messages of a million spaces),
  each graded in this process under ``tracemalloc``: the grader's peak memory while it grades them is measured
  and bounded, and each is graded within its deadline.
- A class of the ``demo`` assignment graded with the real command: unreadable timestamps (a folder, a link,
  garbage, binary; one 3 days late), unreadable notebooks, ids with control characters and a judging that never
  ends. The run exits 0 within its deadline plus a margin, the others are exact, the summary flags the rest.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import time
import tracemalloc
from contextlib import closing
from datetime import datetime, timedelta

import nbformat
import numpy as np
import pytest
from test_grading_batch import HIDDEN, source_notebook

from mha_lab.grading import batch, checks, judge
from mha_lab.grading import course as courses
from mha_lab.grading.judge import HIDDEN_DIR_ENV
from mha_lab.grading.references import Array, Extent, Reference, RefusedError
from mha_lab.grading.remote import REPLY_TEXT, REPLY_VALUES, RemoteSubmission
from mha_lab.grading.sandbox import Limits
from mha_lab.grading.worker import decode, encode, frame, read_message
from mha_lab.instructor import classroom
from mha_lab.instructor import grade as cli

MiB = 2**20
GRADER_PEAK = 64 * MiB  # what grading one hostile submission may add to the grader's process, at most
TIMEOUT = 20  # seconds per submission
CLASS_TIMEOUT, CLASS_GRACE = 6, 3  # for the broken class: its answers take milliseconds; one judging never ends


# --- units ---------------------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_long_student_text_is_cut_before_any_expression_reads_it():
    message = "`f` raised ValueError: " + " " * 1_000_000 + "x [bug: raises-valueerror]"
    out = checks.retag(message, note=" (called with no arguments)")
    assert len(out) < checks.MESSAGE_CHARS + 100 and out.startswith("`f` raised ValueError:    ")
    assert out.endswith("x (called with no arguments) [bug: raises-valueerror]") and "characters cut" in out
    assert checks.bug_ids(message) == ["raises-valueerror"]
    short = checks.retag("a" + " " * 300_000 + "b [bug: x]", "y")
    assert len(short) < checks.MESSAGE_CHARS + 100 and short.endswith(" b [bug: y]") and "[bug: x]" not in short


def _peak(fn) -> tuple[object, int]:
    """``fn()`` and the bytes it allocated at its peak (tracemalloc, which NumPy reports to)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(60)
def test_an_answer_is_bounded_in_size_and_structure_before_it_is_parsed():
    bounded = {"limit": 64 * MiB, "text": REPLY_TEXT, "values": REPLY_VALUES}
    for lists, reason in [(21 * MiB, "longer than"), (5 * MiB, "JSON values")]:  # 63 MiB and 15 MiB of []
        stream = io.BytesIO(b'{"ok": true, "result": [' + b"[]," * lists + b'[]], "sizes": []}\n')
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match=reason):
                read_message(stream, **bounded)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 48 * MiB, f"{peak / MiB:.0f} MiB to refuse {lists * 3 / MiB:.0f} MiB of empty lists"
    text = {"outputs": [["[1, 2], {3: 4}, \"quoted\" " * 800, ""]] * 40}  # printed brackets are text, not values
    message, _ = read_message(io.BytesIO(b"".join(frame(text, []))), **bounded)
    assert message["outputs"] == [list(pair) for pair in text["outputs"]]


def test_the_loss_that_crosses_into_the_sandbox_carries_no_answer():
    x = checks.SmoothLoss(np.arange(3.0))
    arrays: list = []
    crossed = decode(json.loads(json.dumps(encode(x, arrays))), arrays)
    assert hasattr(x, "exact") and not hasattr(crossed, "exact") and crossed() == x()


OUTER = Reference("numpy.outer", (("a", Array((0, 4))), ("b", Array((0, 4)))), 2)
LOOP = """
import numpy as np

def loop(x, n):
    try:
        attention(np.ones((1, n, 1)), np.ones((1, n, 1)))
    except RuntimeError as exc:
        refused.append(str(exc))
    return attention(x, x)

def attention(a, b):  # the student's own, swapped for the reference during the call
    return a

refused = []

def said():
    return refused
"""


@pytest.mark.timeout(120)
def test_a_reference_computes_only_at_the_sizes_of_its_call(tmp_path):
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        student.run([LOOP])
        x = np.ones((2, 8, 4))
        big = lambda: student.remote_call("loop", (x, 16384), {}, measure=False,  # noqa: E731
                                          replace={"attention": OUTER})[0]
        out, peak = _peak(big)
        assert out.shape == (64, 64) and peak < 8 * MiB, peak / MiB  # outer at 16,384 would be 2 GiB
        said = student.remote_call("said", (), {}, measure=False, replace={})[0]
        assert said and "only near the sizes of the call it was given to" in said[0], said
    extent = Extent(elements=200_000, axis=100, ndim=3)  # one more axis is admitted, not two; 16x the elements
    assert _admits(extent, np.ones((2, 100, 4)), np.ones((1, 2, 400, 4))) and not _admits(extent, np.ones((1,) * 5))
    assert _admits(extent, np.ones((8, 400, 400))) and not _admits(extent, np.ones((21, 400, 400)))  # elements
    assert not _admits(extent, np.ones((401, 1))) and not _admits(extent, np.ones((8, 401)))  # an axis too long
    small = Extent.of([np.ones((2, 8, 4)), np.ones((4, 4))])  # a small call: its reference still works to 64
    assert _admits(small, np.ones((2, 64, 4))) and not _admits(small, np.ones((2, 65, 4)))


def _admits(extent: Extent, *arrays: np.ndarray) -> bool:
    try:
        for a in arrays:
            extent.check("attention", a)
    except RefusedError:
        return False
    return True


# --- hostile submissions against the grader's process --------------------------------------------

HOSTILE = ("ps1_reference_at_huge_sizes", "reply_of_empty_lists", "exception_of_spaces")


@pytest.fixture(scope="module")
def ps1(tmp_path_factory: pytest.TempPathFactory):
    """A ps1 course: its releases, hidden checks and the deserved score of each hostile submission."""
    assignment = "ps1_per_head_loop"
    course = classroom.new_course(tmp_path_factory.mktemp("ps1") / "course", [assignment])
    found = {a.name: a for a in classroom.attacks()}
    target = classroom.Target("mha-bounds", 9, str(course), str(classroom.REPO), os.getpid())
    students = {name: classroom.hostile(course, name, found[name], target) for name in HOSTILE}
    students["honest"] = classroom.honest(course, "honest", assignment)
    return course, assignment, courses.register(course, assignment), judge.hidden_module(assignment, course), students


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["honest", *HOSTILE])
def test_the_grader_holds_little_memory_and_keeps_its_deadline_whatever_the_submission(ps1, name):
    course, assignment, releases, hidden, students = ps1
    start = time.monotonic()
    result, peak = _peak(lambda: batch.grade_submission(course / "submitted" / name / assignment, releases, hidden,
                                                        Limits(seconds=TIMEOUT), student=name))
    wall = time.monotonic() - start
    print(f"{name}: grader peak {peak / MiB:.1f} MiB, {wall:.1f} s, {result.score:g}/{result.max_score:g} "
          f"{result.error[:120]!r}")
    assert peak < GRADER_PEAK, f"{name}: the grader's peak grew by {peak / MiB:.0f} MiB"
    assert wall < TIMEOUT + 30, f"{name}: graded in {wall:.0f} s, past its {TIMEOUT} s deadline and a margin"
    expected = students[name]
    assert result.score <= expected.expected if expected.at_most else result.score == expected.expected, result
    if name == "ps1_reference_at_huge_sizes":  # the refused call costs the honest loop nothing
        assert result.score == expected.expected and not result.error, result
    if name == "reply_of_empty_lists":
        assert "answered garbage (ValueError: a message of more than" in result.error, result.error
    if name == "exception_of_spaces":
        message = next(c.message for c in result.cells if c.grade_id == "split_heads_shape")
        assert len(message) < 2 * checks.MESSAGE_CHARS and "characters cut" in message, message[:300]


# --- a class whose folders are broken in every way but the code --------------------------------

DUE = datetime(2026, 11, 20, 17, 0)
GOOD = "def double(x):\n    return 2 * x"
HANGS = GOOD + "\ndef grader_hangs():\n    return True"
JUDGE_HANGS = '''

def test_double_values__judging_that_never_ends(student):
    """This course's stand-in for a judging that never ends (the grader's own work, outside the sandbox)."""
    if _defines(student, "grader_hangs"):
        import time
        time.sleep(3600)
'''
PENALTY = ('c.AssignLatePenalties.plugin_class = "mha_lab.instructor.term.PerDayPenalty"\n'
           'c.PerDayPenalty.per_day = 0.1\n')
STAMP = "2026-11-20 12:00:00.000000 UTC\n"  # on time
CLASS = {  # student -> (answer, what timestamp.txt is: text or bytes, "dir", "link", or None for none)
    "honest": (GOOD, STAMP),
    "stamp-dir": (GOOD, "dir"),
    "stamp-link": (GOOD, "link"),
    "stamp-binary": (GOOD, b"\xff\xfe\x00\x01 2026-11-20"),
    "stamp-garbage-late": (GOOD, "the twentieth, before noon"),  # its notebook arrived 3 days late
    "id\nnewline": (GOOD, STAMP),
    "id\x1b[31mred": (GOOD, STAMP),
    "nb-folder": (GOOD, STAMP),
    "nb-binary": (GOOD, STAMP),
    "judge-hangs": (HANGS, STAMP),
}


@pytest.fixture(scope="module")
def broken_class(tmp_path_factory: pytest.TempPathFactory, grading_cluster):
    """The class, graded by ``python -m mha_lab grade demo`` on the shared cluster (the worker whose judging never
    ends is restarted, as on a cluster of the command's own); returns (root, summary, wall seconds, exit code)."""
    root = tmp_path_factory.mktemp("broken_class")
    (root / "hidden").mkdir()
    (root / "hidden" / "test_demo.py").write_text(HIDDEN + JUDGE_HANGS)
    (root / "nbgrader_config.py").write_text((classroom.REPO / "nbgrader_config.py").read_text() + PENALTY)
    (root / "solutions" / "demo").mkdir(parents=True)
    nbformat.write(source_notebook(), root / "solutions" / "demo" / "demo.ipynb")
    with courses.gradebook(root) as gb:  # what `nbgrader db assignment add demo --duedate ...` does, in this process
        gb.update_or_create_assignment("demo", duedate=f"{DUE} UTC")
    release = courses.register(root, "demo")["demo.ipynb"]
    for student, (answer, stamp) in CLASS.items():
        nb = nbformat.from_dict(release)
        next(c for c in nb.cells if c.get("id") == "ans_double").source = answer
        folder = root / "submitted" / student / "demo"
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "demo.ipynb")
        if stamp == "dir":
            (folder / "timestamp.txt").mkdir()
        elif stamp == "link":
            (folder / "timestamp.txt").symlink_to(folder / "demo.ipynb")
        elif isinstance(stamp, bytes):
            (folder / "timestamp.txt").write_bytes(stamp)
        elif stamp:
            (folder / "timestamp.txt").write_text(stamp)
        arrived = DUE + (timedelta(days=3) if student == "stamp-garbage-late" else -timedelta(hours=5))
        seconds = (arrived - datetime(1970, 1, 1)).total_seconds()
        os.utime(folder / "demo.ipynb", (seconds, seconds))
    (root / "submitted" / "nb-folder" / "demo" / "demo.ipynb").unlink()
    (root / "submitted" / "nb-folder" / "demo" / "demo.ipynb").mkdir()
    (root / "submitted" / "nb-binary" / "demo" / "demo.ipynb").write_bytes(bytes(range(256)) * 64)
    out = io.StringIO()
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv(HIDDEN_DIR_ENV, str(root / "hidden"))
        mp.setattr(batch, "GRACE_SECONDS", CLASS_GRACE)
        code = cli.main(["demo", "--course", str(root), "--scheduler", grading_cluster.scheduler.address,
                         "--timeout", str(CLASS_TIMEOUT)])
    return root, out.getvalue(), time.monotonic() - start, code


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_broken_folder_costs_its_student_only(broken_class):
    root, summary, wall, code = broken_class
    print(f"graded in {wall:.0f} s, exit {code}:\n{summary}")
    assert code == 0, summary
    limit = 2 * (CLASS_TIMEOUT + CLASS_GRACE) + 60  # the stuck judging's deadline and grace, the others, a margin
    assert wall < limit, f"graded in {wall:.0f} s, past {limit:.0f} s"
    with open(root / "grades_demo.csv", newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert set(rows) == set(CLASS), sorted(rows)
    got = {s: (r["status"], r["score"], r["final_score"]) for s, r in rows.items()}
    for s in ("honest", "stamp-dir", "stamp-link", "stamp-binary"):
        assert got[s] == ("graded", "3.0", "3"), (s, rows[s])  # on time: their notebooks arrived before the due date
    for s in ("stamp-dir", "stamp-link", "stamp-binary", "stamp-garbage-late"):
        assert "timestamp.txt" in rows[s]["note"] and "the notebook's file time" in rows[s]["note"], rows[s]
    late = rows["stamp-garbage-late"]  # 72 h late by its notebook's time: 3 started days, -0.3 of 3
    assert (late["status"], late["score"], late["seconds_late"], late["penalty"], late["final_score"]) == \
        ("graded", "3.0", "259200.0", "0.9", "2.1"), late
    for s in ("id\nnewline", "id\x1b[31mred"):
        assert got[s][0] == "not graded" and "control characters" in rows[s]["error"], rows[s]
    assert got["nb-folder"][0] == "not graded" and "not a notebook file" in rows["nb-folder"]["error"]
    assert got["nb-binary"][0] == "not graded" and "not a valid notebook" in rows["nb-binary"]["error"]
    assert got["judge-hangs"][0] == "not graded" and "without finishing" in rows["judge-hangs"]["error"]
    assert (root / "feedback" / "honest" / "demo" / "demo.html").is_file()
    attention = summary.split("needs attention:", 1)[-1]
    for s in set(CLASS) - {"honest"}:
        assert repr(s) in attention, (s, summary)
    assert "late 72.0 h (-0.9) [file time: timestamp.txt unreadable]" in summary, summary
