"""The pieces that contain a student by construction: text made writable where it enters, folder walks that cannot
blow up, submissions that travel as bytes (sparse files too), and references that take only declared arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

from mha_lab.cpu import apply_rope
from mha_lab.grading import batch, folders, judge, text, transport
from mha_lab.grading import course as courses
from mha_lab.grading.references import Array, Choice, Extent, Function, Number, Reference, RefusedError
from mha_lab.instructor import classroom

ROPE = Reference("mha_lab.cpu.apply_rope", (("x", Array((1, 5))), ("positions", Array((1, 1), "iuf", listed=True))), 2)


@pytest.fixture
def tmp_path(tmp_path: Path):
    """pytest's folder, emptied afterwards by ``classroom.remove_tree``: pytest's own clean-up recurses, and a
    folder thousands deep left there would stop a later run."""
    yield tmp_path
    for child in tmp_path.iterdir():
        classroom.remove_tree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def deep(folder: Path, levels: int, name: str = "d") -> None:
    """``levels`` folders, one in the other, below ``folder`` (by file descriptor: the path outgrows PATH_MAX)."""
    fd = os.open(folder, os.O_RDONLY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


# --- text -------------------------------------------------------------------------------------------


def test_writable_escapes_lone_surrogates_and_bytes_and_keeps_the_rest():
    assert text.writable("plain é ✓") == "plain é ✓"
    assert text.writable("a\udcff b") == "a\\udcff b"
    assert text.writable_name(os.fsdecode(b"caf\xe9")) == "caf\\xe9"
    assert text.writable_name("café") == "café"
    for s in ("\ud800", "x\udfff\ud800y", os.fsdecode(b"\xff\xfe")):
        text.writable(s).encode("utf-8")  # never raises
        text.writable_name(s).encode("utf-8")


def test_writable_tree_reaches_every_string_at_any_depth():
    nb = json.loads('{"cells": [{"source": "notes \\udcff", "metadata": {"k\\ud800": ["ok", {"x": "\\udc80"}]}}]}')
    fixed, changed = text.writable_tree(nb)
    assert changed and fixed["cells"][0]["source"] == "notes \\udcff"
    assert fixed["cells"][0]["metadata"] == {"k\\ud800": ["ok", {"x": "\\udc80"}]}
    json.dumps(fixed, ensure_ascii=False).encode("utf-8")
    nested: list = []
    inner = nested
    for _ in range(20_000):  # deeper than Python's recursion limit
        inner.append([])
        inner = inner[0]
    inner.append("\udcff")
    assert text.writable_tree(nested)[1] and text.writable_tree(["fine"]) == (["fine"], False)


# --- walks ------------------------------------------------------------------------------------------


def test_a_folder_thousands_deep_is_walked_without_recursion_and_cut_at_the_cap(tmp_path):
    (tmp_path / "a.ipynb").write_text("{}")
    deep(tmp_path, 3000)
    found = folders.walk(tmp_path)
    assert [e.relative for e in found.entries][:2] == ["a.ipynb", "d"]
    assert max(e.relative.count("/") for e in found.entries) == folders.Caps.depth - 1
    assert "a folder deeper than 32 levels" in found.note()


def test_walk_caps_entries_bytes_and_paths_while_walking_and_leaves_out_pipes(tmp_path):
    for i in range(50):
        (tmp_path / f"f{i:02}").write_bytes(b"x" * 100)
    os.mkfifo(tmp_path / "pipe")  # opened, it would block the grader
    found = folders.walk(tmp_path, folders.Caps(entries=10))
    assert len(found.entries) <= 10 and "more than 10 entries" in found.note()
    found = folders.walk(tmp_path, folders.Caps(bytes=1000))
    assert sum(e.size for e in found.entries) == 1000
    assert "past the 1000 bytes of files a submission may hold" in found.note()
    assert "pipe (not a file, folder or link)" in folders.walk(tmp_path).note()
    (tmp_path / ("n" * 200)).mkdir()
    deep(tmp_path / ("n" * 200), 8, "m" * 200)
    assert "a path longer than 1024 bytes" in folders.walk(tmp_path).note()
    assert re.search(r"\) and \d+ more$", folders.walk(tmp_path, folders.Caps(bytes=10)).note())  # reasons: bounded


def test_a_sparse_file_travels_and_is_copied_as_its_data(tmp_path):
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "nb.ipynb").write_text("{}")
    with open(folder / "zeros.bin", "wb") as f:
        f.truncate(250 * 2**20)
    with open(folder / "mixed.bin", "wb") as f:  # data, holes, data, and a hole at the end
        f.write(b"head")
        f.seek(3 * 2**20)
        f.write(b"middle" * 1000)
        f.truncate(5 * 2**20)
    os.symlink("/etc/passwd", folder / "link")
    start = time.perf_counter()
    packed = transport.pack(folder, 256 * 2**20)
    assert len(packed.data) < 64 * 2**10 and time.perf_counter() - start < 5, len(packed.data)
    with transport.unpacked(packed) as root:
        assert (root / "mixed.bin").read_bytes() == (folder / "mixed.bin").read_bytes()
        assert os.stat(root / "zeros.bin").st_size == 250 * 2**20 and os.stat(root / "zeros.bin").st_blocks < 64
        assert os.readlink(root / "link") == "/etc/passwd"
        copy = tmp_path / "copy"
        copy.mkdir()
        folders.copy(folders.walk(root), copy)
        assert os.stat(copy / "zeros.bin").st_blocks < 64
        assert (copy / "mixed.bin").read_bytes() == (folder / "mixed.bin").read_bytes()


def test_a_killed_grading_process_leaves_no_student_work_behind(tmp_path):
    """A grading process killed mid-submission (the OOM killer, a lost Dask worker) cannot remove its temporary
    folders; the next grading process of the same user removes them, and a process that ends removes its own."""
    code = ("import os, signal, sys, tempfile; from mha_lab.grading import folders; "
            "parent = folders.temporary_parent(); work = tempfile.mkdtemp(prefix='mha_lab_submission_', dir=parent); "
            "open(os.path.join(work, 'answer.ipynb'), 'w').write('a student'); print(parent, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == 'killed' else None")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = [sys.executable, "-c", code]
    killed = Path(subprocess.run([*run, "killed"], capture_output=True, text=True, env=env).stdout.strip())
    assert killed.stat().st_mode & 0o777 == 0o700 and killed.name.startswith(f"mha_lab_grader_{os.getuid()}_")
    assert any(killed.rglob("answer.ipynb")), "the killed process's folder should still be there"
    ended = Path(subprocess.run([*run, "ends"], capture_output=True, text=True, env=env, check=True).stdout.strip())
    assert not killed.exists(), "the next grading process did not remove a dead one's folder"
    assert not ended.exists(), "a grading process that ended left its folder"


def test_pack_of_a_deep_and_strange_folder_finishes_with_its_note(tmp_path):
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / os.fsdecode(b"nb \xff.ipynb")).write_text("{}")
    deep(folder, 1000)
    os.mkfifo(folder / "pipe")
    packed = transport.pack(folder, 2**20)
    assert not packed.error and "deeper than 32 levels" in packed.note and "pipe" in packed.note
    with transport.unpacked(packed) as root:
        assert os.fsdecode(b"nb \xff.ipynb") in os.listdir(root)


# --- references -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "kwargs", "said"), [
    ((np.ones((16, 8, 8, 1, 64)), np.array([0]), "half", [[1e4]] * 8192), {}, "at most 2 arguments"),
    ((np.ones((2, 4)),), {"positions": [0, 1], "base": [[1e4]]}, "no parameter 'base'"),
    ((np.ones((2, 4)), [[0], [1]]), {}, "a flat list of numbers"),
    ((np.ones((2, 4)), list(range(10**6))), {}, "a list of at most 64 numbers"),
    (([[1.0, 2.0]], [0]), {}, "`x`: a numpy.ndarray, got list"),
    ((np.ones((2, 4), dtype=object), [0, 1]), {}, "an array of kind f"),
    ((np.ones((1,) * 6), [0]), {}, "`x`: an array of 1 to 5 axes"),
    ((np.ones((2, 4)),), {}, "missing argument `positions`"),
    ((np.ones((2, 4)), [0, 1]), {"x": np.ones(2)}, "`x` given twice"),
    ((np.ones((4096, 4096)), np.arange(4096)), {}, "only near the sizes of the call"),
])
def test_a_reference_refuses_what_it_did_not_declare_before_computing(args, kwargs, said):
    with pytest.raises(RefusedError, match=said):
        ROPE.bind(args, kwargs, Extent.of([np.ones((2, 3, 4))]))


def test_a_reference_computes_on_what_it_declared():
    x = np.random.default_rng(0).normal(size=(2, 3, 4))
    extent = Extent.of([x])
    np.testing.assert_array_equal(ROPE.call((x, [3, 1, 4]), {}, extent), apply_rope(x, np.array([3, 1, 4])))
    np.testing.assert_array_equal(ROPE.call((), {"x": x, "positions": np.array([3, 1, 4])}, extent),
                                  apply_rope(x, np.array([3, 1, 4])))
    scalar = Reference("builtins.round", (("number", Number(-10, 10)), ("ndigits", Number(0, 5, integer=True))), 1)
    assert scalar.call((np.float64(2.25),), {"ndigits": 1}, extent) == 2.2
    for bad, said in [((True,), "a number, got bool"), ((11,), "from -10 to 10"), ((1.0, 1.5), "an integer")]:
        with pytest.raises(RefusedError, match=said):
            scalar.bind(bad, {}, extent)
    layout = Reference("builtins.str", (("object", Choice(("half", "interleaved"))),), 1)
    with pytest.raises(RefusedError, match="one of 'half', 'interleaved'"):
        layout.bind(("full",), {}, extent)
    with pytest.raises(RefusedError, match="a function, got int"):
        Reference("builtins.callable", (("f", Function()),), 1).bind((3,), {}, extent)
    with pytest.raises(ValueError, match="the grader's apply_rope refused its arguments: at most 2 arguments"):
        ROPE.bound(extent)(x, [0, 1, 2], "half", 1e4)


# --- the grader's memory --------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_twelve_sparse_files_cost_the_client_nothing(tmp_path):
    """Twelve students each hand in a 250 MiB file of zeros: packing them all costs the client a few MiB."""
    for i in range(12):
        folder = tmp_path / f"s{i}" / "ps1"
        folder.mkdir(parents=True)
        nbformat.write(nbformat.v4.new_notebook(), folder / "ps1.ipynb")
        with open(folder / "zeros.bin", "wb") as f:
            f.truncate(250 * 2**20)
    code = ("import resource, sys\nfrom pathlib import Path\nfrom mha_lab.grading import transport\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "packed = [transport.pack(Path(sys.argv[1]) / f's{i}' / 'ps1', 256 << 20) for i in range(12)]\n"
            "print(sum(len(p.data) for p in packed), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=100,
                         check=True).stdout.split()
    size, grown_kib = int(out[0]), int(out[1])
    assert size < 12 * 64 * 2**10 and grown_kib < 32 * 1024, (size, grown_kib)


@pytest.mark.timeout(120)
def test_links_of_every_kind_cost_an_honest_student_nothing(tmp_path):
    """Links beside the notebook, one to a file the sandbox may not read: the worker once followed it to ask
    whether it was a folder, and died of the PermissionError with every point still to judge."""
    assignment = "ps1_per_head_loop"
    course = classroom.new_course(tmp_path / "course", [assignment])
    student = classroom.honest(course, "ana", assignment)
    folder = courses.submission(course, "ana", assignment)
    for name, to in [("shadow", "/etc/shadow"), ("up", ".."), ("self", "self"), ("dangling", "/nowhere"),
                     ("root", "/"), ("tmp", "/tmp")]:
        os.symlink(to, folder / name)
    result = batch.grade_submission(folder, courses.register(course, assignment),
                                    judge.hidden_module(assignment, course), student="ana",
                                    release_files=courses.release_files(course, assignment))
    assert (result.score, result.error) == (student.expected, ""), result.error
