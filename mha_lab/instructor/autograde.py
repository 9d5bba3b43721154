"""``nbgrader autograde`` and formgrader's Autograde button, routed through the sandbox.

Stock nbgrader runs a submitted notebook in a kernel with the instructor's rights and believes the
outputs of its tests cells, which the notebook itself can forge. ``nbgrader_config.py`` puts
``SandboxedAutograde`` in place of nbgrader's execution (``c.Autograde.autograde_preprocessors``):
the submission is graded as ``make grade`` grades it (run in the sandbox, every point judged outside),
recorded in the gradebook with its lateness, and the notebook nbgrader writes to ``autograded/`` is
the one that ran in the sandbox. Without a working sandbox it refuses and names ``make grade``.
nbgrader's own sanitising steps (clear outputs, restore locked cells) still run first; none runs code.
"""

from __future__ import annotations

import functools
from pathlib import Path

from nbconvert.exporters.exporter import ResourcesDict
from nbformat import NotebookNode
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor, OverwriteCells

from mha_lab.grading import batch, judge, sandbox
from mha_lab.grading import course as courses
from mha_lab.instructor import term

__all__ = ["SandboxedAutograde", "ReleasedCellsUnchanged", "grade_one"]


@functools.cache
def _releases(course: Path, assignment: str) -> tuple[dict, dict[str, bytes]]:
    """The release's notebooks and the files beside them, once per process: `nbgrader autograde` may grade a class."""
    return courses.register(course, assignment), courses.release_files(course, assignment)


def grade_one(course: Path, assignment: str, student: str) -> batch.StudentResult:
    """Grade one submission in the sandbox and record it (scores, autograded notebook, lateness)."""
    releases, files = _releases(course, assignment)
    result = batch.grade_submission(course / "submitted" / student / assignment, releases,
                                    judge.hidden_module(assignment, course), student=student, release_files=files)
    if result.notebooks:  # one that did not run fails in nbgrader instead (see preprocess)
        late = term.apply(course, assignment, batch.record(course, assignment, [result]))
        line = term.late_line(late[student], term.describe_policy(term.late_plugin(course))) if student in late else ""
        for nb in result.notebooks.values():  # nbgrader writes these to autograded/: the feedback's late line
            nb.metadata[term.NOTE_KEY] = line
    return result


class ReleasedCellsUnchanged(OverwriteCells):
    """nbgrader's ``OverwriteCells`` (restore every locked cell from the gradebook), with no warning for a tests
    cell handed in exactly as released.

    The gradebook keeps a tests cell as the source has it, hidden block included; the release has it without, so
    stock nbgrader warned "Attribute 'checksum' for cell ... has changed!" for every tests cell of every
    student. A cell that differs from its release (a student's edit) still warns.
    """

    def preprocess_cell(self, cell: NotebookNode, resources: ResourcesDict, cell_index: int) -> tuple:
        self._handed_in = cell.source  # before it is restored
        return super().preprocess_cell(cell, resources, cell_index)

    def report_change(self, name: str, attr: str, old: object, new: object) -> None:
        if attr == "checksum" and self._handed_in == self._released(name):
            self.log.debug("tests cell %s is as released; its hidden block is restored", name)
            return
        super().report_change(name, attr, old, new)

    def _released(self, name: str) -> str:
        """The gradebook's source of the cell ``name`` with its hidden block cleared, as the release has it."""
        cell = NotebookNode(source=self.gradebook.find_source_cell(name, self.notebook_id, self.assignment_id).source)
        ClearHiddenTests(config=self.config)._remove_hidden_test_region(cell)
        return cell.source


class SandboxedAutograde(NbGraderPreprocessor):
    """nbgrader's autograde step for one notebook, done by the sandboxed grader instead of a local kernel."""

    def _course(self) -> Path:
        owner = self.parent
        while owner is not None and not hasattr(owner, "coursedir"):
            owner = owner.parent
        if owner is None:
            raise RuntimeError("SandboxedAutograde runs inside nbgrader's Autograde converter only")
        return Path(owner.coursedir.root).resolve()

    def preprocess(self, nb: NotebookNode, resources: ResourcesDict) -> tuple[NotebookNode, ResourcesDict]:
        info = resources["nbgrader"]
        assignment, student, name = info["assignment"], info["student"], f"{info['notebook']}.ipynb"
        fix = f"grade with `make grade A={assignment}` (python -m mha_lab grade {assignment} --student {student})"
        try:
            sandbox.check()
        except sandbox.SandboxError as exc:
            raise RuntimeError(f"refusing to run student code outside the sandbox: {exc}; then {fix}") from None
        result = grade_one(self._course(), assignment, student)
        if name not in result.notebooks:
            raise RuntimeError(f"{student}'s {assignment} was not graded: {result.error}")
        self.log.info("graded %s's %s in the sandbox: %g / %g", student, assignment, result.score, result.max_score)
        return result.notebooks[name], resources
