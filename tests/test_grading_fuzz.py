"""A fuzzer of the grader's containment: hypothesis builds hostile classes of ps1 and the real grading command
grades each one.

Each class holds an honest student and hostile ones, each hostile in several ways at once: a folder name of
random bytes (surrogates, control characters, HTML, bytes that are not UTF-8, long), a notebook under an odd name
or none that parses, lone surrogates in every field, huge stored outputs, cells that print, raise or return odd
objects, a reference called with odd arguments, and beside the notebook folders thousands deep, thousands of tiny
files, sparse files, links of every kind and pipes. Every class must end with exit 0, the honest student exact,
each hostile one graded (no more than the release earns) or "not graded" with a reason, the feedback, the CSV
and the report written, and the client's and each worker's peak memory under ``CLIENT_PEAK`` and
``WORKER_PEAK``.

Memory is read as each process's highest resident set (VmHWM, reset before each class). ``make test`` grades
``QUICK`` classes; ``pytest tests/test_grading_fuzz.py --hypothesis-profile grading-fuzz``
grades more (tests/conftest.py registers the profile).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mha_lab.grading.text import writable_name
from mha_lab.instructor import classroom, grade, report

A = "ps1_per_head_loop"
QUICK = 2  # classes graded in make test
PROFILE = "grading-fuzz"
MiB = 2**20
CLIENT_PEAK = 256 * MiB  # how much the client's resident set may grow while it grades a class
WORKER_PEAK = 512 * MiB  # a grading worker's resident set, at its highest while it grades a class
TIMEOUT = 15  # seconds per submission

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# --- what a hostile student may hand in ----------------------------------------------------------

NAME_PARTS = [b"caf\xe9", b"\xff\xfe", b"\xed\xb3\xbf", b"<script>alert(1)</script>", b"=HYPERLINK(\"x\")",
              b"a\nb", b"tab\there", b"\x1b[31m", b" padded ", b"\xe2\x80\xae", b"x" * 120, b"student", b"&amp;"]
CODE = [  # what the first answer cell does
    'print("notes \\udcff", "\\ud800")',
    'raise ValueError("\\udcff" * 100 + "<b>bold</b>")',
    'print("x" * 3_000_000)',
    "def attention(Q, K, V, mask=None):\n    return object(), None",
    "def split_heads(x, num_heads):\n    return [[[[]]]] * 10_000",
    "def split_heads(x, num_heads):\n    return np.empty(3, dtype=object)",
    "def merge_heads(x):\n    return (lambda: None)",
    "def merge_heads(x):\n    return '\\udcff' * 10_000",
    "def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):\n"
    "    return attention(X, X, X, mask, 'extra', [[1e4]] * 8192)",
    "def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):\n"
    "    return attention(np.ones((1, 4096, 64)), np.ones((1, 4096, 64)), np.ones((1, 4096, 64)))",
    "def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):\n"
    "    return attention(Q=[[1.0]] * 100, K=X, V=X, weights=X)",
]
NOTEBOOKS = ["plain", "surrogates", "huge output", "malformed", "not utf-8 name", "renamed"]
EXTRAS = ["deep", "many files", "sparse", "links", "pipe"]


@dataclass(frozen=True)
class Hostile:
    name: bytes
    code: tuple[str, ...]
    notebook: str
    extras: tuple[str, ...]
    depth: int


def _name(parts: list[bytes], salt: int) -> bytes:
    name = b"".join(parts).replace(b"/", b"_").replace(b"\0", b"_")[:200] or b"x"
    return name + b"-%d" % salt  # distinct in the class, never "." or ".."


hostiles = st.builds(
    Hostile,
    name=st.lists(st.sampled_from(NAME_PARTS) | st.binary(min_size=1, max_size=8), min_size=1, max_size=4)
    .map(lambda parts: b"".join(parts)),
    code=st.lists(st.sampled_from(CODE), min_size=1, max_size=3, unique=True).map(tuple),
    notebook=st.sampled_from(NOTEBOOKS),
    extras=st.lists(st.sampled_from(EXTRAS), max_size=3, unique=True).map(tuple),
    depth=st.integers(33, 3000),
)


def _deep(folder: Path, levels: int) -> None:
    fd = os.open(folder, os.O_RDONLY)
    for _ in range(levels):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def _surrogates_everywhere(nb: nbformat.NotebookNode) -> str:
    """The notebook's JSON with the escape of a lone surrogate in every field a student could fill."""
    nb.metadata["kernelspec"] = {"name": "SURR", "display_name": "SURR", "language": "python"}
    nb.metadata["SURR"] = ["SURR", {"SURR": "SURR"}]
    for cell in nb.cells:
        cell.source += "\n# SURR" if cell.cell_type == "code" else "\nSURR"
        cell.metadata["SURR"] = "SURR"
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="SURR"),
                            nbformat.v4.new_output("error", ename="SURR", evalue="SURR", traceback=["SURR"])]
    nb.cells.append(nbformat.v4.new_markdown_cell("SURR <img src=x onerror=alert(1)>"))
    return json.dumps(nb, ensure_ascii=True).replace("SURR", "\\udcff\\ud800")


def _hand_in(course: Path, h: Hostile, salt: int, release: nbformat.NotebookNode) -> bytes:
    """The hostile student's folder under ``submitted/``; returns its name (bytes)."""
    name = _name([h.name], salt)
    folder = os.fsencode(course / "submitted") + b"/" + name + b"/" + A.encode()
    os.makedirs(folder)
    folder = Path(os.fsdecode(folder))
    nb = nbformat.from_dict(release)
    first = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution"))
    first.source = "import numpy as np\n" + "\n".join(h.code) + "\n\n" + first.source
    target = folder / f"{A}.ipynb"
    if h.notebook == "not utf-8 name":
        target = Path(os.fsdecode(os.fsencode(folder) + f"/{A} ".encode() + b"\xff.ipynb"))
    elif h.notebook == "renamed":
        target = folder / f"{A} (1).ipynb"
    if h.notebook == "surrogates":
        target.write_text(_surrogates_everywhere(nb))
    elif h.notebook == "malformed":
        target.write_bytes(json.dumps(nb).encode()[:5000] + b"\xff\x00{[")
    else:
        if h.notebook == "huge output":
            first.outputs = [nbformat.v4.new_output("stream", name="stdout", text="y" * (8 * MiB))]
        nbformat.write(nb, target)
    for extra in h.extras:
        if extra == "deep":
            _deep(folder, h.depth)
        elif extra == "many files":
            (folder / "many").mkdir()
            for i in range(3000):
                (folder / "many" / f"{i}").write_bytes(b"z")
        elif extra == "sparse":
            with open(folder / "zeros.bin", "wb") as f:
                f.truncate(250 * MiB)
        elif extra == "links":
            for link, to in [("passwd", "/etc/passwd"), ("up", ".."), ("self", "self"), ("dangling", "/nowhere"),
                             ("peer", str(course / "submitted" / "honest" / A / f"{A}.ipynb")), ("root", "/")]:
                os.symlink(to, folder / link)
        elif extra == "pipe":
            os.mkfifo(folder / "pipe")
    return name


def _peak(reset: bool = False) -> int:
    """This process's resident set at its highest (VmHWM, bytes) since the last ``_peak(reset=True)``, which
    starts the count again from what it holds now (/proc/self/clear_refs)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def _examples() -> int:
    """``QUICK`` classes; the profile's count under ``--hypothesis-profile grading-fuzz``."""
    return settings().max_examples if settings._current_profile == PROFILE else QUICK


@settings(max_examples=_examples(), deadline=None, database=None, phases=(Phase.generate,),  # no shrinking: slow
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(hostiles, min_size=2, max_size=3))
def test_a_hostile_class_is_graded_to_the_end(grading_cluster, capsys, students):
    root = Path(tempfile.mkdtemp(prefix="mha_lab_fuzz_"))
    try:
        course = classroom.new_course(root / "course", [A])
        honest = classroom.honest(course, "honest", A)
        release = classroom.read_notebook(course, "assignments", A)
        names = [_hand_in(course, h, i, release) for i, h in enumerate(students)]
        before = _peak(reset=True)
        grading_cluster.run(_peak, reset=True)
        status = grade.main([A, "--course", str(course), "--timeout", str(TIMEOUT),
                             "--scheduler", grading_cluster.scheduler.address])
        client_peak = _peak() - before
        out = capsys.readouterr().out
        assert status == 0, out[-3000:]
        rows = {r["student"]: r for r in classroom.read_grades(course, A)}
        ids = {writable_name(os.fsdecode(n)) for n in names}
        assert set(rows) == ids | {"honest"}, (sorted(rows), out[-2000:])
        assert float(rows["honest"]["score"]) == honest.expected and not rows["honest"]["error"], rows["honest"]
        for s in ids:
            row = rows[s]
            assert row["status"] == "graded" and float(row["score"]) == 0.0 or row["status"] == "not graded" \
                and row["error"], row
        assert (course / "feedback" / "honest" / A / f"{A}.html").is_file()
        for s in (s for s in ids if rows[s]["status"] == "graded"):
            assert any((course / "feedback" / s / A).glob("*.html")), f"no feedback for {s!r}: {rows[s]}"
        assert (course / "reports" / A / "index.html").is_file() and "no class report" not in out, out[-2000:]
        graded = sorted(s for s in ids if rows[s]["status"] == "graded")
        if graded:  # an autograded notebook that cannot be read costs the class report only its own student
            (course / "autograded" / graded[0] / A / f"{A}.ipynb").write_bytes(b"\xff not a notebook")
            assert (report.build(course, A) / "index.html").is_file()
        worker_peaks = grading_cluster.run(_peak)
        assert client_peak < CLIENT_PEAK, f"the client allocated {client_peak / MiB:.0f} MiB"
        assert max(worker_peaks.values()) < WORKER_PEAK, {w: p / MiB for w, p in worker_peaks.items()}
    finally:
        classroom.remove_tree(root)
