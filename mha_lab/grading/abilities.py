"""What each grading worker can do, declared to Dask as worker resources, so that work goes only where it can
be done: ``mha_lab_sandbox`` (this worker can make the sandbox) and ``mha_lab_memory`` (it can also measure a
sandbox's memory soundly, ``sandbox.memory_mode``). A worker plugin probes each worker when it joins or restarts;
``place`` picks the resource a class's tasks ask for, or refuses before any grading starts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from mha_lab.grading import sandbox

__all__ = ["SANDBOX", "MEMORY", "Abilities", "CannotGradeError", "probe", "place"]

SANDBOX, MEMORY = "mha_lab_sandbox", "mha_lab_memory"


@dataclass(frozen=True)
class Abilities:
    """One worker's: ``sandbox`` is '' when it can make a sandbox, else why not; ``memory`` its memory mode as
    the grade sheet writes it; ``measures`` whether that mode is sound."""

    sandbox: str
    memory: str
    measures: bool

    def resources(self) -> dict[str, float]:
        return {SANDBOX: float(not self.sandbox), MEMORY: float(not self.sandbox and self.measures)}


class CannotGradeError(RuntimeError):
    """No worker of the cluster can grade the assignment as asked; the message says why, worker by worker."""


def probe(limits: sandbox.Limits) -> Abilities:
    """What the machine this runs on can do under ``limits`` (``--unsafe-no-sandbox``: no sandbox is needed)."""
    problem = ""
    if not limits.unsafe:
        try:
            sandbox.check()
        except sandbox.SandboxError as exc:
            problem = str(exc)
    mode = sandbox.memory_mode(limits)
    return Abilities(problem, str(mode), mode.parent is not None)


def _plugin(limits: sandbox.Limits) -> Any:
    """A worker plugin that probes its worker and declares the resources (``Abilities.resources``)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class Declare(WorkerPlugin):
        name = f"mha_lab:abilities:{hash(limits):x}"

        async def setup(self, worker: Any) -> None:
            found = await asyncio.to_thread(probe, limits)  # starts a sandbox: not on the event loop
            worker.mha_lab_abilities = found
            await worker.set_resources(**found.resources())

    return Declare()


def place(client: Any, limits: sandbox.Limits, *, measures: bool, require_memory: bool = False) -> dict[str, float]:
    """The resources each grading task of a class asks for: workers that measure when the class's checks do
    (``measures``) and one can, else any that can make a sandbox; none when every worker qualifies (tasks with
    restrictions skip Dask's queue on the scheduler). CannotGradeError when none can make one, or when none
    measures and ``require_memory``."""
    client.register_plugin(_plugin(limits))  # runs on every worker now, and on each that joins later
    found: dict[str, Abilities] = client.run(lambda dask_worker: dask_worker.mha_lab_abilities)
    able = {w: a for w, a in found.items() if not a.sandbox}
    if not able:
        raise CannotGradeError("no Dask worker can make a sandbox: "
                          + "; ".join(f"{w}: {a.sandbox}" for w, a in sorted(found.items())) if found
                          else "the cluster has no workers")
    if measures and any(a.measures for a in able.values()):
        return {} if all(not a.sandbox and a.measures for a in found.values()) else {MEMORY: 1}
    if measures and require_memory:
        modes = "; ".join(sorted({a.memory for a in able.values()}))
        raise CannotGradeError(f"no Dask worker can measure memory ({modes}): grade as root on cgroup v1, or give "
                               "the workers a delegated cgroup v2 directory (--memory-cgroup DIR)")
    return {} if len(able) == len(found) else {SANDBOX: 1}
