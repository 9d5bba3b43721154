"""Kill the grader by name: pkill -9 -f <course>, then SIGKILL every process that works in the course folder.

Stopped by: the pid namespace, which shows only the submission's own processes, and a scratch folder outside the course.
"""


def cell(marker, port, course, repo, protect):
    import os
    import signal
    import subprocess

    try:
        subprocess.run(["pkill", "-9", "-f", course], check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pass
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), protect):
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if cwd == course or cwd.startswith(course + os.sep) or course in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
