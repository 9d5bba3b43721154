"""The feedback page's exporter (``mha_lab.grading.feedback_page``): HTMLExporter's page without its second parse.

A bug it would hide: a filter HTMLExporter registers before rendering left out (the code unhighlighted), or an
image left without the ``alt`` HTMLExporter gives it, or the student's markup kept because the page skipped a step.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import nbgrader
import pytest
from bs4 import BeautifulSoup
from nbconvert.exporters import HTMLExporter
from test_site import CHROMIUM, CHROMIUM_ARGS, needs_chromium
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from mha_lab.grading import course, math_html
from mha_lab.grading.feedback_page import FeedbackExporter
from mha_lab.instructor.classroom import REPO

CSS = Path(nbgrader.__file__).parent / "server_extensions/formgrader/static/node_modules/bootstrap/dist/css"
IMAGE = '<img src="data:image/png;base64,iVBORw0KGgo=">'  # an embedded image, kept by the sanitiser, with no alt


def _page(exporter: type[HTMLExporter], nb: nbformat.NotebookNode) -> str:
    """The page ``exporter`` makes of ``nb`` with the feedback settings (the CSS folder nbgrader adds)."""
    config = Config({"HTMLExporter": {**course.feedback_exporter(), "extra_template_paths": [str(CSS)]}})
    resources = {"nbgrader": {"notebook": "hw", "score": 1.0, "max_score": 2.0, "late_penalty": 0.0}}
    return exporter(config=config).from_notebook_node(nb, resources)[0]


def _graded() -> nbformat.NotebookNode:
    """An autograded notebook: a markdown answer with a script, an answer, a tests cell that lost a point."""
    answer_md = nbformat.v4.new_markdown_cell("# Notes\n\n$x^2 < y$, `split_heads`, **bold** <script>alert(1)</script>")
    answer_md.metadata["nbgrader"] = {"grade_id": "ans_md", "solution": True, "grade": False, "locked": False}
    tests = nbformat.v4.new_code_cell("assert f(1) == 3")
    tests.metadata["nbgrader"] = {"grade_id": "t_f", "grade": True, "solution": False, "points": 2.0, "score": 1.0,
                                  "locked": True}
    tests.outputs = [nbformat.v4.new_output("stream", name="stdout", text="<b>printed</b>"),
                     nbformat.v4.new_output("error", ename="AssertionError", evalue="<i>no</i>",
                                            traceback=["\x1b[31mAssertionError\x1b[0m: <i>no</i>"])]
    nb = nbformat.v4.new_notebook()
    nb.cells = [answer_md, nbformat.v4.new_code_cell("def f(x):\n    return x + 1"), tests]
    return nb


def test_a_page_without_images_is_html_exporters_page_unparsed():
    nb = _graded()
    fast, stock = _page(FeedbackExporter, nb), _page(HTMLExporter, nb)
    assert str(BeautifulSoup(fast, "html.parser")) == stock  # the same document, only not written back by the parser
    assert 'class="k">def</span>' in fast  # highlighted
    assert "<script>alert" not in fast and "<b>printed" not in fast and "&lt;b&gt;printed" in fast


def test_a_page_with_an_image_is_html_exporters_page_whole():
    nb = _graded()
    nb.cells.append(nbformat.v4.new_markdown_cell(IMAGE))
    fast = _page(FeedbackExporter, nb)
    assert fast == _page(HTMLExporter, nb)
    assert 'alt="No description has been provided for this image"' in fast


def test_nbgrader_config_names_the_exporter_for_formgraders_button_too():
    config = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    assert config.GenerateFeedback.exporter_class == course.FEEDBACK_EXPORTER
    assert course.FEEDBACK_EXPORTER == f"{FeedbackExporter.__module__}.{FeedbackExporter.__name__}"


def test_formulas_are_mathml_made_with_the_page_and_nothing_is_loaded():
    nb = _graded()
    nb.cells[0].source += "\n\n$$\\frac{Q K^\\top}{\\sqrt{d_k}}$$ costs $5 and $6; `$x$` is code"
    page = _page(FeedbackExporter, nb)
    assert "<script" not in page.split("<body", 1)[0] and "cdnjs" not in page and "MathJax" not in page
    assert page.count("<math") == 2 and "$5 and $6" in page and "<code>$x$</code>" in page
    assert "<mfrac>" in page and "<msqrt>" in page


@pytest.mark.slow
@needs_chromium
def test_the_feedback_page_renders_its_math_offline_in_chromium(tmp_path):
    """ps3's own formulas, in a feedback page opened with every request off the disk refused: each is drawn (a
    fraction is taller than a line of text), no TeX shows, and no request leaves the machine."""
    from playwright.sync_api import sync_playwright

    release = nbformat.read(REPO / "assignments" / "ps3_memory_efficient" / "ps3_memory_efficient.ipynb", as_version=4)
    nb = nbformat.v4.new_notebook()
    nb.cells = [c for c in release.cells if c.cell_type == "markdown" and "$" in c.source]
    formulas = sum(len(math_html.MATH.findall(c.source)) for c in nb.cells)
    path = tmp_path / "ps3.html"
    path.write_text(_page(FeedbackExporter, nb))
    requests = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()

            def offline(route):
                requests.append(route.request.url)
                route.continue_() if route.request.url.startswith(("file://", "data:")) else route.abort()

            page.route("**/*", offline)
            page.goto(path.as_uri(), wait_until="load")
            shown = page.locator("math").count()
            layout = page.locator("math").first.evaluate("m => getComputedStyle(m).display")
            fraction = page.locator("math[display=block]:has(mfrac)").first.bounding_box()
            line = page.locator("p").first.evaluate("p => parseFloat(getComputedStyle(p).lineHeight) || 20")
            text = page.locator("body").inner_text()
        finally:
            browser.close()
    assert [u for u in requests if not u.startswith("data:")] == [path.as_uri()], requests
    assert formulas >= 10 and shown == formulas, (shown, formulas)
    assert layout.endswith("math"), f"the browser does not draw MathML ({layout})"
    assert fraction and fraction["height"] > 1.5 * line, (fraction, line)
    assert "$" not in text and "\\frac" not in text and "\\sum" not in text, text[:500]
