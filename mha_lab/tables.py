"""Markdown tables, the form in which chapters, benchmarks and reports show numbers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table; floats are written with 3 significant digits, everything else with ``str``."""
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
