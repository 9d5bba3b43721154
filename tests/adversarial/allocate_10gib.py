"""Allocate and touch 10 GiB in one process, one GiB at a time (stopping early only if the host itself runs short).

Stopped by: the sandbox's memory cap (2 GiB by default): the process is killed or gets MemoryError.
"""


def cell(marker, port, course, repo, protect):
    import subprocess
    import sys

    hog = """
import numpy as np
def available():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
held = []
for _ in range(10):
    if available() < 6 * 2**30:  # without a cap, spare the machine the rest
        break
    held.append(np.ones(2**30, dtype=np.uint8))
"""
    subprocess.run([sys.executable, "-c", hog, marker], check=False, timeout=120)
