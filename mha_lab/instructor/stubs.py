"""nbgrader's ClearSolutions with stubs that name the task (``nbgrader_config.py`` puts it in its place).

A solution region becomes ``raise NotImplementedError("ps2_mqa task 1: mqa_forward")``: the task
number counts the notebook's answer cells in order, the name is the function the region sits in.
"""

from __future__ import annotations

import re
from typing import Any

from nbgrader.preprocessors import ClearSolutions
from nbgrader.utils import is_solution

__all__ = ["TaskStubs"]


class TaskStubs(ClearSolutions):
    """Replace each solution region by ``raise NotImplementedError("<assignment> task <n>: <function>")``."""

    def preprocess(self, nb: Any, resources: dict) -> tuple[Any, dict]:
        self._task, self._default = 0, self.code_stub
        self._assignment = resources.get("nbgrader", {}).get("assignment", "")
        try:
            return super().preprocess(nb, resources)
        finally:
            self.code_stub = self._default

    def preprocess_cell(self, cell: Any, resources: dict, cell_index: int) -> tuple[Any, dict]:
        if cell.cell_type == "code" and is_solution(cell):
            before, found, _ = cell.source.partition(self.begin_solution_delimeter)
            names = re.findall(r"^\s*def\s+(\w+)\s*\(", before, re.MULTILINE)
            self._task += bool(found)
            what = names[-1] if names else cell.metadata["nbgrader"].get("grade_id", "this cell")
            stub = f'raise NotImplementedError("{self._assignment} task {self._task}: {what}")'
            self.code_stub = {**self._default, resources["language"]: stub} if found else self._default
        return super().preprocess_cell(cell, resources, cell_index)
