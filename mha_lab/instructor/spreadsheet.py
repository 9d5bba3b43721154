"""CSV files that a spreadsheet opens without running anything a student wrote.

A cell whose text starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is read by Excel,
LibreOffice and Google Sheets as a formula (OWASP, "CSV Injection"): a student id ``=HYPERLINK(...)`` or
``@SUM(1+1)`` would run in the instructor's gradebook. Every CSV the project writes goes through
``writer`` or ``DictWriter``, which prefix such a cell with a single quote, the OWASP rule. A plain decimal
number (``-2.5``, ``3``, ``1e-3``) is data, not a formula, and is written as it is, so scores and penalties
stay numeric. A cell that already starts with a quote gets one more, so ``restore`` (used by ``DictReader``
when the project reads its own files back) undoes exactly what was added.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping
from typing import IO, Any

__all__ = ["FORMULA_START", "neutral", "restore", "writer", "DictWriter", "DictReader"]

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _quoted(text: str) -> bool:
    """Whether ``text`` is written with a leading quote: a formula start, or a quote of its own."""
    return text.startswith((*FORMULA_START, "'")) and not _NUMBER.fullmatch(text)


def neutral(value: Any) -> Any:
    """``value`` as a spreadsheet may read it: text that would start a formula (or a quote) gets a leading ``'``;
    numbers, plain decimal numbers as text, None and other text are unchanged."""
    return "'" + value if isinstance(value, str) and _quoted(value) else value


def restore(text: str) -> str:
    """The text that ``neutral`` turned into ``text`` (its inverse on strings)."""
    return text[1:] if text.startswith("'") and _quoted(text[1:]) else text


class _Writer:
    """``csv.writer`` whose rows pass through ``neutral``."""

    def __init__(self, f: IO[str], **options: Any) -> None:
        self._writer = csv.writer(f, **options)

    def writerow(self, row: Iterable[Any]) -> Any:
        return self._writer.writerow([neutral(v) for v in row])

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        for row in rows:
            self.writerow(row)


def writer(f: IO[str], **options: Any) -> _Writer:
    """``csv.writer(f, **options)`` that neutralises every cell."""
    return _Writer(f, **options)


class DictWriter(csv.DictWriter):
    """``csv.DictWriter`` that neutralises every cell."""

    def writerow(self, rowdict: Mapping[str, Any]) -> Any:
        return super().writerow({k: neutral(v) for k, v in rowdict.items()})

    def writerows(self, rowdicts: Iterable[Mapping[str, Any]]) -> None:
        for row in rowdicts:
            self.writerow(row)


class DictReader(csv.DictReader):
    """``csv.DictReader`` of a file the project wrote: every cell as it was before ``neutral``."""

    def __next__(self) -> dict[str, Any]:
        row = super().__next__()
        return {k: restore(v) if isinstance(v, str) else v for k, v in row.items()}
