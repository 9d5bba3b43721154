"""A bounded fork storm: 400 processes, each exec'ing `sleep 3600`, until fork fails.

Stopped by: the process cap of the sandbox, and its pid namespace, which takes every one of them down with it.
"""


def cell(marker, port, course, repo, protect):
    import os

    started = 0
    for _ in range(400):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            try:
                os.execvp("sleep", ["sleep", "3600"])  # inherits MHA_LAB_ATTACK
            finally:
                os._exit(0)
        started += 1
    print(f"started {started} processes")
