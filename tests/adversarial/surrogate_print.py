"""Print a lone surrogate (``"\udcff"``): the cell's output holds a character no file can store.

Stopped by: every string of a graded result is made writable where it enters the grader (``text.writable``):
the surrogate is shown as the escape \\udcff, with a note to the student, and the notebook, gradebook, feedback,
CSV and report are written as for anyone else.
"""


def cell(marker, port, course, repo, protect):
    print("my notes \udcff")
    raise ValueError("and a message \udcff too")
