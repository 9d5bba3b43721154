"""The students' download holds the release notebooks and what they import, and no answers."""

from __future__ import annotations

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
    releases = {p.relative_to(REPO).as_posix() for p in [*REPO.glob("assignments/*/*.ipynb"),
                                                         *REPO.glob("assignments/*/*.npz")]}
    assert releases and releases <= names
    assert names == releases | {"README.txt", "assignments/requirements.txt"}, "the pack holds no package"
    for name in names:
        text = (pack / name).read_text(errors="ignore")
        assert not [m for m in student_pack.MARKERS if m in text], f"{name} carries a solution or hidden-test marker"


def test_the_requirements_are_the_students_environment(pack):
    wanted = [line.split(">")[0].split("=")[0].strip() for line in (pack / "assignments" / "requirements.txt")
              .read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert wanted == ["numpy", "matplotlib", "jupyter"]


def test_a_leaked_solution_stops_the_build(tmp_path):
    (tmp_path / "assignments" / "ps9").mkdir(parents=True)
    (tmp_path / "assignments" / "ps9" / "ps9.ipynb").write_text('{"source": "### BEGIN SOLUTION"}')
    (tmp_path / "assignments" / "requirements.txt").write_text("numpy\n")
    with pytest.raises(ValueError, match="no solutions or hidden checks"):
        student_pack.build(tmp_path / "out.zip", repo=tmp_path)
    assert not (tmp_path / "out.zip").exists()
