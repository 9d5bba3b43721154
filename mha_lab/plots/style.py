"""One look for every figure of the book, and the check that keeps it readable.

Every figure is ``FIGURE_WIDTH_IN`` inches wide and saved as SVG at that size, which the page
shows at its natural width (96 CSS pixels per inch) in the text column of a 1400 px window.
Text is at least 10 pt; legends sit outside the data. Importing any ``mha_lab.plots`` module
applies the style, and inside IPython (the book's build, a notebook) registers ``to_svg`` as the
way figures are displayed, so the check runs on every figure the book saves.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text

__all__ = [
    "FIGURE_WIDTH_IN", "DISPLAY_WIDTH_PX", "MIN_TEXT_PX", "FigureStyleError",
    "new_figure", "legend_outside", "style_problems", "check", "to_svg", "save",
]

FIGURE_WIDTH_IN = 7.0
"""The width of every figure, in inches: 672 CSS pixels at the SVG's natural size."""

DISPLAY_WIDTH_PX = 672
"""The widest the page shows a figure (px): the text column of the book at a 1400 px window."""

MIN_TEXT_PX = 10.0
"""No text may render smaller than this (CSS px) at the displayed width."""

CSS_PX_PER_PT = 96 / 72

RC = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "legend.title_fontsize": 10,
    "figure.titlesize": 12,
    "figure.dpi": 96,
    "savefig.dpi": 192,  # raster parts of an SVG (heat maps) at 2x
    "svg.fonttype": "path",  # the same glyphs on every machine, no font needed in the browser
    "axes.grid": False,
}


class FigureStyleError(ValueError):
    """A figure breaks the book's style: wrong width, text too small, or a legend on the data."""


def apply_style() -> None:
    """Set the book's matplotlib defaults (sizes in points)."""
    matplotlib.rcParams.update(RC)


def new_figure(height_in: float, nrows: int = 1, ncols: int = 1, **subplots_kw) -> tuple[Figure, object]:
    """A figure of the book's width and ``height_in`` inches, with constrained layout.

    Returns ``(fig, axes)`` like ``plt.subplots``; the figure is detached from pyplot so that a
    notebook displays it once, when a cell returns it.
    """
    fig, axes = plt.subplots(nrows, ncols, figsize=(FIGURE_WIDTH_IN, height_in), layout="constrained",
                             **subplots_kw)
    plt.close(fig)
    return fig, axes


def legend_outside(ax: Axes, where: str = "right", **kw) -> None:
    """The legend of ``ax``'s lines, beside the plot (``"right"``) or under it (``"below"``), never on
    the data; constrained layout makes room for it."""
    locs = {"right": "outside right upper", "below": "outside lower center"}
    if where not in locs:
        raise ValueError(f"where must be 'right' or 'below', got {where!r}")
    ax.figure.legend(*ax.get_legend_handles_labels(), loc=locs[where], **kw)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def style_problems(fig: Figure, display_width_px: float = DISPLAY_WIDTH_PX) -> list[str]:
    """What breaks the style in ``fig`` as drawn: its width, any text below ``MIN_TEXT_PX`` at the
    displayed width, any legend drawn over a plotting area. Empty when the figure is fine."""
    problems = []
    width = fig.get_figwidth()
    if abs(width - FIGURE_WIDTH_IN) > 1e-6:
        problems.append(f"figure is {width:g} in wide; every figure is {FIGURE_WIDTH_IN:g} in (use new_figure)")
    natural_px = width * 96
    scale = min(1.0, display_width_px / natural_px)  # the page shrinks a wider image to the column
    fig.draw_without_rendering()  # lay the figure out, so that tick labels and extents are final
    renderer = fig._get_renderer()
    small = set()
    for text in fig.findobj(Text):
        if not (text.get_visible() and text.get_text().strip()):
            continue
        px = text.get_fontsize() * CSS_PX_PER_PT * scale
        if px < MIN_TEXT_PX - 1e-9:
            small.add(f"{text.get_text()[:30]!r} ({px:.1f} px)")
    if small:
        shown = ", ".join(sorted(small)[:5])
        problems.append(f"text below {MIN_TEXT_PX:g} px at {display_width_px:g} px wide: {shown}")
    areas = [ax.get_window_extent(renderer) for ax in fig.axes if ax.get_label() != "<colorbar>"]
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        box = legend.get_window_extent(renderer)
        if any(_overlaps(box, area) for area in areas):
            problems.append("a legend covers a plotting area: put it outside (legend_outside, or fig.legend "
                            "with loc='outside ...')")
    return problems


def check(fig: Figure) -> Figure:
    """Raise ``FigureStyleError`` if ``fig`` breaks the style; otherwise detach it from pyplot and
    return it. Every figure function of ``mha_lab.plots`` ends with it."""
    problems = style_problems(fig)
    if problems:
        title = fig.get_suptitle() or next((ax.get_title() for ax in fig.axes if ax.get_title()), "untitled")
        raise FigureStyleError(f"figure {title!r}: " + "; ".join(problems))
    plt.close(fig)
    return fig


def to_svg(fig: Figure) -> str:
    """The figure as SVG text at its own size, after ``check``: how the book saves every figure."""
    check(fig)
    buf = io.StringIO()
    fig.savefig(buf, format="svg")  # no bbox_inches="tight": every figure keeps the book's width
    return buf.getvalue()


def save(fig: Figure, path: str) -> None:
    """Write ``fig`` to ``path`` as SVG, checked like every figure of the book."""
    with open(path, "w") as f:
        f.write(to_svg(fig))


def _display_as_checked_svg() -> None:
    """Inside IPython, show figures through ``to_svg`` only (no PNG), so each displayed figure is checked."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    plt.switch_backend(matplotlib.get_backend())  # the inline backend registers its PNG formatter now, not later
    formatters = shell.display_formatter.formatters
    for mime in ("image/png", "image/jpeg", "application/pdf"):
        formatters[mime].pop(Figure, None)
    formatters["image/svg+xml"].for_type(Figure, to_svg)


def tick_labels(values: Sequence[float]) -> list[str]:
    """Short tick labels: integers without a decimal point, others with three significant digits."""
    return [f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}" for v in values]


apply_style()
_display_as_checked_svg()
