"""Rewrite the tests cells: 1000 points each, their asserts replaced by `pass`, and unlocked.

Stopped by: the grader, which takes each tests cell's points and source from the release, never from the submission.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import nbformat

    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("grade"):
            meta.update(points=1000, locked=False)
            c.source = "pass"
    nbformat.write(nb, folder / "ps1_per_head_loop.ipynb")
