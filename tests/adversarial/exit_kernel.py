"""End the kernel at once with os._exit(0) in the first answer cell.

Stopped by: nothing needs to: the run ends, the submission is recorded with its reason and scores what it earned (0).
"""


def cell(marker, port, course, repo, protect):
    import os

    os._exit(0)
