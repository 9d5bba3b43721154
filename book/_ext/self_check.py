"""``self-check``: a question the reader answers on the page, with the answer and why behind a click.

A chapter's self-checks sit in its "Self-check" section. Two kinds, both written with a colon fence
(the question may hold math, references and glued numbers):

    :::{self-check} Which heads does MQA keep for the keys and values?
    :answer: 2
    - one per query head
    - one for all query heads
    - one per pair of query heads

    Every query head reads the same single key head and value head.
    :::

    :::{self-check} How large is the KV cache of that model at 32k tokens, in GiB?
    :number: kv-32k-gib
    :format: .1f
    :unit: GiB

    2 (K and V) x layers x kv heads x head size x tokens x 2 bytes, over 2^30.
    :::

A choice question opens with a bullet list of its choices (shown as A, B, C...); ``:answer:`` is the
number of the right one, counted from 1. A number question names with ``:number:`` a value glued on
the same page by a hidden cell (``glue(key, value, display=False)``), so that the answer is computed by
``mha_lab`` when the book builds; ``:format:`` is how the answer is shown (a format spec, default
``.3g``; ``d`` or ``,d`` for a whole number), ``:unit:`` what follows it, ``:tolerance:`` the
relative error still accepted (default 0.02; the shown, rounded answer is accepted too). What
follows the list, or the options, is the one-line why.

A new chapter gets its checks the same way: a "## Self-check" section just before its exercises,
with one hidden cell that glues the numbers its questions name (``tests/test_selfcheck.py`` asks
for 3-5 questions in every numbered chapter of ``_toc.yml``).

The page stays readable without JavaScript: the answer and why are a closed ``<details>`` block.
``book/_static/self-check.js`` puts each choice in a button inside its list item (so each choice is
one paragraph) and adds an input box to number questions, marks an answer right or wrong in a status
line that screen readers announce, and opens the answer once it is right; all of it works from the
keyboard alone. ``book/_static/self-check.css`` styles them. Nothing is loaded from the network.
"""

from __future__ import annotations

import math
import string

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

DEFAULT_FORMAT = ".3g"
DEFAULT_TOLERANCE = 0.02


class self_check(nodes.General, nodes.Element):  # noqa: N801 - docutils names nodes in lower case
    """One question: rendered as ``<div class="self-check" data-...>`` holding its stem, choices and answer."""


class self_check_answer(nodes.General, nodes.Element):  # noqa: N801
    """The answer and why: a closed ``<details>`` block."""


def glued_number(document: nodes.document, key: str) -> float:
    """The number glued under ``key`` on this page; ValueError says what is missing or not a number."""
    from myst_nb.core.variables import RetrievalError, format_plain_text
    from myst_nb.ext.glue.utils import retrieve_glue_data

    try:
        data = retrieve_glue_data(document, key).data
    except RetrievalError as exc:
        raise ValueError(f"{exc} Glue it in a hidden cell of this page: glue({key!r}, value, display=False)") from None
    try:
        value = float(format_plain_text(data.get("text/plain", ""), "s").replace(",", ""))
    except ValueError:
        raise ValueError(f"the value glued as {key!r} is not a number: {data.get('text/plain')!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"the value glued as {key!r} is not finite: {value}")
    return value


class SelfCheck(SphinxDirective):
    """The ``self-check`` directive: a choice question (``:answer:``) or a number question (``:number:``)."""

    required_arguments = 1
    final_argument_whitespace = True
    has_content = True
    option_spec = {"answer": directives.positive_int, "number": directives.unchanged_required,
                   "format": directives.unchanged_required, "unit": directives.unchanged_required,
                   "tolerance": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        if ("answer" in self.options) == ("number" in self.options):
            raise self.error("self-check needs exactly one of :answer: (a choice question) or :number: (a glued key)")
        box = self_check(classes=["self-check"])
        self.set_source_info(box)
        stem = nodes.paragraph(classes=["self-check-question"])
        inline, messages = self.parse_inline(self.arguments[0], lineno=self.lineno)
        stem += inline
        box += stem
        body = self.parse_content_to_nodes()
        if "answer" in self.options:
            shown = self._choices(box, body)
        else:
            shown = self._number(box)
        why = [n for n in body if not isinstance(n, nodes.system_message)]
        if not why:
            raise self.error("self-check needs a why: a line after the choices or the options")
        answer = self_check_answer(classes=["self-check-answer"])
        answer += nodes.paragraph("", "", nodes.strong(text="Answer: "), *shown)
        answer += why
        box += answer
        return [box, *messages]

    def _choices(self, box: self_check, body: list[nodes.Node]) -> list[nodes.Node]:
        """Move the leading bullet list into ``box`` as lettered choices; return the right one's text."""
        if not body or not isinstance(body[0], nodes.bullet_list) or len(body[0]) < 2:
            raise self.error("a choice self-check starts its content with a bullet list of two choices or more")
        items = body.pop(0).children
        right = self.options["answer"]
        if right > len(items) or len(items) > len(string.ascii_uppercase):
            raise self.error(f":answer: {right} is not one of the {len(items)} choices")
        if not all(len(item) == 1 and isinstance(item[0], nodes.paragraph) for item in items):
            raise self.error("each choice of a self-check is one paragraph (the page shows it inside a button)")
        choices = nodes.enumerated_list(enumtype="upperalpha", prefix="", suffix=".", classes=["self-check-choices"])
        choices += items
        box += choices
        box["data-kind"], box["data-answer"] = "choice", str(right)
        text = [n.deepcopy() for n in items[right - 1][0].children]
        return [nodes.Text(f"{string.ascii_uppercase[right - 1]}. "), *text]

    def _number(self, box: self_check) -> list[nodes.Node]:
        """Fill ``box``'s data from the glued value; return the answer as shown (formatted, with its unit)."""
        try:
            value = glued_number(self.state.document, self.options["number"])
            spec = self.options.get("format", DEFAULT_FORMAT)
            text = format(int(value) if spec.endswith("d") and value.is_integer() else value, spec)
            rounded = float(text.replace(",", ""))
            tolerance = float(self.options.get("tolerance", DEFAULT_TOLERANCE))
            if not 0 <= tolerance < 1:
                raise ValueError(f"the tolerance is relative, between 0 and 1: {tolerance}")
        except ValueError as exc:
            raise self.error(f"self-check :number: {exc}") from None
        unit = self.options.get("unit", "")
        box["data-kind"], box["data-value"], box["data-shown"] = "number", repr(value), repr(rounded)
        box["data-tolerance"] = repr(tolerance)
        box["data-unit"] = unit
        return [nodes.Text(f"{text} {unit}".rstrip())]


def visit_self_check_html(self, node: self_check) -> None:
    data = {k: v for k, v in node.attributes.items() if k.startswith("data-")}
    self.body.append(self.starttag(node, "div", **data))


def depart_div_html(self, node: nodes.Element) -> None:
    self.body.append("</div>\n")


def visit_answer_html(self, node: self_check_answer) -> None:
    self.body.append(self.starttag(node, "details") + "<summary>Show the answer</summary>\n")


def depart_answer_html(self, node: self_check_answer) -> None:
    self.body.append("</details>\n")


def visit_plain(self, node: nodes.Element) -> None:
    """Builders other than HTML show the question, the choices and the answer as plain content."""


def setup(app: Sphinx) -> dict:
    plain = (visit_plain, visit_plain)
    app.add_node(self_check, html=(visit_self_check_html, depart_div_html), latex=plain, text=plain)
    app.add_node(self_check_answer, html=(visit_answer_html, depart_answer_html), latex=plain, text=plain)
    app.add_directive("self-check", SelfCheck)
    app.add_js_file("self-check.js", loading_method="defer")
    app.add_css_file("self-check.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
