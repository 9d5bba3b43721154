"""Kill the grader: SIGKILL the kernel's parent and every ancestor above it, up to the test runner.

Stopped by: the pid namespace. The grader's processes are outside it: getppid() is 0 and /proc lists none of them.
"""


def cell(marker, port, course, repo, protect):
    import os
    import signal

    def parent(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                return int(next(line.split()[1] for line in f if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            return 0

    spared, pid = set(), protect
    while pid > 1:  # the test runner and everything above it stay alive
        spared.add(pid)
        pid = parent(pid)
    pid = os.getppid()
    while pid > 1 and pid not in spared:
        above = parent(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        pid = above
