"""One look for every figure of the book, and the check that keeps it readable.

Every figure is ``FIGURE_WIDTH_IN`` inches wide and saved as SVG at that size, which the page
shows at its natural width (96 CSS pixels per inch) in the text column of a 1280 px window (the
browser test checks that no figure is shown smaller). Text is at least 10 pt at that size; legends
sit outside the data and are no larger than the plot; tick labels do not overlap. Importing any ``mha_lab.plots`` module
applies the style, and inside IPython (the book's build, a notebook) registers ``to_svg`` as the
way figures are displayed, so the check runs on every figure the book saves.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

__all__ = [
    "FIGURE_WIDTH_IN", "DISPLAY_WIDTH_PX", "MIN_TEXT_PT", "FigureStyleError",
    "new_figure", "legend_outside", "log_ticks", "style_problems", "check", "to_svg", "save",
]

FIGURE_WIDTH_IN = 7.0
"""The width of every figure, in inches: 672 CSS pixels at the SVG's natural size."""

DISPLAY_WIDTH_PX = 672
"""The width (CSS px) at which the page shows a figure: its natural width, which fits the text column
of the book at a 1280 px window."""

MIN_TEXT_PT = 10.0
"""No text may render smaller than this (points, 1/72 in, as displayed) at the displayed width."""


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
    """A figure breaks the book's style: wrong width, text too small, a legend on the data or larger than
    the plot, tick labels that overlap, or a log axis with fewer than two labelled ticks."""


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


def _plain_number(value: float, _pos=None) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:g}"


def log_ticks(axis) -> None:
    """Readable ticks on a log ``axis``, called once its data are plotted: over two decades or more,
    labels at the powers of ten only; over less, plain numbers at 1, 2 and 5 times each power of ten
    (so a short axis still shows several labels, and never the crowded minor labels of the default). An
    axis whose data span less than two of those steps is widened to the steps around them."""
    x = axis is axis.axes.xaxis
    lo, hi = sorted(axis.axes.get_xlim() if x else axis.axes.get_ylim())
    if lo > 0 and hi / lo < 100:
        steps = [m * 10.0**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in (1, 2, 5)]
        if sum(lo <= s <= hi for s in steps) < 2:
            widened = (max(s for s in steps if s <= lo), min(s for s in steps if s >= hi))
            axis.axes.set_xlim(*widened) if x else axis.axes.set_ylim(*widened)
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(_plain_number))
    axis.set_minor_formatter(NullFormatter())


def _overlaps(a, b, slack: float = 0.0) -> bool:
    """Whether boxes ``a`` and ``b`` overlap by more than ``slack`` pixels in both directions."""
    return a.x0 + slack < b.x1 and b.x0 + slack < a.x1 and a.y0 + slack < b.y1 and b.y0 + slack < a.y1


def _shown_tick_labels(axis) -> list[Text]:
    """The tick labels of ``axis`` (major and minor) that are drawn: visible, not empty, inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    pad = 1e-9 * max(abs(lo), abs(hi), 1e-300)
    shown = []
    for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks), (axis.get_minorticklocs(),
                                                                           axis.get_minor_ticks)):
        for loc, tick in zip(locs, ticks(len(locs)), strict=True):
            for label in (tick.label1, tick.label2):
                if lo - pad <= loc <= hi + pad and label.get_visible() and label.get_text().strip():
                    shown.append(label)
    return shown


def _axis_problems(ax: Axes, renderer) -> list[str]:
    """Tick labels of ``ax`` that overlap each other, and log axes with fewer than two labelled ticks."""
    problems = []
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        if not axis.get_visible():
            continue
        labels = _shown_tick_labels(axis)
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
        clash = next(((a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:]
                      if _overlaps(box_a, box_b, slack=0.5)), None)
        if clash:
            problems.append(f"tick labels overlap on the {name} axis of {ax.get_title() or 'a plot'!r}: "
                            f"{clash[0]!r} and {clash[1]!r}")
        if axis.get_scale() == "log" and len({t.get_text() for t in labels}) < 2 and ax.has_data():
            problems.append(f"the log {name} axis of {ax.get_title() or 'a plot'!r} has fewer than two "
                            f"labelled ticks: a reader cannot read its scale")
    return problems


def style_problems(fig: Figure, display_width_px: float = DISPLAY_WIDTH_PX) -> list[str]:
    """What breaks the style in ``fig`` as drawn: its width, any text below ``MIN_TEXT_PT`` at the
    displayed width, a legend over a plotting area or larger than it, overlapping tick labels, a log
    axis with fewer than two labels. Empty when the figure is fine."""
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
        pt = text.get_fontsize() * scale
        if pt < MIN_TEXT_PT - 1e-9:
            small.add(f"{text.get_text()[:30]!r} ({pt:.1f} pt)")
    if small:
        shown = ", ".join(sorted(small)[:5])
        problems.append(f"text below {MIN_TEXT_PT:g} pt at {display_width_px:g} px wide: {shown}")
    areas = [ax.get_window_extent(renderer) for ax in fig.axes if ax.get_label() != "<colorbar>"]
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        box = legend.get_window_extent(renderer)
        if any(_overlaps(box, area) for area in areas):
            problems.append("a legend covers a plotting area: put it outside (legend_outside, or fig.legend "
                            "with loc='outside ...')")
        if areas and box.width * box.height > max(a.width * a.height for a in areas):
            problems.append("a legend is larger than the plot it labels: shorten its entries, or put it below")
    for ax in fig.axes:
        if ax.get_label() != "<colorbar>" and ax.get_visible():
            problems += _axis_problems(ax, renderer)
    return problems


def check(fig: Figure) -> Figure:
    """Raise ``FigureStyleError`` if ``fig`` breaks the style; otherwise detach it from pyplot and
    return it. Every figure function of ``mha_lab.plots`` ends with it.

    A figure that passed and has not changed since is not laid out again: a change to any of its
    artists marks it stale (matplotlib's own flag), and a stale figure is checked anew. So saving a
    figure that a plotting function has just checked costs one layout, not two.
    """
    if not (getattr(fig, "_mha_style_passed", False) and not fig.stale):
        problems = style_problems(fig)  # lays the figure out, which leaves it not stale
        if problems:
            title = fig.get_suptitle() or next((ax.get_title() for ax in fig.axes if ax.get_title()), "untitled")
            raise FigureStyleError(f"figure {title!r}: " + "; ".join(problems))
        fig._mha_style_passed = True
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
