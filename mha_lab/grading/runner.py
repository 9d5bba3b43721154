"""Run one group of hidden checks (pytest functions in ``tests/hidden/``) against a submission.

The group ``g`` of an assignment is every test function in ``tests/hidden/test_<assignment>.py``
named ``test_<g>`` or ``test_<g>__<case>``. Each takes the fixture ``student`` (from
``tests/hidden/conftest.py``), which this module's plugin provides.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

import mha_lab
from mha_lab.grading.checks import Submission

__all__ = [
    "HIDDEN_DIR_ENV", "PLUGIN_NAME", "NoHiddenChecksError", "hidden_dir", "hidden_module", "in_group", "run_group",
    "run_in_kernel", "failure_message",
]

HIDDEN_DIR_ENV = "MHA_LAB_HIDDEN_DIR"
PLUGIN_NAME = "mha_lab_student"


def hidden_dir() -> Path:
    """``$MHA_LAB_HIDDEN_DIR`` or ``tests/hidden`` of the repository mha_lab is installed from."""
    env = os.environ.get(HIDDEN_DIR_ENV)
    return Path(env) if env else Path(mha_lab.__file__).resolve().parents[1] / "tests" / "hidden"


def hidden_module(assignment: str) -> Path:
    """The hidden checks of ``assignment``; FileNotFoundError names the folder searched."""
    path = hidden_dir() / f"test_{assignment}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no hidden checks for assignment {assignment!r}: {path} does not exist")
    return path


class NoHiddenChecksError(RuntimeError):
    """The hidden module has no test function for this group (a tests cell graded in the notebook only)."""


def in_group(function_name: str, group: str) -> bool:
    """``test_<group>`` or ``test_<group>__<case>``: the test functions that grade one tests cell."""
    return function_name == f"test_{group}" or function_name.startswith(f"test_{group}__")


class StudentPlugin:
    """pytest plugin: keeps only the group's tests, hands out the submission, records failures."""

    def __init__(self, group: str, make_submission: Callable[[Iterable[str]], Mapping[str, Any]]) -> None:
        self.__name__ = PLUGIN_NAME  # pytest registers a plugin object under this name
        self.group = group
        self.make_submission = make_submission
        self.selected: list[str] = []
        self.failures: list[tuple[str, str]] = []

    def submission(self, module: Any) -> Mapping[str, Any]:
        """The ``student`` fixture's value for a hidden module (its ``ALLOWED_HELPERS`` apply)."""
        return self.make_submission(getattr(module, "ALLOWED_HELPERS", ()))

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep = [i for i in items if in_group(getattr(i, "originalname", i.name), self.group)]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
        self.selected = [i.name for i in keep]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        report = outcome.get_result()
        if report.failed and call.excinfo is not None:
            exc = call.excinfo.value
            text = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            self.failures.append((item.name, text or "assertion failed"))


def run_group(assignment: str, group: str,
              make_submission: Callable[[Iterable[str]], Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Run the group's hidden checks in this process; returns ``[(test name, failure message)]``.

    ``make_submission(allowed)`` builds the ``student`` fixture (a namespace, or a remote one).
    RuntimeError when the group has no checks or the hidden module does not import.
    """
    path = hidden_module(assignment)
    root = path.parent
    plugin = StudentPlugin(group, make_submission)
    args = [str(path), "-c", os.devnull, "--rootdir", str(root), "--confcutdir", str(root),
            "--import-mode=importlib", "--assert=plain", "-p", "no:cacheprovider", "--capture=no",
            "-q", "--tb=no", "--no-header", "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "-p", "no:unraisableexception", "-p", "no:threadexception"]  # each would gc.collect() for ~0.5 s
    log = io.StringIO()
    autoload = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only pytest itself: no third-party plugins
    saved = _forget_hidden_modules(root, path)  # import the hidden modules afresh every time
    try:
        with redirect_stdout(log), redirect_stderr(log):
            code = pytest.main(args, plugins=[plugin])
    finally:
        _forget_hidden_modules(root, path)
        sys.modules.update(saved)
        if autoload is None:
            del os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
        else:
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = autoload
    if not plugin.selected:
        raise NoHiddenChecksError(f"no hidden checks named test_{group} or test_{group}__* in {path} "
                           f"(pytest exit code {int(code)}):\n{log.getvalue()[-2000:]}")
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise RuntimeError(f"hidden checks of {assignment}/{group} did not run (exit code {int(code)}):\n"
                           f"{log.getvalue()[-2000:]}")
    return plugin.failures


def _forget_hidden_modules(root: Path, path: Path) -> dict[str, Any]:
    """Drop the hidden modules from sys.modules, and whatever holds their names (``conftest``...).

    pytest names them by their path under ``root``; a module of that name from elsewhere (another
    hidden folder, the test suite's own conftest) would be reused instead. Returns those others.
    """
    others = {}
    for name, mod in list(sys.modules.items()):
        inside = str(getattr(mod, "__file__", None) or "").startswith(str(root))
        if inside or name in ("conftest", path.stem):
            del sys.modules[name]
            if not inside:
                others[name] = mod
    return others


def failure_message(assignment: str, group: str, failures: list[tuple[str, str]]) -> str:
    """One readable message for nbgrader's feedback: each failing check and the likely bug."""
    lines = [f"{assignment} / {group}: {len(failures)} hidden check(s) failed"]
    lines += [f"- {name}: {text}" for name, text in failures]
    return "\n".join(lines)


def run_in_kernel(assignment: str, group: str, namespace: Mapping[str, Any]) -> None:
    """The in-notebook path: judge the namespace's functions here; AssertionError when any check fails."""
    failures = run_group(assignment, group, lambda allowed: Submission(namespace, allowed))
    if failures:
        raise AssertionError(failure_message(assignment, group, failures))
