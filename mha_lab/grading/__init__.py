"""Grading: each submission runs in a sandbox, every point is judged outside it.

``course`` (folder, gradebook), ``sandbox`` (bubblewrap), ``worker`` (the standalone file that runs in it),
``remote`` (the grader's side of it), ``judge`` and ``checks`` (the hidden checks), ``batch`` (a submission,
or a class on Dask), ``report``. ``python -m mha_lab.grading <assignment>`` (``make grade A=...``).
"""

from mha_lab.grading.judge import run_hidden_checks

__all__ = ["run_hidden_checks"]
