"""Rename every tests cell's grade_id and strip its nbgrader metadata, then add cells under the old names
that only `pass`.

Stopped by: the grader, which finds the release's tests cells by its own record and grades the student's code there.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import nbformat
    from nbformat.v4 import new_code_cell

    cells = []
    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("grade"):
            stand_in = new_code_cell("pass")
            stand_in.metadata["nbgrader"] = dict(meta)
            cells.append(stand_in)
            c.metadata["nbgrader"] = {**meta, "grade_id": meta["grade_id"] + "_old", "grade": False}
        cells.append(c)
    nb.cells = cells
    nbformat.write(nb, folder / "ps1_per_head_loop.ipynb")
