"""nbgrader's ClearSolutions with stubs that name the task.

A solution region becomes ``raise NotImplementedError("ps2_mqa task 1: mqa_forward")``.

The task number counts the notebook's answer cells in order; the name is the function the
solution region sits in. ``nbgrader_config.py`` puts this preprocessor in ClearSolutions' place.
"""

from __future__ import annotations

import re
from typing import Any

from nbgrader.preprocessors import ClearSolutions
from nbgrader.utils import is_solution

__all__ = ["TaskStubs"]

_DEF = re.compile(r"^\s*def\s+(\w+)\s*\(")


class TaskStubs(ClearSolutions):
    """Replace each solution region by ``raise NotImplementedError("<assignment> task <n>: <function>")``."""

    def preprocess(self, nb: Any, resources: dict) -> tuple[Any, dict]:
        self._task = 0
        self._assignment = resources.get("nbgrader", {}).get("assignment", "")
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell: Any, resources: dict, cell_index: int) -> tuple[Any, dict]:
        if cell.cell_type == "code" and is_solution(cell) and self.begin_solution_delimeter in cell.source:
            self._task += 1
            before = cell.source.split(self.begin_solution_delimeter)[0].splitlines()
            names = [m.group(1) for m in map(_DEF.match, before) if m]
            what = names[-1] if names else cell.metadata.get("nbgrader", {}).get("grade_id", "this cell")
            stub = f'raise NotImplementedError("{self._assignment} task {self._task}: {what}")'
            saved = self.code_stub
            self.code_stub = {**saved, resources["language"]: stub}
            try:
                return super().preprocess_cell(cell, resources, cell_index)
            finally:
                self.code_stub = saved
        return super().preprocess_cell(cell, resources, cell_index)
