"""The sandbox itself, one worker on an empty submission: what the student's code can and cannot do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

import mha_lab
from mha_lab.grading import sandbox
from mha_lab.grading.references import Array, Reference
from mha_lab.grading.remote import RemoteSubmission
from mha_lab.grading.sandbox import GiB, Limits, memory_mode
from mha_lab.grading.worker import decode, encode

REPO = Path(mha_lab.__file__).resolve().parents[1]

PROBE = """
import os, socket, time
report = {"uid": os.getuid(), "pid": os.getpid(), "scratch": sorted(os.listdir("/scratch"))}
report["hidden"] = os.path.exists(HIDDEN)
report["home"] = os.path.exists(os.path.expanduser("~root/.bashrc")) or os.path.exists("/root/.bashrc")
try:
    open(PACKAGE, "a").write("# changed")
    report["package_writable"] = True
except OSError:
    report["package_writable"] = False
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2)
    report["network"] = True
except OSError:
    report["network"] = False
try:
    import numpy as np
    np.ones(3 * 2**30 // 8)
    report["memory"] = "3 GiB allocated"
except MemoryError:
    report["memory"] = "MemoryError"
if os.fork() == 0:  # a detached grandchild that would outlive its parent
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
forks = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forks += 1
except OSError:
    pass
report["forks"] = forks
print(report)
"""


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


@pytest.mark.timeout(120)
def test_the_sandbox_confines_the_code_and_dies_whole(tmp_path, listener):
    (tmp_path / "data.txt").write_text("the student's file")
    package = str(Path(mha_lab.__file__).resolve())
    probe = (PROBE.replace("HIDDEN", repr(str(REPO / "tests" / "hidden"))).replace("PACKAGE", repr(package))
             .replace("PORT", str(listener.getsockname()[1])))
    worker = RemoteSubmission(tmp_path, Limits(memory=2 * GiB, processes=32, seconds=60))
    try:
        reply, _ = worker.request({"op": "run", "cells": [probe, "def twice(x):\n    return 2 * x"], "files": True})
        text, error = reply["outputs"][0]
        assert not error, error
        report = eval(text)  # noqa: S307 - the dict the probe printed, from a test fixture
        assert report["uid"] != 0 and report["pid"] < 100, report  # an unprivileged uid in its own pid namespace
        assert report["scratch"] == [".cache", "data.txt"], report  # .cache: matplotlib's font list, read-only
        assert not report["hidden"] and not report["home"] and not report["package_writable"], report
        assert not report["network"] and report["memory"] == "MemoryError", report
        assert report["forks"] < 32, report
        answer, arrays = worker.request({"op": "call", "name": "twice", "arguments": encode(((21,), {}), []),
                                         "replace": {}})
        assert decode(answer["result"], arrays) == 42
    finally:
        worker.close()
    uids = subprocess.run(["ps", "-eo", "uid="], capture_output=True, text=True).stdout.split()
    assert str(report["uid"]) not in uids, "a process of the sandbox outlived it"
    assert (tmp_path / "data.txt").read_text() == "the student's file" and os.listdir(tmp_path) == ["data.txt"]
    assert json.dumps(report)  # the probe ran to its end


@pytest.mark.timeout(120)
def test_a_worker_that_hangs_is_stopped_at_its_deadline(tmp_path):
    worker = RemoteSubmission(tmp_path, Limits(seconds=3))  # the loop spins until then: a short deadline
    try:
        with pytest.raises(AssertionError, match="ran out of its 3 s"):
            worker.request({"op": "run", "cells": ["import signal\nsignal.alarm(0)\nwhile True:\n    pass"]})
        with pytest.raises(AssertionError, match="ran out of its 3 s"):
            worker.request({"op": "run", "cells": []})
    finally:
        worker.close()


SPREAD = """
import os, time
import numpy as np
children = []
for _ in range(3):  # 3 x 600 MiB, each under the per-process cap, 1.8 GiB together
    pid = os.fork()
    if pid == 0:
        block = np.ones(600 * 2**20 // 8)  # written, so resident
        time.sleep(3)
        os._exit(0)
    children.append(pid)
held = sum(os.waitpid(pid, 0)[1] == 0 for pid in children)
print(held)
"""


def _needs_a_memory_group() -> None:
    mode = memory_mode(Limits())
    if mode.parent is None:
        pytest.skip(f"this grader may not make a memory cgroup ({mode}): memory is capped per process, and "
                    "not measured (tests/test_grading_memory.py grades such a host)")


@pytest.mark.timeout(120)
def test_processes_share_one_memory_cap(tmp_path):
    _needs_a_memory_group()
    worker = RemoteSubmission(tmp_path, Limits(memory=GiB, processes=16, seconds=60))
    group = worker.group
    try:
        reply, _ = worker.request({"op": "run", "cells": [SPREAD]})
        held = int(reply["outputs"][0][0])
    finally:
        worker.close()
    assert held <= 1, f"{held} processes held 600 MiB each at once under a 1 GiB cap"
    assert not group.top.exists(), "the memory group outlived its sandbox"


GRAB = """
import os
import numpy as np

def grab(n, unused=None):  # n float64 numbers, written, so resident; dropped before returning
    block = np.ones(n)
    return float(block[0])

def grab_in_child(n):  # the same, in a forked process: the caller itself never holds it
    pid = os.fork()
    if pid == 0:
        grab(n)
        os._exit(0)
    os.waitpid(pid, 0)
    return 1.0

def forge(n):  # the same, then the worker's own measurement reset
    import tracemalloc
    grab(n)
    tracemalloc.reset_peak()
    return 1.0
"""


@pytest.mark.timeout(120)
def test_a_calls_peak_memory_is_read_from_outside_the_sandbox(tmp_path):
    _needs_a_memory_group()
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        student.run([GRAB])
        n, x = 4 * 2**20 // 8, np.zeros(4 * 2**20 // 8)  # 4 MiB allocated; 4 MiB of input (not counted)
        peaks = {name: student.remote_call(name, (n,), {}, measure=True, replace={})[1] for name in
                 ("grab", "grab_in_child", "forge")}
        peaks["input only"] = student.remote_call("grab", (2**14,), {"unused": x}, measure=True, replace={})[1]
    mib = {k: round(v / 2**20, 2) for k, v in peaks.items()}
    # the kernel charges pages to a cgroup in batches of up to 64 per CPU: up to 256 KiB a CPU either way (4.25
    # MiB is the usual reading here, on 2 CPUs). The last call allocates 1/8 MiB itself; its 4 MiB input, were it
    # counted, would put it above 3.5 MiB
    assert 3.5 <= mib["grab"] <= 4.75 and 3.5 <= mib["forge"] <= 4.75 and mib["input only"] <= 1, mib
    assert 3.5 <= mib["grab_in_child"] <= 6, mib  # the child's own copies of the pages it writes count too


KEEP = """
import numpy as np
kept = []

def keep(n):  # allocates n float64 numbers on its first call only, and keeps them ("preallocated")
    if not kept:
        kept.append(np.ones(n))
    return float(kept[0][0])
"""


@pytest.mark.timeout(120)
def test_memory_a_call_keeps_between_calls_counts(tmp_path):
    _needs_a_memory_group()
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        student.run([KEEP])
        peak = student.remote_call("keep", (4 * 2**20 // 8,), {}, measure=True, replace={})[1]
    # within the kernel's charging batches of 4 MiB, as in the test above
    assert 3.5 <= peak / 2**20 <= 4.75, f"{peak / 2**20:.2f} MiB: the buffer kept from before the call was missed"


IMPORTS = ["import numpy, matplotlib.pyplot, json, tracemalloc", "import mha_lab", "import torch",
           "from scipy import special", "import mha_lab.cpu as cpu\ndef f(x):\n    return x",
           "def g(x):\n    from mha_lab.cpu import softmax\n    return softmax(x)",
           "import os, sys\nprint([sorted(os.listdir(p)) for p in sys.path if 'site-packages' in p])"]


FONTS = """
import os
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.set_title("fonts")
fig.savefig("/scratch/plot.png")
path = os.path.join(os.environ["HOME"], ".cache", "matplotlib", {name!r})
try:
    open(path, "a").close()
    writable = True
except OSError:
    writable = False
print(os.path.getsize(path) > 1000, writable)
"""


@pytest.mark.timeout(120)
def test_matplotlib_finds_its_font_list_read_only_and_scans_no_fonts(tmp_path):
    """The grader's font list is in the sandbox: ``import matplotlib.pyplot`` neither scans the fonts again (which runs
    fc-list and writes a new list, or says it could not) nor may change the list the next sandbox reads."""
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        (out, error), = student.run([FONTS.format(name=sandbox.font_list()[1])])
    assert (out, error) == ("True False\n", ""), (out, error)


@pytest.mark.timeout(120)
def test_the_font_list_is_made_once_per_environment_and_set_of_fonts(tmp_path, monkeypatch):
    """Grading processes share the list through the user's cache folder: a second process makes none, a new font
    or another environment (whose matplotlib ships its fonts at another path) makes a new one, and a cached file
    that is no font list (a name that leaves the cache folder) is made again. The bugs this catches: a list made by
    every Dask worker again (half a second each), or one kept after the fonts or the environment changed, or a
    tampered file's name put into the sandbox."""
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sandbox, "SYSTEM_FONTS", (*sandbox.SYSTEM_FONTS, str(fonts)))
    made = []
    make = sandbox._make_font_list
    monkeypatch.setattr(sandbox, "_make_font_list", lambda: made.append(1) or make())

    def a_new_process() -> str:
        sandbox.font_list.cache_clear()  # what each grading process starts with
        fd, name = sandbox.font_list()
        assert json.loads(os.pread(fd, 1 << 24, 0)), name
        return name

    try:
        assert a_new_process() == a_new_process() and len(made) == 1
        (fonts / "new.ttf").write_bytes(b"not a font, but a new file")
        a_new_process()
        assert len(made) == 2
        key, packages = sandbox._font_key(), sandbox.student_environment()[1]
        with monkeypatch.context() as other:
            other.setattr(sandbox, "student_environment", lambda: (tmp_path / "other-venv", packages))
            assert sandbox._font_key() != key
        (cached,) = (tmp_path / "cache" / "mha_lab").glob(f"fonts-{key}.json")
        cached.write_text(json.dumps(["../../escape.json", "{}"]))
        assert a_new_process().startswith("fontlist-v") and len(made) == 3
    finally:
        sandbox.font_list.cache_clear()


@pytest.mark.timeout(120)
def test_the_sandbox_holds_the_students_environment_only(tmp_path):
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        outputs = student.run(IMPORTS)
        assert outputs[0] == ["", ""], outputs[0]
        for (_, error), name in zip(outputs[1:4], ("mha_lab", "torch", "scipy"), strict=True):
            assert error == f"ModuleNotFoundError: {name} is not available when graded: write the function yourself"
        site = eval(outputs[-1][0])  # noqa: S307 - the list the cell printed: what each site-packages holds
        assert len(site) == 1, site
        entries = set(site[0])
        assert {"numpy", "matplotlib"} <= entries and not entries & {"mha_lab", "torch", "scipy", "nbgrader"}, entries
        with pytest.raises(AssertionError, match="`f` is not defined.*mha_lab is not available when graded"):
            student.remote_call("f", (1,), {}, measure=False, replace={})
        with pytest.raises(AssertionError, match="`g` raised ModuleNotFoundError: mha_lab is not available"):
            student.remote_call("g", (np.ones(2),), {}, measure=False, replace={})


NEGATIVE = Reference("numpy.negative", (("x", Array((0, 4))),), 1)
REFERENCED = """
import numpy as np
stolen = []

def layer(x):
    stolen.append(attention)  # the grader's stand-in, kept for later
    return attention(x) + 1

def attention(x):
    return stolen[0](x) if stolen else x * 0  # takes the stand-in when it has one
"""


@pytest.mark.timeout(120)
def test_a_reference_runs_in_the_grader_and_only_during_its_call(tmp_path):
    with closing(RemoteSubmission(tmp_path, Limits(seconds=60))) as student:
        student.run([REFERENCED])
        x = np.array([1.0, -2.0])
        out = student.remote_call("layer", (x,), {}, measure=False, replace={"attention": NEGATIVE})[0]
        np.testing.assert_array_equal(out, [0.0, 3.0])
        with pytest.raises(AssertionError, match="answered by the grader only during the call it was given to"):
            student.remote_call("attention", (x,), {}, measure=False, replace={})
