"""How the grader measures memory, on every kind of host: which mode it finds (cgroup v1 as root, a delegated
cgroup v2 directory, or none), the cgroup v2 group's files (against a fake cgroup filesystem: this machine
has cgroup v1 only), what runs before the baseline, and a class of ps3's memory attacks graded as an
unprivileged user, where no memory is measured and no memory points are given, and every graded student
still gets a feedback page.
(As root on cgroup v1 these attacks and ps3's others are graded by ``test_grading_adversarial.py``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat
import pytest

from mha_lab.grading import batch, sandbox
from mha_lab.grading.sandbox import NOT_MEASURED, Limits, MemoryGroup, MemoryMode, memory_mode
from mha_lab.instructor import classroom
from mha_lab.instructor.classroom import Target

PS3 = "ps3_memory_efficient"
NOBODY = 65534
MEMORY_CELLS = {"head_by_head_forward_memory", "chunked_attention_memory"}
# ps3's attacks on the memory measurement (tests/adversarial/), one for each way in: all earn at most what naive
# work earns. With nothing measured, ps3_forged_peak would repeat ps3_forged_in_process (tracemalloc forged in the
# student's process) and ps3_replayed_outputs the root grading (fresh inputs are drawn on any host): the adversarial
# suite grades both as root
MEMORY_ATTACKS = ("ps3_forged_in_process", "ps3_forged_reply_frame", "ps3_memory_before_answers", "ps3_ballast_file",
                  "ps3_peak_in_child")


def _fake_cgroup2(root: Path, writable: bool = True) -> Path:
    """A directory laid out as a delegated cgroup v2 folder: its controllers, subtree_control, cgroup.procs."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    if not writable:
        root.chmod(0o555)
    return root


def test_memory_mode_names_cgroup_v1_where_the_grader_may_write_it(tmp_path):
    fs = tmp_path / "fs"
    own = fs / "memory" / "grader"
    own.mkdir(parents=True)
    (own / "memory.max_usage_in_bytes").write_text("0")
    mode = memory_mode(Limits(), "5:memory:/grader\n0::/\n", fs)
    assert (mode.parent, mode.version, str(mode)) == (own, 1, "cgroup v1")
    unsafe = memory_mode(Limits(unsafe=True), "5:memory:/grader\n", fs)
    assert unsafe.parent is None and str(unsafe).startswith(NOT_MEASURED) and "unsafe" in str(unsafe)


def test_memory_mode_on_cgroup_v2_needs_a_delegated_directory(tmp_path):
    fs = _fake_cgroup2(tmp_path / "fs")
    alone = memory_mode(Limits(), "0::/user.slice/session-1.scope\n", fs)
    assert alone.parent is None and "--memory-cgroup" in str(alone), alone
    handed = _fake_cgroup2(tmp_path / "fs" / "grading")
    mode = memory_mode(Limits(cgroup=str(handed)), "0::/user.slice/session-1.scope\n", fs)
    assert (mode.parent, mode.version) == (handed, 2) and str(mode) == f"cgroup v2 ({handed})"
    assert (handed / "cgroup.subtree_control").read_text() == "+memory"  # its children get memory.* files
    (handed / "cgroup.controllers").write_text("cpu pids\n")
    assert "not delegated" in str(memory_mode(Limits(cgroup=str(handed)), "", fs))
    assert "not a cgroup v2 directory" in str(memory_mode(Limits(cgroup=str(tmp_path)), "", fs))
    assert memory_mode(Limits(), "", tmp_path / "nothing").parent is None


def test_a_cgroup_v2_group_caps_moves_and_reads_its_peak_from_the_students_leaf(tmp_path):
    parent = _fake_cgroup2(tmp_path / "grading")
    group = MemoryGroup.make(MemoryMode(parent, 2), 3 * 2**30)
    assert (group.top / "memory.max").read_text() == str(3 * 2**30)
    assert (group.top / "cgroup.subtree_control").read_text() == "+memory"
    assert group.entry == group.top / "before"  # processes live in leaves only
    (group.entry / "cgroup.procs").write_text("")  # the kernel's file: no process left behind
    group.baseline()
    student = group.top / "student"
    assert student.is_dir()
    (student / "memory.peak").write_text("123456\n")
    group.reset()  # kernel >= 6.12: "reset" written to memory.peak restarts this file descriptor's peak
    (student / "memory.peak").write_text("4096\n")  # what the kernel reports through it afterwards
    assert group.peak() == 4096
    for fake in group.top.rglob("*"):  # files the kernel would have made and removed itself
        if fake.is_file():
            fake.unlink()
    group.release()
    assert not group.top.exists()


def test_a_cgroup_v2_baseline_fails_when_a_process_stays_behind(tmp_path):
    group = MemoryGroup.make(MemoryMode(_fake_cgroup2(tmp_path / "grading"), 2), 2**30)
    (group.entry / "cgroup.procs").write_text(f"{os.getpid()}\n")  # a fake file: writing elsewhere moves nothing
    with pytest.raises(OSError, match="could not join"):
        group.baseline()


def test_only_the_releases_given_cells_run_before_the_baseline():
    def code(source: str, **meta) -> nbformat.NotebookNode:
        cell = nbformat.v4.new_code_cell(source)
        if meta:
            cell.metadata["nbgrader"] = meta
        return cell

    cells = [code("given = 1", grade_id="setup", locked=True), code("ballast = 2"),  # the student's, before answers
             code("def f(): pass", grade_id="f", solution=True), code("check()", grade_id="t", grade=True),
             code("data = 3", grade_id="data", locked=True), code("def g(): pass", grade_id="g", solution=True)]
    before, after = batch._definitions(cells)
    assert before == ["given = 1"]
    assert after == ["ballast = 2", "def f(): pass", "data = 3", "def g(): pass"]


# --- a class graded by an unprivileged user: no memory cgroup, so no memory measured ----------------------


def _can_grade_as_nobody() -> str:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv to grade as an unprivileged user"
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sandbox.bwrap(),
                            "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True, check=False)
    return "" if probe.returncode == 0 else "bubblewrap does not run unprivileged here"


@pytest.fixture(scope="module")
def unprivileged_class():
    """ps3 graded as uid 65534: an honest student and the memory attacks, then the grade sheet's rows."""
    if why := _can_grade_as_nobody():
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="mha_lab_unprivileged_"))
    try:
        course = classroom.new_course(root / "course", [PS3])
        students = {"honest": classroom.honest(course, "honest", PS3)}
        attacks = {a.name: a for a in classroom.attacks() if a.name in MEMORY_ATTACKS}
        for name, attack in attacks.items():
            target = Target(f"mha-attack-unprivileged-{name}", 9, str(course), str(classroom.REPO), os.getpid())
            students[name] = classroom.hostile(course, name, attack, target)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(root)], check=True)
        root.chmod(0o755)
        refused, _ = classroom.run_grader(course, PS3, timeout=60, limit=120, uid=NOBODY,
                                          extra=["--require-memory-measurement"])
        graded, wall = classroom.run_grader(course, PS3, jobs=2, timeout=60, limit=900, uid=NOBODY)
        assert graded is not None, f"the class was not graded within 900 s ({wall:.0f} s)"
        rows = {r["student"]: r for r in classroom.read_grades(course, PS3)}
        yield refused, graded, rows, students, course
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_require_memory_measurement_refuses_a_host_that_cannot(unprivileged_class):
    refused = unprivileged_class[0]
    assert refused is not None and refused.returncode == 1, refused
    assert f"cannot grade {PS3} with --require-memory-measurement: {NOT_MEASURED}" in refused.stderr, refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_without_a_cgroup_no_memory_points_and_the_mode_is_said(unprivileged_class):
    _, graded, rows, students, course = unprivileged_class
    log = graded.stdout + graded.stderr
    assert graded.returncode == 0, log[-3000:]
    assert f"memory measured by: {NOT_MEASURED}" in graded.stdout, graded.stdout[-2000:]
    points = classroom.points(classroom.read_notebook(course, "solutions", PS3))
    naive = sum(points.values()) - sum(points[c] for c in MEMORY_CELLS)
    assert float(rows["honest"]["score"]) == naive, rows["honest"]  # memory is the instructor's to grade
    assert set(rows) == set(students)
    for name, row in rows.items():
        assert row["memory"].startswith(NOT_MEASURED), row
        assert float(row["score"]) <= min(students[name].expected, naive), f"{name}: {row['score']}: {row['failed']}"
        for cell in MEMORY_CELLS:  # lost, and said why, unless the submission died first
            assert cell in row["failed"], row["failed"]
    assert f"{NOT_MEASURED}, so the grader gives no points here" in rows["honest"]["failed"]
    report = (course / "reports" / PS3 / "report.md").read_text()
    assert f"memory: {NOT_MEASURED}" in report


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_unprivileged_grading_writes_every_graded_students_feedback(unprivileged_class):
    """The feedback comes out as uid 65534 too, through the system's interpreter on this environment's packages
    (``run_grader``'s unprivileged path). The bug this catches: a feedback step that needs what only the
    instructor's own environment has, as nbconvert's BeautifulSoup pass did (its selector failed there)."""
    _, graded, rows, _, course = unprivileged_class
    assert "generate_feedback failed" not in graded.stdout + graded.stderr
    graded_students = [s for s, r in rows.items() if r["status"] == "graded"]
    assert graded_students and "honest" in graded_students
    for student in graded_students:
        page = course / "feedback" / student / PS3 / f"{PS3}.html"
        assert page.is_file() and "Score:" in page.read_text(), f"no feedback page for {student}"
