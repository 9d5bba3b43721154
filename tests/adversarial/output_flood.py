"""Flood the output: 300 MB through sys.stdout, sys.stderr and the kernel's raw file descriptors 1 and 2.

Stopped by: the cap on output size; the grader keeps a bounded head of what the submission printed.
"""


def cell(marker, port, course, repo, protect):
    import os
    import sys

    chunk = (marker + " flood ") * (1 << 15)  # about 1.5 MB
    for _ in range(50):
        sys.stdout.write(chunk)
        sys.stderr.write(chunk)
        sys.stdout.flush()
        for fd in (1, 2):
            try:
                os.write(fd, chunk.encode())
            except OSError:
                pass
