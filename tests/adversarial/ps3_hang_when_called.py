"""Hang inside a graded function: each one ignores SIGINT/SIGTERM and spins forever when a check calls it.

Stopped by: the time limit of the worker, which is killed with its sandbox; the submission is recorded, no one waits.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import signal

    def _forever(*args, **kwargs):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass

    measure_peak = head_by_head_forward = chunked_attention = _forever  # noqa: F841 - module-level names in the notebook
