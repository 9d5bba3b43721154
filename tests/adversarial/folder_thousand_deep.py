"""A folder 1,000 levels deep beside the notebook (made with ``mkdirat``, one level at a time).

Stopped by: folders are walked iteratively with a cap on depth checked while walking; what lies deeper is left
out, with a note, and the notebook is graded.
"""


def prepare(folder, nb, target):
    import os

    fd = os.open(folder, os.O_RDONLY)
    for _ in range(1000):
        os.mkdir("deeper", dir_fd=fd)
        inner = os.open("deeper", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def cell(marker, port, course, repo, protect):
    pass
