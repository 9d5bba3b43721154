"""``diagram_scripts``: mermaid's scripts only on the pages that draw a diagram.

mermaid is vendored as one classic script (``book/_static/vendor/mermaid/mermaid.min.js``, 3.5 MB) that
defines ``window.mermaid``; sphinxcontrib-mermaid then adds its own module scripts, which import that global
and draw each ``.mermaid`` block on load. Listed in ``html_js_files`` the script would be fetched, parsed and run
on every page, most of which have no diagram; here it is added, with sphinxcontrib-mermaid's scripts, to a
page whose doctree holds a mermaid node, and to no other. sphinxcontrib-mermaid's own hook would also add
its scripts to the generated pages (the index, the search page), which have no doctree and no diagram: that
hook is replaced by the one below.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinxcontrib.mermaid import install_js, mermaid

MERMAID_JS = "vendor/mermaid/mermaid.min.js"  # under html_static_path (book/_static)


def diagram_scripts(app: Sphinx, pagename: str, templatename: str, context: dict,
                    doctree: nodes.document | None) -> None:
    """Add mermaid and sphinxcontrib-mermaid's scripts to this page if, and only if, it holds a diagram."""
    if doctree is None or doctree.next_node(mermaid) is None:
        return
    app.add_js_file(MERMAID_JS)  # a classic script: it runs before the module scripts that import its global
    install_js(app, pagename, templatename, context, doctree)


def setup(app: Sphinx) -> dict:
    app.setup_extension("sphinxcontrib.mermaid")
    hooks = [hook for hook in app.events.listeners["html-page-context"] if hook.handler is install_js]
    if len(hooks) != 1:
        raise ExtensionError("sphinxcontrib-mermaid no longer adds its scripts in one html-page-context hook "
                             "(install_js): check book/_ext/diagram_scripts.py against its setup()")
    app.disconnect(hooks[0].id)
    app.connect("html-page-context", diagram_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
