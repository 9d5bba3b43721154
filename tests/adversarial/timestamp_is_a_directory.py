"""A folder named ``timestamp.txt`` in the submission: reading the submission time raises IsADirectoryError, which
once ended the whole run (exit 1) with no CSV, feedback or report for anyone.

Stopped by: a timestamp.txt that cannot be read is recorded as a problem of this student (the notebook's file
time stands for it, flagged in the summary and the CSV); the others are graded and recorded as usual.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    (folder / "timestamp.txt").mkdir()
    (folder / "timestamp.txt" / target.marker).write_text("2026-11-20 12:00:00 UTC\n")
