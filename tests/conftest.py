"""Shared fixtures. The book is built at most once per pytest session, by the same `make book` users run.

The build starts in the background as soon as the tests are collected (when one of them needs the
site), so that it overlaps the tests that run before the site's; ``built_site`` waits for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
LOG = ROOT / "_build" / "book_build.log"
_book: dict[str, object] = {}  # the running `make book`: its process and start time


def _reuse() -> bool:
    """``MHA_LAB_REUSE_BUILD=1`` checks the existing ``_build/html`` instead of building (for iterating on tests)."""
    return os.environ.get("MHA_LAB_REUSE_BUILD") == "1" and (HTML / "index.html").exists()


def pytest_collection_finish(session: pytest.Session) -> None:
    needed = any("built_site" in getattr(item, "fixturenames", ()) for item in session.items)
    if _reuse() or not needed or session.config.option.collectonly:
        return
    LOG.parent.mkdir(exist_ok=True)
    with open(LOG, "w") as log:
        _book["proc"] = subprocess.Popen(["make", "book"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
    _book["start"] = time.perf_counter()


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = _book.get("proc")
    if isinstance(proc, subprocess.Popen) and proc.poll() is None:  # the session ended before the site's tests
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


@pytest.fixture(scope="session")
def built_site() -> Path:
    """Wait for the `make book` started at collection; returns ``_build/html``. Log: ``_build/book_build.log``."""
    if _reuse():
        return HTML
    proc = _book["proc"]
    code = proc.wait()
    text = LOG.read_text()
    LOG.write_text(f"# make book: exit {code} after {time.perf_counter() - _book['start']:.1f} s\n{text}")
    if code != 0:
        pytest.fail(f"make book failed (exit {code}); see {LOG}\n{text[-3000:]}")
    return HTML
