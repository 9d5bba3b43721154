"""``accessible_html``: markup that docutils and myst-nb write for every build, made to meet WCAG 2.1 AA.

The site is audited with axe-core on every page (tests/test_site.py). Two pieces of the HTML that the
libraries emit fail it, and both are corrected here, as the page is written, rather than by a script in
the reader's browser:

- The bibliography. docutils writes citations as a ``<div role="list">`` of
  ``<div role="doc-biblioentry">``; DPUB-ARIA 1.1 deprecates that role in favour of plain list items,
  and a list whose children are not list items is an error to assistive technology (axe-core:
  ``aria-required-children``, critical; ``aria-deprecated-role``). Each entry is a ``listitem`` here.
- A folded code cell (``hide-input``). myst-nb names its ``<summary>`` "Toggle hidden content" with an
  ``aria-label`` while it shows "Show code cell source": a speech user who says what they see cannot
  reach it (WCAG 2.5.3, label in name). Without the label, the visible text is the name.
- The site's root page. When the book's first page is not ``index``, sphinx-external-toc writes ``index.html``
  as one bare ``<meta http-equiv="Refresh">``: no language (WCAG 3.1.1), no title (2.4.2), and no icon, so
  the browser asks the server for ``/favicon.ico`` and logs a 404 on every visit to the site's address. It is
  written here as a whole document first, which that hook then leaves as it is.

The theme's own buttons that failed the same criterion are overridden in ``book/_templates``.
"""

from __future__ import annotations

import html
from pathlib import Path

from docutils import nodes
from myst_nb.sphinx_ import HideCodeCellNode, depart_HideCellInput, visit_HideCellInput
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.writers.html5 import HTML5Translator

LABELLED_SUMMARY = '<summary aria-label="Toggle hidden content">\n'


def visit_citation(self: HTML5Translator, node: nodes.citation) -> None:
    """One bibliography entry as a list item; a run of them is one list (as docutils groups them)."""
    if not isinstance(node.previous_sibling(), nodes.citation):
        self.body.append('<div role="list" class="citation-list">\n')
    self.body.append(self.starttag(node, "div", classes=[node.tagname], role="listitem"))


def visit_hidden_cell(self: HTML5Translator, node: HideCodeCellNode) -> None:
    """myst-nb's folded cell, its summary named by the prompt it shows."""
    start = len(self.body)
    visit_HideCellInput(self, node)
    try:
        at = self.body.index(LABELLED_SUMMARY, start)
    except ValueError:
        raise ExtensionError(f"myst-nb no longer writes {LABELLED_SUMMARY.strip()!r} for a folded cell: "
                             "check its summary's name and update book/_ext/accessible_html.py") from None
    self.body[at] = "<summary>\n"


ROOT_PAGE = """<!DOCTYPE html>
<html lang="{language}">
<head>
<meta charset="utf-8">
<title>{title}</title>
<link rel="icon" href="{icon}">
<meta http-equiv="Refresh" content="0; url={url}">
</head>
<body><p><a href="{url}">{title}</a></p></body>
</html>
"""


def write_root_page(app: Sphinx, exception: Exception | None) -> None:
    """``index.html`` at the site's root, forwarding to the first page, as a document with a language, a title
    and the site's icon (only where the first page is not ``index`` itself)."""
    if exception is not None or app.builder.format != "html" or app.config.root_doc == "index":
        return
    favicon = app.config.html_favicon
    if not favicon:
        icon = "data:,"  # an empty icon: the browser asks the server for none
    elif "://" in favicon:
        icon = favicon
    else:
        icon = f"_static/{Path(favicon).name}"  # where Sphinx copies html_favicon
    title = app.config.html_title or app.config.project
    page = ROOT_PAGE.format(language=app.config.language or "en", title=html.escape(title), icon=html.escape(icon),
                            url=html.escape(app.builder.get_target_uri(app.config.root_doc)))
    Path(app.outdir, "index.html").write_text(page, encoding="utf-8")


def setup(app: Sphinx) -> dict:
    app.setup_extension("myst_nb")  # its visitor for folded cells is the one replaced here
    app.add_node(nodes.citation, override=True, html=(visit_citation, HTML5Translator.depart_citation))
    app.add_node(HideCodeCellNode, override=True, html=(visit_hidden_cell, depart_HideCellInput))
    app.connect("build-finished", write_root_page, priority=400)  # before sphinx-external-toc's (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
