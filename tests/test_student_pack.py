"""The students' download holds the release notebooks and what they import, and no answers."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mha_lab.instructor import student_pack

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = student_pack.build(tmp_path_factory.mktemp("pack") / "mha_lab_student.zip")
    folder = out.parent / "unzipped"
    with zipfile.ZipFile(out) as zf:
        zf.extractall(folder)
    return folder


def test_the_pack_holds_every_release_and_no_answers(pack):
    names = {p.relative_to(pack).as_posix() for p in pack.rglob("*") if p.is_file()}
    releases = {p.relative_to(REPO).as_posix() for p in REPO.glob("assignments/*/*.ipynb")}
    assert releases and releases <= names
    assert {"README.txt", "pyproject.toml", "mha_lab/cpu/__init__.py"} <= names
    assert not [n for n in names if n.startswith(("solutions/", "tests/", "mha_lab/grading/"))]
    for name in names:
        text = (pack / name).read_text(errors="ignore")
        assert not [m for m in student_pack.MARKERS if m in text], f"{name} carries a solution or hidden-test marker"


def test_the_notebooks_import_everything_from_the_pack(pack):
    imported = set()
    for nb in pack.glob("assignments/*/*.ipynb"):
        imported |= set(re.findall(r"from (mha_lab[\w.]*) import", nb.read_text()))
    assert {"mha_lab.cpu", "mha_lab.testing"} <= imported
    code = (f"import sys; sys.path.insert(0, {str(pack)!r})\nimport importlib, mha_lab\n"
            f"assert mha_lab.__file__.startswith({str(pack)!r}), mha_lab.__file__\n"
            f"for name in {sorted(imported)!r}: importlib.import_module(name)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=pack, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_leaked_solution_stops_the_build(tmp_path):
    (tmp_path / "assignments" / "ps9").mkdir(parents=True)
    (tmp_path / "assignments" / "ps9" / "ps9.ipynb").write_text('{"source": "### BEGIN SOLUTION"}')
    (tmp_path / "mha_lab").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    with pytest.raises(ValueError, match="no solutions or hidden checks"):
        student_pack.build(tmp_path / "out.zip", repo=tmp_path)
    assert not (tmp_path / "out.zip").exists()
