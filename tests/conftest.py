"""Shared fixtures. The book is built at most once per pytest run, by the same `make book` users run.

The build starts in the background as soon as the tests are collected (when one of them needs the
site), so that it overlaps the tests that run before the site's; ``built_site`` waits for it. Under
pytest-xdist every worker collects: the first to claim the run's build folder starts the build, and
whichever worker runs the site's tests waits for its exit status there; the controller, which outlives
the workers, stops a build still running at the end. Tests are handed out by file, or by class where a
file has classes: slow units first, then the site's, then the quick ones.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import settings

# pytest tests/test_grading_fuzz.py --hypothesis-profile grading-fuzz: the grader's fuzzer on more classes
settings.register_profile("grading-fuzz", max_examples=30, deadline=None)

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
LOG = ROOT / "_build" / "book_build.log"
RUN_ENV = "MHA_LAB_TEST_RUN"  # one id per pytest run, set by the controller and inherited by xdist's workers
BOOK_TIMEOUT = 1800  # seconds a worker waits for the build before failing the site's tests


def _reuse() -> bool:
    """``MHA_LAB_REUSE_BUILD=1`` checks the existing ``_build/html`` instead of building (for iterating on tests)."""
    return os.environ.get("MHA_LAB_REUSE_BUILD") == "1" and (HTML / "index.html").exists()


def _worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _run_dir() -> Path:
    """This run's build state: ``started`` (claimed by one process), ``pid``, ``exit`` (the build's status and
    seconds)."""
    return ROOT / "_build" / ".test_runs" / os.environ[RUN_ENV]


def pytest_configure(config: pytest.Config) -> None:
    if not _worker(config):
        os.environ[RUN_ENV] = uuid.uuid4().hex
        _seconds["started"] = time.time()


def pytest_collection_finish(session: pytest.Session) -> None:
    needed = any("built_site" in getattr(item, "fixturenames", ()) for item in session.items)
    if _reuse() or not needed or session.config.option.collectonly:
        return
    run = _run_dir()
    run.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(run / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another worker of this run started it
        return
    # the exit status and the build's seconds are written last, through a rename, so that a reader never sees
    # half of them
    script = (f'make book > "{LOG}" 2>&1; echo "$? $SECONDS" > "{run}/exit.tmp"; '
              f'mv "{run}/exit.tmp" "{run}/exit"')
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, start_new_session=True)
    (run / "pid").write_text(str(proc.pid))


def _unit(item: pytest.Item) -> str:
    """The unit of work pytest-xdist hands a worker whole (``--dist loadscope``): the test's class, else its file."""
    return f"{item.path.name}::{item.cls.__name__}" if item.cls else item.path.name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each file, or each class of a file that has classes, runs whole in one worker, so that a fixture built once
    per module or class (a graded class, the browser) is built once; the heaviest files split their work into
    classes (one per assignment graded). Workers take the units in collection order (``--no-loadscope-reorder``):
    units with slow tests first, then those that read the built site (the book builds meanwhile; their browsers
    spend much of their time waiting), then the quick ones, which keep both cores busy to the end."""
    first: dict[str, int] = {}
    rank: dict[str, int] = defaultdict(lambda: 2)
    for i, item in enumerate(items):
        unit = _unit(item)
        first.setdefault(unit, i)
        if "built_site" in getattr(item, "fixturenames", ()):
            rank[unit] = 1
        elif item.get_closest_marker("slow") and rank[unit] == 2:
            rank[unit] = 0
    items.sort(key=lambda item: (rank[_unit(item)], first[_unit(item)]))  # stable: each unit keeps its order


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _worker(session.config) or RUN_ENV not in os.environ:
        return
    run = _run_dir()
    pid = run / "pid"
    if pid.exists() and not (run / "exit").exists():  # the run ended before the site's tests
        try:
            os.killpg(int(pid.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass
    shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="session")
def built_site() -> Path:
    """Wait for the `make book` started at collection; returns ``_build/html``. Log: ``_build/book_build.log``."""
    if _reuse():
        return HTML
    run = _run_dir()
    deadline = time.monotonic() + BOOK_TIMEOUT
    while not (run / "exit").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"make book did not finish within {BOOK_TIMEOUT} s; see {LOG}")
        time.sleep(1)
    code, took = map(int, (run / "exit").read_text().split())
    text = LOG.read_text()
    if not text.startswith("# make book:"):  # another worker's fixture may have written it already
        LOG.write_text(f"# make book: exit {code} after {took} s\n{text}")
    if code != 0:
        pytest.fail(f"make book failed (exit {code}); see {LOG}\n{text[-3000:]}")
    return HTML


@pytest.fixture(scope="session")
def grading_cluster():
    """One local Dask cluster (2 worker processes) per test process, for the tests that grade whole classes
    in-process or through the command's ``--scheduler``: starting one costs seconds of CPU each time. Tests of the
    cluster itself (its workers' environment, their uid, ``--jobs``) start their own.

    It waits between its users for most of the run, and Dask's processes spend CPU while they wait: a statistical
    profiler sampling each worker every 10 ms (off in ``dask_client`` without a dashboard), an event-loop tick every
    20 ms and memory polls every 100 ms took 0.15 s of CPU a second, 0.02 s with the profiler off and the other two
    once a second (``WAITING``, read as the cluster starts, its restarted workers included; the rest of the run
    keeps Dask's defaults)."""
    import dask
    import distributed  # noqa: F401 - its config's defaults, before WAITING overrides two of them

    from mha_lab.grading import batch, sandbox

    sandbox.check()
    with contextlib.ExitStack() as stack:
        with dask.config.set(WAITING):
            client = stack.enter_context(batch.dask_client(2))
        yield client


WAITING = {"distributed.admin.tick.interval": "1s", "distributed.worker.memory.monitor-interval": "1s"}


# --------------------------------------------------------------------------------------------
# where the time went: every run ends with its time per test file (the ten slowest tests come
# from --durations in pyproject.toml)

_seconds: dict[str, float] = defaultdict(float)  # test file -> seconds; "started": when this run began


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::")[0]] += report.duration  # set-up, call and tear-down alike


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    started = _seconds.pop("started", None)
    if _worker(config) or not _seconds:
        return
    if started and LOG.exists() and LOG.stat().st_mtime >= started:  # this run built the book
        terminalreporter.write_line(f"{LOG.read_text().splitlines()[0]} (alongside the tests; log: {LOG})")
    rows = sorted(_seconds.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"time per test file (set-up included), {len(rows)} files")
    for path, seconds in rows[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    rest = sum(s for _, s in rows[15:])
    if rest:
        terminalreporter.write_line(f"{rest:8.1f} s  the other {len(rows) - 15} files")
