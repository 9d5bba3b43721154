"""The feedback page's formulas, typeset when the page is made: TeX between ``$...$``, ``$$...$$``, ``\\(...\\)`` or
``\\[...\\]`` in a page's cleaned HTML becomes MathML (``latex2mathml``), which browsers draw themselves. The page
then needs no script and no network to show its math: MathJax loaded from a CDN showed raw ``$$...$$`` offline.

TeX a student wrote is untrusted like the rest of their markdown: the MathML made of it goes through ammonia
(``nh3``) with MathML's presentation elements and attributes only (no links, no styles, no foreign content), and
TeX that does not convert stays as the text it was. Code (``<pre>``, ``<code>``) is never read as math.
"""

from __future__ import annotations

import html
import re

import nh3

__all__ = ["FILTER", "typeset_math"]

FILTER = f"{__name__}.typeset_math"  # the dotted name nbconvert's HTMLExporter.filters takes
# display math first; inline $...$ neither next to a word or a digit (prices, $PATH) nor empty, nor spanning lines
MATH = re.compile(r"\$\$(?P<block>.+?)\$\$|\\\[(?P<block2>.+?)\\\]|\\\((?P<inline2>.+?)\\\)"
                  r"|(?<![\\$\w])\$(?=[^\s$])(?P<inline>[^$\n]+?)(?<=\S)\$(?![\w$])", re.S)
CODE = re.compile(r"(<(pre|code|script|style|textarea)\b.*?</\2\s*>)", re.S | re.IGNORECASE)
TAGS = {"math", "mrow", "mi", "mn", "mo", "ms", "mspace", "mtext", "mfrac", "msqrt", "mroot", "msub", "msup",
        "msubsup", "munder", "mover", "munderover", "mtable", "mtr", "mtd", "mstyle", "mpadded", "mphantom",
        "menclose", "merror", "mmultiscripts", "mprescripts", "none", "semantics", "annotation"}
ATTRIBUTES = {"*": {"display", "mathvariant", "stretchy", "fence", "form", "separator", "accent", "accentunder",
                    "lspace", "rspace", "movablelimits", "largeop", "symmetric", "minsize", "maxsize", "columnalign",
                    "columnspacing", "rowspacing", "columnlines", "rowlines", "frame", "linethickness",
                    "scriptlevel", "displaystyle", "width", "height", "depth", "notation", "encoding"}}


def _mathml(tex: str, display: str) -> str | None:
    """MathML for ``tex`` (as the page's text holds it: HTML-escaped), cleaned; None when it does not convert."""
    from latex2mathml.converter import convert

    try:
        made = convert(html.unescape(tex).strip(), display=display)
    except Exception:  # noqa: BLE001 - TeX latex2mathml cannot read stays the text it was
        return None
    return nh3.clean(made, tags=TAGS, attributes=ATTRIBUTES, clean_content_tags=set(), link_rel=None) or None


def _typeset(text: str) -> str:
    def one(m: re.Match) -> str:
        tex = next(g for g in m.groups() if g is not None)
        if "<" in tex:  # crosses markup: not one formula
            return m.group(0)
        made = _mathml(tex, "inline" if m.group("inline") is not None or m.group("inline2") is not None else "block")
        return made or m.group(0)

    return MATH.sub(one, text)


def typeset_math(page: str) -> str:
    """``page`` (HTML, already cleaned) with every formula outside code as MathML: nbconvert's filter contract."""
    parts = CODE.split(str(page))  # [text, code, tag name, text, code, tag name, ...]
    return "".join(part if i % 3 else _typeset(part) for i, part in enumerate(parts) if i % 3 != 2)
