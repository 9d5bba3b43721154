"""Forge measure_peak without measuring: it returns fn's result and the arguments' sizes plus 4 KiB, which is
right for the old check (np.std of an array holds one temporary of the array's size) but measures nothing.

Stopped by: measure_peak is also checked on np.multiply of a column and a row, whose peak (the product) the
arguments' sizes do not give. The other answers are left blank: it deserves nothing.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import numpy as np

    def measure_peak(fn, *args, **kwargs):
        result = fn(*args, **kwargs)
        return result, sum(np.asarray(a).nbytes for a in args) + 4096
