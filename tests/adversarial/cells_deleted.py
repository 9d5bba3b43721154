"""Delete every tests cell, turn the answer cells into graded cells worth 50 points, and point the notebook
at a kernel named `evil`.

Stopped by: the grader, which restores the release's tests cells and metadata and runs its own kernel.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import nbformat

    nb.cells = [c for c in nb.cells if not c.metadata.get("nbgrader", {}).get("grade")]
    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("solution"):
            meta.update(grade=True, points=50)
    nb.metadata["kernelspec"] = {"name": "evil", "display_name": "evil", "language": "python"}
    nbformat.write(nb, folder / "ps1_per_head_loop.ipynb")
