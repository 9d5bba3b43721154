"""HTML from a student's notebook made safe to show the instructor: the feedback page's sanitiser.

Markdown a student wrote and HTML their code displayed are rendered by nbconvert, then cleaned by ammonia
(``nh3``): scripts, event handlers, frames, forms, styles and ``javascript:`` links go, the text around them
stays. What a feedback page needs survives: headings, paragraphs, lists, tables, links, embedded images
(``data:image/...``; an image from elsewhere would tell its server who opened the page), code with its
highlighting classes, and math, as TeX text that ``math_html`` then typesets. ``course.feedback`` installs
``clean_html`` as nbconvert's filter of that name and turns on nbconvert's ``sanitize_html``, which routes
student HTML through it and drops JavaScript and widget outputs.
"""

from __future__ import annotations

import re

import nh3

__all__ = ["FILTER", "clean_html"]

FILTER = f"{__name__}.clean_html"  # the dotted name nbconvert's HTMLExporter.filters takes
ATTRIBUTES = {**{tag: set(names) for tag, names in nh3.ALLOWED_ATTRIBUTES.items()}, "*": {"class", "id", "title"}}
EMBEDDED_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*", re.IGNORECASE)


def _attribute(tag: str, name: str, value: str) -> str | None:
    """Keep an image's source only when it is embedded, and no link to a ``data:`` URL."""
    if tag == "img" and name == "src":
        return value if EMBEDDED_IMAGE.fullmatch(value) else None
    if name == "href" and value.strip().lower().startswith("data:"):
        return None
    return value


def clean_html(html: str | bytes) -> str:
    """``html`` with everything that could run or load a page removed (nbconvert's ``clean_html`` contract)."""
    text = html.decode() if isinstance(html, bytes) else str(html)
    return nh3.clean(text, attributes=ATTRIBUTES, clean_content_tags={"script", "style"}, attribute_filter=_attribute,
                     url_schemes={*nh3.ALLOWED_URL_SCHEMES, "data"})
