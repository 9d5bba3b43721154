"""``graded-listing``: a ``literalinclude`` of code that answers a graded task, shown or withheld.

While a class works on the problem sets, the book must not print their answers. Each such listing
is written as

    ```{graded-listing} ../mha_lab/cpu/memory.py
    :pyobject: chunked_attention
    :assignment: ps3
    ```

and the config value ``graded_listings`` (``_config.yml``, ``sphinx.config``) decides what a build
shows: ``show`` (the listing, as ``literalinclude`` would), ``fold`` (the listing inside a closed
block marked as the solution of the problem set) or ``hide`` (a note in its place, no code).
The environment variable ``MHA_LAB_GRADED_LISTINGS`` overrides the config for one build:
``MHA_LAB_GRADED_LISTINGS=hide make book``.
"""

from __future__ import annotations

import os

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.directives.code import LiteralInclude

MODES = ("show", "fold", "hide")
ENV = "MHA_LAB_GRADED_LISTINGS"


def mode(config) -> str:
    """The build's mode: the environment variable, else the config value; ValueError names a bad one."""
    value = os.environ.get(ENV) or config.graded_listings
    if value not in MODES:
        raise ValueError(f"graded_listings must be one of {MODES}, got {value!r}")
    return value


class GradedListing(LiteralInclude):
    """``literalinclude`` with ``:assignment:``, the problem set whose answer the listing is, and an optional
    ``:title:``, the name a folded or hidden listing goes by (default: its ``:pyobject:``)."""

    option_spec = {**LiteralInclude.option_spec, "assignment": directives.unchanged_required,
                   "title": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        assignment = self.options.pop("assignment", None)
        if not assignment:
            raise self.error("graded-listing needs :assignment: (e.g. ps3), the problem set it answers")
        what = self.options.pop("title", None) or self.options.get("pyobject", self.arguments[0])
        how = self.config.graded_listings
        if how == "show":
            return super().run()
        title = f"Solution: {what} (problem set {assignment.removeprefix('ps')})"
        box = nodes.admonition(classes=["graded-listing", "dropdown"] if how == "fold" else ["graded-listing"])
        box += nodes.title(text=title)
        if how == "fold":
            box += nodes.paragraph(text="This code is the answer to a graded task: open it after you have handed in "
                                        "your own.")
            box += super().run()
        else:
            box += nodes.paragraph(text="This code is the answer to a graded task, so this build of the book leaves "
                                        "it out while the class works on it.")
        return [box]


def _settle(app: Sphinx, config) -> None:
    config.graded_listings = mode(config)  # a change of mode, by config or environment, rereads every page


def setup(app: Sphinx) -> dict:
    app.add_config_value("graded_listings", "show", "env", [str])
    app.connect("config-inited", _settle)
    app.add_directive("graded-listing", GradedListing)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
