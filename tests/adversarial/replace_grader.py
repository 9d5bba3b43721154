"""Replace the grader's own code in the kernel: a fake mha_lab.grading (run_hidden_checks does nothing),
a fake pytest whose main() reports success, and no-op checks.

Stopped by: judging outside the sandbox: the grader imports its own modules, in its own process.
"""


def cell(marker, port, course, repo, protect):
    import sys
    import types

    import mha_lab.grading

    fake = types.ModuleType("mha_lab.grading")
    fake.run_hidden_checks = lambda *args, **kwargs: None
    fake.__path__ = mha_lab.grading.__path__
    sys.modules["mha_lab.grading"] = fake
    mha_lab.grading = fake
    mha_lab.grading.run_hidden_checks = fake.run_hidden_checks
    pytest = types.ModuleType("pytest")
    pytest.main = lambda *args, **kwargs: 0
    sys.modules["pytest"] = pytest
    try:
        from mha_lab.grading import checks

        for name in dir(checks):
            if name.startswith("expect"):
                setattr(checks, name, lambda *args, **kwargs: None)
    except ImportError:
        pass
