"""Allocate 6 GiB as six processes of 1 GiB each, all held for 5 s: a cap per process lets every one through.

Stopped by: a memory cap on the whole submission (its cgroup), not on each of its processes.
"""


def cell(marker, port, course, repo, protect):
    import subprocess
    import sys

    hog = """
import time
import numpy as np
with open("/proc/meminfo") as f:
    available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
held = np.ones(2**30, dtype=np.uint8) if available > 6 * 2**30 else None  # without a cap, spare the machine
time.sleep(5)  # the test samples memory twice a second
"""
    hogs = []
    for _ in range(6):
        try:
            hogs.append(subprocess.Popen([sys.executable, "-c", hog, marker]))
        except OSError:
            break
    for p in hogs:
        p.wait()
