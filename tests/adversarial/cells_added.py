"""Add graded cells: new grade_ids worth 100 points each, and a duplicate of every tests cell (same grade_id,
source `pass`) placed before the original.

Stopped by: the grader, which grades exactly the release's tests cells and ignores cells it did not hand out.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import copy

    import nbformat
    from nbformat.v4 import new_code_cell

    cells = []
    for c in nb.cells:
        meta = c.metadata.get("nbgrader", {})
        if meta.get("grade"):
            twin = copy.deepcopy(c)
            twin.source = "pass"
            twin["id"] = f"{c.get('id', 'cell')}-twin"
            cells.append(twin)
        cells.append(c)
    for i in range(3):
        extra = new_code_cell("pass")
        extra.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": 100,
                                      "grade_id": f"bonus_{i}", "schema_version": 3}
        cells.append(extra)
    nb.cells = cells
    nbformat.write(nb, folder / "ps1_per_head_loop.ipynb")
