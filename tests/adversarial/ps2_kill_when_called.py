"""Kill the grader from inside a graded function: when a check calls mqa_forward, gqa_forward or kv_cache_bytes,
SIGKILL every ancestor process up to the test runner.

Stopped by: the worker's pid namespace: the function runs in the sandbox, which cannot see the grader's processes.
"""

ASSIGNMENT = "ps2_mqa"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import os
    import signal

    def _parent(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                return int(next(line.split()[1] for line in f if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            return 0

    def _kill_ancestors(*args, **kwargs):
        spared, pid = set(), protect
        while pid > 1:
            spared.add(pid)
            pid = _parent(pid)
        pid = os.getppid()
        while pid > 1 and pid not in spared:
            above = _parent(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            pid = above
        return None

    mqa_forward = gqa_forward = kv_cache_bytes = _kill_ancestors  # noqa: F841 - module-level names in the notebook
