"""The exporter of every feedback page: nbconvert's ``HTMLExporter`` without its pass of BeautifulSoup over the page.

That pass gives an image with no ``alt`` a placeholder one and JupyterLab's cells a ``tabindex``; a feedback page
(the ``mha_feedback`` template, made from the classic one) seldom has either, and parsing and writing back its
180 KB was over half its time (39 ps1 students' pages: 5.4 s with HTMLExporter, 2.2 s with this one). A page
that has an image or a JupyterLab cell goes through ``HTMLExporter`` whole. nbgrader takes it by name
(``course.FEEDBACK_EXPORTER``) as ``GenerateFeedback.exporter_class``; the ``HTMLExporter`` settings of
``course.feedback_exporter`` apply to it.
"""

from __future__ import annotations

from typing import Any

from nbconvert.exporters import HTMLExporter
from nbconvert.exporters.templateexporter import TemplateExporter
from nbconvert.filters.highlight import Highlight2HTML
from nbconvert.filters.widgetsdatatypefilter import WidgetsDataTypeFilter
from nbformat import NotebookNode

__all__ = ["FeedbackExporter"]


class FeedbackExporter(HTMLExporter):
    """``HTMLExporter``'s page, unparsed when it has no ``<img`` and no JupyterLab cell."""

    def from_notebook_node(self, nb: NotebookNode, resources: dict | None = None, **kw: Any) -> tuple[str, dict]:
        given = dict(resources or {})
        language = nb.metadata.get("language_info", {})  # the filters HTMLExporter.from_notebook_node registers
        lexer = language.get("pygments_lexer", language.get("name"))
        self.register_filter("highlight_code",
                             self.filters.get("highlight_code", Highlight2HTML(pygments_lexer=lexer, parent=self)))
        resources = self._init_resources(resources)
        self.register_filter("filter_data_type", WidgetsDataTypeFilter(notebook_metadata=self._nb_metadata,
                                                                       parent=self, resources=resources))
        html, resources = TemplateExporter.from_notebook_node(self, nb, resources, **kw)  # the template alone
        if "<img" in html.lower() or "jp-Notebook" in html:
            return super().from_notebook_node(nb, given, **kw)
        return html, resources
