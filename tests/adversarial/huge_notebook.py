"""A huge notebook: 256 MiB of JSON in one markdown cell (the rest is the blank release plus the marker).

Stopped by: a size limit on submissions (or a grader that copes); either way it earns nothing and stalls no one.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import nbformat
    from nbformat.v4 import new_markdown_cell

    nb.cells.insert(0, new_markdown_cell((target.marker + " ") * (256 * 2**20 // (len(target.marker) + 1))))
    nbformat.write(nb, folder / "ps1_per_head_loop.ipynb")
