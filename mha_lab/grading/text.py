"""Text from a student, made writable once, where it enters the grader.

A Python string may hold what no file, database or web page can store: a lone surrogate (``"\\udcff"``, which
JSON's ``\\udcff`` escape and a cell's ``print`` both make) or a byte that is not UTF-8, which Python keeps as a
surrogate when it decodes a file name (``os.fsdecode(b"\\xff") == "\\udcff"``). Either one makes every encoder
raise ``UnicodeEncodeError``. ``writable`` turns each into a visible escape (``\\udcff``; ``\\xff`` for a byte of a
file name) and leaves every other character as it is: nothing a student wrote is lost, and what the grader
writes afterwards (notebooks, gradebook, feedback, CSV, report) can always be encoded.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["NOTE", "writable", "writable_name", "writable_tree"]

NOTE = ("some of the text handed in held characters no file can store (lone surrogates or bytes that are not "
        "UTF-8): they are shown as escapes such as \\udcff or \\xff")
_SURROGATE = re.compile("[\ud800-\udfff]")


def writable(text: str) -> str:
    """``text`` with each lone surrogate written as its escape: ``writable("a\\udcff") == "a\\\\udcff"``."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def writable_name(name: str) -> str:
    """A file or folder name as the file system gave it, each byte that is not UTF-8 as ``\\xNN``:
    ``writable_name(os.fsdecode(b"bob\\xff")) == "bob\\\\xff"``."""
    if not _SURROGATE.search(name):
        return name
    try:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no byte decodes to: not from a file system
        return writable(name)


def writable_tree(value: Any) -> tuple[Any, bool]:
    """``value`` (strings, lists and dicts, keys too, at any depth: a parsed notebook, say) with every string
    ``writable``, changed in place where it can be, and whether anything changed. Iterative: a structure nested
    deeper than Python's recursion limit is walked as well."""
    root, changed = [value], False
    stack: list[tuple[Any, Any]] = [(root, 0)]  # (container, key) of each value still to visit
    while stack:
        container, key = stack.pop()
        item = container[key]
        if isinstance(item, str):
            container[key] = writable(item)
            changed |= container[key] is not item
        elif isinstance(item, dict):
            for k in list(item):
                if isinstance(k, str) and (new := writable(k)) is not k:
                    item[new], changed = item.pop(k), True
                    k = new
                stack.append((item, k))
        elif isinstance(item, list):
            stack.extend((item, i) for i in range(len(item)))
    return root[0], changed
