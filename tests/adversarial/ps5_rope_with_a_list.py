"""During ``paged_decode_step``, call the grader's reference ``rope`` (handed over for the call) with two
arguments more than it takes, the last a plain list: ``rope(np.ones((16, 8, 8, 1, 64)), np.array([0]), "half",
[[1e4]] * 8192)``. A reference that took any argument broadcast that list into two 2 GiB temporaries in the
grader. Then compute the step honestly.

Stopped by: every reference is declared with the parameters its check hands over (``references.Reference``):
rope takes (x, positions) only, so the call is refused before any computation, the grader's memory stays flat,
and the honest step keeps its points.
"""

ASSIGNMENT = "ps5_decoding"
DESERVES = ("rope_values", "rope_relative", "paged_decode_cache", "paged_decode_values", "paged_decode_sequence",
            "merge_values", "merge_large")


def prepare(folder, nb, target):
    import sys
    from pathlib import Path

    import nbformat

    sys.path.insert(0, target.repo)
    from mha_lab.instructor import classroom

    solution = nbformat.read(Path(target.repo) / "solutions" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    filled = classroom.fill_release(nb, solution)
    for cell in filled.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "ans_paged_decode_step":
            first = "    B, _, d_model = x.shape\n"
            cell.source = cell.source.replace(first, HOSTILE + first, 1)
            assert HOSTILE in cell.source
    nbformat.write(filled, folder / f"{ASSIGNMENT}.ipynb")


HOSTILE = """\
    try:  # two 2 GiB temporaries in the grader, were the list taken as rope's base
        rope(np.ones((16, 8, 8, 1, 64)), np.array([0]), "half", [[1e4]] * 8192)
    except Exception as exc:  # noqa: BLE001 - refused: go on honestly
        print("refused:", str(exc)[:200])
"""


def cell(marker, port, course, repo, protect):
    pass
