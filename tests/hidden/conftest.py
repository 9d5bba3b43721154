"""The ``student`` fixture of the hidden checks: the submission under test.

These modules run only through ``mha_lab.grading`` (``run_hidden_checks`` in a notebook, or the
batch grader), which registers the plugin that knows the submission. A hidden module may set
``ALLOWED_HELPERS = {"create_causal_mask", ...}``: the mha_lab names the student may call.
"""

import pytest

from mha_lab.grading.runner import PLUGIN_NAME


@pytest.fixture
def student(request: pytest.FixtureRequest):
    """The student's namespace (a Mapping of name -> object); pass it to ``checks.call``."""
    plugin = request.config.pluginmanager.get_plugin(PLUGIN_NAME)
    if plugin is None:
        raise pytest.UsageError("hidden checks run through mha_lab.grading.run_hidden_checks, not plain pytest")
    return plugin.submission(request.module)
