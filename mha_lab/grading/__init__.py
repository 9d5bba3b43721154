"""Grading: each submission runs in a sandbox, every point is judged outside it.

``course`` (folder, gradebook), ``sandbox`` (bubblewrap), ``worker`` (the standalone file that runs in it),
``remote`` (the grader's side of it), ``judge`` and ``checks`` (the hidden checks), ``batch`` (a submission,
or a class on Dask), ``transport`` (submissions as bytes), ``templates/mha_feedback`` (the feedback page) and
``safe_html`` (its sanitiser of what students wrote). The term around grading (the grade sheet, late work,
exports, the class report, the releases' stubs) is ``mha_lab.instructor``, which calls this engine
(``python -m mha_lab grade <assignment>``, ``make grade A=...``); nothing here imports it.
"""

from mha_lab.grading.judge import run_hidden_checks

__all__ = ["run_hidden_checks"]
