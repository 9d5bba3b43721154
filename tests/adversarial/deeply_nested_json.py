"""A notebook whose metadata nests lists 200,000 deep, which a recursive JSON reader or validator cannot parse.

Stopped by: a grader that records an unreadable notebook as such and goes on with the others.
"""


def cell(marker, port, course, repo, protect):
    pass


def prepare(folder, nb, target):
    import json

    depth = 200_000
    text = json.dumps(nb).rstrip()
    nested = "[" * depth + json.dumps(target.marker) + "]" * depth
    path = folder / "ps1_per_head_loop.ipynb"
    path.write_text(text[:-1] + f', "x-nested": {nested}}}' if text.endswith("}") else text)
