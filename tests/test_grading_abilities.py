"""Grading workers say what they can do (Dask worker resources), and work goes only where it can be done:
memory checks to workers that measure soundly, a class that no worker can grade as asked refused before it
starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mha_lab.grading import abilities, batch, sandbox
from mha_lab.instructor import classroom

pytestmark = pytest.mark.timeout(600)

SOUND = abilities.Abilities("", "cgroup v1", True)
UNMEASURED = abilities.Abilities("", "memory not measured on this host (no memory cgroups on this host)", False)
NO_SANDBOX = abilities.Abilities("no sandbox: bwrap could not start", "cgroup v1", True)


class FakeClient:
    """The two calls ``place`` makes, answered from a table of workers."""

    def __init__(self, workers: dict[str, abilities.Abilities]) -> None:
        self.workers, self.plugins = workers, []

    def register_plugin(self, plugin: object) -> None:
        self.plugins.append(plugin)

    def run(self, fn: object) -> dict[str, abilities.Abilities]:
        return dict(self.workers)


@pytest.mark.parametrize(("workers", "measures", "require", "needs"), [
    ({"a": SOUND, "b": UNMEASURED}, True, False, {abilities.MEMORY: 1}),  # memory checks: only where measured
    ({"a": SOUND, "b": UNMEASURED}, False, False, {}),  # no memory check: every worker will do
    ({"b": UNMEASURED}, True, False, {}),  # graded, the memory cells left to the instructor
    ({"a": SOUND, "c": NO_SANDBOX}, False, True, {abilities.SANDBOX: 1}),  # only where a sandbox can be made
    ({"a": SOUND, "d": SOUND}, True, True, {}),
    ({"a": SOUND, "c": NO_SANDBOX}, True, False, {abilities.MEMORY: 1}),  # c would measure, but has no sandbox
])
def test_tasks_ask_for_what_the_checks_need(workers, measures, require, needs):
    assert abilities.place(FakeClient(workers), sandbox.Limits(), measures=measures, require_memory=require) == needs


def test_a_class_no_worker_can_grade_is_refused_before_it_starts():
    with pytest.raises(abilities.CannotGradeError, match="no Dask worker can measure memory"):
        abilities.place(FakeClient({"b": UNMEASURED}), sandbox.Limits(), measures=True, require_memory=True)
    with pytest.raises(abilities.CannotGradeError, match="c: no sandbox: bwrap could not start"):
        abilities.place(FakeClient({"c": NO_SANDBOX}), sandbox.Limits(), measures=False)


def test_abilities_declare_the_resources_a_worker_has():
    assert SOUND.resources() == {abilities.SANDBOX: 1.0, abilities.MEMORY: 1.0}
    assert UNMEASURED.resources() == {abilities.SANDBOX: 1.0, abilities.MEMORY: 0.0}
    assert NO_SANDBOX.resources() == {abilities.SANDBOX: 0.0, abilities.MEMORY: 0.0}


@pytest.mark.slow
def test_real_workers_declare_their_resources_and_ps3_is_refused_without_a_measurement(tmp_path: Path):
    """A LocalCluster's workers probe themselves; with a cgroup directory that is not delegated they cannot
    measure, and ps3 with require_memory is refused before any submission is graded."""
    sandbox.check()
    course = classroom.new_course(tmp_path / "course", ["ps3_memory_efficient"])
    classroom.honest(course, "ana", "ps3_memory_efficient")
    not_delegated = tmp_path / "not_a_cgroup"
    not_delegated.mkdir()
    with batch.dask_client(jobs=1) as client:
        abilities.place(client, sandbox.Limits(), measures=True)
        declared = client.run(lambda dask_worker: dict(dask_worker.state.total_resources))
        sound = sandbox.memory_mode(sandbox.Limits()).parent is not None
        assert list(declared.values()) == [{abilities.SANDBOX: 1.0, abilities.MEMORY: float(sound)}]
        limits = sandbox.Limits(cgroup=str(not_delegated))
        with pytest.raises(abilities.CannotGradeError, match="is not a cgroup v2 directory"):
            batch.grade_class(course, "ps3_memory_efficient", client=client, limits=limits, require_memory=True,
                              progress=False)
        declared = client.run(lambda dask_worker: dict(dask_worker.state.total_resources))
        assert list(declared.values()) == [{abilities.SANDBOX: 1.0, abilities.MEMORY: 0.0}]
    assert not (course / "autograded").exists()  # nothing was graded
