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
from nbgrader.preprocessors import NbGraderPreprocessor

from mha_lab.grading import batch, judge, sandbox
from mha_lab.grading import course as courses
from mha_lab.instructor import term

__all__ = ["SandboxedAutograde", "grade_one"]


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
        term.apply(course, assignment, batch.record(course, assignment, [result]))
    return result


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
