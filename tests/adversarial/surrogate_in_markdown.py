"""A markdown cell whose JSON holds the escape ``\\udcff`` (a lone surrogate): no code at all.

Stopped by: the text is made writable where it enters the grader; the markdown shows \\udcff in the feedback.
"""


def prepare(folder, nb, target):
    import json

    import nbformat

    nb.cells.insert(1, nbformat.v4.new_markdown_cell("notes: SURROGATE"))
    text = json.dumps(nb, ensure_ascii=True).replace("SURROGATE", "\\udcff")
    (folder / "ps1_per_head_loop.ipynb").write_text(text)


def cell(marker, port, course, repo, protect):
    pass
