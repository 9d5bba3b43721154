"""Kill the worker from inside a graded function: os._exit(1) whenever a check calls one of them.

Stopped by: the batch, which retries a dead worker once, then records the reason and goes on.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import os

    def _exit(*args, **kwargs):
        os._exit(1)

    measure_peak = head_by_head_forward = chunked_attention = _exit  # noqa: F841 - module-level names in the notebook
