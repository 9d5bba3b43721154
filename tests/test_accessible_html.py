"""The library markup that ``accessible_html`` (book/_ext) corrects, on a two-page project built here in seconds.

The site's browser check audits every built page with axe-core; this test shows, without a browser, that the
corrections are made as Sphinx writes the page: bibliography entries are list items (not the deprecated
``doc-biblioentry``), a folded code cell's summary is named by the prompt it shows, and the site's root page,
which forwards to the first, is a whole document.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import nbformat
from sphinx.application import Sphinx
from test_selfcheck import own_warnings

REPO = Path(__file__).resolve().parents[1]

CITATIONS = """\
Sources
=======

.. toctree::

   cell

As in [Vaswani2017]_ and [Shazeer2019]_.

.. [Vaswani2017] Attention is all you need.
.. [Shazeer2019] Fast transformer decoding: one write-head is all you need.
"""


def build(out: Path, extensions: list[str]) -> tuple[str, str, str]:
    """Build the project with ``extensions``; return the citation page, the folded cell's page and the warnings."""
    src = out / "src"
    src.mkdir(parents=True)
    (src / "index.rst").write_text(CITATIONS)
    cell = nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["hide-input"]},
                                     outputs=[nbformat.v4.new_output("stream", text="1\n")])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A folded cell"), cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, src / "cell.ipynb")
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'book' / '_ext')!r})\n"
                                 f"extensions = {extensions!r}\nnb_execution_mode = 'off'\n")
    warnings = io.StringIO()
    Sphinx(str(src), str(src), str(out / "html"), str(out / ".doctrees"), "html", status=None,
           warning=warnings, freshenv=True).build()
    return ((out / "html" / "index.html").read_text(), (out / "html" / "cell.html").read_text(),
            own_warnings(warnings.getvalue()))


def test_bibliography_entries_are_list_items_and_folded_cells_are_named_by_their_prompt(tmp_path):
    citations, cell, warnings = build(tmp_path / "fixed", ["myst_nb", "accessible_html"])
    assert not warnings, warnings
    assert citations.count('<div role="list" class="citation-list">') == 1
    entries = re.findall(r'<div class="citation" id="[^"]+" role="([^"]+)">', citations)
    assert entries == ["listitem", "listitem"], entries
    assert "doc-biblioentry" not in citations
    assert "<summary>\n" in cell and "aria-label" not in cell.split("<summary>", 1)[1].split("</summary>", 1)[0]
    assert "Show code cell source" in cell

    # what the libraries write on their own: the test can tell the difference
    citations, cell, _ = build(tmp_path / "plain", ["myst_nb"])
    assert 'role="doc-biblioentry"' in citations
    assert '<summary aria-label="Toggle hidden content">' in cell


def test_the_root_page_that_forwards_to_the_first_page_has_a_language_a_title_and_the_icon(tmp_path):
    """Where the first page is not ``index``, the site's address serves a page that forwards to it: a whole
    document, so that it passes the audit and the browser asks for the site's icon, not a missing /favicon.ico."""
    src = tmp_path / "src"
    (src / "_static").mkdir(parents=True)
    (src / "_static" / "favicon.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    (src / "intro.rst").write_text("Welcome\n=======\n\nThe first page.\n")
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'book' / '_ext')!r})\n"
                                 "extensions = ['myst_nb', 'accessible_html']\nroot_doc = 'intro'\n"
                                 "html_title = 'A & B'\nhtml_favicon = '_static/favicon.svg'\nlanguage = 'en'\n")
    warnings = io.StringIO()
    Sphinx(str(src), str(src), str(tmp_path / "html"), str(tmp_path / ".doctrees"), "html", status=None,
           warning=warnings, freshenv=True).build()
    assert not own_warnings(warnings.getvalue())
    root = (tmp_path / "html" / "index.html").read_text()
    assert root.startswith("<!DOCTYPE html>\n<html lang=\"en\">"), root
    assert "<title>A &amp; B</title>" in root
    icon = re.search(r'<link rel="icon" href="([^"]+)">', root).group(1)
    assert (tmp_path / "html" / icon).is_file(), icon
    assert '<meta http-equiv="Refresh" content="0; url=intro.html">' in root
    assert '<a href="intro.html">' in root
