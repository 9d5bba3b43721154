"""Shared fixtures. The book is built at most once per pytest session, by the same `make book` users run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def built_site() -> Path:
    """Run `make book` once and return ``_build/html``; the log goes to ``_build/book_build.log``.

    ``MHA_LAB_REUSE_BUILD=1`` checks the existing ``_build/html`` instead of building (for iterating on tests).
    """
    html = ROOT / "_build" / "html"
    log = ROOT / "_build" / "book_build.log"
    if os.environ.get("MHA_LAB_REUSE_BUILD") == "1" and (html / "index.html").exists():
        return html
    start = time.perf_counter()
    proc = subprocess.run(["make", "book"], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log.parent.mkdir(exist_ok=True)
    log.write_text(f"# make book: exit {proc.returncode} after {seconds:.1f} s\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"make book failed (exit {proc.returncode}); see {log}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return html
