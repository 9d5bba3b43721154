"""The notebook, alone in its folder, under a name that is not UTF-8 (``b"ps1_per_head_loop \xff.ipynb"``), as a
zip made on another system unpacks.

Stopped by: the name is shown with the escape \\xff in the note that says which file was graded, and the
notebook is graded as the assignment's only one.
"""


def prepare(folder, nb, target):
    import os

    os.rename(folder / "ps1_per_head_loop.ipynb", os.fsencode(folder) + b"/ps1_per_head_loop \xff.ipynb")


def cell(marker, port, course, repo, protect):
    pass
