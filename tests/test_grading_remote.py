"""A class graded through a Dask scheduler and worker started as processes of their own, as on a cluster:
the worker runs in a mount namespace where the course folder is an empty tmpfs, from another working
directory, with a temporary folder of its own. Submissions, releases and hidden checks reach it as bytes;
it must give the same grades as a LocalCluster on the course's own machine, and leave no folder behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mha_lab.grading import batch, sandbox, transport
from mha_lab.instructor import classroom

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

A = "ps1_per_head_loop"
DASK = str(Path(sys.executable).with_name("dask"))


def _namespace() -> list[str]:
    """A private mount namespace: as root plainly, otherwise as root of a new user namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    return ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--user",
                                                                                               "--map-root-user"])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _class(root: Path) -> tuple[Path, list[classroom.Student]]:
    course = classroom.new_course(root, [A])
    students = [classroom.honest(course, "ana", A), classroom.blank(course, "ben", A),
                classroom.buggy(course, "cat", A, 0)]
    attack = next(a for a in classroom.attacks() if a.name == "symlinks_to_hidden")
    target = classroom.Target("remote-attack", 9, str(course), str(classroom.REPO), os.getpid())
    students.append(classroom.hostile(course, "dan", attack, target))
    return course, students


def _grades(results: list[batch.StudentResult]) -> dict[str, tuple[float, list[tuple[str, float]]]]:
    return {r.student: (r.score, sorted((c.grade_id, c.score) for c in r.cells)) for r in results}


def test_pack_refuses_what_would_land_outside(tmp_path):
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "a.ipynb").write_text("{}")
    (folder / "link").symlink_to("/etc")
    packed = transport.pack(folder, cap=1 << 20)
    with transport.unpacked(packed) as root:
        assert (root / "a.ipynb").read_text() == "{}" and os.readlink(root / "link") == "/etc"
    with pytest.raises(ValueError, match="damaged"):
        with transport.unpacked(transport.Packed(packed.data + b"x", packed.sha256)):
            pass
    assert transport.pack(tmp_path / "nowhere", cap=1).error.endswith("not a submitted folder")


def test_a_worker_that_cannot_see_the_course_grades_as_a_local_cluster(tmp_path, grading_cluster):
    course, students = _class(tmp_path / "course")
    limits = sandbox.Limits(seconds=60)
    t0 = time.perf_counter()
    local = batch.grade_class(course, A, client=grading_cluster, limits=limits, progress=False)
    local_s = time.perf_counter() - t0

    port, scratch, away = _port(), tmp_path / "worker_tmp", tmp_path / "elsewhere"
    scratch.mkdir()
    away.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    scheduler = subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                  "--no-dashboard"], cwd=away, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    hide = f"mount -t tmpfs tmpfs {course} && exec {DASK} worker tcp://127.0.0.1:{port} --nworkers 1 " \
           f"--nthreads 1 --no-dashboard --local-directory {scratch}"
    worker = subprocess.Popen([*_namespace(), "sh", "-c", hide], cwd=away, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            seen = client.run(lambda: sorted(os.listdir(str(course))))
            assert list(seen.values()) == [[]]  # the worker sees an empty folder where the course is
            assert list(client.run(os.getcwd).values()) == [str(away)]
            t0 = time.perf_counter()
            remote = batch.grade_class(course, A, client=client, limits=limits, progress=False)
            remote_s = time.perf_counter() - t0
            left = client.run(lambda: sorted(p.name for p in scratch.rglob("mha_lab_*")  # within its own folder
                                             if not p.name.startswith("mha_lab_grader_")))
    finally:
        for proc in (worker, scheduler):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    assert _grades(remote) == _grades(local)
    for s in students:
        got = next(r for r in remote if r.student == s.name).score
        assert got <= s.expected if s.at_most else got == s.expected, (s, got)
    assert list(left.values()) == [[]], left  # the worker's unpacked submissions and hidden checks are gone
    print(f"\nlocal cluster {local_s:.1f} s, remote worker {remote_s:.1f} s for {len(students)} submissions")
