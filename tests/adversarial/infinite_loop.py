"""Never finish: ignore SIGINT, SIGTERM and SIGHUP, then spin forever at the top level of a cell.

Stopped by: the wall-clock limit per submission, which kills the sandbox (SIGKILL cannot be ignored).
"""


def cell(marker, port, course, repo, protect):
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        pass
