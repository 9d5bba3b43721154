"""nbgrader configuration of MHA Lab: the course root is the directory nbgrader runs in.

Sources (instructor notebooks) live in ``solutions/``, releases in ``assignments/``; students'
work goes to ``submitted/<student>/<assignment>/``. ``make assignments`` and ``make grade`` use it.
"""

from nbgrader.preprocessors import (
    CheckCellMetadata,
    ClearHiddenTests,
    ClearMarkScheme,
    ClearOutput,
    ComputeChecksums,
    IncludeHeaderFooter,
    InstantiateTests,
    LockCells,
    SaveCells,
)

from mha_lab.grading.course import FEEDBACK_EXPORTER, feedback_exporter, stamp_in_process
from mha_lab.instructor.stubs import TaskStubs

stamp_in_process()  # a new gradebook's schema revision is read here, not by running `alembic`: no activated venv needed

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

c.CourseDirectory.course_id = "mha_lab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "assignments"

# Stubs name their task: raise NotImplementedError("ps2_mqa task 1: mqa_forward").
c.GenerateAssignment.preprocessors = [
    IncludeHeaderFooter, InstantiateTests, LockCells, TaskStubs, ClearOutput, CheckCellMetadata,
    ComputeChecksums, SaveCells, ClearHiddenTests, ClearMarkScheme, ComputeChecksums, CheckCellMetadata,
]
c.ClearSolutions.code_stub = {"python": 'raise NotImplementedError("write your solution here")'}

# Autograde: restore any deleted or edited read-only cell, and stop a cell that hangs.
c.OverwriteCells.add_missing_cells = True
c.Execute.timeout = 60  # seconds per cell; the solutions need well under a second per cell
c.Execute.interrupt_on_timeout = True

# `nbgrader autograde` and formgrader's Autograde button grade in the sandbox, as `make grade` does
# (stock nbgrader would run student code here, as you); nbgrader's sanitising steps run first.
c.Autograde.autograde_preprocessors = ["mha_lab.instructor.autograde.SandboxedAutograde"]
# nbgrader's sanitising steps, with OverwriteCells quiet about tests cells handed in as released (stock nbgrader
# warns "Attribute 'checksum' ... has changed!" for each: the gradebook keeps them with their hidden block).
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput", "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec", "mha_lab.instructor.autograde.ReleasedCellsUnchanged",
    "nbgrader.preprocessors.CheckCellMetadata"]

# Feedback (`nbgrader generate_feedback`, formgrader's button, `make grade`): the mha_feedback page, with what the
# students wrote or displayed sanitised, so that no script of theirs runs when you open it.
for name, value in feedback_exporter().items():
    setattr(c.HTMLExporter, name, value)
c.GenerateFeedback.exporter_class = FEEDBACK_EXPORTER  # HTMLExporter's page without a second parse of it

# Late work: submission times from timestamp.txt, due dates from the gradebook, extensions.csv.
# nbgrader's policies: c.LateSubmissionPlugin.penalty_method = "none" (default) or "zero"; or a
# fraction per started day late, with a cap:
# c.AssignLatePenalties.plugin_class = "mha_lab.instructor.term.PerDayPenalty"
# c.PerDayPenalty.per_day = 0.1
# c.PerDayPenalty.cap = 0.5

# `nbgrader export`: nbgrader's CSV with a last column, status (graded / not graded / not submitted); a student
# who did not submit, or could not be graded, gets empty scores instead of stock nbgrader's 0.
c.ExportApp.plugin_class = "mha_lab.instructor.lms.CsvExport"
