"""The notebook is a folder named ``ps1_per_head_loop.ipynb`` (holding a notebook of its own), not a file.

Stopped by: a notebook that is not a readable file is recorded as "not graded" with its reason; the others are
graded as usual.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import nbformat

    path = folder / "ps1_per_head_loop.ipynb"
    path.unlink()
    path.mkdir()
    nbformat.write(nb, path / "ps1_per_head_loop.ipynb")
