"""The feedback page's exporter (``mha_lab.grading.feedback_page``): HTMLExporter's page without its second parse.

A bug it would hide: a filter HTMLExporter registers before rendering left out (the code unhighlighted), or an
image left without the ``alt`` HTMLExporter gives it, or the student's markup kept because the page skipped a step.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import nbgrader
from bs4 import BeautifulSoup
from nbconvert.exporters import HTMLExporter
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from mha_lab.grading import course
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
