"""The grader's memory readings go on record, passed or not: in the grade sheet (``memory_peak``), in the
feedback beside the student's own reading, and as a distribution in the class report."""

from __future__ import annotations

import pytest

from mha_lab.grading import checks
from mha_lab.grading.batch import CellResult, StudentResult, memory_reading
from mha_lab.instructor import gradesheet, report, spreadsheet

MiB = 2**20


def test_every_budget_judged_in_a_recording_is_read_passed_or_not():
    with checks.recording_memory() as readings:
        checks.expect_within_budget(int(9.93 * MiB), 12 * MiB, what="fits", hint="h [bug: x]")
        with pytest.raises(AssertionError, match="over the budget"):
            checks.expect_within_budget(13 * MiB, 12 * MiB, what="over", hint="h [bug: x]")
        with pytest.raises(AssertionError, match="not measured"):
            checks.expect_within_budget(None, 12 * MiB, what="host", hint="h [bug: x]")
    assert readings == [(int(9.93 * MiB), 12 * MiB), (13 * MiB, 12 * MiB), (None, 12 * MiB)]
    checks.expect_within_budget(MiB, 2 * MiB, what="outside", hint="h [bug: x]")
    assert len(readings) == 3, "a reading outside a recording went on record"
    assert memory_reading(readings[:1]) == "peak 9.93 MiB of a 12.00 MiB budget"


def test_the_grade_sheet_and_the_report_give_each_reading(tmp_path):
    def student(name, peak):
        cells = [CellResult("mem", 2.0 if peak <= 12 else 0.0, 2.0, memory=[(int(peak * MiB), 12 * MiB)]),
                 CellResult("values", 1.0, 1.0)]
        return StudentResult(name, sum(c.score for c in cells), 3.0, cells, notebooks={"hw.ipynb": {}})

    sheet = tmp_path / "grades_hw.csv"
    gradesheet.write_csv([student("ann", 9.93), student("bob", 4.0), student("cy", 30.5)], sheet)
    with open(sheet, newline="", encoding="utf-8") as f:
        rows = {r["student"]: r for r in spreadsheet.DictReader(f)}
    assert rows["ann"]["memory_peak"] == "mem: peak 9.93 MiB of a 12.00 MiB budget", rows["ann"]
    assert report.memory_rows(sheet) == [("mem", "3", "4.00", "9.93", "30.50", "12.00", "1")]
