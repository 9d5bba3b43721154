"""Grading: each submission runs in a sandbox, every point is judged outside it.

``course`` (folder and gradebook), ``sandbox`` (bubblewrap), ``worker`` (the protocol between the
sandbox and the grader), ``judge`` (the hidden checks), ``batch`` (one submission, or a class on
Dask), ``report`` (table and CSV), ``templates/mha_feedback`` (the feedback page); ``checks`` holds the
helpers the hidden checks are written with. The term around grading (late work, exports) is
``mha_lab.instructor``.
``python -m mha_lab.grading <assignment>`` (``make grade A=...``) grades a class.
"""

from mha_lab.grading.judge import run_hidden_checks

__all__ = ["run_hidden_checks"]
