"""``python -m mha_lab grade-bench`` on a class of six, and its check of the returned rows."""

from __future__ import annotations

import pytest

from mha_lab.__main__ import main as cli_main
from mha_lab.instructor import grade_bench
from mha_lab.instructor.classroom import Student

CLASS = {"h": Student("h", "honest", 20.0), "b": Student("b", "buggy", 18.0),
         "x": Student("x", "hostile", 0.0, at_most=True)}


def test_check_names_every_lost_duplicated_unknown_or_wrong_row():
    rows = [{"student": "h", "score": "20"}, {"student": "h", "score": "20"}, {"student": "b", "score": "20"},
            {"student": "z", "score": "1"}]
    assert grade_bench.check(CLASS, rows) == ["x: no row", "h: 2 rows", "z: a row for no submission",
                                              "b (buggy): score 20, expected 18"]
    assert grade_bench.check(CLASS, [{"student": "h", "score": "20"}, {"student": "b", "score": "18"},
                                     {"student": "x", "score": "0"}]) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grade_bench_grades_a_small_class_exactly(capsys):
    assert cli_main(["grade-bench", "--n", "6"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "6 ps1_per_head_loop submissions (3 honest, 1 buggy, 1 blank, 1 hostile)" in out
    assert "rows: 6 for 6 submissions; every one exactly once with its expected score: yes" in out
